"""``progress.jsonl``: what a run has measured so far, one JSON line per training step and per
validation, appended by rank 0 as it goes (:class:`Progress`, a Lightning callback).

The workers hold a run's measurements until the end of ``fit``, where rank 0 gathers them into
``metrics.json``. A run stopped before that (Ctrl-C, SIGTERM: every worker is killed at once)
would leave nothing; the launching process reads this file instead (:func:`read`) and writes
``metrics.json`` with ``"status": "interrupted"`` from it. A finished run removes it.

A line is appended and flushed whole; a line cut short by a kill or a full disk is skipped when
read. Writing it is best effort: a failed write never stops training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch import Callback, LightningModule, Trainer

NAME = "progress.jsonl"


class Progress(Callback):
    """Appends each training step's loss, wall seconds and samples per second (rank 0's) and each
    validation's ``val_loss`` to ``<out_dir>/progress.jsonl``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / NAME
        self._t0 = 0.0
        self._broken = False

    def _append(self, trainer: Trainer, rec: Mapping[str, Any]) -> None:
        if trainer.global_rank != 0 or self._broken:
            return
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        except (OSError, TypeError, ValueError):
            self._broken = True  # a full disk: the checkpoint or metrics writer reports it

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank != 0:
            return
        wall = time.perf_counter() - self._t0
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        try:
            value = float(loss) if loss is not None else None
        except (TypeError, ValueError, RuntimeError):
            value = None
        n = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch) if hasattr(batch, "__len__") else 0
        self._append(trainer, {"step": trainer.global_step, "loss": value, "step_s": wall,
                               "samples_per_s": n / wall if wall else None, "samples": n})

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self._append(trainer, {"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"])})


def read(out_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(steps, val)`` recorded so far in ``out_dir`` (both empty when nothing was)."""
    steps: list[dict[str, Any]] = []
    val: list[dict[str, Any]] = []
    try:
        lines = (Path(out_dir) / NAME).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return steps, val
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # cut short by the stop
        if isinstance(rec, dict):
            (val if "val_loss" in rec else steps).append(rec)
    return steps, val


def remove(out_dir: str | Path) -> None:
    try:
        (Path(out_dir) / NAME).unlink(missing_ok=True)
    except OSError:
        pass
