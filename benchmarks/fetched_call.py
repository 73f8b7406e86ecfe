"""What running a stage on a fetched copy of its weights costs, against its own parameters.

    python benchmarks/fetched_call.py             # the default GPT's block, 2 sequences of 64
    python benchmarks/fetched_call.py --d 256 --batch 4

A job on fetched weights (FSDP, FSLPP) calls the stage's skeleton with the copy's tensors standing
in for its parameters (views of one flat buffer, so the gradient lands in one flat tensor). One
thread, one process; the CPU of a forward and of a forward plus backward of one transformer block:
on its own parameters, through ``torch.func.functional_call``, and through the engine's
``call_with``. Medians of 5 repetitions; each printed beside the own-parameters baseline measured
in the same invocation. Exit status 1 when the three sides' outputs differ.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch.func import functional_call

from launcher.models import GPT
from launcher.runtime.layout import StageLayout
from launcher.torch_support.staged import call_with


def cpu_ms(f: Callable[[], object], n: int) -> float:
    for _ in range(10):
        f()
    reps = []
    for _ in range(5):
        c = time.thread_time()
        for _ in range(n):
            f()
        reps.append((time.thread_time() - c) / n * 1e3)
    return statistics.median(reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=64, help="d_model (the default GPT's: 64)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (the default run's: 2)")
    ap.add_argument("--n", type=int, default=200, help="calls per repetition")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = list(GPT(d_model=args.d, seq_len=args.seq).stages)[1]
    x = torch.randn(args.batch, args.seq, args.d)
    layout = StageLayout.of(block)
    flat = layout.pack([p.detach() for p in block.parameters()]).requires_grad_(True)
    sides: dict[str, Callable[[], torch.Tensor]] = {
        "own parameters": lambda: block(x),
        "functional_call": lambda: functional_call(block, layout.views(flat), (x,)),
        "call_with": lambda: call_with(block, layout.views(flat), (x,), {}),
    }
    outs = [f() for f in sides.values()]
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    print(f"GPT block d={args.d}, {args.batch} x {args.seq} tokens, one thread: CPU ms per call (x own parameters)")
    for what, run in (("forward", lambda f: f()), ("forward + backward", lambda f: f().sum().backward())):
        base = None
        for name, f in sides.items():
            ms = cpu_ms(lambda: run(f), args.n)
            base = base or ms
            print(f"  {what:18s} {name:16s} {ms:7.3f}  ({ms / base:.2f})")
    print(f"outputs equal: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
