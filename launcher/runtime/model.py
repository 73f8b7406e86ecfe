"""Staged models: a list of stage modules plus a loss on the last stage, and the oracle.

A stage is called with the values it receives (:mod:`.values`): a source stage with the
micro-batch's input, any other with its predecessors' outputs in ``graph.preds`` order (``picks``
may select items of a tuple output per edge). A value is a tensor, or tuples, lists and dicts of
tensors and constants; floating-point tensors that require grad get a gradient back, the others
(token ids, masks) travel forward only. A loss stage's output goes to ``loss(output, target)``. The
loss of a step is the mean over micro-batches, so every micro-batch's loss is scaled by ``1/B``
before its backward.

Stages may hold buffers: constant ones (a rotary embedding's frequencies) are present wherever the
stage computes; BatchNorm's running statistics follow exact sequential semantics (:mod:`.stats`).
A parameter shared by two stages (tied embeddings) gets the sum of both stages' gradients.
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.func import functional_call

from launcher.schedule.graph import StageGraph

from .torch_private import autograd_run_backward, import_dynamo
from .values import Signature, arguments, describe, pick, to_device, unsupported

Batch = tuple[Any, Any]  # (input, target) of one micro-batch: tensors, or tuples/lists/dicts of them
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Picks = dict[tuple[int, int], tuple[int, ...]]


class ModelError(ValueError):
    """A model the runtime cannot train; ``sentences`` holds one sentence per problem."""

    def __init__(self, sentences: Sequence[str]):
        self.sentences = list(sentences)
        super().__init__("\n".join(self.sentences))


@dataclass
class StagedModel:
    """The user's model, cut into stages; ``graph`` defaults to the chain ``0 -> ... -> S-1``.
    Stages may be built on the meta device: each worker materialises only those it owns (``init``).

    ``picks[(p, c)]``: the items of stage ``p``'s tuple output that stage ``c`` receives (default:
    the whole output), so a value only a later stage needs is sent straight to it."""

    stages: list[nn.Module]
    loss: Callable[[Any, Any], torch.Tensor]
    graph: StageGraph | None = None
    picks: Picks | None = None
    #: stages built on the meta device: ``init(indices)`` materialises and initialises those
    #: stages by the model's rule (:mod:`.init`); None: each stage is a unit of
    #: :func:`~launcher.runtime.init.init_units` under ``torch.initial_seed()``
    init: Callable[[Sequence[int]], None] | None = None

    def __post_init__(self) -> None:
        if self.graph is None and isinstance(self.stages, (list, tuple, nn.ModuleList)):
            self.graph = StageGraph.chain(len(self.stages))
        self.picks = dict(self.picks or {})
        found = _own_errors(self)
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


_what = describe


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
    preds = model.graph.preds if model.graph is not None else ()
    for (p, c) in model.picks or {}:
        if not (0 <= c < len(preds) and p in preds[c]):
            out.append(f"picks names the edge {p}->{c}, which is not an edge of the stage graph.")
    for s, m in enumerate(stages):
        if not isinstance(m, nn.Module):
            out.append(f"stage {s} is {_what(m)}, not a torch.nn.Module.")
            continue
        dtypes = {p.dtype for p in m.parameters()}
        if len(dtypes) > 1:
            out.append(f"stage {s} ({type(m).__name__}) mixes parameter dtypes {sorted(map(str, dtypes))}; use one "
                       f"dtype per stage.")
    return out


def returns_error(s: int, out: object, where: str, module: nn.Module | None = None) -> str | None:
    """The sentence for a stage whose output cannot be passed on; ``None`` when it can."""
    bad = unsupported(out)
    if bad is None:
        return None
    name = f" ({type(module).__name__})" if module is not None else ""
    return (f"stage {s}{name} returned {_what(out)} holding a {bad} {where}; a stage returns tensors, or tuples, "
            f"lists and dicts of tensors and constants.")


def model_errors(model: object, stages: int, example: Any = None) -> list[str]:
    """Everything that would stop the runtime from training ``model`` as a step of ``stages``
    stages, one sentence per problem, found before any worker starts.

    With ``example`` (one micro-batch's input) the stages also run on the meta device, which
    costs no memory or compute, to find a stage that fails or returns something it cannot pass
    on. A stage that cannot run on meta only for want of a meta kernel is not reported here: it
    fails on real data with its own error.
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


def meta_errors(model: StagedModel, example: Any) -> str | None:
    """Run ``model``'s stages on meta-device copies of themselves and of ``example``; the sentence
    for the first stage that raises or returns something it cannot pass on."""
    try:
        signatures(model, [as_meta(example)])
    except NoMeta:  # an op without a meta kernel, or one that reads values: run the stages for real
        try:
            real_signatures(model, example)
        except ModelError as e:
            return e.sentences[0]
    except ModelError as e:
        return e.sentences[0]
    return None


def as_meta(value: Any) -> Any:
    from .torch_private import pytree

    return pytree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                           if isinstance(x, torch.Tensor) else x, value)


