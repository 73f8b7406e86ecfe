"""A ``timm`` image classifier cut into stages made of the model's own submodules, and a small
synthetic image set that needs no download.

A timm model is cut at its own stage structure, ``stages = [stem, unit 1, ..., unit n, head]``,
the units being its ``stages`` (ConvNeXt, ...), ``blocks`` (ViT; MobileNet and EfficientNet, whose
blocks hold BatchNorm), ``layers``, or a ResNet's ``layer1`` ... ``layer4``. The stem runs the
model's own ``forward_features`` up to the first unit (a ViT's patch embedding with its class token
and position embedding; a ResNet's ``conv1``, ``bn1``, ``act1``, ``maxpool``); the head runs what
``forward_features`` does after the last unit (a ViT's ``norm``) and the model's own
``forward_head``. Each stage takes the previous one's tensor and returns a tensor; the head returns
the logits. BatchNorm running statistics are buffers inside the stages.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import TensorDataset

from .base import adamw_cosine
from .data import SeededData
from .twins import Reached, twin


def _timm() -> Any:
    """timm, imported on first use: the models extra is optional."""
    try:
        import timm
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"model=timm needs timm: pip install -e '.[models]' ({error})") from error
    return timm


#: the names under which timm models keep their sequence of stages or blocks
CONTAINERS = ("stages", "blocks", "layers")
ROUTE = "train it with model=custom split=auto (traced and cut at any module)"


def _units(model: nn.Module) -> tuple[dict[str, nn.Module], list[nn.Module]]:
    """The model's own stage structure: the items of its first child named ``stages``, ``blocks`` or
    ``layers`` (a ``Sequential`` or ``ModuleList``), or its numbered children ``layer1``,
    ``layer2``, ... (ResNets); with the children that the forward calls (by name)."""
    for name in CONTAINERS:
        container = model._modules.get(name)
        if isinstance(container, (nn.Sequential, nn.ModuleList)) and len(container) > 0:
            return {name: container}, list(container)
    numbered = {n: m for n, m in model._modules.items() if re.fullmatch(r"layer\d+", n) and m is not None}
    return numbered, list(numbered.values())


class _Stop(nn.Module):
    """The first unit, in the first stage: the tensor it would receive ends ``forward_features``."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise Reached(x)


class _Twinned(nn.Module):
    """A stage that runs the timm model's own methods on a twin of it (a plain attribute, so deep
    copies of the stage copy it along), whose train/eval mode it keeps."""

    twin: Any  # timm's models share no type that declares forward_features and forward_head

    def train(self, mode: bool = True) -> _Twinned:
        super().train(mode)
        if "twin" in self.__dict__:
            self.twin.training = mode  # the model's own methods read it (the head's dropout)
        return self


