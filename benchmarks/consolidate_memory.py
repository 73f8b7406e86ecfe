"""Memory and time of consolidating a sharded checkpoint into one file, streamed against loading the
whole checkpoint and saving it (a benchmark, not a test).

    python benchmarks/consolidate_memory.py [--stages 16] [--width 2048]

Writes a sharded checkpoint of ``--stages`` linear stages of ``--width`` (their weights and AdamW's
two moments, as a training run's ``last.ckpt`` holds them), then consolidates it twice, each in a
fresh process: ``python -m launcher.checkpoint consolidate``'s streaming (one stage at a time) and
the whole dict loaded and ``torch.save``-d. Prints each process's peak resident growth (``VmHWM``
after, less before) and wall time, and the files' equality.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import launcher  # noqa: F401
from launcher.lightning import sharded

SIDE = """
import json, sys, time
from pathlib import Path
import launcher, torch
from launcher.checkpoint import consolidate, load

def hwm():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

before, t = hwm(), time.perf_counter()
if sys.argv[3] == "whole":
    torch.save(load(sys.argv[1]), sys.argv[2])
else:
    consolidate(sys.argv[1], sys.argv[2])
print(json.dumps({"grew": hwm() - before, "seconds": time.perf_counter() - t}))
"""


def write_checkpoint(path: Path, stages: int, width: int) -> int:
    """A sharded checkpoint of ``stages`` linear stages after one AdamW step; its training state's bytes."""
    torch.manual_seed(0)
    model = nn.Module()
    model.stages = nn.ModuleList(nn.Linear(width, width) for _ in range(stages))
    opt = torch.optim.AdamW(model.parameters())
    sum(m.weight.sum() for m in model.stages).backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    ids = {id(p): n for n, p in model.named_parameters()}
    ckpt = {"state_dict": model.state_dict(), "global_step": 1, "epoch": 0,
            "optimizer_states": [sharded.optimizer_entries(opt, ids, set(names))]}
    sharded.save(ckpt, path, set(model.state_dict()), names, {}, rank=0)
    return 3 * sum(v.numel() * v.element_size() for v in model.state_dict().values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "last.ckpt"
        state = write_checkpoint(ckpt, args.stages, args.width)
        print(f"{args.stages} stages of width {args.width}: training state {state / 2**20:.0f} MB, "
              f"{state / args.stages / 2**20:.0f} MB a stage")
        got = {}
        for side in ("streamed", "whole"):
            out = Path(tmp) / f"{side}.ckpt"
            p = subprocess.run([sys.executable, "-c", SIDE, str(ckpt), str(out), side], capture_output=True,
                               text=True, check=True)
            got[side] = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"{side:9} peak RSS grew {got[side]['grew'] / 2**20:7.0f} MB in {got[side]['seconds']:.1f} s")
        a, b = (torch.load(Path(tmp) / f"{s}.ckpt", weights_only=True) for s in ("streamed", "whole"))
        same = all(torch.equal(a["state_dict"][k], v) for k, v in b["state_dict"].items())
        print(f"streamed / whole: memory {got['streamed']['grew'] / got['whole']['grew']:.2f}, "
              f"time {got['streamed']['seconds'] / got['whole']['seconds']:.2f}; same weights: {same}")
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
