"""Models users bring that draw random numbers where a trace fixes things: recurrent layers with
dropout between their layers (``nn.LSTM``/``nn.GRU``/``nn.RNN``, traced to one ``aten.lstm``-like
op whose train flag the trace holds), and a diffusion model's training step, which draws its noise
(``torch.randn_like``) and timesteps (``torch.randint``) itself, around a ``diffusers.UNet2DModel``
(random weights): the user code of ``benchmarks/user_models.py``, which docs/models.md shows.

Both are traced and cut (``split=auto``) and train under several schemes to the parameters of
``strategy=single`` (:class:`~launcher.lightning.single.StreamedSingleDevice`: one device running
each step's micro-batches through the same random streams), float64, 3 steps, within 1e-10, at
the launcher's defaults: gradient clipping 1.0, the model's own dropout, ``DataLoader(shuffle=True)``
with ``drop_last=False`` (the data sets divide by the batch size, which a traced model needs).

Where the draws happen matters for the oracle: a training step draws its noise for the batch it is
given, so one device running the whole batch at once would draw other numbers than the micro-batches
do. Every scheme and ``strategy=single`` run the step once per micro-batch, each inside the job of
``(seed, step, micro-batch)``, whose stream seeds the step's head (the code before the network)
and each module's own draws: the same numbers for a micro-batch, whichever worker runs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from helpers.oracle import assert_scheme_equals_single_device
from helpers.training import char_data, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice

pytestmark = pytest.mark.timeout(600)

TOL = 1e-10
STEPS = 3
B = 4  # micro-batches, and stages
#: the gradient clipping a user of the launcher gets
ROOT = Path(__file__).parents[2]
CLIP = float(OmegaConf.load(ROOT / "conf" / "trainer" / "default.yaml").gradient_clip_val)


def _user_models() -> ModuleType:
    """``benchmarks/user_models.py``: the user code docs/models.md's table runs, tested here as it is."""
    spec = importlib.util.spec_from_file_location("user_models", ROOT / "benchmarks" / "user_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


user_models = _user_models()


def images() -> DataLoader:
    """64 random 8 x 8 images (their own generator), shuffled, in batches of 8."""
    data = torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 2 - 1
    return DataLoader(TensorDataset(data), batch_size=8, shuffle=True)


MODELS = {  # tiny: width 16, 8 x 8 images of one channel
    "lstm": (lambda: user_models.RecurrentLM("LSTM", width=16), lambda: {"datamodule": char_data()}),
    "gru": (lambda: user_models.RecurrentLM("GRU", width=16), lambda: {"datamodule": char_data()}),
    "rnn": (lambda: user_models.RecurrentLM("RNN", width=16), lambda: {"datamodule": char_data()}),
    "unet": (lambda: user_models.Diffusion(size=8, channels=1, width=8), lambda: {"train_dataloaders": images()}),
}
SCHEMES = {"gpipe": {}, "lpp": {"G": 2, "R": 2}, "fsdp": {}}


def fit(name: str, strategy, devices: int) -> dict:
    build, data = MODELS[name]
    L.seed_everything(0, verbose=False)
    model = build()
    quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP).fit(model, **data())
    return model.state_dict()


@pytest.fixture(scope="module")
def single() -> dict:
    """``strategy=single``'s parameters for each model, trained once."""
    return {}


@pytest.mark.slow  # a forked run of 4 workers and a one-device run, each
@pytest.mark.parametrize("name, scheme", [("lstm", "gpipe"), ("gru", "lpp"), ("rnn", "fsdp"),
                                          ("unet", "gpipe"), ("unet", "lpp"), ("unet", "fsdp")])
def test_a_traced_model_that_draws_equals_strategy_single(name: str, scheme: str, single: dict) -> None:
    if name not in single:
        single[name] = fit(name, StreamedSingleDevice(microbatches=B, split="auto"), 1)
    got = fit(name, UnifiedStrategy(scheme, stages=B, microbatches=B, split="auto", **SCHEMES[scheme]), 4)
    diff = max_diff(single[name], got)
    print(f"{name}, {scheme}: parameters within {diff:.1e} of strategy=single")
    assert diff < TOL


def test_the_draws_matter() -> None:
    """The randomness is on: dropout and the step's noise change what one device trains to."""
    a = fit("unet", StreamedSingleDevice(microbatches=B, split="auto", seed=1), 1)
    b = fit("unet", StreamedSingleDevice(microbatches=B, split="auto", seed=2), 1)
    assert max_diff(a, b) > 1e-6


@pytest.mark.slow
def test_a_diffusion_step_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' command (``model=custom model._target_=user_models.Diffusion data=images``) at the
    launcher's defaults but float64: its ``last.ckpt`` under lpp equals strategy=single's parameters."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # for the oracle, built in this process
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "benchmarks"))  # for the command
    assert_scheme_equals_single_device("lpp", [
        "G=2", "R=2", "stages=4", "microbatches=4", "split=auto", "model=custom",
        "model._target_=user_models.Diffusion", "model.size=8", "model.width=8", "data=images", "data.size=8",
        "data.n=256", "data.batch_size=8",
        f"trainer.max_steps={STEPS}", "trainer.precision=64-true", "logger=none"], tmp_path)
