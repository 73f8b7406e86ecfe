"""What a rolled-back optimizer step costs (:mod:`launcher.torch_support.post_validation`): CPU time
of one ``ProvisionalStep.take`` + ``validate`` against the optimizer's plain ``step()``.

    python benchmarks/rollback_cost.py                      # 10M float32 parameters, 5 repetitions
    python benchmarks/rollback_cost.py --params 1000000 --reps 9

The parameters are ``--tensors`` float32 tensors of ``--params`` elements in all, with random
gradients, stepped once first so every optimizer state exists. Three sides, alternated repetition
by repetition so the machine's noise falls on all alike:

- ``step``: the optimizer's own ``step()``;
- ``take+validate (kept)``: ``take(1.0)`` then ``validate(1.0)``: the provisional step confirmed;
- ``take+validate (rolled back)``: ``take(1.0)`` then ``validate(0.8)``: the step undone in place and
  taken again with the true coefficient (clipping that the partial norm missed);
- ``keep_copy (kept)``, ``keep_copy (rolled back)``: the same with ``keep_copy=True``, the exact
  fallback (a copy of the parameters and state before each step, copied back on a rollback).

Measured: the thread's CPU seconds (``time.thread_time``, one intra-op thread), the median over
repetitions; the ratio is to ``step``. The gradients are restored outside the timed region.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from launcher.torch_support.post_validation import ProvisionalStep

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "SGD(momentum=0.9)": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "AdamW(weight_decay=0.01)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
}
SIDES = ("step", "take+validate (kept)", "take+validate (rolled back)", "keep_copy (kept)", "keep_copy (rolled back)")


def measure(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], n: int, tensors: int,
            reps: int) -> dict[str, float]:
    """The median CPU seconds of each side for one optimizer."""
    g = torch.Generator().manual_seed(0)
    sizes = [n // tensors + (i < n % tensors) for i in range(tensors)]
    ps = [torch.randn(s, generator=g).requires_grad_() for s in sizes]
    grads = [torch.randn(s, generator=g) for s in sizes]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    opt = make(ps)
    opt.step()  # the state exists, as after the first step
    provisional, copying = ProvisionalStep(opt), ProvisionalStep(opt, keep_copy=True)
    runs: dict[str, Callable[[], None]] = {
        "step": lambda: opt.step(),
        "take+validate (kept)": lambda: (provisional.take(1.0), provisional.validate(1.0))[1],
        "take+validate (rolled back)": lambda: (provisional.take(1.0), provisional.validate(0.8))[1],
        "keep_copy (kept)": lambda: (copying.take(1.0), copying.validate(1.0))[1],
        "keep_copy (rolled back)": lambda: (copying.take(1.0), copying.validate(0.8))[1],
    }
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(reps):
        for k in range(len(SIDES)):
            side = SIDES[(r + k) % len(SIDES)]  # each first in turn
            for p, gr in zip(ps, grads):
                p.grad.copy_(gr)
            t0 = time.thread_time()
            runs[side]()
            times[side].append(time.thread_time() - t0)
    assert provisional.rollbacks == copying.rollbacks == reps
    return {s: statistics.median(v) for s, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=10_000_000, help="parameters in all (float32)")
    ap.add_argument("--tensors", type=int, default=10, help="how many tensors hold them")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each side (the median is printed)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{args.params:,} float32 parameters in {args.tensors} tensors, one thread, "
          f"median CPU seconds of {args.reps} repetitions")
    for name, make in OPTIMIZERS.items():
        t = measure(make, args.params, args.tensors, args.reps)
        cells = ", ".join(f"{s} {t[s] * 1e3:.1f} ms ({t[s] / t['step']:.2f}x)" for s in SIDES)
        print(f"{name}: {cells}")


if __name__ == "__main__":
    main()
