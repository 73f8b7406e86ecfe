"""Where a looped pipeline's step goes, against PyTorch's ``ScheduleInterleaved1F1B`` (a benchmark).

    python benchmarks/looped_time.py                      # GPT d=128, W=2, two stages per worker, B=8
    python benchmarks/looped_time.py --model llama --W 4 --reps 7

One set of W forked workers runs three sides, alternated step by step (after warm-up): our engine
with ``order=1f1b`` (the tie-break), ours with ``order=interleaved_1f1b`` (Megatron's order, the
one PyTorch's schedule runs) and PyTorch's ``ScheduleInterleaved1F1B``, on the stages of
``vs_native_transformer.py`` (S = 2 W: two per worker, stage s on worker s mod W). Printed:

- the order: each of our orders' programs (the job sequences the workers ran, chosen by the
  simulator at F = B = 1) replayed on the per-stage job times the workers measured (their CPU per
  job), every worker with a core of its own and on the cores they shared; beside it, each order
  chosen afresh on the measured times (a sequence ``1f1b`` picks only when given those times);
- the engine's cost: per worker and step, the CPU of the whole process against the jobs' CPU, per
  job (what the engine spends around the stage compute, the communication threads included);
- the waits: per worker and step, the wall seconds the compute thread spent blocked on a message;
- the measured step (medians, barrier to barrier, the slowest rank's) and CPU of every side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from typing import Any

import torch.distributed as dist
import vs_native_transformer as vt
from vs_torch_native import Pair, alternate, pair_device, pair_link

from launcher.report.measured_costs import shared_cores, stage_job_seconds
from launcher.runtime import launch
from launcher.schedule import make_schedule, simulate
from launcher.schedule.cores import replay

ORDERS = ("1f1b", "interleaved_1f1b")


def _pairs(W: int, B: int) -> dict[str, Pair]:
    return {o: Pair(f"looped-{o}-w{W}", "lpp", 1, W, 2 * W, B, o, False, "interleaved_1f1b") for o in ORDERS}


def run(size: vt.Size, W: int, B: int, reps: int, warmup: int) -> dict[str, Any] | None:
    device = pair_device()
    pairs = _pairs(W, B)
    pair_link(pairs["1f1b"], device)
    sides: dict[str, Any] = {o: vt.OursT(p, size, device) for o, p in pairs.items()}
    sides["native"] = vt.NativeT(pairs["1f1b"], size, device)
    # alternate() keeps the records of the side named "ours": each order's in turn, gathered below
    sides = {"ours": sides["1f1b"], "interleaved_1f1b": sides["interleaved_1f1b"], "native": sides["native"]}
    out = alternate(sides, device, reps, 1, warmup)
    gathered: list[Any] = [None] * dist.get_world_size()
    inter = sides["interleaved_1f1b"]
    dist.gather_object({"records": [r for r in inter.records[warmup:] if r]},
                       gathered if dist.get_rank() == 0 else None, dst=0)
    if out is None:
        return None
    out["per_rank_interleaved"] = gathered
    return out


def _steps(rank: dict) -> list[dict]:
    """A worker's step records, the first (warm-up) left out."""
    recs = [x["measured_only"] for x in rank["records"] if x]
    return recs[1:] if len(recs) > 1 else recs


def _ms(seconds: list[float]) -> str:
    return ", ".join(f"{x * 1e3:.1f}" for x in seconds)


def _per_step(ranks: list[dict], key) -> list[float]:
    """Per worker, the median over its steps of ``key(step record)``."""
    return [statistics.median(key(m) for m in _steps(r)) for r in ranks]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt", choices=list(vt.MODELS))
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--W", type=int, default=2)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    W, B, S = args.W, args.B, 2 * args.W
    size = vt.Size(args.model, args.d, 6, 64, 1)
    res = launch(run, W, size, W, B, args.reps, args.warmup, timeout=120, deadline=900)[0]
    print(f"{vt.MODELS[args.model]} d={args.d}, lpp G=1 R={W} S={S} B={B} (two stages per worker), "
          f"{args.reps} alternated repetitions")
    for name in ("ours", "interleaved_1f1b", "native"):
        label = {"ours": "ours order=1f1b", "interleaved_1f1b": "ours order=interleaved_1f1b",
                 "native": "ScheduleInterleaved1F1B"}[name]
        print(f"  measured {label:32s} {statistics.median(res['times'][name]) * 1e3:7.1f} ms wall, "
              f"{statistics.median(res['cpus'][name]) * 1e3:6.0f} ms CPU (all processes)")
    for order, ranks in (("1f1b", res["per_rank"][:W]), ("interleaved_1f1b", res["per_rank_interleaved"][:W])):
        per_stage = stage_job_seconds(ranks, ("F", "B"), S)
        print(f"order={order}; per-stage job CPU (ms, F/B): " + ", ".join(
            f"{d['F'] * 1e3:.1f}/{d['B'] * 1e3:.1f}" for d in per_stage))
        sims, rederived = {}, {}
        for o in ORDERS:  # each order on this run's per-stage job times
            ran = simulate(make_schedule("lpp", S, B, G=1, R=W, order=o))  # the programs the workers run
            timed = replace(ran, schedule=replace(ran.schedule, stage_durations=per_stage))
            # the sequences that ran, timed by what the workers measured (what metrics.json predicts),
            # and the order chosen afresh on those times (issue 36's note: a 1f1b the workers never ran)
            sims[o] = (replay(timed, W).seconds, replay(timed, shared_cores(ranks) or W).seconds)
            rederived[o] = simulate(timed.schedule).latency
        print("  (a) the programs that ran, replayed on its per-stage job CPU: " + ", ".join(
            f"{o} {a * 1e3:.1f} ms (a core each) / {c * 1e3:.1f} ms (on {shared_cores(ranks) or W} cores)"
            for o, (a, c) in sims.items()) + "; each order re-derived on those times instead: " + ", ".join(
            f"{o} {v * 1e3:.1f} ms" for o, v in rederived.items()))
        jobs = len(_steps(ranks[0])[0]["jobs"])
        cpu = _per_step(ranks, lambda m: m["cpu_s"])
        job_cpu = _per_step(ranks, lambda m: sum(j[5] for j in m["jobs"]))
        job_proc = _per_step(ranks, lambda m: sum(j[4] for j in m["jobs"]))
        end_cpu = _per_step(ranks, lambda m: m["end_cpu_s"])
        outside = [(c - p - e) * 1e6 / jobs for c, p, e in zip(cpu, job_proc, end_cpu)]
        print(f"  (b) per worker per step: process CPU {_ms(cpu)} ms; jobs' compute thread {_ms(job_cpu)} ms; "
              f"jobs' process CPU {_ms(job_proc)} ms; end of step {_ms(end_cpu)} ms; outside jobs and end "
              f"{', '.join(f'{u:.0f}' for u in outside)} us per job ({jobs} jobs)")
        waited = _per_step(ranks, lambda m: m["step_s"] - sum(j[3] for j in m["jobs"]) - m["end_s"])
        step = _per_step(ranks, lambda m: m["step_s"])
        print(f"  (c) per worker per step: wall {_ms(step)} ms, of which blocked on messages (wall less jobs' work "
              f"less end of step) {_ms(waited)} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
