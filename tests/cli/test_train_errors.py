"""Bad input to the flagship command: one sentence naming the key, the value and the rule, exit 2,
before any worker, W&B run or run directory exists. A worker that raises in the user's code stops
the others, naming the rank, the job and the error (exit 1). Ctrl-C and SIGTERM stop every worker
with one line (exit 130 / 143). No process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from functools import partial

import pytest
import torch

from helpers.cli import SMALL_RUN, start_launcher, survivors
from launcher.models import GPT
from launcher.preflight import preflight as _preflight

pytestmark = pytest.mark.timeout(240)

SMALL = [*SMALL_RUN, "logger=none"]

class BadGPT(GPT):
    """A stage that cannot take what the stage before it returns."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stages[3] = torch.nn.Linear(3, 3)


INVALID = [
    (["data.batch_size=30"], "data.batch_size=30 is invalid: each batch is cut into microbatches=16"),
    (["data.batch_size=0"], "data.batch_size=0 is invalid: the batch size must be a positive integer"),
    (["data.batch_size=abc"], "data.batch_size"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 is invalid"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1 with trainer.max_epochs=-1 never ends"),
    (["+trainer.foo=1"], "trainer.foo=1 is invalid: foo is not an argument of lightning's Trainer."),
    (["trainer.foo=1"], "trainer.foo=1 is invalid: foo is not an argument of lightning's Trainer."),
    (["trainer.max_step=10"], "max_step is not an argument of lightning's Trainer; did you mean trainer.max_steps?"),
    (["+trainer.devices=3"], "trainer.devices=3 is invalid: the launcher sets devices from W = G*R"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 is invalid: it must be a positive"),
    (["trainer.accelerator=tpu"], "trainer.accelerator=tpu is invalid: use cpu, gpu, cuda, auto"),
    (["trainer.precision=17"], "trainer.precision=17 is invalid: use one of lightning's precisions"),
    (["model=nope"], "model=nope is not a known model; choose one of custom, gpt, hf, hf_traced, mlp, timm"),
    (["model=custom"], "model._target_=??? is invalid: model needs _target_"),
    (["model=custom", "model._target_=collections.OrderedDict"], "built a OrderedDict, not a LightningModule"),
    (["model=custom", "model._target_=nosuchmodule.Model"], "model._target_=nosuchmodule.Model could not be built"),
    (["model=custom", "model._target_=torch.nn.Linear"], "could not be built"),
    (["stages=9"], "stages=9 is invalid: GPT.stages has only 8 modules"),
    (["model=custom", "model._target_=test_train_errors.BadGPT"],
     "cannot be trained by the schedule: stage 3 (Linear) raised RuntimeError on an input of shape"),
    (["data=nope"], "data=nope is not a known data; choose one of chars, custom, images"),
    (["data=custom"], "data._target_=??? is invalid"),
    (["logger=nope"], "logger=nope is not a known logger; choose one of none, wandb"),
    (["timeout=0"], "timeout=0 is invalid: the failure timeout must be a positive number of seconds"),
    (["ckpt_path=/no/such.ckpt"], "ckpt_path=/no/such.ckpt is invalid: no such checkpoint file"),
    (["strategy=ddp", "G=2", "R=4"], "strategy=ddp needs W = microbatches"),
    (["strategy=gpipe", "stages=4", "G=2"], "strategy=gpipe needs W = stages"),
    (["R=16"], "R=16 is invalid: R must not exceed stages=8"),
    (["G=32"], "G=32 is invalid: G must not exceed microbatches=16"),
    (["order=zigzag"], "order=zigzag is not a known order"),
    (["strategy=foo"], "strategy=foo is not a known strategy"),
    (["memory_limit=1"], "memory_limit=1 on worker 0 cannot finish the step"),
    (["G=2.5"], "G=2.5 is invalid"),
    (["mode=fly"], "mode=fly"),
    (["png=maybe"], "png=maybe is invalid: use true, false or auto."),
    (["step_overlap=post_validation"], "step_overlap=post_validation is invalid with mode=train and strategy=lpp G=2: "
                                       "the runtime overlaps steps only where each stage has one owner (lpp with G=1)"),
    (["strategy=fslpp", "G=2", "R=2", "step_overlap=post_validation"],
     "step_overlap=post_validation is invalid with mode=train and strategy=fslpp: the runtime overlaps steps only "
     "under strategy=gpipe or lpp with G=1 (one owner per stage)"),
    (["strategy=gpipe", "stages=4", "step_overlap=post_validation_paper"],
     "step_overlap=post_validation_paper is invalid with mode=train: the paper's chain runs the next step's forwards "
     "on weights not yet validated"),
]


@pytest.mark.parametrize("overrides,sentence", INVALID, ids=[" ".join(c[0]) for c in INVALID])
def test_refused_before_anything_runs(overrides, sentence):
    _, found = _preflight(list(overrides))
    assert found.fatal, overrides
    assert any(sentence in s for s in found.fatal), found.fatal
    for s in found.fatal:
        assert "\n" not in s and s.endswith((".", "?")), s


def test_the_defaults_and_the_flagship_are_valid():
    for overrides in ([], ["strategy=fslpp", "G=4", "R=4"], ["strategy=single"], ["model=mlp"],
                      ["strategy=ddp"], ["strategy=gpipe"], ["strategy=fsdp"]):
        _, found = _preflight(overrides)
        assert not found.fatal, (overrides, found.fatal)


launcher = partial(start_launcher, pythonpath="cwd")


def test_invalid_run_exits_2_and_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    p = launcher("data.batch_size=30", f"hydra.run.dir={run}", cwd=tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2
    assert err.strip().splitlines() == [
        "error: data.batch_size=30 is invalid: each batch is cut into microbatches=16 equal micro-batches, so the "
        "batch size must be a multiple of 16 (e.g. 16)."]
    assert not run.exists()


BOOM = '''
from torch import nn

from launcher.models import GPT

CALLS = [0]  # per process


class Boom(nn.Module):
    """Wraps a block; raises on the 10th real (not meta-device) call in a process."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if not x.is_meta:
            CALLS[0] += 1
            if CALLS[0] == 10:
                raise ValueError("boom in user code")
        return self.inner(x)


class BoomGPT(GPT):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.stages[2] = Boom(self.stages[2])
'''


@pytest.mark.slow
def test_raising_worker_stops_the_others(tmp_path):
    (tmp_path / "boom.py").write_text(BOOM)
    p = launcher("model=custom", "model._target_=boom.BoomGPT", "+model.seq_len=8", "+model.d_model=16",
                 "+model.n_head=2", "+model.n_layer=2", "strategy=lpp", "G=1", "R=2", *SMALL, "trainer.max_steps=50",
                 "timeout=5", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err[-2000:]
    line = [x for x in err.splitlines() if x.startswith("error: ")][0]
    assert "rank 0 failed while running F(2," in line and "ValueError: boom in user code" in line, line
    assert (tmp_path / "run" / "failed.json").exists()
    assert not survivors(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_every_worker_with_one_line(tmp_path, sig, code):
    run = tmp_path / "run"
    p = launcher("strategy=fslpp", "G=2", "R=2", *SMALL, "trainer.max_steps=100000", "trainer.val_check_interval=1000",
                 f"hydra.run.dir={run}", cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not (run / "checkpoints").exists() and not list(run.glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
        if _workers_running(p.pid) >= 4:
            break
    time.sleep(2.0)  # mid-step
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)  # Ctrl-C reaches the whole foreground process group
    else:
        os.kill(p.pid, sig)  # SIGTERM to the launching process only
    t0 = time.monotonic()
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - t0 < 15
    assert p.returncode == code, err[-2000:]
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"stopped by {sig.name}" in errors[0] and "workers stopped" in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert not survivors(str(tmp_path))


def _workers_running(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return len(out.split())
