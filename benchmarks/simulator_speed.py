"""How long the simulator takes on the two large steps of issue 2 (a benchmark, not a test).

    python benchmarks/simulator_speed.py [--repeats 3] [--quick]

Prints, for each step and each order: jobs, seconds (best of ``--repeats``), the target, and the
time ``summarize`` takes on the same timeline. Targets, on the project's 2-core machine:

- S=64,  B=512,  LPP G=8,  R=8:  65,536 jobs    in under 0.25 s
- S=128, B=4096, LPP G=64, R=8:  1,048,576 jobs in under 10 s
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

from launcher.schedule import make_schedule, simulate
from launcher.schedule.metrics import summarize

STEPS = [
    # (S, B, G, R, target seconds)
    (64, 512, 8, 8, 0.25),
    (128, 4096, 64, 8, 10.0),
]
ORDERS = ("1f1b", "breadth_first", "depth_first")


def best_of(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    ap.add_argument("--quick", action="store_true", help="only the 65,536-job step")
    args = ap.parse_args(argv)

    print(f"python {platform.python_version()} on {platform.machine()}, best of {args.repeats}")
    header = ("step", "order", "jobs", "simulate s", "target s", "ok", "summarize s", "latency_fb")
    rows = []
    failed = 0
    for S, B, G, R, target in STEPS[:1] if args.quick else STEPS:
        for order in ORDERS:
            step = make_schedule("lpp", S, B, G, R, order=order)
            secs, tl = best_of(lambda: simulate(step), args.repeats)
            ssecs, summary = best_of(lambda tl=tl: summarize(tl), args.repeats)
            ok = secs < target
            failed += not ok
            rows.append((f"S={S} B={B} LPP G={G} R={R}", order, f"{step.space.N:,}", f"{secs:.3f}",
                         f"< {target:g}", "yes" if ok else "NO", f"{ssecs:.3f}", f"{summary['latency_fb']:g}"))
            del tl, summary
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    if failed:
        print(f"{failed} step(s) over target")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
