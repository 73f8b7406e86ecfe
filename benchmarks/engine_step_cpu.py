"""The engine's own cost on one worker: CPU per training step against plain PyTorch (a benchmark).

    python benchmarks/engine_step_cpu.py                       # GPT d=128, 6 blocks, T=64, 4 stages
    python benchmarks/engine_step_cpu.py --reps 6 --steps 25
    python benchmarks/engine_step_cpu.py --size 128,6,64,1 --stages 1 --microbatches 1   # a DDP rank's share
    python benchmarks/engine_step_cpu.py --size 256,6,64,1 --split   # the backward as I then W
    PYTHONPATH=<another checkout> python benchmarks/engine_step_cpu.py   # the same, on other code

One worker (W=1, no communication) runs every job of the step, so what it spends beyond plain
PyTorch on the same stages is the engine itself: the per-job Python, the saved-tensor count, the
gradient sums. Both sides train the transformer benchmark's GPT stages (``vs_native_transformer``)
on the same ``--microbatches`` micro-batches with AdamW; plain PyTorch is forward and backward per
micro-batch (gradient accumulation), then the optimizer. Both run in this process (the engine in a
process group of one, as a worker's), alternated step by step so the machine's noise falls on both
alike, after 3 steps each. Measured: the thread's CPU seconds per step (``time.thread_time``), the
median of each repetition's ``--steps`` steps, and the median over repetitions. One intra-op thread.

Exit status 1 when the two sides' first-step losses differ by more than 1e-5 relative.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import vs_native_transformer as vt

from launcher.runtime import Engine
from launcher.schedule import make_schedule
from launcher.torch_support.staged import StagedModel


def _step_of_ours(size: vt.Size, S: int, B: int, split: bool) -> Callable[[], float]:
    """One training step of the engine (a world of one worker), returning its loss."""
    stages, loss, _ = vt.build(size, S, torch.device("cpu"))
    engine = Engine(StagedModel(stages, loss), make_schedule("lpp", S, B, G=1, R=1, split_backward=split), vt.adamw)
    x, y = vt.build_batch(size, B, torch.device("cpu"))
    mbs = list(zip(x.chunk(B), y.chunk(B)))
    return lambda: engine.train_step(mbs)["measured_only"]["loss"]


def _step_of_plain(size: vt.Size, S: int, B: int) -> Callable[[], float]:
    """One step of plain PyTorch on the same stages: gradient accumulation, then the optimizer."""
    stages, loss, _ = vt.build(size, S, torch.device("cpu"))
    model = torch.nn.Sequential(*stages)
    opt = vt.adamw(model.parameters())
    x, y = vt.build_batch(size, B, torch.device("cpu"))

    def step() -> float:
        total = 0.0
        for xb, yb in zip(x.chunk(B), y.chunk(B)):
            part = loss(model(xb), yb) / B
            part.backward()
            total += float(part.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _cpu(step: Callable[[], float]) -> float:
    t = time.thread_time()
    step()
    return time.thread_time() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="128,6,64,4", help="d,layers,T,mb of the GPT")
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions per side")
    ap.add_argument("--steps", type=int, default=25, help="timed steps per repetition")
    ap.add_argument("--stages", type=int, default=4, help="S: the GPT's modules cut into this many stages")
    ap.add_argument("--microbatches", type=int, default=4, help="B: micro-batches per step")
    ap.add_argument("--split", action="store_true", help="our backward split into I and W (plain: one backward)")
    args = ap.parse_args(argv)
    S, B = args.stages, args.microbatches
    d, layers, T, mb = (int(v) for v in args.size.split(","))
    size = vt.Size("gpt", d, layers, T, mb)
    torch.set_num_threads(1)
    # the engine runs in this process, a world of one (as a worker's group), beside plain PyTorch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sides = {"ours": _step_of_ours(size, S, B, args.split), "plain": _step_of_plain(size, S, B)}
        firsts = {k: step() for k, step in sides.items()}
        for _ in range(2):  # warm-up
            for step in sides.values():
                step()
        spent: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.reps * args.steps):  # alternated step by step: the noise falls on both
            for k, step in sides.items():
                spent[k].append(_cpu(step))
    finally:
        dist.destroy_process_group()
    n = args.steps
    mine = [statistics.median(spent["ours"][i * n:(i + 1) * n]) for i in range(args.reps)]
    theirs = [statistics.median(spent["plain"][i * n:(i + 1) * n]) for i in range(args.reps)]
    first, plain_first = firsts["ours"], firsts["plain"]
    a, b = statistics.median(mine), statistics.median(theirs)
    print(f"GPT d={d} layers={layers} T={T} mb={mb}, S={S} B={B}{', split backward' if args.split else ''}, "
          f"one worker, {args.reps} x {args.steps} steps")
    print(f"ours   {a * 1e3:8.1f} ms CPU per step  (runs: {', '.join(f'{v * 1e3:.1f}' for v in mine)})")
    print(f"plain  {b * 1e3:8.1f} ms CPU per step  (runs: {', '.join(f'{v * 1e3:.1f}' for v in theirs)})")
    print(f"ratio  {a / b:.3f}")
    print(f"first-step loss: ours {first:.6f}, plain {plain_first:.6f}")
    return 0 if abs(first - plain_first) <= 1e-5 * abs(plain_first) else 1


if __name__ == "__main__":
    sys.exit(main())
