"""In-process training: tiny models and data, a quiet Lightning trainer, checkpoints read back, and
how far two trained states are apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from launcher.lightning import UnifiedStrategy
from launcher.models import GPT, CharCorpus


def char_data(batch_size: int = 8) -> CharCorpus:
    """The character corpus, small: windows of 8 characters from 20,000, shuffled with seed 3."""
    return CharCorpus(batch_size=batch_size, seq_len=8, chars=20_000, shuffle=True, seed=3)


def tiny_gpt(**kw: Any) -> GPT:
    """The built-in GPT, tiny: sequences of 8, d_model 16, 2 heads, 2 blocks (``kw`` changes any)."""
    return GPT(**{"seq_len": 8, "d_model": 16, "n_head": 2, "n_layer": 2, **kw})


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
