"""How long lowering a large step takes, beside the lowering before it became passes (a benchmark, not a test).

    python benchmarks/lowering_time.py [--repeats 7] [--cache step] [--size lpp,32,512,8,4] [--no-gc]

The old lowering (``launcher/runtime/plan.py`` at ``--old``, the commit before lowering became
passes over printable action lists) is taken out of git history into a temporary module and run in
this same process, on the same simulated timeline, alternately with :func:`launcher.schedule.lowering.lower`
(each side first in turn), so a shared machine's load falls on both alike. Prints, per side, the
median wall and CPU seconds over ``--repeats`` runs, then new / old. ``--no-gc`` pauses Python's
cyclic collector around both sides (the lowering pauses it itself; the old code did not), which
leaves the Python work alone. Both sides must give the same messages; the benchmark fails if not.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from launcher.schedule import make_schedule, simulate
from launcher.schedule.lowering import lower

ROOT = Path(__file__).resolve().parents[1]
#: the last commit whose lowering built the programs directly (9208a66 made it passes)
OLD = "86a3bf2"
OLD_PATH = "launcher/runtime/plan.py"
#: modules the old code imports that have moved since, and names renamed since (issue 48)
MOVED = {"launcher.schedule.memory": "launcher.schedule.activations", "tl.step": "tl.schedule",
         "tl.program": "tl.sequences", "tl.weights": "tl.owner", "space.B": "space.microbatches"}


def old_module(commit: str) -> ModuleType:
    """The lowering module as it was at ``commit``, imported from a temporary file."""
    text = subprocess.run(["git", "show", f"{commit}:{OLD_PATH}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    for was, now in MOVED.items():
        text = text.replace(was, now)
    path = Path(tempfile.mkdtemp()) / "old_lowering.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_lowering", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_lowering"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def messages(lowered: Any) -> list[tuple]:
    return [(m.mid, m.kind, m.src, m.dst, m.stage, m.microbatch, m.peer_stage, m.key) for m in lowered.messages]


def timed(fn: Callable[[], Any], no_gc: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one call of ``fn``."""
    gc.collect()
    if no_gc:
        gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="runs of each side (default 7); medians are printed")
    ap.add_argument("--cache", choices=("step", "job"), default="step", help="weight cache (default step)")
    ap.add_argument("--size", default="lpp,32,512,8,4", help="scheme,S,B,G,R (default lpp,32,512,8,4: 32,768 jobs)")
    ap.add_argument("--old", default=OLD, help=f"the commit of the old lowering (default {OLD})")
    ap.add_argument("--no-gc", action="store_true", help="pause the cyclic collector around both sides")
    args = ap.parse_args(argv)

    name, *dims = args.size.split(",")
    S, B, G, R = (int(x) for x in dims)
    tl = simulate(make_schedule(name, S, B, G, R))
    old = old_module(args.old)
    sides: dict[str, Callable[[], Any]] = {"old": lambda: old.lower(tl, args.cache),
                                          "new": lambda: lower(tl, args.cache)}
    if messages(sides["old"]()) != messages(sides["new"]()):
        print("the old and the new lowering give different messages")
        return 1
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for r in range(args.repeats):
        for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
            runs[side].append(timed(sides[side], args.no_gc))
    print(f"{name} S={S} B={B} G={G} R={R}: {tl.schedule.space.N:,} jobs, weight_cache={args.cache}, "
          f"median of {args.repeats}{', collector paused' if args.no_gc else ''}")
    med = {side: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for side, v in runs.items()}
    for side in ("old", "new"):
        print(f"{side:5} wall {med[side][0]:.3f} s  cpu {med[side][1]:.3f} s")
    print(f"ratio wall {med['new'][0] / med['old'][0]:.2f}  cpu {med['new'][1] / med['old'][1]:.2f}  (new / old)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
