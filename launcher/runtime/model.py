"""Staged models: a list of stage modules plus a loss on the last stage, and the oracle.

A stage takes the outputs of its predecessor stages (in ``graph.preds`` order; a source stage takes
the micro-batch input) and returns one tensor. A loss stage's output goes to ``loss(output,
target)``. The loss of a step is the mean over micro-batches, so every micro-batch's loss is
scaled by ``1/B`` before its backward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from launcher.schedule.graph import StageGraph

Batch = tuple[torch.Tensor, torch.Tensor]  # (input, target) of one micro-batch
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ModelError(ValueError):
    """A model the runtime cannot train; ``sentences`` holds one sentence per problem."""

    def __init__(self, sentences: Sequence[str]):
        self.sentences = list(sentences)
        super().__init__("\n".join(self.sentences))


@dataclass
class StagedModel:
    """The user's model, cut into stages; ``graph`` defaults to the chain ``0 -> ... -> S-1``."""

    stages: list[nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    graph: StageGraph | None = None

    def __post_init__(self) -> None:
        if self.graph is None and isinstance(self.stages, (list, tuple, nn.ModuleList)):
            self.graph = StageGraph.chain(len(self.stages))
        found = _own_errors(self)
        if found:
            raise ModelError(found)

    @property
    def S(self) -> int:
        return len(self.stages)


def _what(x: object) -> str:
    """``a tuple of 2``, ``a NoneType``: what a value is, for a sentence."""
    n = f" of {len(x)}" if isinstance(x, (tuple, list, dict)) else ""
    return f"a {type(x).__name__}{n}"


def _own_errors(model: StagedModel) -> list[str]:
    """What :class:`StagedModel` checks at construction (and the engine again, since the stages
    may have changed since), one sentence per problem, naming the stage."""
    stages = model.stages
    if not isinstance(stages, (list, tuple, nn.ModuleList)):
        return [f"the model's stages are {_what(stages)}; give a list of torch.nn.Module, one per stage."]
    out: list[str] = []
    if not callable(model.loss):
        out.append(f"the model's loss is {_what(model.loss)}, not a callable loss(output, target).")
    if model.graph is not None and model.graph.stages != len(stages):
        out.append(f"the stage graph has {model.graph.stages} stages but the model has {len(stages)}.")
    for s, m in enumerate(stages):
        if not isinstance(m, nn.Module):
            out.append(f"stage {s} is {_what(m)}, not a torch.nn.Module.")
            continue
        names = [n for n, _ in m.named_buffers()]
        if names:
            out.append(f"stage {s} has buffers ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                       f"the runtime supports stages whose state is parameters only.")
        dtypes = {p.dtype for p in m.parameters()}
        if len(dtypes) > 1:
            out.append(f"stage {s} mixes parameter dtypes {sorted(map(str, dtypes))}; use one dtype per stage.")
    return out


def returns_error(s: int, out: object, where: str) -> str | None:
    """The sentence for a stage whose output is not one tensor; ``None`` when it is."""
    if isinstance(out, torch.Tensor):
        return None
    return f"stage {s} returned {_what(out)} {where}; a stage must return one tensor."


def model_errors(model: object, stages: int, example: torch.Tensor | None = None) -> list[str]:
    """Everything that would stop the runtime from training ``model`` as a step of ``stages``
    stages, one sentence per problem, found before any worker starts.

    With ``example`` (one micro-batch's input) the stages also run on the meta device, which
    costs no memory or compute, to find a stage that does not return one tensor. A stage that
    cannot run on meta (an op without a meta kernel) is not reported here: it fails on real
    data with its own error.
    """
    if not isinstance(model, StagedModel):
        return [f"the model is {_what(model)}, not a StagedModel; build one with StagedModel(stages, loss), "
                f"stages being a list of torch.nn.Module."]
    out = _own_errors(model)
    if out:
        return out
    if len(model.stages) != stages:
        out.append(f"the model has {len(model.stages)} stages but the step has stages={stages}; "
                   f"cut the model into {stages} stages or set stages={len(model.stages)}.")
        return out
    if example is not None:
        e = meta_errors(model, example)
        if e:
            out.append(e)
    return out


def meta_errors(model: StagedModel, example: torch.Tensor) -> str | None:
    """Run ``model``'s stages on a meta-device copy of ``example``; the sentence for the first
    stage that does not return one tensor."""
    outs: list[torch.Tensor] = []
    x = torch.empty(example.shape, dtype=example.dtype, device="meta")
    with torch.no_grad():
        for s, m in enumerate(model.stages):
            preds = model.graph.preds[s]
            try:
                out = skeleton(m)(*([outs[p] for p in preds] if preds else [x]))
            except Exception:
                return None  # no meta kernel, or data-dependent: real data will say
            e = returns_error(s, out, f"on an input of shape {tuple(example.shape)}")
            if e:
                return e
            outs.append(out)
    return None


@dataclass
class StageLayout:
    """Names, shapes and offsets of one stage's parameters inside a flat buffer."""

    names: list[str]
    shapes: list[torch.Size]
    numels: list[int]
    dtype: torch.dtype
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(self.numels)

    @classmethod
    def of(cls, module: nn.Module) -> "StageLayout":
        named = list(module.named_parameters())
        dtype = named[0][1].dtype if named else torch.float32
        return cls([n for n, _ in named], [p.shape for _, p in named], [p.numel() for _, p in named], dtype)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters as views into ``flat`` (so autograd through them lands in ``flat.grad``)."""
        return {n: t.view(shape) for n, t, shape in zip(self.names, flat.split(self.numels), self.shapes)}

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=self.dtype) if out is None else out
        return torch.cat([t.reshape(-1) for t in tensors], out=out) if out is not None else torch.cat([t.reshape(-1) for t in tensors])


try:  # what torch.autograd.grad calls after its argument checks (about 40 us a call on this CPU)
    from torch.autograd import Variable as _Variable

    _run_backward = _Variable._execution_engine.run_backward
except AttributeError:  # pragma: no cover - a torch without the engine handle: the public call
    _run_backward = None


def stage_grads(root: torch.Tensor, wrt: Sequence[torch.Tensor], grad: torch.Tensor | None,
                retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(root, wrt, grad, retain_graph=..., allow_unused=True)``.

    Called once per backward job, so it goes straight to the autograd engine: the public call's
    argument checks cost as much as a small stage's whole backward. ``grad=None`` means ``root`` is
    a scalar loss (gradient 1)."""
    if not wrt:
        return ()
    if _run_backward is None:
        return torch.autograd.grad(root, wrt, grad, retain_graph=retain_graph, allow_unused=True)
    if grad is None:
        if root.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        grad = torch.ones_like(root)
    return _run_backward((root,), (grad,), retain_graph, False, tuple(wrt), True, False)


def run_stage(module: nn.Module, params: dict[str, torch.Tensor] | None, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Apply a stage with its own parameters (``params=None``) or with the given tensors."""
    out = module(*inputs) if params is None else functional_call(module, params, tuple(inputs))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"a stage must return one tensor, got {_what(out)}")
    return out


def warm_up_meta() -> None:
    """Run common ops on the meta device once: their first use imports ``torch._dynamo`` (~1 s).

    The local launcher calls this before forking, so W workers do not import it all at once.
    """
    import torch._dynamo  # noqa: F401  (what the meta kernels import lazily)
    import torch.nn.functional as F

    with torch.no_grad():
        for dt in (torch.float32, torch.float64):
            x = torch.empty(2, 4, dtype=dt, device="meta")
            y = F.linear(x, torch.empty(3, 4, dtype=dt, device="meta"), torch.empty(3, dtype=dt, device="meta"))
            for f in (torch.tanh, F.relu, F.gelu, torch.sigmoid):
                f(y)
            F.layer_norm(y, (3,))
            F.softmax(y, -1)


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device: its structure, without storage."""
    return copy.deepcopy(module).to("meta")


# ---- a small staged MLP, for tests and examples -------------------------------------------------


class Block(nn.Module):
    """``tanh(x W + b)``: one stage of the test MLP."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def staged_mlp(
    stages: int, width: int = 8, d_in: int = 6, d_out: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0
) -> StagedModel:
    """A chain of ``stages`` tanh layers (the last one linear) with an MSE loss; deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    mods: list[nn.Module] = []
    for s in range(stages):
        a = d_in if s == 0 else width
        z = d_out if s == stages - 1 else width
        m: nn.Module = nn.Linear(a, z) if s == stages - 1 else Block(a, z)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
        mods.append(m.to(dtype))
    return StagedModel(mods, nn.functional.mse_loss)


def mlp_batches(
    microbatches: int, size: int = 4, d_in: int = 6, d_out: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0
) -> list[Batch]:
    """``microbatches`` random (input, target) pairs of ``size`` rows each."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [
        (torch.randn(size, d_in, generator=gen, dtype=dtype), torch.randn(size, d_out, generator=gen, dtype=dtype))
        for _ in range(microbatches)
    ]


# ---- the oracle ---------------------------------------------------------------------------------


def forward_all(model: StagedModel, x: torch.Tensor) -> list[torch.Tensor]:
    """Outputs of every stage for one micro-batch, through the stage graph."""
    outs: list[torch.Tensor] = []
    for s, m in enumerate(model.stages):
        preds = model.graph.preds[s]
        outs.append(run_stage(m, None, [outs[p] for p in preds] if preds else [x]))
    return outs


def reference_loss(model: StagedModel, batch: Batch, microbatches: int) -> torch.Tensor:
    """One micro-batch's contribution to the step loss: the sum of its sinks' losses over ``B``."""
    x, y = batch
    outs = forward_all(model, x)
    return sum(model.loss(outs[s], y) for s in model.graph.sinks) / microbatches


def reference_step(
    model: StagedModel, optimizer: torch.optim.Optimizer, microbatches: Sequence[Batch]
) -> tuple[list[torch.Tensor], float]:
    """Plain single-process training with gradient accumulation; returns per-stage flat grads and the loss."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch in microbatches:
        loss = reference_loss(model, batch, len(microbatches))
        loss.backward()
        total += float(loss.detach())
    grads = [
        torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in m.parameters()])
        if list(m.parameters())
        else torch.zeros(0)
        for m in model.stages
    ]
    optimizer.step()
    return grads, total


def flat_params(module: nn.Module) -> torch.Tensor:
    ps = [p.detach().reshape(-1) for p in module.parameters()]
    return torch.cat(ps) if ps else torch.zeros(0)
