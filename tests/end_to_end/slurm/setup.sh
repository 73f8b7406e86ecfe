#!/usr/bin/env bash
# A real single-node Slurm for the tests, without systemd: install Debian's slurmctld, slurmd and
# munge if missing, write a minimal slurm.conf, start munged, slurmctld and slurmd in the background,
# and wait until the node is idle. Idempotent: daemons already up are left alone. Needs root.
set -euo pipefail
STATE=${SLURM_TEST_STATE:-/tmp/launcher-slurm}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || { echo "no apt-get to install Slurm with"; exit 3; }
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge) >/dev/null
fi
mkdir -p "$STATE"/{spool,ctld,log} /etc/slurm /run/munge /var/lib/munge /var/log/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=launcher
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
ReturnToService=2
MinJobAge=3600
KillWait=5
NodeName=localhost CPUs=16 RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x slurmctld >/dev/null || (setsid /usr/sbin/slurmctld -D -c >"$STATE/log/ctld.out" 2>&1 &)
pgrep -x slurmd >/dev/null || (setsid /usr/sbin/slurmd -D -N localhost >"$STATE/log/d.out" 2>&1 &)
for _ in $(seq 60); do
  if sinfo -h -o %t 2>/dev/null | grep -qx idle; then exit 0; fi
  scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
  sleep 0.5
done
echo "slurm did not come up: $(tail -3 "$STATE/log/slurmctld.log" 2>/dev/null)"
exit 4
