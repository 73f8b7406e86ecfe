"""What each module of a chain costs, measured on one process: the input of a partition by cost.

:func:`profile_chain` runs ``modules`` in turn on one example micro-batch, forward and backward,
as the engine runs stages (each module called with what the one before returned, its backward
stopped at its own inputs), a warm-up and a few timed repetitions, and gives per module a
:class:`ModuleCost`: the median forward and backward seconds, and the bytes a worker holds for it.
A parameter shared by several modules (a tied embedding) counts once, where it is first used.
Modules are profiled one at a time (a model built on the meta device, whose launching process holds
no weights, materialises one module at a time for it). The model is left as it was: its gradients,
and the random number generators (dropout draws from them), are restored afterwards.
"""

from __future__ import annotations

import statistics
import time
from copy import deepcopy
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..torch_support.staged import run_stage
from ..torch_support.torch_private import pytree
from ..torch_support.values import differentiable, nbytes

#: optimizer-state bytes per parameter byte: AdamW keeps two moments of every parameter
ADAM_STATE = 2


@dataclass(frozen=True)
class ModuleCost:
    """One module's measured cost per micro-batch: ``forward_s``/``backward_s`` (median seconds),
    ``params``/``grads``/``optimizer`` (bytes, AdamW-style state: twice the trainable parameters),
    ``activation`` (bytes held from its forward to its backward: its input plus the distinct
    tensors autograd saves, parameters excluded)."""

    forward_s: float
    backward_s: float
    params: int
    grads: int
    optimizer: int
    activation: int

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    def memory(self, inflight: int = 1) -> int:
        """Bytes a worker holds for this module with ``inflight`` micro-batches' activations live."""
        return self.params + self.grads + self.optimizer + inflight * self.activation

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(modules: Sequence[nn.Module]) -> torch.device | None:
    for m in modules:
        for p in m.parameters():
            return p.device
    return None


def _detach(value: Any) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """``value`` with each differentiable leaf a fresh leaf requiring grad, those leaves, and the
    originals they stand for (what the previous module's backward starts from)."""
    flat, tree = pytree.tree_flatten(value)
    out, leaves, origins = [], [], []
    for x in flat:
        if isinstance(x, torch.Tensor):
            if differentiable(x):
                origins.append(x)
                x = x.detach().requires_grad_(True)
                leaves.append(x)
            else:
                x = x.detach()
        out.append(x)
    return pytree.tree_unflatten(out, tree), leaves, origins


def _sum_output(out: Any) -> torch.Tensor:
    """A scalar to start the backward from when there is no loss: the sum of the outputs."""
    ts = [t for t in pytree.tree_leaves(out) if differentiable(t)]
    return torch.stack([t.float().sum() for t in ts]).sum() if ts else torch.zeros(())  # on the outputs' device


def _real(module: nn.Module, reset: Callable[[nn.Module], None] | None) -> nn.Module:
    """``module`` itself when its parameters are real; else a materialised, initialised copy (a
    model built on the meta device: the launching process holds one module at a time)."""
    from ..torch_support.init import has_meta, init_units

    if not has_meta(module):
        return module
    copy = deepcopy(module)  # meta parameters: nothing is copied but their shapes
    init_units([copy], 0, reset=reset)
    return copy


def _timed(fn: Callable[[], Any], device: torch.device | None) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def profile_chain(modules: Sequence[nn.Module], example: Any, loss: Callable[[Any, Any], torch.Tensor] | None = None,
                  target: Any = None, warmup: int = 1, repeat: int = 3, min_seconds: float = 0.1,
                  max_repeat: int = 30, reset: Callable[[nn.Module], None] | None = None) -> list[ModuleCost]:
    """Per module of the chain, its :class:`ModuleCost` on the micro-batch input ``example`` (and
    ``target`` for ``loss(output, target)``, which the last module's output goes into; without a
    loss the backward starts from the output's sum). Modules are profiled one at a time, each on
    the previous one's output, its backward seeded with ones (its cost does not depend on the
    values). At least ``repeat`` timed repetitions, more (up to ``max_repeat``) until they took
    ``min_seconds``: a fast module is timed often enough that a descheduled repetition does not
    move the median. A module on the meta device is profiled on a materialised copy (``reset``:
    how the model initialises one, :func:`launcher.torch_support.init.init_units`)."""
    modules = list(modules)
    n = len(modules)
    out_costs = []
    seen: set[int] = set()
    value: Any = example
    with torch.random.fork_rng(devices=[d for d in [_device_of(modules)] if d is not None and d.type == "cuda"]):
        for i, original in enumerate(modules):
            m = _real(original, reset)
            device = _device_of([m])
            kept = {id(p): p.grad for p in m.parameters()}
            fwd: list[float] = []
            bwd: list[float] = []
            activation = 0
            spent, rep = 0.0, 0
            out: Any = None
            while rep < warmup + max(1, repeat) or (spent < min_seconds and rep < warmup + max_repeat):
                x, leaves, _ = _detach(value) if i > 0 else (value, [], [])
                store: dict[int, int] = {}
                ids = {p.untyped_storage().data_ptr() for p in m.parameters()}

                def pack(t: torch.Tensor, store: dict[int, int] = store, ids: set[int] = ids) -> torch.Tensor:
                    st = t.untyped_storage()
                    if st.data_ptr() not in ids:
                        store[st.data_ptr()] = st.nbytes()
                    return t

                def forward() -> tuple[Any, Any]:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        y = run_stage(m, None, [x])
                        return y, (loss(y, target) if loss is not None else _sum_output(y)) if i == n - 1 else y

                (out, root), f_s = _timed(forward, device)
                roots = [root] if i == n - 1 else [t for t in pytree.tree_leaves(root) if differentiable(t)]
                roots = [r for r in roots if r.requires_grad]
                seeds = [None] if i == n - 1 else [torch.ones_like(r) for r in roots]
                _, b_s = _timed(lambda: torch.autograd.backward(roots, seeds) if roots else None, device)
                if rep == warmup:  # bytes once: the same every repetition
                    inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(x)
                              if isinstance(t, torch.Tensor)}
                    activation = nbytes(x) + sum(b for p, b in store.items() if p not in inputs)
                if rep >= warmup:
                    fwd.append(f_s)
                    bwd.append(b_s)
                    spent += f_s + b_s
                for p in m.parameters():
                    p.grad = None
                rep += 1
            for p in m.parameters():
                p.grad = kept[id(p)]
            value = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            own = [p for p in original.parameters() if id(p) not in seen]
            seen.update(id(p) for p in original.parameters())
            pb = sum(p.numel() * p.element_size() for p in own)
            gb = sum(p.numel() * p.element_size() for p in own if p.requires_grad)
            out_costs.append(ModuleCost(statistics.median(fwd), statistics.median(bwd), pb, gb, ADAM_STATE * gb,
                                        activation))
    return out_costs