class Stem(_Twinned):
    """The model's ``forward_features`` up to its first unit: the modules it calls there (a ResNet's
    ``conv1``, ``bn1``, ``act1``, ``maxpool``; a ViT's patch embedding, with the class token and the
    position embedding, which the model holds as parameters of its own)."""

    def __init__(self, model: nn.Module, held: dict[str, nn.Module | None], units: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in held.items():
            self.add_module(name, module)
        for name, p in model._parameters.items():
            if p is not None:
                self.register_parameter(name, p)
        for name, b in model._buffers.items():
            if b is not None:
                self.register_buffer(name, b)
        first = next(iter(units))
        object.__setattr__(self, "twin", twin(model, {first: _Stop()}))
        # the model's own tensors are this stage's: one dict, so a stage computing on fetched
        # weights (which the engine swaps into this module) computes with them in the twin too
        self.twin._parameters = self._parameters
        self.twin._buffers = self._buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self.twin.forward_features(x)
        except Reached as reached:
            return reached.value
        raise RuntimeError("forward_features never reached the model's first unit")


class Head(_Twinned):
    """What ``forward_features`` does after the last unit (a ViT's ``norm``, an EfficientNet's
    ``conv_head`` and ``bn2``), in order, then the model's own ``forward_head`` (pooling, dropout,
    the classifier), on a twin that holds only the modules it calls."""

    def __init__(self, model: nn.Module, after: list[str], head: list[str]) -> None:
        super().__init__()
        self.after = list(after)
        for name in dict.fromkeys([*after, *head]):
            self.add_module(name, model._modules[name])
        keep = {n: (m if n in head else None) for n, m in model._modules.items()}
        object.__setattr__(self, "twin", twin(model, keep))
        self.twin._parameters = OrderedDict()  # the stem holds the model's own parameters
        self.twin._buffers = OrderedDict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.after:
            x = getattr(self, name)(x)
        return self.twin.forward_head(x)


def _probe_input(model: nn.Module, in_chans: int) -> torch.Tensor:
    """Two images the model takes: its patch embedding's fixed size where it has one, else 64 x 64."""
    size = getattr(getattr(model, "patch_embed", None), "img_size", None) or (64, 64)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return torch.randn(2, in_chans, h, w, generator=torch.Generator().manual_seed(0)).to(dtype)


def cut(model: nn.Module, name: str, in_chans: int = 3) -> list[nn.Module]:
    """The stages of a timm model at its own structure, made of its own modules (no copies):
    ``[stem, unit 1, ..., unit n, head]``, the units being its stages or blocks. A probe (one
    forward in eval mode, the random state untouched) finds which modules ``forward_features`` calls
    before the first unit and after the last, and which ``forward_head`` calls, and checks that the
    stages give the model's own output exactly; one sentence (``ValueError``) when not."""
    def refuse(why: str) -> NoReturn:
        raise ValueError(f"model.name={name} cannot be cut into stages: {why}; {ROUTE}.")

    units, items = _units(model)
    if not items or not all(callable(getattr(model, f, None)) for f in ("forward_features", "forward_head")):
        refuse(f"a timm {type(model).__name__} has no {', '.join(CONTAINERS)} or layer1, layer2, ... to cut at, "
               f"or no forward_features and forward_head")
    log: list[tuple[str, str]] = []
    phase = ["features"]
    handles = []
    for child_name, child in model.named_children():
        handles.append(child.register_forward_pre_hook(
            lambda *_, n=child_name: log.append((phase[0], n))))
    x = _probe_input(model, in_chans)
    timm_model: Any = model  # forward_features and forward_head exist (checked above); no type declares them
    was = model.training
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            features = timm_model.forward_features(x)
            phase[0] = "head"
            expected = timm_model.forward_head(features)
    except Exception as e:  # noqa: BLE001 - any failure of the model's forward is the model's
        refuse(f"its forward failed on a probe of shape {tuple(x.shape)} ({type(e).__name__})")
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    called = [n for p, n in log if p == "features"]
    at = [i for i, n in enumerate(called) if n in units]
    if not at:
        refuse("forward_features never calls its stages or blocks")
    if any(n not in units for n in called[at[0]:at[-1] + 1]):
        refuse("forward_features calls other modules between its stages or blocks")
    before, after = called[:at[0]], called[at[-1] + 1:]
    head = list(dict.fromkeys(n for p, n in log if p == "head"))
    if set(after) & set(head) or set(before) & set([*after, *head]):
        refuse("the same module runs before and after its stages or blocks")
    unused = [n for n, m in model.named_children() if n not in units and n not in before and n not in after
              and n not in head and m is not None]
    stem = Stem(model, {n: model._modules[n] for n in dict.fromkeys([*before, *unused])}, units)
    stages = [stem, *items, Head(model, after, head)]
    was = model.training
    try:
        for s in stages:
            s.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            out = x
            for s in stages:
                out = s(out)
    except Exception as e:  # noqa: BLE001
        refuse(f"its stages fail where the model's forward runs ({type(e).__name__}: {e})")
    finally:
        for s in stages:
            s.train(was)
    if not torch.equal(out, expected):
        refuse("its stages, run in turn, do not give the model's own output")
    return stages


class TimmClassifier(LightningModule):
    """A timm image classifier (``name``, random weights, ``num_classes`` outputs) as ``self.stages``.

    The timm model stays whole as ``self.net``: its own ``forward`` is the single-device path, the
    oracle the stages must match. It is kept out of the module tree, so every parameter and buffer
    is named once, under ``stages.``, and ``.to()`` on this module reaches all of them. Batches are
    ``(images [N, C, H, W], labels [N])``; the loss is cross-entropy, the mean over the batch.
    ``kwargs`` go to ``timm.create_model`` as they are (``img_size`` for a ViT, ``drop_path_rate``,
    ...). AdamW with a cosine learning-rate schedule over ``max_steps``, like :class:`GPT`.
    """

    stages: nn.ModuleList
    net: nn.Module  # a plain attribute (see __init__)

    def __init__(self, name: str = "resnet10t", num_classes: int = 10, in_chans: int = 3, drop_rate: float = 0.0,
                 lr: float = 3e-3, weight_decay: float = 0.0, max_steps: int = 0,
                 kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        # the hyperparameters are the arguments by name: Lightning would record their name as
        # "kwargs", and load_from_checkpoint would then pass them all as this class's `kwargs`
        self._hparams_name = None
        extra = {str(k): v for k, v in dict(kwargs or {}).items() if v is not None}  # null: not passed
        try:
            model = _timm().create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans,
                                         drop_rate=drop_rate, **extra)
        except (TypeError, RuntimeError) as e:  # a keyword the model does not take
            given = "".join(f", model.kwargs.{k}={v}" for k, v in extra.items())
            raise ValueError(f"model.name={name}{given} cannot be built: {str(e).splitlines()[0]}.") from e
        # a plain attribute, not a child module: its parameters are named once, under stages
        object.__setattr__(self, "net", model)
        self.stages = nn.ModuleList(cut(model, name, in_chans))
        held = {id(t) for t in self.stages.state_dict(keep_vars=True).values()}
        missed = [k for k, t in model.state_dict(keep_vars=True).items() if id(t) not in held]
        if missed:  # the model has state outside the modules its forward runs through the stages
            raise ValueError(f"model.name={name}: {missed[0]} of the timm model is in no stage")

    def train(self, mode: bool = True) -> TimmClassifier:
        super().train(mode)
        self.net.train(mode)  # the model object itself, which the stages do not hold
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits from the timm model's own forward."""
        return self.net(x)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], key: str, prog_bar: bool) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.log(f"{key}_loss", loss, prog_bar=prog_bar, batch_size=y.shape[0])
        self.log(f"{key}_acc", (logits.argmax(-1) == y).float().mean(), batch_size=y.shape[0])
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train", True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val", True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test", False)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's union of return types
        hp = self.hparams
        return adamw_cosine(self.parameters(), hp["lr"], hp["weight_decay"], hp["max_steps"])


