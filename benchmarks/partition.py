"""Stages cut by measured time against stages cut by parameter count, on real workers.

    python benchmarks/partition.py                          # GPipe, stages=2 on 2 workers, 8 steps
    python benchmarks/partition.py --stages 4 --steps 10    # stages=4 G=1 R=4

Two models whose parameter counts mislead: the built-in GPT with a large vocabulary (its embedding
has as many parameters as its head but costs next to nothing, while the head's projection to the
vocabulary costs as much as several blocks) and a Hugging Face GPT-2 with tied embeddings (the
head's weight is counted once, with the embedding, so by parameters the head looks free). Each is
trained under GPipe with ``partition=params`` and ``partition=time`` (``python -m launcher``, a
subprocess, as a user types it); the table shows each run's cut, its measured step time (the
median over the steps after the first, slowest worker) and the step time the run predicted from
its own workers' per-stage job times, and the ratio time/params of both. ``partition=time`` should
measure a shorter step, and the prediction should follow it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

RUN = ["logger=none", "trainer.enable_checkpointing=false", "trainer.limit_val_batches=0",
       "trainer.val_check_interval=1000"]
MODELS = {
    "gpt V=32768": ["model=gpt", "model.vocab_size=32768", "model.d_model=128", "model.n_layer=8"],
    "hf gpt2 tied V=12288": ["model=hf", "model.arch=gpt2", "model.config.vocab_size=12288", "model.config.n_embd=128",
                             "model.config.n_layer=8", "model.config.n_head=4", "model.config.n_positions=64"],
}


def train(args: list[str], cwd: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "launcher", *args, f"hydra.run.dir={cwd}"], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"python -m launcher {' '.join(args)} failed:\n{p.stderr[-3000:]}{p.stdout[-2000:]}")
    return json.loads((cwd / "metrics.json").read_text())


def cut_of(metrics: dict) -> str:
    """Per stage, its share of the profiled step (predicted per-stage F+B)."""
    per = metrics["profile"].get("stage_durations_s") or []
    total = sum(d["F"] + d["B"] for d in per) or 1.0
    return " ".join(f"{(d['F'] + d['B']) / total:.0%}" for d in per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2, help="stages = workers (GPipe, G=1)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each (alternating); the median counts")
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="models to run (default: both)")
    a = ap.parse_args()
    con = Console()
    table = Table(title=f"GPipe stages={a.stages} microbatches={a.microbatches}: partition=params vs time")
    for col in ("model", "partition", "stage shares (measured F+B)", "measured step s", "predicted step s"):
        table.add_column(col)
    summary = []
    for name in a.model or list(MODELS):
        runs: dict[str, list[dict]] = {"params": [], "time": []}
        for _ in range(a.rounds):  # alternating, so a busy spell of the machine hits both alike
            for by in ("params", "time"):
                args = ["strategy=gpipe", "G=1", f"R={a.stages}", f"stages={a.stages}",
                        f"microbatches={a.microbatches}", f"trainer.max_steps={a.steps}", f"partition={by}", *RUN,
                        *MODELS[name]]
                with tempfile.TemporaryDirectory() as tmp:
                    m = train(args, Path(tmp))
                runs[by].append(m)
                lat = m["latency_s"]
                con.print(f"{name} partition={by}: measured {lat['measured']:.3f} s, predicted "
                          f"{lat['predicted']:.3f} s", highlight=False)
        got = {}
        for by, ms in runs.items():
            ms.sort(key=lambda m: m["latency_s"]["measured"])
            got[by] = m = ms[len(ms) // 2]  # the median run
            lat = m["latency_s"]
            table.add_row(name, by, cut_of(m), f"{lat['measured']:.3f}", f"{lat['predicted']:.3f}")
        meas = got["time"]["latency_s"]["measured"] / got["params"]["latency_s"]["measured"]
        pred = got["time"]["latency_s"]["predicted"] / got["params"]["latency_s"]["predicted"]
        table.add_row(name, "time/params", "", f"{meas:.3f}", f"{pred:.3f}", end_section=True)
        summary.append((name, meas, pred))
    con.print(table)
    for name, meas, pred in summary:
        verdict = "shorter" if meas < 1 else "NOT shorter"
        con.print(f"{name}: partition=time measures a {verdict} step ({meas:.2f}x params); predicted {pred:.2f}x",
                  highlight=False)


if __name__ == "__main__":
    main()
