"""Random draws belong to the job, not to the worker (:mod:`launcher.torch_support.streams`): with dropout
and stochastic depth on, every scheme trains to the parameters of ``strategy=single`` (one device
running each step's micro-batches through the same streams), float64, 3 steps, within 1e-10.

The schemes are spread over three models, each with its own randomness on:

- GPT-2 from scratch (``model=hf``'s defaults: dropout 0.1 in embeddings, attention and residuals;
  ``lm_head`` tied to the embedding), a model with ``self.stages``;
- Lightning's ``demos.LightningTransformer`` (dropout 0.2, in its positional encoding and in
  ``nn.Transformer``'s layers and attention), unchanged, traced and cut (``split=auto``);
- a timm ResNet with stochastic depth (``drop_path_rate``) and BatchNorm.

ddp, fsdp, gpipe, lpp, fslpp, an interleaved (looped) order, ZB-H1 with ``split_backward`` and
``recompute=full`` each run at least once; one command-line run, resumed from a mid-run checkpoint,
ends where the uninterrupted single-device run does.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.cli import run_launcher
from helpers.training import char_data, last_state, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import HFCausalLM, ShapesImages, TimmClassifier

pytestmark = pytest.mark.timeout(600)

STEPS = 3
TOL = 1e-10
B = 4  # micro-batches


def gpt2(**config: float) -> L.LightningModule:
    return HFCausalLM(arch="gpt2", config=dict(n_layer=2, n_embd=32, n_head=4, **config), max_steps=STEPS)


def demo() -> L.LightningModule:
    from lightning.pytorch.demos import LightningTransformer

    model = LightningTransformer(vocab_size=128)  # its own dropout, 0.2
    model.prepare_data = lambda: None  # it downloads WikiText-2; the character corpus feeds it here
    return model


def resnet() -> L.LightningModule:
    """resnet10t with stochastic depth as timm builds it for ``drop_path_rate=0.3`` (a DropPath per
    residual block, its rate growing with depth), trained by SGD with momentum (BatchNorm leaves
    rounding-level gradients that Adam would amplify; see tests/models/test_real_models.py)."""
    import timm

    model = TimmClassifier(name="resnet10t", num_classes=4, max_steps=STEPS)
    paths = timm.create_model("resnet10t", num_classes=4, drop_path_rate=0.3)
    for (_, mine), (_, theirs) in zip(model.net.named_modules(), paths.named_modules()):
        if getattr(theirs, "drop_path", None) is not None:
            mine.drop_path = theirs.drop_path
    assert any(type(m).__name__ == "DropPath" for m in model.stages.modules())
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model


def images() -> ShapesImages:
    return ShapesImages(batch_size=16, size=32, n=128, num_classes=4, val_fraction=0.25, seed=3)


MODELS = {"gpt2": (gpt2, char_data, {}), "demo": (demo, char_data, {"split": "auto"}),
          "resnet": (resnet, images, {})}

# (model, scheme, keywords): every scheme and variant at least once, with randomness on
CASES = [
    ("gpt2", "ddp", {}),
    ("gpt2", "gpipe", {"order": "zb_h1", "split_backward": True}),  # ZB-H1: I and W apart
    ("gpt2", "fslpp", {"G": 2, "R": 2, "recompute": "full"}),
    ("demo", "lpp", {"G": 2, "R": 2}),
    ("demo", "lpp", {"G": 1, "R": 2, "order": "breadth_first"}),  # looped: 2 stages on each worker
    ("demo", "fsdp", {"recompute": "full"}),
    ("resnet", "fsdp", {"weight_cache": "job"}),  # every forward on fetched weights, recomputed
    ("resnet", "gpipe", {}),
]


def fit(name: str, strategy, devices: int) -> tuple[dict, L.Trainer]:
    build, data, _ = MODELS[name]
    L.seed_everything(0, verbose=False)
    model = build()
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, limit_val_batches=0)
    tr.fit(model, datamodule=data())
    return model.state_dict(), tr


@pytest.fixture(scope="module")
def oracles() -> dict:
    """Each model on one device, its micro-batches through the streams (strategy=single)."""
    return {name: fit(name, StreamedSingleDevice(microbatches=B, split=MODELS[name][2].get("split")), 1)[0]
            for name in MODELS}


@pytest.mark.parametrize("name,scheme,kw", CASES, ids=[f"{n}-{s}-{'-'.join(map(str, k.values())) or 'plain'}"
                                                      for n, s, k in CASES])
def test_scheme_draws_what_one_device_draws(name: str, scheme: str, kw: dict, oracles: dict) -> None:
    state, _ = fit(name, UnifiedStrategy(scheme, stages=4, microbatches=B, **MODELS[name][2], **kw), 4)
    assert max_diff(oracles[name], state) < TOL


def test_randomness_is_on_and_matters(oracles: dict) -> None:
    """GPT-2 above does draw: one device without the streams (Lightning's own strategy, the whole
    batch at once) ends elsewhere, so the equalities are not those of a model that draws nothing."""
    plain, _ = fit("gpt2", "auto", 1)
    assert max_diff(oracles["gpt2"], plain) > 1e-4


def test_streams_change_nothing_without_randomness() -> None:
    """With dropout off, one device's micro-batched step through the streams is Lightning's own
    step on the whole batch, up to rounding."""
    def build() -> L.LightningModule:
        return gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    MODELS["gpt2-nodrop"] = (build, char_data, {})
    try:
        plain, _ = fit("gpt2-nodrop", "auto", 1)
        streamed, _ = fit("gpt2-nodrop", StreamedSingleDevice(microbatches=B), 1)
    finally:
        del MODELS["gpt2-nodrop"]
    assert max_diff(plain, streamed) < TOL


def test_recomputed_forward_draws_the_same_mask() -> None:
    """A unit's forward inside the same job draws the same numbers again (a recomputation), and
    another micro-batch, step or unit draws others; outside a job the user's generator is used."""
    from launcher.torch_support import streams

    drop = torch.nn.Dropout(0.5)
    streams.install([(drop, 3)])
    x = torch.ones(1000)

    def draw(step: int, b: int) -> torch.Tensor:
        with streams.job(7, step, b):
            return drop(x)

    assert torch.equal(draw(2, 1), draw(2, 1))
    assert not torch.equal(draw(2, 1), draw(2, 0)) and not torch.equal(draw(2, 1), draw(1, 1))
    streams.install([(drop, 4)])
    other = draw(2, 1)
    streams.install([(drop, 3)])
    assert not torch.equal(other, draw(2, 1))
    torch.manual_seed(5)
    outside = drop(x)
    torch.manual_seed(5)
    assert torch.equal(outside, drop(x))


