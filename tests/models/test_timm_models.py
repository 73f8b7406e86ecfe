"""TimmClassifier's stages, cut at each model's own structure (a ResNet's layers, ConvNeXt's stages,
a ViT's blocks, MobileNet's and EfficientNet's blocks with BatchNorm), against the timm model's own
forward (float64, train and eval mode, BatchNorm running statistics included), every parameter and
buffer under ``stages``, ``model.kwargs`` reaching ``timm.create_model``, the image set deterministic
and resumable, and the models extra importable."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from helpers.training import quiet_trainer, run_stages
from launcher.models import ShapesImages, TimmClassifier

pytestmark = [pytest.mark.timeout(60),
              # Lightning asks the dataloader; the data module is what saves the position in the epoch
              pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch")]


#: name -> (timm.create_model keywords, the units it is cut at, how many). timm's own small test
#: models stand for ConvNeXt and EfficientNet (their classes, a few channels): float64 depthwise
#: convolutions are slow on a CPU (docs/models.md lists the full-size models through the command line)
MODELS: dict[str, tuple[dict[str, Any], str, int]] = {
    "resnet10t": ({}, "layer1", 4),
    "vit_tiny_patch16_224": ({"img_size": 32}, "blocks", 12),  # class token and position embedding in the stem
    "test_convnext": ({}, "stages", 4),  # norm_pre after the stages, in the head
    "mobilenetv3_small_050": ({}, "blocks", 6),  # BatchNorm in the stem and the blocks, conv_head in the head
    "test_efficientnet": ({}, "blocks", 5),  # conv_head and bn2 after the blocks, in the head
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> TimmClassifier:
    pytest.importorskip("timm")
    torch.manual_seed(0)
    return TimmClassifier(request.param, num_classes=5, kwargs=MODELS[request.param][0]).double()


@pytest.mark.parametrize("train", [True, False])
def test_stages_equal_the_model_forward(model: TimmClassifier, train: bool) -> None:
    staged, whole = copy.deepcopy(model).train(train), copy.deepcopy(model).train(train)
    _, units, n = MODELS[staged.hparams.name]
    first = getattr(staged.net, units)
    assert len(staged.stages) == n + 2  # the stem, the units, the head
    assert staged.stages[1] is (first if units == "layer1" else first[0])  # the copy keeps one set of modules
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 4])
    out = run_stages(staged.stages, x)
    ref = whole(x)
    assert out.dtype == torch.float64 and out.shape == (4, 5)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(staged.loss(out, y), whole.loss(ref, y), rtol=0, atol=0)
    # the running statistics: moved alike in train mode, untouched in eval mode
    for (k, a), b in zip(staged.state_dict().items(), whole.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    moved = any(not torch.equal(a, b) for a, b in zip(staged.state_dict().values(), model.state_dict().values()))
    batch_norm = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())  # a ViT and ConvNeXt have none
    assert moved == (train and batch_norm)


def test_gradients_equal_the_model_forward(model: TimmClassifier) -> None:
    staged, whole = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([3, 1, 0, 4])
    staged.loss(run_stages(staged.stages, x), y).backward()
    whole.loss(whole(x), y).backward()
    for (k, a), b in zip(staged.named_parameters(), whole.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=k)


def test_every_parameter_and_buffer_is_under_stages_once(model: TimmClassifier) -> None:
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert names and all(n.startswith("stages.") for n in names)
    assert type(model.stages[0]).__name__ == "Stem" and type(model.stages[-1]).__name__ == "Head"
    # the timm model's own tensors, each exactly once: no copies, nothing outside the stages
    ours = [id(t) for t in model.state_dict(keep_vars=True).values()]
    theirs = [id(t) for t in model.net.state_dict(keep_vars=True).values()]
    assert len(ours) == len(set(ours)) and sorted(ours) == sorted(theirs)
    assert all(t.dtype == torch.float64 for t in model.net.parameters())  # .double() reached the model


def test_a_model_that_cannot_be_cut_is_named() -> None:
    """A RegNet keeps its stages as s1 ... s4: one sentence naming the traced route."""
    pytest.importorskip("timm")
    with pytest.raises(ValueError) as e:
        TimmClassifier("regnetx_002")
    assert str(e.value) == ("model.name=regnetx_002 cannot be cut into stages: a timm RegNet has no stages, blocks, "
                            "layers or layer1, layer2, ... to cut at, or no forward_features and forward_head; train "
                            "it with model=custom split=auto (traced and cut at any module).")


def test_kwargs_reach_create_model() -> None:
    pytest.importorskip("timm")
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    import launcher.config.schema  # noqa: F401 - registers the schema

    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = compose("config", overrides=["model=timm", "model.name=vit_tiny_patch16_224", "model.kwargs.img_size=32",
                                           "+model.kwargs.depth=2", "data.num_classes=3"])
    model = instantiate(cfg.model)
    assert model.net.patch_embed.img_size == (32, 32) and len(model.stages) == 4
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    with pytest.raises(ValueError, match=r"^model.name=resnet10t, model.kwargs.img_size=32 cannot be built: "):
        TimmClassifier("resnet10t", kwargs={"img_size": 32})


def small(**kw: Any) -> ShapesImages:
    args = dict(batch_size=4, size=8, n=72, num_classes=3, val_fraction=0.125, seed=0)
    args.update(kw)
    data = ShapesImages(**args)
    data.setup()
    return data


def test_images_are_deterministic_per_seed() -> None:
    a, b, c = small(), small(), small(seed=1)
    for s, t in zip(a.train_set.tensors + a.val_set.tensors, b.train_set.tensors + b.val_set.tensors):
        assert torch.equal(s, t)
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    x, y = a.train_set.tensors
    assert x.dtype == torch.float32 and x.shape == (63, 3, 8, 8) and y.dtype == torch.long
    assert len(a.val_set) == 9 and sorted(set(y.tolist())) == [0, 1, 2]
    first = [torch.cat([yb for _, yb in d.train_dataloader()]) for d in (a, b)]
    assert torch.equal(*first)
    assert len(a.val_dataloader()) == 2  # whole batches only


class Recorder(L.LightningModule):
    """The smallest model that trains: remembers the labels of every batch it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[1].tolist())
        return (self.w * batch[0].mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(steps: int, ckpt: str | None = None, save: str | None = None) -> list[list[int]]:
    """The label batches a run of ``steps`` steps trains on; ``save``: a checkpoint after every step
    there, as a run's own checkpoints are written (inside the loop), named ``step=N.ckpt``."""
    model = Recorder()
    callbacks = [ModelCheckpoint(dirpath=save, filename="{step}", every_n_train_steps=1, save_top_k=-1)] if save else []
    trainer = quiet_trainer(max_steps=steps, enable_checkpointing=bool(save), callbacks=callbacks, limit_val_batches=0)
    trainer.fit(model, datamodule=small(n=40), ckpt_path=ckpt)  # 35 training images: 8 batches an epoch
    return model.seen


def test_a_resumed_run_sees_the_batches_an_uninterrupted_one_would(tmp_path) -> None:
    whole = fit(11, save=str(tmp_path))  # into the second epoch
    assert whole[8:] != whole[:3]  # the second epoch is shuffled anew
    for stop in (3, 8, 9):  # in the first epoch, at its end, and in the second
        assert fit(11, ckpt=str(tmp_path / f"step={stop}.ckpt")) == whole[stop:]


def test_the_models_extra_imports() -> None:
    """What ``pip install -e ".[models]"`` provides imports beside this torch, whatever its build:
    this process imported launcher first (tests/conftest.py), as every process of the launcher does."""
    try:
        import timm
        import torchvision
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        pytest.fail(f"install the models extra: pip install -e '.[models]' ({error})")
    assert timm.create_model("resnet10t", num_classes=3)(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    assert LlamaForCausalLM(cfg)(torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 32)
    boxes, scores = torch.tensor([[0.0, 0, 1, 1], [0, 0, 1, 1]]), torch.tensor([0.9, 0.8])
    if torchvision.extension._has_ops():  # its own operators: they work
        assert torchvision.ops.nms(boxes, scores, 0.5).tolist() == [0]
    else:  # declared without kernels by launcher/_torchvision.py: torchvision's own error
        with pytest.raises(RuntimeError, match="Couldn't load custom C"):
            torchvision.ops.nms(boxes, scores, 0.5)
