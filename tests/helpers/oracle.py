"""The single-device oracle of a command-line run: the same config's model and data, trained in this
process as ``strategy=single`` trains them (Lightning's single-device strategy, each step's
micro-batches through the random streams) with the trainer settings of the config that decide what
is computed (precision, steps, gradient clipping, validation)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra import compose, initialize_config_module
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

import launcher.config  # noqa: F401  (registers the schema and the resolver)
from launcher.lightning.single import StreamedSingleDevice
from launcher.torch_support.init import empty_init, has_meta, init_units

from .cli import run_launcher
from .training import last_state, quiet_trainer


def composed(overrides: Sequence[str]) -> Any:
    """The launcher's config with ``overrides`` (G and R dropped: they do not apply to one device)."""
    with initialize_config_module("launcher.conf", version_base=None):
        return compose("config", overrides=[o for o in overrides if not o.startswith(("G=", "R="))])


def single_device(overrides: Sequence[str], microbatches: int | None = None,
                  callbacks: Sequence[L.Callback] = ()) -> dict[str, torch.Tensor]:
    """The config's model and data, built after ``seed_everything(seed)`` as the command builds
    them, trained on one device by ``strategy=single``'s strategy (:mod:`launcher.lightning.single`:
    Lightning's single-device strategy, each batch as the config's ``microbatches`` micro-batches
    through the random streams, so dropout draws and BatchNorm's per-micro-batch statistics are
    every scheme's); its state dict. ``microbatches`` overrides the config's."""
    cfg = composed(overrides)
    L.seed_everything(int(cfg.seed), verbose=False)
    data = instantiate(cfg.data)
    # as the command builds it: a model that says how its layers start (reset_stage) is built on
    # the meta device and started by the launcher's rule, in the run's precision
    meta = callable(getattr(get_class(cfg.model._target_), "reset_stage", None))
    with empty_init() if meta else contextlib.nullcontext():
        model = instantiate(cfg.model)
    t = cfg.trainer
    if has_meta(model):
        if str(t.precision).startswith("64"):
            model.double()
        init_units(list(model.stages), torch.initial_seed(), reset=model.reset_stage)
    model.prepare_data = lambda: None
    split = OmegaConf.to_container(cfg.split) if OmegaConf.is_list(cfg.split) else cfg.split
    strategy = StreamedSingleDevice(microbatches=int(microbatches or cfg.microbatches), split=split)
    tr = quiet_trainer(strategy, precision=t.precision, max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val,
                       limit_val_batches=t.limit_val_batches, val_check_interval=t.val_check_interval,
                       accumulate_grad_batches=t.get("accumulate_grad_batches", 1), callbacks=list(callbacks))
    tr.fit(model, datamodule=data)
    return model.state_dict()


def assert_scheme_equals_single_device(scheme: str, overrides: Sequence[str], tmp_path: Path) -> None:
    """``python -m launcher strategy=<scheme> <overrides>`` trains, and its ``last.ckpt`` equals
    :func:`single_device` on the same overrides within 1e-10."""
    run = tmp_path / "run"
    p = run_launcher(f"strategy={scheme}", *overrides, f"hydra.run.dir={run}", cwd=tmp_path, timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    got = last_state(run)
    want = single_device(list(overrides))
    assert got.keys() == want.keys()
    assert max((got[k].double() - want[k].double()).abs().max().item() for k in want) < 1e-10
