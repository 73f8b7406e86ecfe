"""Models too large for one process: built on the meta device, materialised where they are owned.

- :func:`empty_init`: a module built inside has its parameters on the meta device (no storage, no
  initialisation: Lightning's ``init_module(empty_init=True)`` and torchtitan's meta init), while
  its buffers stay real (a rotary embedding's frequencies, BatchNorm's statistics: small, and
  computed by the constructor, which a meta tensor would lose).
- :func:`init_units`: the initialisation rule every path follows, so a worker that materialises
  only the stages it owns gets exactly what single-device training starts from. The model's layers
  are its *units* (the modules of ``self.stages``); unit ``i`` is initialised under an RNG seeded
  from ``(seed, i)`` alone, so its values do not depend on how units are grouped into stages, nor
  on which other units a process holds. A parameter several units share (a tied embedding) takes
  the value its first unit gives it.

A unit is initialised by the model's ``reset_stage(module)`` when it has one (Hugging Face models:
the library's own ``_init_weights``), else by ``reset_parameters()`` of every submodule that has
it, in module order (what ``torch.nn`` layers do in their constructors).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from .torch_private import parameter_dict

Reset = Callable[[nn.Module], None]
_REGISTER = nn.Module.register_parameter  # torch's own, whatever context is active


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay where they are made."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def real_init() -> Iterator[None]:
    """Inside :func:`empty_init`, parameters that must be real after all (weights loaded from a
    checkpoint): torch's own registration while it lasts."""
    current = nn.Module.register_parameter
    nn.Module.register_parameter = _REGISTER  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = current  # type: ignore[method-assign]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device (not materialised yet)."""
    return any(p.is_meta for p in module.parameters())


def unit_seed(seed: int, index: int) -> int:
    """The RNG seed of unit ``index`` under the run's ``seed`` (distinct units, distinct streams)."""
    return (int(seed) * 1_000_003 + 7_919 * (index + 1)) % (2**63 - 1)


def materialize(module: nn.Module, device: torch.device | str = "cpu",
                memo: dict[int, nn.Parameter] | None = None) -> None:
    """Give every meta parameter of ``module`` uninitialised storage on ``device``, in place; a
    parameter met twice (shared, also across calls through ``memo``) becomes one parameter.
    Buffers are left as they are (``Module.to_empty`` would empty them too)."""
    memo = {} if memo is None else memo
    for m in module.modules():
        own = parameter_dict(m)
        for name, p in list(own.items()):
            if p is None or not p.is_meta:
                continue
            new = memo.get(id(p))
            if new is None:
                new = memo[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            own[name] = new


def default_reset(module: nn.Module) -> None:
    """``reset_parameters()`` of every submodule that has one, in module order."""
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def init_units(units: Sequence[nn.Module], seed: int, indices: Sequence[int] | None = None,
               reset: Reset | None = None, device: torch.device | str = "cpu") -> None:
    """Materialise (where on meta) and initialise ``units[i]`` for ``i`` in ``indices`` (default:
    all) by the rule of the module doc. A shared parameter whose first unit is not among
    ``indices`` is left for its first unit's holder to hand over (the engine does, at set-up)."""
    reset = reset or default_reset
    chosen = range(len(units)) if indices is None else sorted(set(indices))
    first: dict[int, int] = {}  # parameter -> the first unit holding it
    for i, u in enumerate(units):
        for p in u.parameters():
            first.setdefault(id(p), i)
    # per unit, the first holder of each of its parameters (read before they become new objects)
    firsts = {i: [first[id(p)] for p in units[i].parameters()] for i in chosen}
    memo: dict[int, nn.Parameter] = {}
    for i in chosen:
        materialize(units[i], device, memo)
    for i in chosen:
        u = units[i]
        # shared parameters an earlier unit set already: kept through this unit's reset
        kept = [(p, p.detach().clone()) for p, f in zip(u.parameters(), firsts[i]) if f < i and f in chosen]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(unit_seed(seed, i))
            reset(u)
            for p, v in kept:
                p.copy_(v)
