"""The check that a split's stages compute what the module computes: both run on the example with
the same random draws, in train and in eval mode, and must agree bit for bit (or within a few ulps
where a kernel is not deterministic), every mode and buffer of the module put back afterwards.
Where they do not, both run again with every ATen op recorded, and the refusal names the first op
whose result differs and the module it ran in."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from launcher.split.capture import SplitError
from launcher.torch_support.torch_private import dispatch_mode_base, pytree

_SEED = 20240517  # both runs of a check draw the same dropout masks
_ULPS = 16


@contextlib.contextmanager
def kept(module: nn.Module) -> Iterator[None]:
    """Put back the train/eval mode of every submodule, and every buffer's value (a forward in
    train mode updates BatchNorm's statistics), as they were."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def seeded(fn: Callable[[], Any], args: tuple, module: nn.Module, grad: bool = True) -> Any:
    """``fn()`` with the RNG seeded, and the RNG state as it was afterwards."""
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)] + list(module.parameters())
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.set_grad_enabled(grad):
        torch.manual_seed(_SEED)
        return fn()


def check_same(want: Any, got: Any, mode: str, module: nn.Module, stages: int,
               again: tuple[Callable[[], Any], Callable[[], Any]] | None = None) -> None:
    """Refuse a split whose output differs from the module's. ``again``: the module's run and the
    stages' run (each seeded as before), to find the first op that differs (:func:`first_difference`)."""
    w, wspec = pytree.tree_flatten(want)
    g, gspec = pytree.tree_flatten(got)
    if wspec != gspec:
        differs = f"return {_what(got)} where it returns {_what(want)}"
    else:
        bad = [(a, b) for a, b in zip(w, g) if not _equal(a, b)]
        if not bad:
            return
        gap = _gap(*bad[0])
        differs = "differ from its output" + (f" by up to {gap:.3g}" if gap is not None else "")
    first = first_difference(module, *again) if again is not None else None
    at = f", first at {first}" if first else ""
    raise SplitError(f"the {stages} stages of {type(module).__name__} {differs} in {mode} mode{at}, so its "
                     f"forward does something the traced graph does not capture; give the model as a list of stage "
                     f"modules (self.stages) instead.")


class _Ops(dispatch_mode_base()):  # type: ignore[misc]  # a class the function returns
    """Records every ATen op that runs: its name, the module it ran in (where ``paths`` are
    tracked) and copies of its tensor results."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, list[torch.Tensor]]] = []
        self.where: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        results = [t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.log.append((str(func.overloadpacket.__name__), self.where[-1] if self.where else "", results))
        return out


def _recorded(fn: Callable[[], Any], module: nn.Module | None = None) -> list[tuple[str, str, list[torch.Tensor]]]:
    """The ops ``fn()`` runs; with ``module``, each with the path and class of the innermost of
    its submodules it ran in."""
    names = {id(m): f"{p!r} ({type(m).__name__})" if p else f"{type(m).__name__}'s own code"
             for p, m in module.named_modules()} if module is not None else {}
    rec = _Ops()
    handles = []
    if module is not None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(m: nn.Module, args: Any) -> None:
            if id(m) in names:
                rec.where.append(names[id(m)])

        def leave(m: nn.Module, args: Any, out: Any) -> None:
            if id(m) in names and rec.where:
                rec.where.pop()

        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with rec:
            fn()
    finally:
        for h in handles:
            h.remove()
    return rec.log


def first_difference(module: nn.Module, want: Callable[[], Any], got: Callable[[], Any]) -> str | None:
    """``aten.lstm in 'rnn' (LSTM)``: the first op of the module's run (``want``) whose result the
    stages' run (``got``) does not reproduce, or ``None`` if none is found. The stages run the same
    ops in the same order, less the ones whose results are unused and plus constants each stage
    computes again: an op of the module's run is matched with the next op of that name in the
    stages' run, a few ops ahead at most."""
    try:
        a, b = _recorded(want, module), _recorded(got)
    except Exception:  # noqa: BLE001 - a run that fails when recorded: the refusal goes on without it
        return None
    j = 0
    for op, where, results in a:
        ahead = next((k for k in range(j, min(j + 64, len(b))) if b[k][0] == op), None)
        if ahead is None:
            continue  # an op the graph dropped (a view nothing reads): skipped
        j = ahead + 1
        theirs = b[ahead][2]
        if len(theirs) != len(results) or not all(_equal(x, y) for x, y in zip(results, theirs)):
            return f"aten.{op} in {where}"
    return None


def _equal(a: Any, b: Any) -> bool:
    """Bit for bit, or within ``_ULPS`` ulps of the tensor's scale (a kernel that is not
    deterministic, as some GPU kernels are, cannot do better)."""
    if not isinstance(a, torch.Tensor):
        return not isinstance(b, torch.Tensor) and bool(a == b)
    if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or not a.numel():
        return False
    eps = _ULPS * torch.finfo(a.dtype).eps
    scale = max(1.0, a.detach().abs().max().item())
    return torch.allclose(b, a, rtol=eps, atol=eps * scale, equal_nan=True)


def _gap(a: Any, b: Any) -> float | None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.numel():
        return (a.detach().double() - b.detach().double()).abs().max().item()
    return None


def _what(x: object) -> str:
    n = f" of {len(x)}" if isinstance(x, (tuple, list, dict)) else ""
    return f"a {type(x).__name__}{n}"
