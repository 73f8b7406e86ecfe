"""Our engine against PyTorch's own schemes, pair by pair, on the reference workload (a benchmark).

    python benchmarks/vs_torch_native.py                 # every pair, H=512 and H=128
    python benchmarks/vs_torch_native.py --quick         # a smoke run (small, few repetitions)
    python benchmarks/vs_torch_native.py --pairs ddp-w4,gpipe-w4 --sizes 512 --reps 9 --json out.json

Reference workload: S stages, stage s = ``Sequential(Linear(H, H), GELU())``, built in order after
``torch.manual_seed(0)`` on every rank; ``torch.manual_seed(1)``, then ``x = randn(B*mb, H)``,
``target = randn(B*mb, H)``, micro-batch b = ``x.chunk(B)[b]``, the same batch every step; loss the
mean over micro-batches of each one's MSE; SGD lr 0.1; one intra-op thread per process.

For each pair, one set of W forked processes runs both sides, alternating repetitions (ours,
native, ours, ...) so the machine's noise falls on both alike. Step time: barrier, start, the
whole step with the optimizer, barrier, end; the slowest rank's. Printed per pair: the median and
minimum of both, their ratio (ours / native, medians) with its 95% interval (a paired bootstrap over
the alternated steps: an interval that holds 1.0 is parity within the run's spread), our predicted
step time, and the fingerprints of the first step on both sides: the loss and the sum of |gradient|
of stage 0.

Predicted: the simulator fed with what our workers measured (per-kind job durations, the link's
latency and bandwidth from a ping-pong, :mod:`launcher.schedule.link` for the gradient exchange
after the compute), plus the optimizer step, which the schedule does not contain (measured).

Exit status 1 when any pair's fingerprints differ by more than 1e-6 relative.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from scipy.stats import bootstrap
from torch import nn

from launcher.report.measured_costs import (
    end_seconds,
    job_seconds,
    message_cpu_seconds,
    message_seconds,
    on_cpu,
    round_seconds,
    shared_cores,
    shared_reduce,
)
from launcher.runtime import Engine, launch
from launcher.runtime.engine import TRANSPORTS
from launcher.runtime.link_probe import measure as measure_link
from launcher.schedule import make_schedule, simulate
from launcher.schedule.cores import job_work, replay
from launcher.schedule.link import Link, exchanges, partners
from launcher.torch_support.staged import StagedModel

TOLERANCE = 1e-6


@dataclass(frozen=True)
class Pair:
    """One comparison: our scheme and settings against one native PyTorch scheme."""

    name: str
    scheme: str
    G: int
    R: int
    S: int
    B: int
    order: str
    split: bool
    #: ddp, fsdp, gpipe, 1f1b, looped_bfs, interleaved_1f1b, interleaved_zb, fsdp_looped_bfs,
    #: fsdp_interleaved_1f1b, zbv, dualpipev
    native: str

    @property
    def W(self) -> int:
        return self.G * self.R


#: ``order="default"``: the scheme's own default order (docs/configuration.md, "Default orders"), as
#: a user who names none gets it; the ``*-default-*`` pairs are one per scheme at that order
PAIRS = [
    Pair("ddp-w4", "ddp", 4, 1, 4, 4, "default", False, "ddp"),
    Pair("ddp-w8", "ddp", 8, 1, 4, 8, "default", False, "ddp"),
    Pair("fsdp-w4", "fsdp", 4, 1, 4, 4, "default", False, "fsdp"),
    Pair("gpipe-w4", "gpipe", 1, 4, 4, 8, "breadth_first", False, "gpipe"),
    Pair("gpipe-w8", "gpipe", 1, 8, 8, 8, "breadth_first", False, "gpipe"),
    Pair("1f1b-w4", "gpipe", 1, 4, 4, 8, "1f1b", False, "1f1b"),
    Pair("looped-bfs-w2", "lpp", 1, 2, 4, 8, "breadth_first", False, "looped_bfs"),
    Pair("interleaved-1f1b-w4", "lpp", 1, 4, 8, 8, "interleaved_1f1b", False, "interleaved_1f1b"),
    Pair("interleaved-zb-w4", "lpp", 1, 4, 8, 8, "1f1b", True, "interleaved_zb"),
    Pair("fslpp-w4", "fslpp", 2, 2, 4, 8, "breadth_first", False, "fsdp_looped_bfs"),
    Pair("gpipe-default-w4", "gpipe", 1, 4, 4, 8, "default", False, "1f1b"),
    Pair("lpp-default-w2", "lpp", 1, 2, 4, 8, "default", False, "interleaved_1f1b"),
    Pair("lpp-default-w4", "lpp", 1, 4, 8, 8, "default", False, "interleaved_1f1b"),
    Pair("fslpp-default-w4", "fslpp", 2, 2, 4, 8, "default", False, "fsdp_interleaved_1f1b"),
]
NATIVE = {"ddp": "DDP", "fsdp": "FSDP2", "gpipe": "GPipe", "1f1b": "1F1B", "looped_bfs": "LoopedBFS",
          "interleaved_1f1b": "Interleaved1F1B", "interleaved_zb": "InterleavedZeroBubble",
          "fsdp_looped_bfs": "FSDP2 + LoopedBFS", "fsdp_interleaved_1f1b": "FSDP2 + Interleaved1F1B",
          "zbv": "ZBVZeroBubble",
          "dualpipev": "DualPipeV"}  # DistributedDataParallel, fully_shard, Schedule*
#: native schedules that place stages in a V (``style="v"``): two stages per rank, ours ``strategy=vshape``
V_SHAPED = ("zbv", "dualpipev")


# ---- the reference workload -----------------------------------------------------------------
def build_stages(S: int, H: int, device: torch.device) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(H, H), nn.GELU()).to(device) for _ in range(S)]


def build_batch(B: int, mb: int, H: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(B * mb, H)
    target = torch.randn(B * mb, H)
    return x.to(device), target.to(device)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target, reduction="mean")


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _sum_abs(ts) -> float:
    total = 0.0
    for t in ts:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            total += float(t.detach().double().abs().sum())
    return total


def _all(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


# ---- our side --------------------------------------------------------------------------------
class Ours:
    def __init__(self, p: Pair, H: int, mb: int, device: torch.device, transport: str = "auto") -> None:
        step = make_schedule(p.scheme, p.S, p.B, G=p.G, R=p.R, order=p.order, split_backward=p.split)
        self.p, self.device = p, device
        # the engine's defaults (the batch check runs on step 1, a warm-up step, then every 50th)
        self.engine = Engine(StagedModel(build_stages(p.S, H, device), mse), step, sgd, transport=transport)
        x, t = build_batch(p.B, mb, H, device)
        self.mbs = list(zip(x.chunk(p.B), t.chunk(p.B)))
        self.records: list[dict] = []
        self.optimizer_s: list[float] = []
        self.optimizer_cpu_s: list[float] = []

    def step(self, fingerprint: bool = False) -> tuple[float, float]:
        """One step; with ``fingerprint``, returns (loss, sum |grad| of stage 0) of this worker
        (not timed steps: the sum is not part of training)."""
        e = self.engine
        rec = e.compute_step(self.mbs)
        g0 = _sum_abs([e.last_grads.get(0)]) if fingerprint and 0 in e.owned else 0.0
        t, cpu = time.perf_counter(), time.process_time()
        if e.optimizer is not None:
            e.install_grads()
            e.optimizer.step()
            e.optimizer.zero_grad(set_to_none=True)
        self.optimizer_s.append(time.perf_counter() - t)
        self.optimizer_cpu_s.append(time.process_time() - cpu)
        self.records.append(rec)
        loss = rec.get("measured_only", {}).get("loss", 0.0) if rec else 0.0
        return loss, g0

    def fingerprint(self, loss: float, g0: float) -> tuple[float, float]:
        # each worker's loss is its micro-batches' share (sum over B); replicas hold equal totals
        return _all(loss, dist.ReduceOp.SUM, self.device), _all(g0, dist.ReduceOp.MAX, self.device)


# ---- the native side -------------------------------------------------------------------------
class Native:
    def __init__(self, p: Pair, H: int, mb: int, device: torch.device) -> None:
        self.p, self.device, self.rank = p, device, dist.get_rank()
        stages = build_stages(p.S, H, device)
        x, t = build_batch(p.B, mb, H, device)
        self.sched = None
        if p.native in ("ddp", "fsdp"):
            self._data_parallel(stages, x, t, device, units=stages)  # FSDP: fully_shard per stage
        else:
            self._pipeline(p, stages, x, t, device)
        self.optimizer = sgd(self.params)

    def _data_parallel(self, stages: list[nn.Module], x: torch.Tensor, t: torch.Tensor, device: torch.device,
                       units: list[nn.Module]) -> None:
        """DDP, or FSDP2 (``fully_shard`` on each of ``units``, then the root); W = B: rank r trains
        micro-batch r, gradients averaged."""
        p = self.p
        self.x, self.t = x.chunk(p.B)[self.rank], t.chunk(p.B)[self.rank]
        model = nn.Sequential(*stages)
        if p.native == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh(device.type, (p.W,))
            for m in units:
                fully_shard(m, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        self.stage0 = list(stages[0].parameters())
        self.params = list(self.model.parameters())

    def _pipeline(self, p: Pair, stages: list[nn.Module], x: torch.Tensor, t: torch.Tensor,
                  device: torch.device) -> None:
        from torch.distributed import pipelining as pp
        n_mb, group, pp_rank, pp_size = p.B, None, self.rank, p.W
        if p.native.startswith("fsdp_"):  # a (dp, pp) mesh: FSDP over dp, the loop over pp
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh(device.type, (p.G, p.R), mesh_dim_names=("dp", "pp"))
            group, pp_rank, pp_size = mesh["pp"].get_group(), mesh["pp"].get_local_rank(), p.R
            dp_rank = mesh["dp"].get_local_rank()
            x, t = x.chunk(p.G)[dp_rank], t.chunk(p.G)[dp_rank]
            n_mb = p.B // p.G
            for s in range(pp_rank, p.S, pp_size):
                fully_shard(stages[s], mesh=mesh["dp"], reshard_after_forward=False)
        if p.native in V_SHAPED:  # stage s on the rank torch's V style gives it: r holds r and 2W - 1 - r
            from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping
            to_rank = generate_stage_to_rank_mapping(pp_size, p.S, style="v")
            mine = sorted(s for s, r in to_rank.items() if r == pp_rank)
        else:
            mine = list(range(pp_rank, p.S, pp_size))  # looped: stage s on pipeline rank s mod size
        self.stages = [pp.PipelineStage(stages[s], s, p.S, device, group=group) for s in mine]
        self.first, self.last = 0 in mine, p.S - 1 in mine
        self.x, self.t = x, t
        self.params = [q for s in mine for q in stages[s].parameters()]
        self.stage0 = list(stages[0].parameters()) if self.first else []
        kind = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "looped_bfs": pp.ScheduleLoopedBFS,
                "interleaved_1f1b": pp.ScheduleInterleaved1F1B, "interleaved_zb": pp.ScheduleInterleavedZeroBubble,
                "fsdp_looped_bfs": pp.ScheduleLoopedBFS, "fsdp_interleaved_1f1b": pp.ScheduleInterleaved1F1B,
                "zbv": pp.ScheduleZBVZeroBubble,
                "dualpipev": pp.ScheduleDualPipeV}[p.native]
        single = kind in (pp.ScheduleGPipe, pp.Schedule1F1B)
        self.sched = kind(self.stages[0] if single else self.stages, n_microbatches=n_mb, loss_fn=self.loss_fn)
        self.n_mb = n_mb

    #: the loss both sides compute (vs_native_transformer's side sets its model's own)
    loss_fn = staticmethod(mse)

    def step(self, fingerprint: bool = False) -> tuple[float, float]:
        p = self.p
        value = g0 = 0.0
        if self.sched is None:
            loss = self.loss_fn(self.model(self.x), self.t)
            loss.backward()
            if fingerprint:
                value = float(loss.detach()) / p.B  # this rank's micro-batch's share of the mean
        else:
            losses: list[torch.Tensor] = []
            args = (self.x,) if self.first else ()
            self.sched.step(*args, target=self.t if self.last else None, losses=losses if self.last else None)
            if fingerprint:
                value = sum(float(v.detach()) for v in losses) / p.B
        if fingerprint:
            g0 = _sum_abs(q.grad for q in self.stage0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value, g0

    def fingerprint(self, loss: float, g0: float) -> tuple[float, float]:
        # DDP's replicas hold equal gradients (max); shards and pipeline stages add up (sum)
        op = dist.ReduceOp.MAX if self.p.native == "ddp" else dist.ReduceOp.SUM
        return _all(loss, dist.ReduceOp.SUM, self.device), _all(g0, op, self.device)


# ---- one pair on its workers -----------------------------------------------------------------
class _Nothing:
    def step(self, fingerprint: bool = False) -> tuple[float, float]:
        return 0.0, 0.0


def _timed(side, device: torch.device, fingerprint: bool = False) -> tuple[float, float, tuple[float, float]]:
    """One step between two barriers: its wall time (the slowest rank's), the CPU seconds every
    process spent on it together (its threads' too), and the step's fingerprint if asked."""
    dist.barrier()
    t, cpu = time.perf_counter(), time.process_time()
    out = side.step(fingerprint)
    cpu = time.process_time() - cpu
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    wall = time.perf_counter() - t
    return _all(wall, dist.ReduceOp.MAX, device), _all(cpu, dist.ReduceOp.SUM, device), out


def pair_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU (one intra-op thread per process)."""
    torch.set_num_threads(1)
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def pair_link(p: Any, device: torch.device) -> dict[str, Any] | None:
    """Workers 0 and 1 ping-pong once before either side runs (the prediction's message cost)."""
    link = measure_link(None, device) if p.W > 1 else None
    shared = [link.to_json() if link else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def alternate(sides: dict[str, Any], device: torch.device, reps: int, steps: int, warmup: int) -> dict[str, Any] | None:
    """On each rank: the first step of each side (fingerprints, then warm-up), then ``reps`` rounds
    of ``steps`` timed steps per side, alternated; rank 0 returns the times, CPU seconds,
    fingerprints, our side's per-rank records and the cost of the timing's own barriers."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpus: dict[str, list[float]] = {k: [] for k in sides}
    prints: dict[str, tuple[float, float]] = {}
    for name, side in sides.items():  # the first step: fingerprints (and warm-up)
        prints[name] = side.fingerprint(*_timed(side, device, fingerprint=True)[2])
        for _ in range(warmup - 1):
            _timed(side, device)
    barriers: list[float] = []  # what the timing itself costs: its two barriers, nothing between
    for _ in range(reps):
        for name, side in sides.items():
            for _ in range(steps):
                wall, cpu, _ = _timed(side, device)
                times[name].append(wall)
                cpus[name].append(cpu)
        barriers.append(_timed(_Nothing(), device)[0])
    ours = sides["ours"]
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = {"records": [r for r in ours.records[warmup:] if r], "optimizer_s": ours.optimizer_s[warmup:],
            "optimizer_cpu_s": ours.optimizer_cpu_s[warmup:]}
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    return {"times": times, "cpus": cpus, "fingerprints": prints, "per_rank": gathered,
            "barrier_s": statistics.median(barriers)}


def ratio_interval(ours: list[float], native: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A ``confidence`` interval of ``median(ours) / median(native)``: a paired bootstrap (step i of
    each side ran in the same alternated repetition, so they are resampled together), seeded, so a
    run prints the same interval for the same times. An interval that holds 1.0 is parity within
    this run's spread; (nan, nan) with fewer than 3 steps a side."""
    if len(ours) < 3:
        return math.nan, math.nan

    def ratio(o: Any, n: Any, axis: int = -1) -> Any:
        return np.median(o, axis=axis) / np.median(n, axis=axis)

    res = bootstrap((np.asarray(ours), np.asarray(native)), ratio, paired=True, vectorized=True,
                    confidence_level=confidence, n_resamples=2000, method="percentile",
                    random_state=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def interval_text(lo_hi: tuple[float, float]) -> str:
    lo, hi = lo_hi
    return "-" if math.isnan(lo) else f"{lo:.2f} - {hi:.2f}"


def run_pair(p: Pair, H: int, mb: int, reps: int, steps: int, warmup: int,
             transport: str = "auto") -> dict[str, Any] | None:
    """On each of W ranks: both sides, alternated; rank 0 returns the measurements. ``transport``:
    how our side's messages and replicas' all-reduces travel."""
    device = pair_device()
    link = pair_link(p, device)
    out = alternate({"ours": Ours(p, H, mb, device, transport), "native": Native(p, H, mb, device)}, device, reps,
                    steps, warmup)
    return None if out is None else {"pair": asdict(p), "H": H, "mb": mb, "link": link, **out}


def predicted(p: Pair, H: int, mb: int, result: dict[str, Any]) -> float:
    """Our step as the simulator predicts it from what our workers measured (the profile): the
    programs the workers ran, timed by the job seconds per kind they measured, replayed
    (:func:`replayed`)."""
    ranks = result["per_rank"][: p.W]
    tl = simulate(make_schedule(p.scheme, p.S, p.B, G=p.G, R=p.R, order=p.order, split_backward=p.split))  # what ran
    kinds = tl.schedule.space.kinds
    return replayed(p, tl, ranks, result, mb * H * 4, [(H * H + H) * 4] * p.S, job_seconds(ranks, kinds))


def replayed(p: Any, tl: Any, ranks: list[dict[str, Any]], result: dict[str, Any], message_bytes: int,
             grads: list[int], durations: dict[str, float]) -> float:
    """The timeline ``tl`` replayed with what the workers measured: its jobs timed by
    ``durations`` per kind (CPU seconds on CPU workers, times the stage's own durations where
    ``tl`` carries them), plus the communication threads' CPU per message the job moves; what a
    message took (else one of ``message_bytes`` over the ping-pong's link); each worker's end of
    step (its CPU, and its exchange's rounds of messages, ``grads`` bytes per stage) and optimizer
    step; on the cores the workers shared (:func:`launcher.schedule.cores.replay`), plus the
    timing's own two barriers (measured with nothing between them)."""
    comm = message_seconds(ranks)
    if comm is None:  # no late message, or workers on several hosts: the ping-pong's link
        comm = Link(**result["link"]).seconds(message_bytes) if result["link"] else 0.0
    which = "optimizer_cpu_s" if on_cpu(ranks) else "optimizer_s"
    tails = [end + statistics.median(r[which]) for end, r in zip(end_seconds(ranks), ranks)]
    round_s = round_seconds(ranks, comm)  # an exchange's round: from when both ends were ready
    rounds = [e.rounds * round_s for e in exchanges(tl, grads, shared_reduce(ranks))]
    work = job_work(tl, durations, message_cpu_seconds(ranks))
    return replay(tl, shared_cores(ranks) or p.W, tails, partners(tl), rounds, durations=work,
                  comm=comm).seconds + result["barrier_s"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="", help="comma-separated pair names (default: all)")
    ap.add_argument("--sizes", default="512,128", help="H values; mb is 32 for H >= 512, else 8")
    ap.add_argument("--reps", type=int, default=7, help="alternated repetitions per side")
    ap.add_argument("--steps", type=int, default=2, help="steps per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="steps per side before timing")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                    help="how our side's messages and replicas' all-reduces travel (the engine's default: auto, "
                         "shared memory on one host's CPUs)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: H=64 mb=4, W <= 4, 2 repetitions")
    ap.add_argument("--json", default="", help="write every measurement here")
    args = ap.parse_args(argv)
    pairs = [p for p in PAIRS if not args.pairs or p.name in args.pairs.split(",")]
    sizes = [(int(h), 32 if int(h) >= 512 else 8) for h in args.sizes.split(",")]
    if args.quick:
        pairs = [p for p in pairs if p.W <= 4]
        sizes, args.reps, args.steps, args.warmup = [(64, 4)], 2, 1, 1
    console = Console(width=260)
    table = Table(title=f"ours vs PyTorch native ({args.backend}, ours over {args.transport}, {os.cpu_count()} cores, "
                        "one thread per process; "
                        f"median of {args.reps} x {args.steps} steps)")
    for col in ("pair", "native", "H", "W", "ours ms (med / min)", "native ms (med / min)", "ours/native",
                "95% interval", "CPU ms ours / native", "predicted ms", "pred/meas", "loss ours / native",
                "|g0| ours / native", "agree"):
        table.add_column(col, justify="left" if col in ("pair", "native") else "right")
    rows, failed = [], False
    for H, mb in sizes:
        for p in pairs:
            result = launch(run_pair, p.W, p, H, mb, args.reps, args.steps, args.warmup, args.transport,
                            backend=args.backend,
                            timeout=60, deadline=900)[0]
            ours, native = result["times"]["ours"], result["times"]["native"]
            (lo, go), (ln, gn) = result["fingerprints"]["ours"], result["fingerprints"]["native"]
            agree = _rel(lo, ln) <= TOLERANCE and _rel(go, gn) <= TOLERANCE
            failed |= not agree
            pred = predicted(p, H, mb, result)
            row = {"pair": p.name, "native": NATIVE[p.native], "H": H, "mb": mb, "W": p.W,
                   "ours_median_s": statistics.median(ours), "ours_min_s": min(ours),
                   "native_median_s": statistics.median(native), "native_min_s": min(native),
                   "ratio": statistics.median(ours) / statistics.median(native), "predicted_s": pred,
                   "ours_cpu_s": statistics.median(result["cpus"]["ours"]),
                   "native_cpu_s": statistics.median(result["cpus"]["native"]),
                   "predicted_over_measured": pred / statistics.median(ours), "loss": [lo, ln], "g0": [go, gn],
                   "loss_rel_diff": _rel(lo, ln), "g0_rel_diff": _rel(go, gn), "agree": agree, "link": result["link"]}
            row["ratio_interval"] = ratio_interval(ours, native)
            rows.append(row)
            table.add_row(p.name, NATIVE[p.native], str(H), str(p.W),
                          f"{row['ours_median_s'] * 1e3:.2f} / {row['ours_min_s'] * 1e3:.2f}",
                          f"{row['native_median_s'] * 1e3:.2f} / {row['native_min_s'] * 1e3:.2f}",
                          f"{row['ratio']:.2f}", interval_text(row["ratio_interval"]),
                          f"{row['ours_cpu_s'] * 1e3:.1f} / {row['native_cpu_s'] * 1e3:.1f}",
                          f"{pred * 1e3:.2f}", f"{row['predicted_over_measured']:.2f}",
                          f"{lo:.6f} / {ln:.6f}", f"{go:.6g} / {gn:.6g}",
                          "yes" if agree else f"NO ({max(row['loss_rel_diff'], row['g0_rel_diff']):.1e})")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "transport": args.transport, "cores": os.cpu_count(),
                       "torch": torch.__version__, "reps": args.reps, "steps": args.steps, "rows": rows}, f, indent=1)
    if failed:
        print(f"fingerprints disagree by more than {TOLERANCE:g} relative on some pair", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
