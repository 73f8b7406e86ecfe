"""Models built on the meta device: no process holds the whole model, and every worker starts its
own stages exactly where single-device training starts (float64, exact), by one rule: unit ``i``
of ``self.stages`` is initialised under an RNG seeded from ``(seed, i)`` alone."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from helpers.training import char_data, load_checkpoint, max_diff, quiet_trainer, tiny_gpt
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import GPT, HFCausalLM
from launcher.torch_support.init import empty_init, has_meta, init_units

pytestmark = pytest.mark.timeout(300)


def test_a_unit_starts_the_same_whoever_holds_it_and_however_the_units_are_grouped() -> None:
    real = tiny_gpt().double()
    init_units(list(real.stages), 7)
    with empty_init():
        meta = tiny_gpt()
    assert has_meta(meta) and not any(b.is_meta for b in meta.buffers())
    meta.double()
    for part in ([3, 1], [0], [2]):  # three "workers", each materialising only its own units
        init_units(list(meta.stages), 7, part)
    assert not has_meta(meta)
    for (name, a), (_, b) in zip(real.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name


def test_a_tied_parameter_takes_its_first_units_value() -> None:
    """GPT-2's ``lm_head`` is its token embedding: one process and a worker holding only the head
    (which receives the value at set-up) agree on it, and the embedding's own rule sets it."""
    def gpt2() -> HFCausalLM:
        return HFCausalLM("gpt2", config=dict(n_layer=1, n_embd=16, n_head=2))

    with empty_init():
        whole, alone = gpt2(), gpt2()
    init_units(list(whole.stages), 3, reset=whole.reset_stage)
    init_units(list(alone.stages), 3, [0], reset=alone.reset_stage)
    assert whole.stages[0].tokens.weight is whole.stages[-1].lm_head.weight
    assert torch.equal(whole.stages[0].tokens.weight, alone.stages[0].tokens.weight)


class Owned(Callback):
    """Each worker writes how many parameter elements it holds for real once training starts."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        real = sum(p.numel() for p in module.parameters() if not p.is_meta)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(real))


class LateGPT(GPT):
    """A GPT whose layers are made in ``configure_model`` (Lightning's hook for large models);
    when they are made for real (one device) it starts them by the launcher's rule, so both paths
    start from the same values."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters(dict(lr=1e-2, weight_decay=0.0, max_steps=0))
        self.stages = None

    def configure_model(self) -> None:
        if self.stages is not None:  # Lightning may call it again: idempotent
            return
        self.stages = tiny_gpt().stages
        if not has_meta(self):
            init_units(list(self.stages), torch.initial_seed(), reset=self.reset_stage)


def fit(model: L.LightningModule, strategy, devices: int, tmp_path: Path | None = None, callbacks=()) -> dict:
    """Two float64 steps; the trained state: the module's own on one device, else the checkpoint
    the workers wrote (a module built on meta stays on meta in this process)."""
    callbacks = list(callbacks)
    if tmp_path is not None:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2))
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=2, enable_checkpointing=tmp_path is not None,
                       limit_val_batches=0, callbacks=callbacks)
    tr.fit(model, datamodule=char_data())
    if tmp_path is None:
        return model.state_dict()
    return load_checkpoint(tmp_path / "last.ckpt")["state_dict"]


def test_configure_model_builds_on_meta_and_workers_hold_only_their_stages(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = LateGPT()
    want = fit(ref, "auto", 1)
    torch.manual_seed(0)
    model = LateGPT()
    got = fit(model, UnifiedStrategy("fsdp", stages=4, microbatches=4), 4, tmp_path, [Owned(tmp_path)])
    assert has_meta(model)  # the launching process never materialised a weight
    held = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    sizes = [sum(p.numel() for p in stage.parameters()) for stage in ref.stages]
    assert sorted(held) == sorted(sizes)  # FSDP with S = W: each worker holds exactly one stage
    assert max_diff(want, got) < 1e-10  # and trains from where one process starts


def test_a_tied_hugging_face_model_on_meta_trains_as_one_device_does(tmp_path: Path) -> None:
    """GPT-2 (tied) built on the meta device under FSLPP: the head's owners get the embedding's
    value at set-up; after two steps the parameters equal one device's from the same rule."""
    def gpt2() -> HFCausalLM:
        with empty_init():
            return HFCausalLM("gpt2", config=dict(n_layer=2, n_embd=16, n_head=2))

    torch.manual_seed(0)
    ref = gpt2().double()
    init_units(list(ref.stages), torch.initial_seed(), reset=ref.reset_stage)
    # one device as strategy=single trains: GPT-2 keeps its dropout (0.1), drawn by the job's stream
    want = fit(ref, StreamedSingleDevice(microbatches=4), 1)
    torch.manual_seed(0)
    model = gpt2()
    got = fit(model, UnifiedStrategy("fslpp", G=2, R=2, stages=4, microbatches=4), 4, tmp_path)
    assert has_meta(model)
    assert max_diff(want, got) < 1e-10
