"""The models of ``tests/models/test_real_models.py`` through the command line, one scheme each (the five
schemes spread over the five models; every pair runs through the Python API there): the final
checkpoint equals the same module, built from the same config and seed, trained on one device in
this process as ``strategy=single`` trains it (tests/helpers/oracle.py; float64, within 1e-10), the
models' own dropout on."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from helpers.cli import run_launcher
from helpers.oracle import assert_scheme_equals_single_device

pytestmark = pytest.mark.timeout(400)

# gradient clipping stays on, at the launcher's default (the single-device oracle clips alike)
COMMON = ["stages=4", "microbatches=4", "trainer.max_steps=3", "trainer.precision=64-true",
          "trainer.val_check_interval=3", "logger=none"]
CHARS = ["data.batch_size=8", "data.seq_len=8", "data.chars=20000"]
CASES = {
    # name: (scheme, overrides of the model and data)
    "gpt2-tied": ("fsdp", ["model=hf", "model.arch=gpt2", "model.config.n_layer=2", "model.config.n_embd=32",
                           "model.config.n_head=4", *CHARS]),
    "llama": ("fslpp", ["model=hf", "model.arch=llama", "model.config.num_hidden_layers=2",
                        "model.config.hidden_size=32", "model.config.intermediate_size=64",
                        "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "G=2", "R=2",
                        *CHARS]),
    "qwen2-tied": ("gpipe", ["model=hf", "model.arch=qwen2", "model.config.num_hidden_layers=2",
                             "model.config.hidden_size=32", "model.config.intermediate_size=64",
                             "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                             "+model.config.tie_word_embeddings=true", *CHARS]),
    # BatchNorm normalises each micro-batch by its own statistics, on one device too (strategy=single)
    "resnet-bn": ("ddp", ["model=timm", "data=images", "data.batch_size=16", "data.size=64", "data.n=128",
                          "data.num_classes=4"]),
    # the demo itself, unchanged: its dropout (0.2) draws the masks one device draws
    "lightning-demo": ("lpp", ["model=custom", "model._target_=lightning.pytorch.demos.LightningTransformer",
                               "+model.vocab_size=128", "split=auto", "G=2", "R=2", *CHARS]),
}


launcher = partial(run_launcher, timeout=380)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_command_line_equals_single_device(name: str, tmp_path: Path) -> None:
    scheme, overrides = CASES[name]
    assert_scheme_equals_single_device(scheme, [*COMMON, *overrides], tmp_path)


def test_a_stage_that_fails_is_named_before_any_worker_starts(tmp_path: Path) -> None:
    """A split point that is not a module of the model: one sentence naming it, exit 2, no run."""
    run = tmp_path / "run"
    p = launcher("strategy=gpipe", *COMMON, "model=custom",
                 "model._target_=lightning.pytorch.demos.LightningTransformer", "+model.vocab_size=128",
                 "split=[model.nothing,model.decoder,model.transformer]", *CHARS, f"hydra.run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "model.nothing" in p.stderr and "Traceback" not in p.stderr
    assert not (run / "checkpoints").exists()
