"""What every stage of a staged model returns (its :class:`~launcher.torch_support.values.Signature`),
found by running the stages on the meta device, or once on real data where a stage cannot run there.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch
from torch import nn

from .stage_errors import ModelError, returns_error
from .staged import StagedModel, meta_copy, run_stage
from .torch_private import import_dynamo, pytree
from .values import Signature, to_device


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
    return "shape " + repr(pytree.tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, x))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("..." if len(text) > 300 else "")


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
