"""In-process training: tiny models and data, a quiet Lightning trainer, checkpoints read back, and
how far two trained states are apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from launcher.lightning import UnifiedStrategy
from launcher.models import GPT, CharCorpus
from launcher.models.base import adamw_cosine


def char_data(batch_size: int = 8) -> CharCorpus:
    """The character corpus, small: windows of 8 characters from 20,000, shuffled with seed 3."""
    return CharCorpus(batch_size=batch_size, seq_len=8, chars=20_000, shuffle=True, seed=3)


def tiny_gpt(**kw: Any) -> GPT:
    """The built-in GPT, tiny: sequences of 8, d_model 16, 2 heads, 2 blocks (``kw`` changes any)."""
    return GPT(**{"seq_len": 8, "d_model": 16, "n_head": 2, "n_layer": 2, **kw})


class Regressor(L.LightningModule):
    """A user's small model: four stages of linear, tanh and dropout (``self.stages``, ``self.loss``:
    mean squared error), AdamW with the built-in models' cosine schedule over ``max_steps``,
    stepped every optimizer step."""

    def __init__(self, width: int = 8, dropout: float = 0.1, max_steps: int = 8) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout))
                                    for _ in range(4))

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for stage in self.stages:
            x = stage(x)
        return self.loss(x, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for stage in self.stages:
            x = stage(x)
        self.log("val_loss", self.loss(x, y))

    def configure_optimizers(self) -> Any:
        return adamw_cosine(self.parameters(), lr=3e-2, weight_decay=0.0, max_steps=self.max_steps)


def user_loader(n: int = 36, shuffle: bool = True) -> DataLoader:
    """A user's own loader at DataLoader's defaults but ``shuffle``: ``n`` float64 samples (x, y) of
    width 8 in batches of 8, the last one smaller (``drop_last=False``): 36 make 5 batches, the 5th of 4."""
    g = torch.Generator().manual_seed(n)
    data = TensorDataset(torch.randn(n, 8, generator=g, dtype=torch.float64),
                         torch.randn(n, 8, generator=g, dtype=torch.float64))
    return DataLoader(data, batch_size=8, shuffle=shuffle)


def quiet_trainer(strategy: Any = "auto", devices: int = 1, **kw: Any) -> L.Trainer:
    """A Lightning trainer on CPU that logs, checkpoints and prints nothing and runs no sanity
    validation, unless ``kw`` says otherwise."""
    args = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)
    return L.Trainer(strategy=strategy, devices=devices, **{**args, **kw})


class Keep(L.Callback):
    """Each step's loss; at the end, every worker's engine records and predicted message bytes,
    written where the test reads them (the workers are forked processes)."""

    def __init__(self, out: Path | None = None) -> None:
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module) -> None:
        st = trainer.strategy
        if self.out is None or not isinstance(st, UnifiedStrategy):
            return
        msgs = st.engine.lowered.messages
        sizes = st.sizes()[0] if st.engine.worker is not None else []
        replicas = st.engine.replicas
        torch.save({"records": st.records, "losses": self.losses, "worker": st.engine.worker,
                    "predicted": [(m.kind, m.dst, n) for m, n in zip(msgs, sizes)],
                    # the bytes this worker all-reduces across replicas each step
                    "allreduce_bytes": sum(f.numel() * f.element_size() for f in replicas.flats)},
                   self.out / f"rank{dist.get_rank()}.pt")


def load_checkpoint(path: Path) -> dict:
    """A checkpoint file, or a sharded checkpoint's directory in the single-device layout, on the CPU."""
    if Path(path).is_dir():
        from launcher.checkpoint import load

        return load(path)
    return torch.load(path, weights_only=False, map_location="cpu")


def last_state(run: Path) -> dict[str, torch.Tensor]:
    """The parameters a run directory's ``checkpoints/last.ckpt`` holds."""
    return load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]


def max_diff(a: dict[str, torch.Tensor] | torch.nn.Module, b: dict[str, torch.Tensor] | torch.nn.Module) -> float:
    """The largest absolute difference between two states (state dicts or modules), in float64;
    both must hold the same keys."""
    if isinstance(a, torch.nn.Module):
        a = a.state_dict()
    if isinstance(b, torch.nn.Module):
        b = b.state_dict()
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def run_stages(stages: torch.nn.ModuleList, inp: Any) -> Any:
    """The engine's calling convention: a dict is keyword arguments, a tuple or list positional
    arguments, a tensor one argument; each stage's output is the next stage's input."""
    x = inp
    for stage in stages:
        x = stage(**x) if isinstance(x, dict) else stage(*x) if isinstance(x, (tuple, list)) else stage(x)
    return x
