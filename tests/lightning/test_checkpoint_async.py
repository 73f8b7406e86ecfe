"""Asynchronous saving (``checkpoint.async_mode=async``): while a save is in flight the previous
checkpoint stays whole under its name, and a run that saved asynchronously resumes exactly as one
that saved synchronously."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.cli import run_launcher
from helpers.training import max_diff
from launcher.checkpoint import load
from launcher.lightning import sharded


def _checkpoint(seed: int) -> tuple[dict, set[str], list[str]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    ids = {id(p): n for n, p in model.named_parameters()}
    ckpt = {"state_dict": model.state_dict(), "global_step": seed, "epoch": 0,
            "optimizer_states": [sharded.optimizer_entries(opt, ids, set(names))]}
    return ckpt, set(model.state_dict()), names


def test_the_previous_checkpoint_stays_whole_while_a_save_is_in_flight(tmp_path):
    path = tmp_path / "last.ckpt"
    first, staged, names = _checkpoint(1)
    sharded.save(first, path, staged, names, {}, rank=0)
    second, _, _ = _checkpoint(2)
    finish = sharded.save(second, path, staged, names, {}, rank=0, async_save=True)
    # the write runs (or has run) in the background; until it is finished and swapped in, the name
    # holds the previous checkpoint, whole: a crash now would resume from it
    assert sharded.problems(path) is None
    got = load(path)
    assert got["global_step"] == 1
    assert max_diff(got["state_dict"], first["state_dict"]) == 0.0
    assert sharded.tmp_dir(path).exists()
    finish()
    assert not sharded.tmp_dir(path).exists() and sharded.problems(path) is None
    got = load(path)
    assert got["global_step"] == 2 and max_diff(got["state_dict"], second["state_dict"]) == 0.0


TINY = ["model.n_layer=2", "model.d_model=16", "model.n_head=2", "data.batch_size=8", "data.seq_len=8",
        "data.chars=600", "data.val_fraction=0.2", "logger=none", "png=false", "trainer.precision=64-true",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "model.max_steps=6",
        "strategy=fsdp", "G=2", "R=1", "stages=2", "microbatches=2"]


def _launch(*args: str, cwd: Path) -> None:
    p = run_launcher(*TINY, *args, cwd=cwd, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_asynchronous_checkpoint_resumes_as_a_synchronous_run(tmp_path):
    """Saved asynchronously at steps 2 and 4 (each save in flight while the next steps train), resumed
    to step 6 with asynchronous saves again: the same state as one synchronous run of 6 steps."""
    first, resumed, whole = tmp_path / "first", tmp_path / "resumed", tmp_path / "whole"
    _launch("checkpoint.async_mode=async", "trainer.max_steps=4", f"hydra.run.dir={first}", cwd=tmp_path)
    ckpt = first / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and sharded.problems(ckpt) is None and load(ckpt)["global_step"] == 4
    assert not sharded.tmp_dir(ckpt).exists()
    _launch("checkpoint.async_mode=async", "trainer.max_steps=6", f"ckpt_path={ckpt}",
            f"hydra.run.dir={resumed}", cwd=tmp_path)
    _launch("trainer.max_steps=6", f"hydra.run.dir={whole}", cwd=tmp_path)
    a, b = load(resumed / "checkpoints" / "last.ckpt"), load(whole / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    assert max_diff(a["state_dict"], b["state_dict"]) < 1e-10
    oa, ob = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert oa.keys() == ob.keys()
    assert max((oa[i][k].double() - ob[i][k].double()).abs().max().item() for i in oa for k in oa[i]) < 1e-10