@pytest.mark.slow
def test_resumed_command_line_run_equals_the_uninterrupted_one(tmp_path) -> None:
    """GPT-2 with its dropout (0.1) through the command line: 3 steps on one device; 2 steps under
    gpipe, then resumed from that run's last.ckpt to step 3: the same parameters."""
    common = ["model=hf", "model.arch=gpt2", "model.config.n_layer=2", "model.config.n_embd=32",
              "model.config.n_head=4", "model.max_steps=3", "data.batch_size=8", "data.seq_len=8",
              "data.chars=20000", "stages=4", f"microbatches={B}", "trainer.precision=64-true",
              "trainer.val_check_interval=1000", "logger=none"]
    runs = {k: tmp_path / k for k in ("single", "first", "resumed")}
    for name, extra in [("single", ["strategy=single", "trainer.max_steps=3"]),
                        ("first", ["strategy=gpipe", "G=1", "R=4", "trainer.max_steps=2"]),
                        ("resumed", ["strategy=gpipe", "G=1", "R=4", "trainer.max_steps=3",
                                     f"ckpt_path={runs['first'] / 'checkpoints' / 'last.ckpt'}"])]:
        p = run_launcher(*common, *extra, f"hydra.run.dir={runs[name]}", cwd=tmp_path, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    assert max_diff(last_state(runs["single"]), last_state(runs["resumed"])) < TOL
    assert max_diff(last_state(runs["single"]), last_state(runs["first"])) > 1e-6  # a step apart