def shapes(n: int, size: int, num_classes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy striped images ``[n, 3, size, size]`` (float32) and their labels ``[n]``.

    Class ``k`` is a grating at angle ``180 k / num_classes`` degrees, of one of two stripe
    widths (by the parity of ``k``); the phase, the colours of the two stripe shades, the
    contrast and the noise are drawn per image, so only the orientation and width tell the class.
    """
    labels = torch.randperm(n, generator=generator) % num_classes
    angle = math.pi * labels.double() / num_classes
    period = torch.where(labels % 2 == 0, 0.25, 0.45) * size  # pixels per stripe pair
    phase = 2 * math.pi * torch.rand(n, generator=generator, dtype=torch.float64)
    grid = torch.arange(size, dtype=torch.float64)
    ys, xs = grid[:, None], grid[None, :]
    along = xs[None] * angle.cos()[:, None, None] + ys[None] * angle.sin()[:, None, None]
    wave = torch.sin(2 * math.pi * along / period[:, None, None] + phase[:, None, None])  # [n, size, size]
    light, dark = (torch.rand(n, 3, 1, 1, generator=generator, dtype=torch.float64) for _ in range(2))
    contrast = 0.5 + 0.5 * torch.rand(n, 1, 1, 1, generator=generator, dtype=torch.float64)
    mix = 0.5 + 0.5 * contrast * wave[:, None]
    images = mix * light + (1 - mix) * dark
    images = images + 0.2 * torch.randn(n, 3, size, size, generator=generator, dtype=torch.float64)
    return ((images - 0.5) / 0.5).float(), labels.long()


class ShapesImages(SeededData):
    """Image classification without a download: :func:`shapes`' striped images, ``n`` in all
    (the first ``val_fraction`` of them for validation), drawn once from ``seed``; shuffled and
    resumed as :class:`~launcher.models.data.SeededData` says."""

    def __init__(self, batch_size: int = 32, size: int = 32, n: int = 4096, num_classes: int = 10,
                 val_fraction: float = 0.125, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(batch_size, shuffle, seed)
        self.size, self.n, self.num_classes, self.val_fraction = size, n, num_classes, val_fraction

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        x, y = shapes(self.n, self.size, self.num_classes, torch.Generator().manual_seed(self.seed))
        n_val = max(1, int(self.n * self.val_fraction))
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])
