"""The planner's pick on real workers: profile the default model, plan under a few budgets, train
each budget's top candidates and compare predicted with measured step time and peak activations.

    python benchmarks/plan_on_workers.py                      # budgets: 4 and 8 live activations
    python benchmarks/plan_on_workers.py --budget plan.max_activations=6 --top 3 --steps 12
    python benchmarks/plan_on_workers.py --top 3 --profile-override split_backward=true  # I and W measured
    python benchmarks/plan_on_workers.py --top 3 --trials 3     # the planner also trains its top 3 (plan.trials)

Each run is ``python -m launcher`` (a subprocess, exactly as a user types it) in a temporary
directory; a candidate's measured step time is the median over ``--rounds`` runs (candidates
alternate within each round) of each run's median step after the first. Prints, per
budget, one row per candidate (rank 1 is the planner's predicted pick) and whether the pick is within
10% of the fastest measured and its measured peak within the budget. With ``--trials K`` the planner
runs with ``plan.trials=K`` (it trains its top K briefly and keeps the fastest measured: its pick,
``plan.json``'s ``best``, is marked and checked the same way, on runs apart from its own trials).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

#: a small training run: the default model and data, no logger, no checkpoints, no validation
RUN = ["logger=none", "trainer.enable_checkpointing=false", "trainer.limit_val_batches=0"]


def launcher(args: list[str], cwd: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"python -m launcher {' '.join(args)} failed:\n{p.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", action="append", help="a plan.* budget override (repeatable)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=5, help="runs of each candidate, alternated")
    ap.add_argument("--trials", type=int, default=0, help="plan.trials: the planner trains its top K and keeps "
                                                              "the fastest measured")
    ap.add_argument("--profile-override", action="append", default=[],
                    help="an override of the profiling run (repeatable): split_backward=true measures I and W, so "
                         "the planner searches the split backward's orders (zb_h1, zb_h2, auto)")
    args = ap.parse_args()
    budgets = args.budget or ["plan.max_activations=4", "plan.max_activations=8"]
    con = Console(width=200)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        profile = root / "profile"
        launcher(["strategy=lpp", "G=2", "R=4", *args.profile_override, f"trainer.max_steps={args.steps}", *RUN,
                  f"hydra.run.dir={profile}"], root)
        for budget in budgets:
            out = root / budget.replace("=", "_")
            launcher(["mode=plan", f"plan.workers={args.workers}", budget, f"plan.top={args.top}",
                      f"plan.trials={args.trials}", f"plan.profile={profile / 'metrics.json'}", f"hydra.run.dir={out}"],
                     root)
            record = json.loads((out / "plan.json").read_text())
            candidates = record["candidates"][: args.top]
            # the trials' pick: plan.json's best (the predicted best without trials)
            best = (record["best"] or {}).get("overrides")  # None: nothing fits
            trial_pick = next((i for i, c in enumerate(candidates) if c["overrides"] == best), None)
            times: list[list[float]] = [[] for _ in candidates]
            peaks: list[int] = [0] * len(candidates)
            for k in range(args.rounds):  # candidates alternate within each round: drift hits them alike
                for i, c in enumerate(candidates):
                    run = out / f"c{i}-{k}"
                    launcher([*c["overrides"], f"trainer.max_steps={args.steps}", *RUN, f"hydra.run.dir={run}"], root)
                    m = json.loads((run / "metrics.json").read_text())
                    times[i].append(m["latency_s"]["measured"])
                    peaks[i] = max(peaks[i], max(m["per_worker"]["peak_activations"]["measured"]))
            rows = [(c, statistics.median(t), peak) for c, t, peak in zip(candidates, times, peaks)]
            fastest = min(r[1] for r in rows)
            limit = int(budget.split("=")[1]) if "max_activations" in budget else None
            t = Table(title=f"{budget} (plan.workers={args.workers}): the planner's top {len(rows)} trained for "
                            f"{args.steps} steps x {args.rounds} rounds", title_justify="left")
            trial_ms = {tuple(r["overrides"]): r["median_s"] for r in (record.get("trials") or {}).get("runs", [])}
            for col in ("#", "overrides", "predicted (ms)", "planner's trials (ms)", "measured (ms)",
                        "measured / fastest", "peak act (pred / meas)"):
                t.add_column(col, justify="left" if col == "overrides" else "right")
            for i, (c, measured, peak) in enumerate(rows):
                pred = c.get("peak_activations")
                pred = max(pred) if isinstance(pred, list) else pred
                tried = trial_ms.get(tuple(c["overrides"]))
                t.add_row(str(i + 1) + (" (trials' pick)" if args.trials and i == trial_pick else ""),
                          " ".join(o for o in c["overrides"] if not o.startswith(("durations.", "comm="))),
                          f"{c['step_time'] * 1e3:.1f}", f"{tried * 1e3:.1f}" if tried else "-",
                          f"{measured * 1e3:.1f}", f"{measured / fastest:.3f}",
                          f"{pred} / {peak}")
            con.print(t)
            picks = [("predicted pick", 0)] + ([("trials' pick", trial_pick)] if args.trials else [])
            for name, k in picks:
                if k is None:
                    con.print(f"{name}: not among the top {len(rows)}")
                    continue
                pick = rows[k]
                within = pick[1] <= 1.10 * fastest
                fits = limit is None or pick[2] <= limit
                con.print(f"{name} (#{k + 1}) within 10% of the fastest measured: {'yes' if within else 'NO'} "
                          f"({pick[1] / fastest:.3f}); measured peak {pick[2]} within the budget: "
                          f"{'yes' if fits else 'NO'}")


if __name__ == "__main__":
    main()