class NoMeta(Exception):
    """A stage cannot run on the meta device (an op without a meta kernel, or one that reads
    tensor values, such as ``.item()``): its shapes must come from a run on real data."""


def _is_meta_failure(e: BaseException) -> bool:
    return isinstance(e, NotImplementedError) or "meta" in str(e)


def real_signatures(model: StagedModel, x: Any) -> list[Signature]:
    """:func:`signatures` from running the stages themselves on one real micro-batch input, in
    eval mode (no statistics updated, no dropout drawn) and without keeping the outputs.

    Remembered per model, input signature and autocast state: the launching process runs it once
    before the fork and every worker inherits the answer instead of running the model again (a
    real run holds one stage's weights at a time, which at scale is most of a worker's margin)."""
    key = (Signature.of(x), tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))
    known = vars(model).setdefault("_real_signatures", {})
    if key in known:
        return known[key]
    modes = [m.training for m in model.stages]
    for m in model.stages:
        m.eval()
    try:
        known[key] = signatures(model, [x], list(model.stages), meta=False)[0]
    finally:
        for m, mode in zip(model.stages, modes):
            m.train(mode)
        trim_heap()
    return known[key]


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise): a process about to
    fork workers would pass them on, and a worker's measured peak would count them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def signatures(model: StagedModel, inputs: Sequence[Any], copies: list[nn.Module] | None = None,
               meta: bool = True) -> list[list[Signature]]:
    """The :class:`Signature` of every stage's output for each input (meta tensors of a micro-batch's
    input), by running meta-device copies of the stages with gradients on, so a leaf's signature
    says whether a gradient flows back through it. Raises :class:`ModelError` naming a stage that
    fails or returns something it cannot pass on (the stage's exception is its ``__cause__``)."""
    copies = copies if copies is not None else [meta_copy(m) for m in model.stages]
    out: list[list[Signature]] = []
    for x in inputs:
        outs: list[Any] = []
        with torch.enable_grad():
            for s, m in enumerate(copies):
                values = model.received(s, outs, x)
                params = None
                if not meta:  # each stage where its weights are
                    params = _zeros_for_meta(m)
                    dev = torch.device("cpu") if params else next((t.device for t in m.parameters()), None)
                    values = [to_device(v, dev) for v in values] if dev is not None else values
                try:
                    y = run_stage(m, params, values)
                except Exception as e:  # noqa: BLE001 - the user's code: one sentence naming the stage
                    if meta and _is_meta_failure(e):
                        raise NoMeta(str(e)) from e
                    raise ModelError([f"stage {s} ({type(model.stages[s]).__name__}) raised "
                                      f"{type(e).__name__} on an input of {_shapes(x)}: "
                                      f"{_one_line(e).rstrip('.')}."]) from e
                err = returns_error(s, y, f"on an input of {_shapes(x)}", model.stages[s])
                if err:
                    raise ModelError([err])
                # cut the graph after each stage: a real run's outputs would otherwise keep every
                # stage's stand-in weights alive (saved for backward), the whole model at once
                outs.append(y if meta else _cut(y))
                del y, params
        out.append([Signature.of(y) for y in outs])
    return out


def _cut(value: Any) -> Any:
    """``value`` detached from its graph, each tensor still requiring a gradient where it did."""
    from .torch_private import pytree

    return pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad)
                           if isinstance(t, torch.Tensor) else t, value)


def _zeros_for_meta(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Zeros standing in for a stage's parameters while they are on the meta device (built on
    meta, owned elsewhere): its shapes come from a real run, one stage's worth of memory at a time."""
    named = dict(module.named_parameters())
    if not any(p.is_meta for p in named.values()):
        return None
    # as the real ones require grad, so do the zeros: the signatures say which outputs carry a gradient
    return {n: torch.zeros(p.shape, dtype=p.dtype, requires_grad=p.requires_grad) for n, p in named.items()}


def _shapes(x: Any) -> str:
    from .torch_private import pytree

    return "shape " + repr(pytree.tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, x))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("..." if len(text) > 300 else "")


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
        return (torch.cat([t.reshape(-1) for t in tensors], out=out) if out is not None
                else torch.cat([t.reshape(-1) for t in tensors]))


