"""``plan.trials``: train the planner's top candidates for a few steps on real workers and keep the
fastest measured.

The planner's prediction is a model: on workers that share cores it misses effects it does not
charge (docs/planner.md measures some), and candidates predicted within a few percent of each other
can measure 10 to 20% apart. With ``plan.trials=k`` the top ``k`` candidates are each trained for
``plan.trial_steps`` steps, ``plan.trial_rounds`` times (the candidates alternate within a round, so
a drift of the machine hits them alike), each as ``python -m launcher`` with the user's own
overrides and the candidate's, and the best is the one with the least median measured step (each
run's ``metrics.json`` ``latency_s.measured``: its median step after the first). A candidate whose
runs fail is reported with its error and never chosen; when every one fails the prediction's best
stands.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rich.table import Table

from ..plan.search import Candidate

#: what a trial sets on top of the user's overrides: a short training run that writes its metrics
#: and nothing else (no logger, no checkpoints, no validation)
TRIAL_SETTINGS = ("mode=train", "logger=none", "trainer.enable_checkpointing=false", "trainer.limit_val_batches=0")


@dataclass
class Trial:
    """One candidate's trial runs."""

    rank: int  # 1 = the prediction's best
    candidate: Candidate
    measured_s: list[float] = field(default_factory=list)  # each run's median step after the first
    peak_activations: int | None = None  # the most live activations any worker held, measured
    error: str | None = None  # the last line a failed run printed

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.measured_s) if self.measured_s and self.error is None else None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "overrides": self.candidate.overrides, "predicted_s": self.candidate.step_time,
                "measured_s": self.measured_s, "median_s": self.median_s,
                "peak_activations": self.peak_activations, "error": self.error}


def trial_overrides(user: Sequence[str], candidate: Sequence[str], steps: int) -> list[str]:
    """The command line of a trial: the user's overrides but those the trial sets itself (the
    mode, the ``plan.*`` keys, each key of the candidate's and every key under a group the
    candidate chooses, the logger, the trainer's steps), then the candidate's and the trial's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    ours = [*candidate, *TRIAL_SETTINGS, f"trainer.max_steps={steps}"]
    parser = OverridesParser.create()  # the key each override sets, as Hydra reads it (``+a.b=1`` sets a.b)
    set_here = {o.key_or_group for o in parser.parse_overrides(ours)}
    dropped = {k for k in set_here if "." not in k} | {"plan"}  # groups (and plan): every key under them goes
    return [text for text, o in zip(user, parser.parse_overrides(list(user)))
            if o.key_or_group not in set_here and o.key_or_group.split(".")[0] not in dropped] + ours


def trials_record(trials: Sequence[Trial], steps: int, rounds: int) -> dict[str, Any]:
    """``plan.json``'s ``trials``: how each candidate was trained, and what it measured."""
    return {"steps": steps, "rounds": rounds, "runs": [t.to_json() for t in trials]}


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no output"


def run_trials(candidates: Sequence[Candidate], user: Sequence[str], out: Path, steps: int, rounds: int,
               cwd: Path, launcher_args: Sequence[str] = ()) -> list[Trial]:
    """Train each candidate ``rounds`` times (alternated) for ``steps`` steps under ``out``;
    ``launcher_args`` go first on every command line (``--config-dir``, ``--config-name``)."""
    trials = [Trial(i + 1, c) for i, c in enumerate(candidates)]
    for k in range(rounds):
        for t in trials:
            if t.error is not None:  # it failed once: its other runs would fail alike
                continue
            run_dir = out / f"{t.rank}-{k}"
            args = [*launcher_args, *trial_overrides(user, t.candidate.overrides, steps), f"hydra.run.dir={run_dir}"]
            p = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, capture_output=True, text=True)
            metrics = run_dir / "metrics.json"
            if p.returncode != 0 or not metrics.exists():
                t.error = f"exit {p.returncode}: {_last_line(p.stderr or p.stdout)}"
                continue
            m = json.loads(metrics.read_text())
            t.measured_s.append(float(m["latency_s"]["measured"]))
            peaks = [x for x in m["per_worker"]["peak_activations"]["measured"] if x is not None]
            t.peak_activations = max([t.peak_activations or 0, *peaks])
    return trials


def fastest(trials: Sequence[Trial]) -> Trial | None:
    """The trial with the least median measured step (the earlier rank on a tie); ``None`` when
    every one failed."""
    done = [t for t in trials if t.median_s is not None]
    return min(done, key=lambda t: (t.median_s, t.rank)) if done else None


def trials_table(trials: Sequence[Trial], steps: int, rounds: int) -> Table:
    """Predicted beside measured, per candidate tried."""
    best = fastest(trials)
    t = Table(title=f"trials: the top {len(trials)} trained for {steps} steps x {rounds} rounds", title_justify="left")
    for h in ("#", "overrides", "predicted", "measured (s)", "measured / fastest", "peak act"):
        t.add_column(h, justify="left" if h == "overrides" else "right")
    for tr in trials:
        m = tr.median_s
        ratio = f"{m / best.median_s:.3f}" if m is not None and best and best.median_s else "-"
        t.add_row(str(tr.rank), " ".join(tr.candidate.overrides), f"{tr.candidate.step_time:.4g}",
                  f"{m:.4g}" if m is not None else (tr.error or "-"), ratio,
                  str(tr.peak_activations) if tr.peak_activations is not None else "-")
    return t
