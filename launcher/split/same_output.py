"""The check that a split's stages compute what the module computes: both run on the example with
the same random draws, in train and in eval mode, and must agree bit for bit (or within a few ulps
where a kernel is not deterministic), every mode and buffer of the module put back afterwards."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from launcher.runtime.torch_private import pytree
from launcher.split.capture import SplitError

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


def check_same(want: Any, got: Any, mode: str, module: nn.Module, stages: int) -> None:
    """Refuse a split whose output differs from the module's."""
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
    raise SplitError(f"the {stages} stages of {type(module).__name__} {differs} in {mode} mode, so its "
                     f"forward does something the traced graph does not capture; give the model as a list of stage "
                     f"modules (self.stages) instead.")


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
