"""Overlapping steps against synchronous ones on real workers (``step_overlap=post_validation``
against ``none``, :mod:`launcher.lightning.step_overlap`): the measured step time ratio beside the
predicted one.

    python benchmarks/step_overlap.py                 # 3 alternated pairs per case
    python benchmarks/step_overlap.py --reps 5 --steps 16
    python benchmarks/step_overlap.py --cases 1 --reps 1 --steps 3   # its run test

Cases: ``strategy=gpipe`` at p=4 (4 workers), m=8 and m=16 micro-batches, the built-in GPT, under
``order=zb_h2`` and ``order=auto memory_limit=8`` (2p), split backward. Each case runs the command
line ``--reps`` times under each rule, alternated (post_validation, none, post_validation, ...) so
the machine's drift falls on both alike. Per run ``metrics.json``'s ``step_cost_s``: ``measured``
(the median step wall, the slowest worker's, after the first step), and the prediction for the
rule the run followed, from that run's own profile (``predicted`` under ``none``, the replayed step
behind its barrier; ``predicted_post_validation`` under post_validation, the same programs back to
back under the runtime's chain; both on the cores the workers shared, :mod:`launcher.schedule.overlap`).
Printed per case: per rule the medians of the measured step wall and of the predicted step (each
run's own rule); then the ratio post_validation / none, measured (the median of the alternated
pairs' ratios) beside predicted by one model (``step_cost_s.predicted_steady``, the steady state of
:mod:`launcher.schedule.overlap` on the cores the workers shared): each run's own rule priced from
its own profile (its jobs, its step ends, post_validation's with the run's own rolled-back steps
taken again), the median of the pairs' ratios, so each side carries what its rule costs and the
load its run saw. "agree": whether the two are within 10%. "one profile's": each post_validation
run's profile priced under both rules (the median): what overlapping would save for the same
jobs and step ends. "cpu": the same ratio of a step's CPU seconds over all workers (``cpu_s``:
measured, and the work the prediction replays), which moves less with the machine's load than the
wall; "load": the 1-minute load average before and after the case; each worker's rollbacks of the
last post_validation run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: the built-in GPT, small enough for 2 shared cores, big enough that a step's jobs outweigh its messages
MODEL = ["model.d_model=64", "model.n_head=4", "model.n_layer=4", "data.seq_len=32", "data.chars=40000"]
CASES = [(m, order, extra) for m in (8, 16)
         for order, extra in (("zb_h2", ["split_backward=true"]), ("auto", ["split_backward=true", "memory_limit=8"]))]
RULES = ("post_validation", "none")


def run(m: int, order: str, extra: list[str], rule: str, steps: int, out: Path) -> dict:
    args = [sys.executable, "-m", "launcher", "strategy=gpipe", "stages=4", f"microbatches={m}", f"order={order}",
            *extra, *MODEL, f"data.batch_size={2 * m}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
            "trainer.enable_checkpointing=false", "logger=none", "png=false", f"step_overlap={rule}",
            f"hydra.run.dir={out}"]
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-3000:]}")
    m_json = json.loads((out / "metrics.json").read_text())
    cost = m_json["step_cost_s"]
    if cost["step_overlap"] != rule or (rule == "post_validation") != ("post_validation" in m_json):
        raise SystemExit(f"{' '.join(args)} ran step_overlap={cost['step_overlap']}, not {rule}")
    steady = cost["predicted_steady"]
    return {"measured": cost["measured"], "predicted": steady[rule], "own": steady["post_validation"] / steady["none"],
            "cpu": cost["cpu_s"]["measured"], "cpu_predicted": cost["cpu_s"]["predicted"],
            "rollbacks": (m_json.get("post_validation") or {}).get("rollbacks")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="runs per rule and case, alternated")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run")
    ap.add_argument("--cases", type=int, default=len(CASES), help="run the first CASES cases only")
    a = ap.parse_args()
    print(f"{'case':<32} {'rule':<16} {'measured ms':>12} {'predicted ms':>13}")
    agreed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for m, order, extra in CASES[:a.cases]:
            load0 = os.getloadavg()[0]
            got: dict[str, list[dict]] = {r: [] for r in RULES}
            for i in range(a.reps):
                for rule in RULES:
                    got[rule].append(run(m, order, extra, rule, a.steps, Path(tmp) / f"{m}-{order}-{rule}-{i}"))
            case = f"gpipe p=4 m={m} order={order}" + (" memory_limit=2p" if order == "auto" else "")
            med = {r: {k: statistics.median(x[k] for x in got[r]) for k in ("measured", "predicted")} for r in RULES}
            for r in RULES:
                print(f"{case:<32} {r:<16} {med[r]['measured'] * 1e3:12.2f} {med[r]['predicted'] * 1e3:13.2f}")
            both = list(zip(got["post_validation"], got["none"]))
            pairs = [p["measured"] / n["measured"] for p, n in both]
            measured = statistics.median(pairs)
            ratio = statistics.median(p["predicted"] / n["predicted"] for p, n in both)
            own = statistics.median(x["own"] for x in got["post_validation"])
            agree = abs(measured / ratio - 1) <= 0.10
            agreed += agree
            cpu = [p["cpu"] / n["cpu"] for p, n in both if p["cpu"] and n["cpu"]]
            cpu_pred = statistics.median(p["cpu_predicted"] / n["cpu_predicted"] for p, n in both)
            rollbacks = got["post_validation"][-1]["rollbacks"]
            print(f"{case:<32} {'ratio pv/none':<16} {measured:12.3f} {ratio:13.3f}   "
                  f"(agree within 10%: {'yes' if agree else 'no'}; pairs {', '.join(f'{x:.3f}' for x in pairs)}; "
                  f"one profile's {own:.3f}; "
                  f"cpu {statistics.median(cpu) if cpu else float('nan'):.3f} against {cpu_pred:.3f}; "
                  f"load {load0:.1f}-{os.getloadavg()[0]:.1f}; rollbacks {rollbacks})", flush=True)
    print(f"agree within 10%: {agreed} of {min(a.cases, len(CASES))} cases")


if __name__ == "__main__":
    main()
