"""What actually happened on a worker in one step, beside what the simulator predicted.

A record's ``per_worker`` keys are ``simulation.json``'s (:data:`PER_WORKER_KEYS`), each with
``predicted`` and ``measured``. Units: ``busy`` is simulated duration units when predicted and
seconds when measured; ``stash_recv`` is not measured (``None``); every other key is a count.
``weights_peak_resident`` counts a fetched copy from the moment its receive buffer is posted.
``measured_only`` holds what the simulator does not predict: bytes per message kind, peak
activation bytes, weight messages received, wall time of each job and of the step.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from launcher.schedule.metrics import PER_WORKER_KEYS

HOST = socket.gethostname()
#: the CPU cores this process may run on (workers of one host that share them slow each other down)
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


@dataclass
class Meter:
    """Counters the engine updates as it runs a step."""

    live: int = 0
    live_bytes: int = 0
    peak_live: int = 0
    peak_live_bytes: int = 0
    resident: int = 0  # fetched stage copies held now
    peak_resident: int = 0
    fetched_stages: set = field(default_factory=set)
    fetched_jobs: int = 0
    allreduce: int = 0
    # [stage, microbatch, kind, seconds of work (waits for peers excluded), process CPU seconds,
    #  the compute thread's CPU seconds]
    jobs: list = field(default_factory=list)
    #: the loss stages' losses, kept on their device and read once, at the end of the step (a
    #: ``float()`` per loss job would make the host wait for the device there, every time)
    losses: list = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    cpu0: float = field(default_factory=time.process_time)
    step_s: float = 0.0
    cpu_s: float = 0.0  # process CPU of the whole step
    end_s: float = 0.0  # wall and CPU of the end of the step: gradient sums, all-reduces, last sends
    end_cpu_s: float = 0.0
    # the traced step only (:meth:`~launcher.runtime.engine.Engine.trace`), on this host's
    # monotonic clock: each job's (start, end), and the end of step's all-reduce of replicas
    spans: list | None = None
    allreduce_span: tuple[float, float] | None = None

    def add_loss(self, loss: Any) -> None:
        self.losses.append(loss.detach())

    @property
    def loss(self) -> float:
        """The sum of this worker's losses of the step, added in job order in float64 (as a float per
        job would be), with one wait for the device."""
        if not self.losses:
            return 0.0
        return sum(torch.stack([v.reshape(()).double() for v in self.losses]).tolist())

    def loss_tensor(self, device: torch.device) -> torch.Tensor:
        """:attr:`loss` as a 0-d float64 tensor on the device, the same bits (added one by one in
        job order), with no wait for the device."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for v in self.losses:
            total = total + v.reshape(()).to(device, torch.float64)
        return total

    def take(self, nbytes: int) -> None:
        self.live += 1
        self.live_bytes += nbytes
        self.peak_live = max(self.peak_live, self.live)
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        self.live -= 1
        self.live_bytes -= nbytes

    def hold_bytes(self, nbytes: int) -> None:
        """Activation bytes that are not a stage input (a forward's autograd graph)."""
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def drop_bytes(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def hold_weights(self) -> None:
        self.resident += 1
        self.peak_resident = max(self.peak_resident, self.resident)

    def free_weights(self) -> None:
        self.resident -= 1


def worker_record(worker: int, predicted: dict[str, list], meter: Meter, comm, owned: int, step: int,
                  device: str = "cpu", shared_reduce: bool = False) -> dict[str, Any]:
    """One worker's record for one step (``shared_reduce``: its replicas' all-reduces go through
    shared memory, :mod:`.shared_reduce`; said where it has none too, so that a profile of any
    scheme prices the replicas of another as this run's workers would have reduced them)."""
    measured = {
        "busy": sum(j[3] for j in meter.jobs),
        "act_recv": comm.recv_count["act"],
        "grad_recv": comm.recv_count["grad"],
        # never measured: lowering refuses placements that split the jobs of (s, b) across workers
        # (schedule.lowering.job_actions), so no stash ever moves and the prediction is 0 by construction
        "stash_recv": None,
        "weight_fetch_stages": len(meter.fetched_stages),
        "weight_fetch_jobs": meter.fetched_jobs,
        "weight_grad_send": comm.sent_count["wgrad"],
        "weight_allreduce": meter.allreduce,
        "peak_activations": meter.peak_live,
        "weights_owned": owned,
        "weights_peak_resident": owned + meter.peak_resident,
    }
    kinds = sorted(set(comm.recv_count) | set(comm.sent_count))
    return {
        "step": step,
        "worker": worker,
        "per_worker": {k: {"predicted": predicted[k][worker], "measured": measured[k]} for k in PER_WORKER_KEYS},
        "measured_only": {
            "recv_count": {k: comm.recv_count[k] for k in kinds},
            "recv_bytes": {k: comm.recv_bytes[k] for k in kinds},
            "sent_count": {k: comm.sent_count[k] for k in kinds},
            "sent_bytes": {k: comm.sent_bytes[k] for k in kinds},
            "weight_fetches": comm.recv_count["weights"],
            "peak_activation_bytes": meter.peak_live_bytes,
            "step_s": meter.step_s,
            "cpu_s": meter.cpu_s,
            "end_s": meter.end_s,
            "end_cpu_s": meter.end_cpu_s,
            "jobs": meter.jobs,
            "loss": meter.loss,
            # what messages took: sender's hand-over times and receiver's late arrivals, on this
            # host's monotonic clock (comparable between workers of one host only)
            "host": HOST,
            "cores": CORES,
            "device": device,
            "sent_at": comm.clock.sent_at,
            "arrivals": comm.clock.arrivals,
            "rounds": comm.clock.rounds,
            "shared_reduce": shared_reduce,
        },
    }


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-worker records of one step -> one record with a list per key, indexed by worker."""
    records = sorted((r for r in records if r), key=lambda r: r["worker"])
    out: dict[str, Any] = {"step": records[0]["step"] if records else 0, "per_worker": {},
                           "measured_only": defaultdict(list)}
    for k in PER_WORKER_KEYS:
        out["per_worker"][k] = {
            "predicted": [r["per_worker"][k]["predicted"] for r in records],
            "measured": [r["per_worker"][k]["measured"] for r in records],
        }
    for r in records:
        for k, v in r["measured_only"].items():
            out["measured_only"][k].append(v)
    out["measured_only"] = dict(out["measured_only"])
    out["loss"] = sum(r["measured_only"]["loss"] for r in records)
    out["step_s"] = max((r["measured_only"]["step_s"] for r in records), default=0.0)
    return out


#: counts the runtime must reproduce exactly, under either weight cache (``weights_peak_resident``
#: under ``"job"`` as the program predicts it for the engine's lookahead). Not ``stash_recv``: the
#: runtime only runs placements that move no stash, so it has nothing to measure (``None``).
EXACT_KEYS = ("act_recv", "grad_recv", "weight_fetch_stages", "weight_fetch_jobs", "weight_grad_send",
              "weight_allreduce", "peak_activations", "weights_owned", "weights_peak_resident")


def mismatches(record: dict[str, Any], keys: tuple[str, ...] = EXACT_KEYS) -> dict[str, Any]:
    """Keys whose measured value differs from the prediction (empty when they all agree)."""
    pw = record["per_worker"]
    return {k: pw[k] for k in keys if pw[k]["predicted"] != pw[k]["measured"]}


def resident_bytes(device: torch.device) -> int:
    """What the process holds now: GPU memory allocated, or its resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the peak so far
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
