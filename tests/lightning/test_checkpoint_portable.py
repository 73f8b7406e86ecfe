"""Every checkpoint the launcher writes is portable: nothing Hydra-specific is pickled into it (the
modules Hydra builds get plain dicts and lists), so ``torch.load(weights_only=True)`` and Lightning's
``load_from_checkpoint`` read it, and each model family resumes from its own ``last.ckpt`` under
another scheme exactly as if it had never stopped (float64: parameters within 1e-10).

A checkpoint holding other Python objects is refused before any worker starts, in one sentence."""

from __future__ import annotations

import importlib
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers.cli import run_launcher
from helpers.training import last_state, max_diff
from launcher.checkpoint import as_file, load
from launcher.preflight import preflight as _preflight

pytestmark = pytest.mark.timeout(600)

# gradient clipping and each model's dropout stay at their defaults; 2 + 2 steps of a tiny model
COMMON = ["stages=2", "microbatches=2", "trainer.precision=64-true", "trainer.val_check_interval=1000",
          "logger=none"]
CHARS = ["data.batch_size=4", "data.seq_len=8", "data.chars=2000"]
TWO = {"ddp": ["strategy=ddp", "G=2", "R=1"], "fsdp": ["strategy=fsdp", "G=2", "R=1"],
       "gpipe": ["strategy=gpipe", "G=1", "R=2"], "lpp": ["strategy=lpp", "G=2", "R=1"],
       "fslpp": ["strategy=fslpp", "G=2", "R=2"]}

FAMILIES = {
    # name: (scheme of the first half and the uninterrupted run, scheme of the resumed half, overrides)
    "gpt": ("fslpp", "gpipe", ["model.n_layer=2", "model.d_model=16", "model.n_head=2", "model.max_steps=4",
                               *CHARS]),
    "mlp": ("ddp", "lpp", ["model=mlp", "model.width=16", "model.n_layer=2", *CHARS]),
    "hf-llama": ("gpipe", "ddp", ["model=hf", "model.arch=llama", "model.config.num_hidden_layers=2",
                                  "model.config.hidden_size=16", "model.config.intermediate_size=32",
                                  "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1",
                                  "model.max_steps=4", *CHARS]),
    "hf-gpt2-tied": ("fsdp", "fslpp", ["model=hf", "model.arch=gpt2", "model.config.n_layer=2",
                                       "model.config.n_embd=16", "model.config.n_head=2", "model.max_steps=4",
                                       *CHARS]),
    "timm-resnet": ("lpp", "fsdp", ["model=timm", "data=images", "data.batch_size=4", "data.size=32", "data.n=64",
                                    "data.num_classes=4", "model.max_steps=4"]),
    # no self.stages: traced from its training_step and cut; its own arguments without +
    "custom-traced": ("ddp", "gpipe", ["model=custom", "model._target_=traced_lm.TracedLM", "model.widths=[16,16]",
                                       "split=auto", *CHARS]),
}

TRACED = '''
import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class TracedLM(L.LightningModule):
    """A character model without self.stages; its hyperparameters hold a list."""

    def __init__(self, widths: list[int], vocab_size: int = 128, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(vocab_size, widths[0])
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])])
        self.head = nn.Linear(widths[-1], vocab_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.body(self.emb(x))).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
'''

launcher = partial(run_launcher, timeout=300, pythonpath="cwd")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("portable")
    (d / "traced_lm.py").write_text(TRACED)
    return d


def _runs(name: str, tmp: Path) -> tuple[Path, Path, Path, list[str]]:
    """The family's first half (2 steps) and uninterrupted run (4 steps) under one scheme, then the
    first half resumed to 4 steps under another; their run directories and stderr."""
    first_scheme, other, overrides = FAMILIES[name]
    first, whole, resumed = (tmp / name / k for k in ("first", "whole", "resumed"))
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda a: launcher(*TWO[first_scheme], *COMMON, *overrides, *a, cwd=tmp),
                             [["trainer.max_steps=2", f"hydra.run.dir={first}"],
                              ["trainer.max_steps=4", f"hydra.run.dir={whole}"]]))
    for p in done:
        assert p.returncode == 0, p.stderr[-3000:]
    p = launcher(*TWO[other], *COMMON, *overrides, "trainer.max_steps=4",
                 f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={resumed}", cwd=tmp)
    return first, whole, resumed, [p.stderr] if p.returncode else []


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_resumes_under_another_scheme_exactly(name: str, workdir: Path) -> None:
    first, whole, resumed, failed = _runs(name, workdir)
    assert not failed, failed[0][-3000:]
    ckpt = first / "checkpoints" / "last.ckpt"
    saved = load(ckpt)  # either format, tensors and plain values only (torch.load with weights_only=True)
    assert saved["global_step"] == 2
    assert max_diff(last_state(resumed), last_state(whole)) < 1e-10
    # Lightning's own way back to the module, with the hyperparameters it was built with
    sys.path.insert(0, str(workdir))
    try:
        target = OmegaConf.load(whole / ".hydra" / "config.yaml").model._target_
        module, _, cls = target.rpartition(".")
        model = getattr(importlib.import_module(module), cls).load_from_checkpoint(as_file(ckpt), map_location="cpu")
    finally:
        sys.path.remove(str(workdir))
    # built in its default dtype (float32), as Lightning builds it: the saved values, in that dtype
    state = model.state_dict()
    assert state.keys() == saved["state_dict"].keys()
    assert all(torch.equal(v, saved["state_dict"][k].to(v.dtype)) for k, v in state.items())
    assert dict(model.hparams) == saved["hyper_parameters"]


@pytest.mark.slow
def test_a_checkpoint_holding_hydra_objects_is_one_sentence(workdir: Path) -> None:
    """A checkpoint whose hyperparameters are Hydra's config objects (as written before they were
    made plain) is refused in the launching process, not by an UnpicklingError in every worker."""
    _, _, overrides = FAMILIES["gpt"]
    run = workdir / "hydra-objects"
    p = launcher(*TWO["gpipe"], *COMMON, *overrides, "trainer.max_steps=2", f"hydra.run.dir={run}", cwd=workdir)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = load(run / "checkpoints" / "last.ckpt")  # gpipe writes a sharded directory: as one file's dict
    ckpt["hyper_parameters"] = OmegaConf.create(ckpt["hyper_parameters"])
    old = workdir / "old.ckpt"
    torch.save(ckpt, old)
    _, found = _preflight([*TWO["ddp"], *COMMON, *overrides, "trainer.max_steps=4", f"ckpt_path={old}"])
    assert found.fatal == [
        f"ckpt_path={old} holds omegaconf.dictconfig.DictConfig, which Lightning's safe load (torch.load with "
        f"weights_only=True) refuses, so no worker could resume from it: resume from a checkpoint whose saved values "
        f"are tensors and plain Python values (hyperparameters as dicts and lists, e.g. through "
        f"OmegaConf.to_container), or start without ckpt_path."]
