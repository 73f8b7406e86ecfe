"""Memory at scale: a Llama of about half a billion parameters (``model=hf``, random weights, no
download), built on the meta device, trained for two steps under FSDP (W = 4) and FSLPP (G = 2,
R = 2, weights sharded over every worker: ``strategy.ownership=balanced``), and, for comparison,
on one process.

For every worker it prints the measured peak resident memory beside the prediction (the process's
own memory measured before any stage was materialised, plus the bytes the planner's memory model
gives for the stages the worker owns and fetches and its live activations), and the worker's owned
share of the model's training state (parameters, gradients, AdamW's two moments). It also prints
the launching process's peak resident memory (it builds the model on the meta device and holds no
weight) and what one process needs to train the same model.

    python benchmarks/scale_memory.py                 # about 0.5 B parameters (needs ~24 GB)
    python benchmarks/scale_memory.py --layers 4      # a quick look (about 0.1 B)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

GB = 1e9


def model_args(layers: int, width: int, vocab: int) -> list[str]:
    return ["model=hf", "model.arch=llama", f"model.config.hidden_size={width}",
            f"model.config.num_hidden_layers={layers}", "model.config.num_attention_heads=16",
            "model.config.num_key_value_heads=16", f"model.config.intermediate_size={4 * width}",
            f"model.config.vocab_size={vocab}", "data.batch_size=4", "data.seq_len=64", "microbatches=4",
            "trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false",
            "logger=none", "png=false"]


def peak_of(pid: int) -> int:
    """The process's own peak resident set so far (``VmHWM``), in bytes; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(args: list[str], out: Path) -> tuple[dict, int, float]:
    """``python -m launcher`` with ``args``: its metrics, the launching process's peak RSS, seconds."""
    cmd = [sys.executable, "-m", "launcher", *args, f"hydra.run.dir={out}"]
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while child.poll() is None:
        peak = max(peak, peak_of(child.pid))
        time.sleep(0.1)
    took = time.monotonic() - t0
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{child.stderr.read()[-3000:]}")
    return json.loads((out / "metrics.json").read_text()), peak, took


def training_state(metrics: dict) -> list[float]:
    b = metrics["profile"]["bytes"]
    return [p + g + o for p, g, o in zip(b["params"], b["grads"], b["optimizer"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--no-single", action="store_true", help="skip the one-process run")
    a = ap.parse_args()
    base = model_args(a.layers, a.width, a.vocab) + [f"stages={a.stages}"]
    con = Console()
    runs = {"fsdp": ["strategy=fsdp", "G=4", "R=1", "weight_cache=job"],
            "fslpp": ["strategy=fslpp", "G=2", "R=2", "strategy.ownership=balanced", "weight_cache=job"]}
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, extra in runs.items():
            con.print(f"[bold]{name}[/]: {' '.join(extra)} ...")
            results[name] = run(base + extra, Path(tmp) / name)
        single = None
        if not a.no_single:
            con.print("[bold]single[/]: one process ...")
            single = run(base + ["strategy=single"], Path(tmp) / "single")
    m0 = results["fsdp"][0]
    state = training_state(m0)
    total = sum(state)
    params = sum(m0["profile"]["bytes"]["params"]) / 4  # float32
    con.print(f"model: Llama, {a.layers} layers of width {a.width}, vocabulary {a.vocab}: {params / 1e9:.2f} B "
              f"parameters; training state (parameters, gradients, AdamW moments) {total / GB:.2f} GB")
    for name, (m, launcher_peak, took) in results.items():
        pw = m["per_worker"]
        meas = pw["peak_memory_bytes"]["measured"]
        pred = pw["peak_memory_bytes"]["predicted"]
        base_b = pw["peak_memory_bytes"].get("base") or [None] * len(meas)
        owned = pw["owned_state_bytes"]["predicted"]
        t = Table(title=f"{name} (W={len(meas)}, {took:.0f} s; launching process peak RSS "
                        f"{launcher_peak / GB:.2f} GB)")
        for col in ("worker", "base GB", "predicted GB", "peak RSS GB", "pred/meas", "owned GB", "owned share"):
            t.add_column(col, justify="right")
        for w, (mm, pp, bb, oo) in enumerate(zip(meas, pred, base_b, owned)):
            t.add_row(str(w), f"{bb / GB:.2f}" if bb else "-", f"{pp / GB:.2f}", f"{mm / GB:.2f}", f"{pp / mm:.3f}",
                      f"{oo / GB:.2f}", f"{oo / total:.1%}")
        con.print(t)
    if single is not None:
        m, peak, took = single
        con.print(f"single process: peak RSS {peak / GB:.2f} GB ({took:.0f} s)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
