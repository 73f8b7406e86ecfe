"""What the random streams cost (:mod:`launcher.torch_support.streams`): one worker's CPU per training step.

    python benchmarks/streams_cost.py                       # GPT-2 d=128, 6 blocks, T=64, S=4, B=4
    python benchmarks/streams_cost.py --size 256,6,64,1 --reps 5 --steps 20

One worker (W=1, no communication) runs every job of the step, on GPT-2's stages as ``model=hf``
builds them (the Hugging Face model's own modules), with AdamW. Three sides, alternated step by
step in this process, each first in turn, so the machine's noise falls on all alike (after 2
warm-up steps each):

- ``streams``: dropout 0.1 (GPT-2's default), each unit seeded for its job (the default);
- ``own``: dropout 0.1, the streams off: each worker draws from its own generator;
- ``none``: dropout 0 and the streams off: what dropout itself costs, for scale.

Measured: the thread's CPU seconds per step (``time.thread_time``), the median of each
repetition's ``--steps`` steps, and the median over repetitions. One intra-op thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import torch
import torch.distributed as dist
from engine_step_cpu import _cpu  # one step's CPU time, measured as that benchmark measures it

import launcher  # noqa: F401  (before transformers: the torchvision fallback)
from launcher.lightning.stage_groups import group_modules
from launcher.models import HFCausalLM
from launcher.runtime import Engine
from launcher.schedule import make_schedule
from launcher.torch_support.staged import StagedModel
from launcher.torch_support.streams import install_stages

VOCAB = 128


def _step(d: int, layers: int, T: int, mb: int, S: int, B: int, dropout: float,
          streams: bool) -> Callable[[], float]:
    """One training step of the engine (a world of one worker) on GPT-2's stages; returns its loss."""
    torch.manual_seed(0)
    p = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    lm = HFCausalLM("gpt2", config={"vocab_size": VOCAB, "n_embd": d, "n_layer": layers, "n_head": max(1, d // 64),
                                    "n_positions": T, **p})
    install_stages(lm.stages)
    stages, _ = group_modules(list(lm.stages), S)
    engine = Engine(StagedModel(stages, lm.loss), make_schedule("lpp", S, B, G=1, R=1),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    engine.streams = 0 if streams else None
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (B * mb, T), generator=g)
    mbs = list(zip(x.chunk(B), x.roll(-1, 1).chunk(B)))
    return lambda: engine.train_step(mbs)["measured_only"]["loss"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="128,6,64,4", help="d,layers,T,mb of GPT-2")
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions per side")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per repetition")
    ap.add_argument("--stages", type=int, default=4, help="S: GPT-2's modules cut into this many stages")
    ap.add_argument("--microbatches", type=int, default=4, help="B: micro-batches per step")
    args = ap.parse_args(argv)
    S, B = args.stages, args.microbatches
    d, layers, T, mb = (int(v) for v in args.size.split(","))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sides = {"streams": _step(d, layers, T, mb, S, B, 0.1, True),
                 "own": _step(d, layers, T, mb, S, B, 0.1, False),
                 "none": _step(d, layers, T, mb, S, B, 0.0, False)}
        for _ in range(2):  # warm-up
            for step in sides.values():
                step()
        spent: dict[str, list[float]] = {k: [] for k in sides}
        names = list(sides)
        for i in range(args.reps * args.steps):  # alternated step by step, each side first in turn
            for k in names[i % 3:] + names[:i % 3]:
                spent[k].append(_cpu(sides[k]))
    finally:
        dist.destroy_process_group()
    n = args.steps
    runs = {k: [statistics.median(v[i * n:(i + 1) * n]) for i in range(args.reps)] for k, v in spent.items()}
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"GPT-2 d={d} layers={layers} T={T} mb={mb}, S={S} B={B}, one worker, {args.reps} x {n} steps")
    for k, v in runs.items():
        print(f"{k:8s} {med[k] * 1e3:8.2f} ms CPU per step  (runs: {', '.join(f'{x * 1e3:.2f}' for x in v)})")
    print(f"streams / own generator: {med['streams'] / med['own']:.4f}   "
          f"dropout / none: {med['own'] / med['none']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
