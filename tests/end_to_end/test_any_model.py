"""Models of families nobody here wrote a line for, through the command line at the launcher's
defaults (gradient clipping on, the data shuffled), one scheme each: the final checkpoint equals
the same config trained by Lightning's default single-device strategy in this process (float64,
3 steps, within 1e-10). The Hugging Face families are cut by ``model=hf`` with no per-family code;
the timm models at their own stage structure."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from helpers.cli import run_launcher
from helpers.oracle import assert_scheme_equals_single_device

pytestmark = pytest.mark.timeout(400)

STEPS = 3
COMMON = ["stages=4", "microbatches=4", f"trainer.max_steps={STEPS}", "trainer.precision=64-true",
          "trainer.val_check_interval=3", "logger=none"]
CHARS = ["data.batch_size=8", "data.seq_len=8", "data.chars=20000"]
HF = ["model=hf", "model.config.num_hidden_layers=2", "model.config.hidden_size=32",
      "model.config.num_attention_heads=4", *CHARS]
IMAGES = ["data=images", "data.batch_size=8", "data.n=64", "data.num_classes=4"]
CASES = {
    # name: (scheme, overrides of the model and data)
    "gpt_neox": ("ddp", [*HF, "model.arch=gpt_neox"]),  # parallel residual, partial rotary
    "opt-tied": ("fsdp", [*HF, "model.arch=opt", "+model.config.ffn_dim=64"]),  # offset learned positions
    "phi3": ("lpp", [*HF, "model.arch=phi3", "G=2", "R=2"]),
    "stablelm": ("fslpp", [*HF, "model.arch=stablelm", "G=2", "R=2"]),
    "falcon-alibi-tied": ("gpipe", [*HF, "model.arch=falcon", "+model.config.alibi=true"]),
    # model=hf's batched_mm experts (the library's grouped_mm takes float32 and bf16 only)
    "mixtral-moe": ("fslpp", [*HF, "model.arch=mixtral", "+model.config.num_local_experts=4", "G=2", "R=2"]),
    # timm, cut at each model's own structure; model.kwargs reach timm.create_model
    "vit": ("fsdp", ["model=timm", "model.name=vit_tiny_patch16_224", "model.kwargs.img_size=32", *IMAGES]),
    "convnext": ("gpipe", ["model=timm", "model.name=test_convnext", *IMAGES]),
    # 64 x 64 images: at 32 x 32 the last blocks' BatchNorm normalises 2 values per channel (a 1 x 1
    # map, micro-batches of 2), so ill-conditioned that rounding (summation order) grew to 1e-3 in 3 steps
    "mobilenet-bn": ("lpp", ["model=timm", "model.name=mobilenetv3_small_050", *IMAGES, "data.size=64",
                             "G=2", "R=2"]),
}

launcher = partial(run_launcher, timeout=380)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_command_line_equals_single_device(name: str, tmp_path: Path) -> None:
    scheme, overrides = CASES[name]
    assert_scheme_equals_single_device(scheme, [*COMMON, *overrides], tmp_path)


def test_a_missing_pretrained_directory_is_one_sentence(tmp_path: Path) -> None:
    """Named as such before any worker starts, exit 2, no traceback."""
    missing = tmp_path / "nowhere"
    p = launcher("model=hf", f"model.pretrained={missing}", "strategy=gpipe", "stages=4", "microbatches=4",
                 "logger=none", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"model.pretrained={missing} is invalid: there is no such directory." in p.stderr
    assert "Traceback" not in p.stderr
