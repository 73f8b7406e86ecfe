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

Checkpointing is on by default (``--no-checkpoint`` turns it off): each scheme also runs without
it, then with ``last.ckpt`` saved (sharded, :mod:`launcher.lightning.sharded`) synchronously and
asynchronously (``checkpoint.async_mode=async``), and fsdp's checkpoint is loaded under fslpp with
another worker count (``G=1 R=2``) and trained on for a step. Every process's peak resident set
(``VmHWM``, polled from ``/proc``) of a run that saves, or that loads, is put beside the same
process's peak in the run that does neither (each at most 1.25x is the bar), and the wall time of
the save beside the step time: a synchronous save blocks training for the whole write, an
asynchronous one for the copy to host memory (the rest runs beside the next steps).

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
            "trainer.max_steps=2", "trainer.limit_val_batches=0", "logger=none", "png=false",
            # a worker of a large model on a shared, busy machine may go 30 s without a heartbeat
            "timeout=600"]

OFF = ["trainer.enable_checkpointing=false"]


def peak_of(pid: int) -> int:
    """The process's own peak resident set so far (``VmHWM``), in bytes; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start_of(pid: int) -> int:
    """When the process started (``/proc/<pid>/stat``'s starttime, clock ticks since boot); 0 once gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def descendants(pid: int) -> list[int]:
    """The processes started under ``pid`` (the workers), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Run:
    """One ``python -m launcher`` run: metrics, seconds, every process's peak RSS (the launching
    process first, then the workers by start order), and the seconds a save's temporary directory
    was on disk (``save_s``: from the first shard written to the swap, the write's wall time)."""

    def __init__(self, args: list[str], out: Path) -> None:
        cmd = [sys.executable, "-m", "launcher", *args, f"hydra.run.dir={out}"]
        t0 = time.monotonic()
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peaks: dict[int, int] = {child.pid: 0}
        started: dict[int, int] = {}
        tmp = out / "checkpoints" / ".last.ckpt.tmp"
        seen: float | None = None
        self.save_s = 0.0
        while child.poll() is None:
            for p in [child.pid, *descendants(child.pid)]:
                peaks[p] = max(peaks.get(p, 0), peak_of(p))
                if p not in started:
                    started[p] = start_of(p)
            if tmp.exists() and seen is None:
                seen = time.monotonic()
            elif seen is not None and not tmp.exists():
                self.save_s += time.monotonic() - seen
                seen = None
            time.sleep(0.05)
        self.seconds = time.monotonic() - t0
        if child.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed:\n{child.stderr.read()[-3000:]}")
        self.metrics = json.loads((out / "metrics.json").read_text())
        # the launching process first, then the workers by start time (pids wrap around)
        order = [child.pid, *sorted((p for p in peaks if p != child.pid), key=lambda p: (started.get(p, 0), p))]
        self.peaks = [peaks[p] for p in order if peaks[p] > 0]
        steps = self.metrics.get("steps") or []
        self.step_s = sum(s.get("step_s", 0.0) for s in steps) / max(len(steps), 1)
        #: rank 0's timing of the last save (blocking_s: training held; write_s: until whole on disk)
        self.save: dict = {}
        meta = out / "checkpoints" / "last.ckpt" / "lightning.pt"
        if meta.is_file():
            import torch

            self.save = torch.load(meta, weights_only=True)["launcher_sharded"].get("save", {})


def run(args: list[str], out: Path) -> tuple[dict, int, float]:
    """``python -m launcher`` with ``args``: its metrics, the launching process's peak RSS, seconds."""
    r = Run(args, out)
    return r.metrics, r.peaks[0], r.seconds


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
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the runs that save and load checkpoints")
    a = ap.parse_args()
    base = model_args(a.layers, a.width, a.vocab) + [f"stages={a.stages}"]
    if a.no_checkpoint:
        base += OFF
    con = Console()
    runs = {"fsdp": ["strategy=fsdp", "G=4", "R=1", "weight_cache=job"],
            "fslpp": ["strategy=fslpp", "G=2", "R=2", "strategy.ownership=balanced", "weight_cache=job"]}
    with tempfile.TemporaryDirectory() as tmp:
        results, kept = {}, {}
        for name, extra in runs.items():
            con.print(f"[bold]{name}[/]: {' '.join(extra)} ...")
            kept[name] = Run(base + extra, Path(tmp) / name)
            results[name] = kept[name].metrics, kept[name].peaks[0], kept[name].seconds
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
    if not a.no_checkpoint:
        checkpoints(base, runs, kept, con)


def checkpoints(base: list[str], runs: dict[str, list[str]], saved: dict[str, Run], con: Console) -> None:
    """Per process: peak RSS without checkpoints, with a save (``saved``: the runs above, which saved
    synchronously; async), with a load; the save's time beside the step's."""
    other = ["strategy=fslpp", "G=1", "R=2", "strategy.ownership=balanced", "weight_cache=job"]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        found: dict[str, dict[str, Run]] = {}
        for name, extra in runs.items():
            con.print(f"[bold]{name}[/]: without checkpoints, then saving asynchronously ...")
            found[name] = {"off": Run(base + extra + OFF, t / f"{name}-off"), "sync": saved[name],
                           "async": Run(base + extra + ["checkpoint.async_mode=async"], t / f"{name}-async")}
            if name == "fsdp":
                con.print("[bold]load[/]: fsdp W=4's last.ckpt under fslpp G=1 R=2, one more step ...")
                ckpt = t / "fsdp-async" / "checkpoints" / "last.ckpt"
                found["load"] = {"off": Run(base + other + OFF, t / "load-off"),
                                 "load": Run(base + other + OFF + ["trainer.max_steps=3", "model.max_steps=2",
                                                                   f"ckpt_path={ckpt}"], t / "load")}
    for name, r in found.items():
        kinds = [k for k in r if k != "off"]
        tab = Table(title=f"{name}: peak RSS per process, GB (process 0 launches; x: / without checkpoints)")
        tab.add_column("process", justify="right")
        tab.add_column("without", justify="right")
        for k in kinds:
            tab.add_column(k, justify="right")
            tab.add_column("x", justify="right")
        for i, off in enumerate(r["off"].peaks):
            row = [str(i), f"{off / GB:.2f}"]
            for k in kinds:
                p = r[k].peaks[i] if i < len(r[k].peaks) else 0
                row += [f"{p / GB:.2f}", f"{p / off:.2f}" if off else "-"]
            tab.add_row(*row)
        con.print(tab)
        if "sync" in r:
            sy, asy = r["sync"].save, r["async"].save
            con.print(f"{name}: step {r['off'].step_s:.2f} s; a save holds training for "
                      f"{sy.get('blocking_s', 0):.2f} s sync (written in {sy.get('write_s', 0):.2f} s), "
                      f"{asy.get('blocking_s', 0):.2f} s async "
                      f"(written in {asy.get('write_s', 0):.2f} s); run wall without/sync/async "
                      f"{r['off'].seconds:.1f} / {r['sync'].seconds:.1f} / {r['async'].seconds:.1f} s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
