"""Bytes the autograd graph of a stage's forward keeps for its backward (activation memory beyond
the stage's input ``x_s^b``), counted the same way when measured and when predicted.

:class:`SavedBytes` wraps a forward in :func:`torch.autograd.graph.saved_tensors_hooks` and counts
each distinct storage a saved tensor lives in once, except the storages it is told to skip: the
stage's parameters (or its fetched flat copy of them), its buffers, its own inputs (``x_s^b``,
counted already) and, on a loss stage, the target (data, like the input). :func:`stage_saved_bytes`
finds the same number per stage once, before anything runs, by running the stages on fake tensors
of the engine's device (no memory, but the device's own kernels: a CPU attention saves what the CPU
kernel saves, which a meta-device run would not), and, for a stage that cannot run on fake tensors,
by one real forward with gradients.

The engine does not hook every forward: a Python hook per saved tensor costs a transformer block a
few percent of its step. :class:`GraphCounts` keeps each count by what decides it (stage, input
shapes and dtypes, grad mode, autocast, ...), since a graph over inputs of the same shapes saves the
same storages; a key is counted until two counts agree, and again on the engine's check steps.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from ..torch_support.torch_private import fake_tensor_mode, pytree, storage_key


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage ``t`` lives in (views share it); meta and fake tensors included."""
    return storage_key(t)


def tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


class SavedBytes:
    """Context manager: ``nbytes`` of the distinct storages autograd saves inside it, except
    those of ``skip`` (tensors whose storages are counted elsewhere)."""

    def __init__(self, skip: Iterable[torch.Tensor] = ()) -> None:
        self.seen = {storage_id(t) for t in skip}
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = storage_id(t)
        if sid not in self.seen:  # the graph keeps the whole storage alive, whatever view it saved
            self.seen.add(sid)
            self.nbytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class Known:
    """Stands for a :class:`SavedBytes` whose count is already known: hooks nothing."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __enter__(self) -> "Known":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Recording(SavedBytes):
    """A :class:`SavedBytes` that hands its count to a :class:`GraphCounts` when its forward ends."""

    def __init__(self, counts: "GraphCounts", key: Any, skip: Iterable[torch.Tensor]) -> None:
        super().__init__(skip)
        self.counts, self.key = counts, key

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if exc[0] is None:
            self.counts.record(self.key, self.nbytes)


class GraphCounts:
    """Saved bytes per forward key, so a forward seen before runs without hooks.

    A key holds everything that decides which storages a stage's graph saves beyond its skipped
    ones (its input leaves' shapes, dtypes and ``requires_grad``, the target's, grad mode, autocast,
    training mode, ...): the skip set (weights, buffers, inputs, target) is new every call but
    plays the same part for equal shapes, so the count is the same. A key is trusted once two counts
    in a row agree (a first call that builds a cache, or a graph whose size depends on values,
    such as routing, keeps being counted), and counted again whenever ``recount`` is asked for (the
    engine's check steps); a differing recount withdraws the trust. ``key=None``: always counted."""

    def __init__(self) -> None:
        self.entries: dict[Any, tuple[int, bool]] = {}  # key -> (bytes, trusted)
        self.taken = 0  # forwards counted (hooked)

    def counter(self, key: Any, recount: bool, skip: Any) -> "SavedBytes | Known":
        """A context manager whose ``nbytes`` is the forward's saved bytes: the cached count, or a
        :class:`SavedBytes` over ``skip()`` (called only then) that records what it counts."""
        if not recount and key is not None:
            entry = self.entries.get(key)
            if entry is not None and entry[1]:
                return Known(entry[0])
        self.taken += 1
        return _Recording(self, key, skip())

    def record(self, key: Any, nbytes: int) -> None:
        if key is None:
            return
        entry = self.entries.get(key)
        self.entries[key] = (nbytes, entry is not None and entry[0] == nbytes)


def state_of(module: nn.Module) -> list[torch.Tensor]:
    """A stage's parameters and buffers: model state, not activations."""
    return [*module.parameters(), *module.buffers()]


def stage_saved_bytes(model: Any, x: Any, y: Any, copies: Sequence[nn.Module], device: torch.device) -> list[int]:
    """Per stage, the bytes its forward (and, on a loss stage, the loss) saves for the backward for
    one micro-batch ``(x, y)``, as :class:`SavedBytes` counts it in the engine. ``copies``: the
    stages' meta-device copies (only their shapes are read)."""
    try:
        return _fake_run(model, x, y, copies, device)
    except Exception:  # noqa: BLE001 - an op without a fake kernel, or one that reads values
        return _real_run(model, x, y, device)


def _fake_run(model: Any, x: Any, y: Any, copies: Sequence[nn.Module], device: torch.device) -> list[int]:
    mode = fake_tensor_mode()

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    def fake_value(v: Any) -> Any:
        return pytree.tree_map(lambda t: fake(t) if isinstance(t, torch.Tensor) else t, v)

    out: list[int] = []
    with mode, torch.enable_grad():
        xf, yf = fake_value(x), fake_value(y)
        outs: list[Any] = []
        for s, m in enumerate(copies):
            state = {k: fake(p).requires_grad_(p.requires_grad) for k, p in m.named_parameters()}
            state.update({k: fake(b) for k, b in m.named_buffers()})
            values = [_leafy(v) for v in model.received(s, outs, xf)]
            sink = s in model.graph.sinks and y is not None
            with SavedBytes([*state.values(), *tensors(values), *(tensors(yf) if sink else [])]) as counted:
                o = _call(m, state, values)
                if sink:
                    model.loss(o, yf)
            out.append(counted.nbytes)
            outs.append(o)
    return out


def _real_run(model: Any, x: Any, y: Any, device: torch.device) -> list[int]:
    """One real forward with gradients, in training mode as the step runs it; the random state and
    every buffer (BatchNorm's statistics) are put back afterwards."""
    from ..torch_support.values import to_device

    stages = list(model.stages)
    kept = [[b.detach().clone() for b in m.buffers()] for m in stages]
    devices = [device.index or 0] if device.type == "cuda" else []
    out: list[int] = []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            outs: list[Any] = []
            for s, m in enumerate(stages):
                dev = next((t.device for t in m.parameters()), device)
                values = [_leafy(to_device(v, dev)) for v in model.received(s, outs, x)]
                sink = s in model.graph.sinks and y is not None
                yd = to_device(y, dev) if sink else None
                with SavedBytes([*state_of(m), *tensors(values), *tensors(yd)]) as counted:
                    o = _call(m, None, values)
                    if sink:
                        model.loss(o, yd)
                out.append(counted.nbytes)
                outs.append(o)
    finally:
        with torch.no_grad():
            for m, bufs in zip(stages, kept):
                for b, v in zip(m.buffers(), bufs):
                    b.copy_(v)
    return out


def _call(m: nn.Module, state: dict | None, values: list[Any]) -> Any:
    from ..torch_support.staged import run_stage

    if state is None:
        return run_stage(m, None, values)
    from ..torch_support.values import arguments

    args, kwargs = arguments(values)
    return functional_call(m, state, tuple(args), kwargs)


def _leafy(v: Any) -> Any:
    """A stage input as the engine gives it: detached, each a leaf of its own that requires grad
    where the value it came from did (a gradient goes back through it)."""
    return pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad)
                           if isinstance(t, torch.Tensor) else t, v)