# what torch.autograd.grad calls after its argument checks (about 40 us a call on this CPU); None: a
# torch without the engine handle, which takes the public call
_run_backward = autograd_run_backward()


def _seeds(roots: Sequence[torch.Tensor | GradientEdge],
           grads: Sequence[torch.Tensor] | None) -> Sequence[torch.Tensor]:
    """The gradients a backward starts from: ``grads``, or 1 for a single scalar loss."""
    if grads is not None:
        return grads
    if not isinstance(roots[0], torch.Tensor) or roots[0].numel() != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    return (torch.ones_like(roots[0]),)


def stage_grads(roots: Sequence[torch.Tensor | GradientEdge], wrt: Sequence[torch.Tensor | GradientEdge],
                grads: Sequence[torch.Tensor] | None, retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, wrt, grads, retain_graph=..., allow_unused=True)``.

    Called once per backward job, so it goes straight to the autograd engine: the public call's
    argument checks cost as much as a small stage's whole backward. ``grads=None`` means ``roots``
    is one scalar loss tensor (gradient 1). Roots and ``wrt`` may be graph edges, as for
    ``torch.autograd.grad``."""
    if not wrt:
        return ()
    if not roots:  # nothing differentiable reaches the stage's output: every gradient is zero
        return (None,) * len(wrt)
    grads = _seeds(roots, grads)
    if _run_backward is None:
        return torch.autograd.grad(tuple(roots), wrt, tuple(grads), retain_graph=retain_graph, allow_unused=True)
    return _run_backward(tuple(roots), tuple(grads), retain_graph, False, tuple(wrt), True, False)


def stage_grads_into(roots: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                     into: Sequence[torch.Tensor],
                     grads: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``leaves``, as :func:`stage_grads` gives them, while each of ``targets``'s
    gradients is added in place into its tensor of ``into`` (same shape) during the backward.

    Autograd's own accumulation (``AccumulateGrad``: ``grad += new``) adds a weight's gradient as
    soon as it is computed, while it is still in cache; adding the returned gradients after the
    backward reads them back from memory (a 6-block Llama stage, 8 micro-batches: 20 ms a step
    against 6). The targets' ``.grad`` point at ``into`` only during the call."""
    if not roots:  # nothing differentiable reaches the stage's output: nothing to add
        return (None,) * len(leaves)
    grads = _seeds(roots, grads)
    before = [t.grad for t in targets]
    for t, g in zip(targets, into):
        t.grad = g
    try:
        if _run_backward is None:
            torch.autograd.backward(tuple(roots), tuple(grads), inputs=[*leaves, *targets])
        else:
            _run_backward(tuple(roots), tuple(grads), False, False, (*leaves, *targets), True, True)
    finally:
        for t, g in zip(targets, before):
            t.grad = g
    out = tuple(leaf.grad for leaf in leaves)
    for leaf in leaves:
        leaf.grad = None
    return out


def run_stage(module: nn.Module, params: dict[str, torch.Tensor] | None, values: Sequence[Any]) -> Any:
    """Apply a stage to the values it receives, with its own parameters (``params=None``) or with
    the given tensors (its buffers are its own either way)."""
    if len(values) == 1 and isinstance(values[0], torch.Tensor):  # the common case, without the unpacking
        return module(values[0]) if params is None else functional_call(module, params, (values[0],))
    args, kwargs = arguments(values)
    return module(*args, **kwargs) if params is None else functional_call(module, params, tuple(args), kwargs)


def warm_up_meta() -> None:
    """Run common ops on the meta device once: their first use imports ``torch._dynamo`` (~1 s).

    The local launcher calls this before forking, so W workers do not import it all at once.
    """
    import torch.nn.functional as F

    import_dynamo()  # what the meta kernels import lazily

    with torch.no_grad():
        for dt in (torch.float32, torch.float64):
            x = torch.empty(2, 4, dtype=dt, device="meta")
            y = F.linear(x, torch.empty(3, 4, dtype=dt, device="meta"), torch.empty(3, dtype=dt, device="meta"))
            for f in (torch.tanh, F.relu, F.gelu, torch.sigmoid):
                f(y)
            F.layer_norm(y, (3,))
            F.softmax(y, -1)


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


def forward_all(model: StagedModel, x: Any) -> list[Any]:
    """Outputs of every stage for one micro-batch, through the stage graph."""
    outs: list[Any] = []
    for s, m in enumerate(model.stages):
        outs.append(run_stage(m, None, model.received(s, outs, x)))
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
