"""The engine's own cost on one worker: CPU per training step against plain PyTorch (a benchmark).

    python benchmarks/engine_step_cpu.py                       # GPT d=128, 6 blocks, T=64, 4 stages
    python benchmarks/engine_step_cpu.py --reps 6 --steps 25
    python benchmarks/engine_step_cpu.py --size 128,6,64,1 --stages 1 --microbatches 1   # a DDP rank's share
    python benchmarks/engine_step_cpu.py --size 256,6,64,1 --split   # the backward as I then W
    PYTHONPATH=<another checkout> python benchmarks/engine_step_cpu.py   # the same, on other code

One worker (W=1, no communication) runs every job of the step, so what it spends beyond plain
PyTorch on the same stages is the engine itself: the per-job Python, the saved-tensor count, the
gradient sums. Both sides train the transformer benchmark's GPT stages (``vs_native_transformer``)
on the same 4 micro-batches with AdamW; plain PyTorch is forward and backward per micro-batch
(gradient accumulation), then the optimizer. Measured: the compute thread's CPU seconds per step
(``time.thread_time``), the median over ``--steps`` steps after 3 warm-up steps; repetitions
alternate the two sides so the machine's noise falls on both alike. One intra-op thread.

Exit status 1 when the two sides' first-step losses differ by more than 1e-5 relative.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vs_native_transformer as vt  # noqa: E402 - the benchmark's own directory, put on the path above

from launcher.runtime import Engine, StagedModel, launch  # noqa: E402
from launcher.schedule import make_step  # noqa: E402


def _median_cpu(step, steps: int) -> tuple[float, float]:
    """The median CPU seconds of ``step()`` and the loss its first call returned."""
    first = step()
    for _ in range(2):
        step()
    spent = []
    for _ in range(steps):
        t = time.thread_time()
        step()
        spent.append(time.thread_time() - t)
    return statistics.median(spent), first


def ours(size: vt.Size, S: int, B: int, split: bool, steps: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    stages, loss, _ = vt.build(size, S, torch.device("cpu"))
    engine = Engine(StagedModel(stages, loss), make_step("lpp", S, B, G=1, R=1, split_backward=split), vt.adamw)
    x, y = vt.build_batch(size, B, torch.device("cpu"))
    mbs = list(zip(x.chunk(B), y.chunk(B)))
    return _median_cpu(lambda: engine.train_step(mbs)["measured_only"]["loss"], steps)


def plain(size: vt.Size, S: int, B: int, steps: int) -> tuple[float, float]:
    torch.set_num_threads(1)
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

    return _median_cpu(step, steps)


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
    mine, theirs, losses = [], [], set()
    for _ in range(args.reps):
        cpu, first = launch(ours, 1, size, S, B, args.split, args.steps)[0]  # a process group of one, as a worker has
        mine.append(cpu)
        cpu, plain_first = plain(size, S, B, args.steps)
        theirs.append(cpu)
        losses.add((first, plain_first))
    a, b = statistics.median(mine), statistics.median(theirs)
    print(f"GPT d={d} layers={layers} T={T} mb={mb}, S={S} B={B}{', split backward' if args.split else ''}, "
          f"one worker, {args.reps} x {args.steps} steps")
    print(f"ours   {a * 1e3:8.1f} ms CPU per step  (runs: {', '.join(f'{v * 1e3:.1f}' for v in mine)})")
    print(f"plain  {b * 1e3:8.1f} ms CPU per step  (runs: {', '.join(f'{v * 1e3:.1f}' for v in theirs)})")
    print(f"ratio  {a / b:.3f}")
    first, plain_first = losses.pop()
    print(f"first-step loss: ours {first:.6f}, plain {plain_first:.6f}")
    return 0 if abs(first - plain_first) <= 1e-5 * abs(plain_first) else 1


if __name__ == "__main__":
    sys.exit(main())
