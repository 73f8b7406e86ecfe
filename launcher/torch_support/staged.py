"""Staged models: a list of stage modules plus a loss on the last stage, how a stage is called,
and the copies of a stage the engine computes with.

A stage is called with the values it receives (:mod:`.values`): a source stage with the
micro-batch's input, any other with its predecessors' outputs in ``graph.preds`` order (``picks``
may select items of a tuple output per edge). A value is a tensor, or tuples, lists and dicts of
tensors and constants; floating-point tensors that require grad get a gradient back, the others
(token ids, masks) travel forward only. A loss stage's output goes to ``loss(output, target)``. The
loss of a step is the mean over micro-batches, so every micro-batch's loss is scaled by ``1/B``
before its backward.

Stages may hold buffers: constant ones (a rotary embedding's frequencies) are present wherever the
stage computes; BatchNorm's running statistics follow exact sequential semantics (:mod:`launcher.runtime.stats`).
A parameter shared by two stages (tied embeddings) gets the sum of both stages' gradients.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from launcher.schedule.graph import StageGraph

from .stage_errors import ModelError, staged_errors
from .torch_private import pytree
from .values import arguments, pick

Batch = tuple[Any, Any]  # (input, target) of one micro-batch: tensors, or tuples/lists/dicts of them
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Picks = dict[tuple[int, int], tuple[int, ...]]


@dataclass
class StagedModel:
    """The user's model, cut into stages; ``graph`` defaults to the chain ``0 -> ... -> S-1``.
    Stages may be built on the meta device: each worker materialises only those it owns (``init``).

    ``picks[(p, c)]``: the items of stage ``p``'s tuple output that stage ``c`` receives (default:
    the whole output), so a value only a later stage needs is sent straight to it."""

    stages: list[nn.Module]
    loss: Callable[[Any, Any], torch.Tensor]
    graph: StageGraph = None  # type: ignore[assignment]  # None: the chain, set by __post_init__
    picks: Picks | None = None
    #: stages built on the meta device: ``init(indices)`` materialises and initialises those
    #: stages by the model's rule (:mod:`.init`); None: each stage is a unit of
    #: :func:`~launcher.torch_support.init.init_units` under ``torch.initial_seed()``
    init: Callable[[Sequence[int]], None] | None = None

    def __post_init__(self) -> None:
        if self.graph is None and isinstance(self.stages, (list, tuple, nn.ModuleList)):
            self.graph = StageGraph.chain(len(self.stages))
        self.picks = dict(self.picks or {})
        found = staged_errors(self)
        if found:
            raise ModelError(found)

    @property
    def S(self) -> int:
        return len(self.stages)

    def edge(self, p: int, c: int) -> tuple[int, ...] | None:
        return self.picks.get((p, c)) if self.picks else None

    def received(self, s: int, outs: Sequence[Any], x: Any) -> list[Any]:
        """What stage ``s`` is called with, given every earlier stage's output and the input ``x``."""
        preds = self.graph.preds[s]
        return [pick(outs[p], self.edge(p, s)) for p in preds] if preds else [x]


def run_stage(module: nn.Module, params: Mapping[str, torch.Tensor] | None, values: Sequence[Any]) -> Any:
    """Apply a stage to the values it receives, with its own parameters (``params=None``) or with
    the given tensors (its buffers are its own either way)."""
    if len(values) == 1 and isinstance(values[0], torch.Tensor):  # the common case, without the unpacking
        return module(values[0]) if params is None else call_with(module, params, (values[0],), {})
    args, kwargs = arguments(values)
    return module(*args, **kwargs) if params is None else call_with(module, params, tuple(args), kwargs)


#: per module, where each of its parameters sits: ``(submodule._parameters, attribute, name, tied)``,
#: ``tied`` the first name of a parameter the module holds under several names. A cache keyed weakly
#: by the module it describes: an entry lives and dies with its module, so it neither grows with runs
#: nor outlives them
_BINDINGS: weakref.WeakKeyDictionary[nn.Module, list[tuple[dict, str, str, str]]] = weakref.WeakKeyDictionary()


def _bindings(module: nn.Module) -> list[tuple[dict, str, str, str]]:
    got = _BINDINGS.get(module)
    if got is None:
        first: dict[int, str] = {}
        got = []
        for name, p in module.named_parameters(remove_duplicate=False):
            path, _, attr = name.rpartition(".")
            got.append((module.get_submodule(path)._parameters, attr, name, first.setdefault(id(p), name)))
        _BINDINGS[module] = got
    return got


def call_with(module: nn.Module, params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` with ``params`` standing in for its parameters by name, as
    ``torch.func.functional_call`` does (a name left out keeps the module's own; a parameter held
    under two names takes the tensor given for either), without its cost per call: where each
    parameter sits is found once per module, so a call swaps a few dictionary entries in and back
    (``benchmarks/fetched_call.py`` measures both against the module's own parameters)."""
    binds = _bindings(module)
    kept = []
    try:
        for slot, attr, name, tied in binds:
            t = params.get(name)
            if t is None:
                t = params.get(tied)
            if t is not None:
                kept.append((slot, attr, slot[attr]))
                slot[attr] = t
        return module(*args, **kwargs)
    finally:
        for slot, attr, orig in kept:
            slot[attr] = orig


def as_meta(value: Any) -> Any:
    return pytree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                           if isinstance(x, torch.Tensor) else x, value)


def skeleton(module: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A copy of ``module`` to compute on fetched weights: its parameters on the meta device (the
    fetched tensors stand in for them), a copy of its buffers on ``device``. Parameters are never
    copied."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    memo.update({id(b): b.detach().to(device, copy=True) for b in module.buffers()})
    return copy.deepcopy(module, memo)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` entirely on the meta device, to learn what its stages return (never
    used to compute: a module that caches a tensor on first use would keep a meta tensor)."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)

