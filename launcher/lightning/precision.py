"""Precision and clipping under the engine: the compute dtype a precision plugin gives, the
gradient norm across owners (each parameter counted once, as one device's ``clip_grad_norm_``
counts it), 16-mixed's GradScaler agreeing across workers, and the dtype the loss is reported in.
Lightning clips and scales in its precision plugin, so the strategy retypes that plugin once
(:func:`with_global_clipping`, :func:`with_synced_scaler`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..runtime.engine import Engine
from ..runtime.failure import blocked, current_watchdog
from ..torch_support.torch_private import FoundInfHookScaler, retype_grad_scaler
from .lightning_private import retype_precision_plugin

if TYPE_CHECKING:
    from .strategy import UnifiedStrategy


def compute_dtype(plugin: Any) -> torch.dtype | None:
    """The engine's compute dtype for a precision plugin: bf16 or fp16 under Lightning's
    ``MixedPrecision`` (autocast over fp32 master weights), else None (the weights' own dtype,
    as under ``bf16-true``, whose module is converted)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    if isinstance(plugin, MixedPrecision):
        return torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
    return None


def norm_is_local(engine: Engine) -> bool:
    """Whether every worker holds every parameter's whole gradient after the step (every rank of
    the group a worker that owns every stage, as under DDP): the global norm is then each worker's
    own, computed alike on every worker from the same reduced bits, with no collective."""
    W = engine.lowered.workers
    return engine.worker is not None and dist.get_world_size(engine.group) == W \
        and all(len(owners) == W for owners in engine.lowered.owners)


def clipped_gradients(engine: Engine, grads: dict[int, dict[int, torch.Tensor]] | None = None,
                      local: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This worker's share of the global gradient norm, and the gradients it scales.

    ``counted``: every parameter's gradient once over all workers, as one device's module lists it:
    by its stage's first owner (replicas hold equal copies), and a parameter several stages share
    (tied embeddings, :attr:`Engine.ties`) only at its first use, ``min(uses)`` (every use holds the
    same summed gradient, :meth:`GradTotals.sum_tied`). ``scaled``: every owned parameter's gradient
    once, on every worker that holds a copy: a parameter held by two stages of this worker (DDP's
    tied embedding) is one tensor, scaled once. ``grads``: per owned stage, its trainable
    parameters' gradients by ``id`` (:meth:`Engine.grad_views`, before they are installed); None:
    their ``.grad``. ``local`` (:func:`norm_is_local`): ``counted`` is every parameter once on this
    worker, the whole norm's terms."""
    owners, me = engine.lowered.owners, engine.worker
    later = {use for uses in engine.ties for use in sorted(uses)[1:]}
    counted: list[torch.Tensor] = []
    scaled: dict[int, torch.Tensor] = {}
    for s in engine.owned:
        first = local or owners[s][0] == me
        for i, p in enumerate(engine.modules[s].parameters()):  # i: the index Engine.ties uses
            g = p.grad if grads is None else grads[s].get(id(p))
            if g is None:
                continue
            if first and (s, i) not in later:
                counted.append(g)
            scaled.setdefault(id(p), g)
    return counted, list(scaled.values())


def squared_norm(counted: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This worker's share of the squared global norm (float64), summed as one device sums it."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        sq += torch.linalg.vector_norm(g.double()) ** 2
    return sq


def clip_coef(sq: torch.Tensor, max_norm: float | None) -> float:
    """The clipping coefficient of a squared global norm, as ``clip_grad_norm_`` computes it (1 when
    clipping is off)."""
    if not max_norm:
        return 1.0
    return float((max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0))


def clip_by_global_norm(strategy: UnifiedStrategy, max_norm: float) -> torch.Tensor:
    """Scale every owned gradient by ``max_norm / (norm + 1e-6)`` (at most 1), where ``norm`` is
    the 2-norm over every parameter's gradient counted once (:func:`clipped_gradients`), summed
    across workers: exactly what ``clip_grad_norm_`` does on one device. Returns ``norm``.

    The squared norm summed across workers comes from the step's one fused all-reduce when the
    strategy took it there (``strategy.fused_norm_sq``, see :meth:`UnifiedStrategy.training_step`);
    else it is summed here, by an all-reduce of its own (a worker lost in it is recovered and the
    step redone), or, where every worker holds every gradient (:func:`norm_is_local`), computed here
    with none."""
    engine = strategy.engine
    assert engine is not None
    pv = strategy.post_validation
    if pv is not None:  # step_overlap=post_validation: the provisional step scales by the partial norm
        pv.max_norm = max_norm
        pv.coef = clip_coef(pv.partial[2], max_norm)
        return pv.partial[2].sqrt()
    while True:
        local = norm_is_local(engine)
        counted, scaled = clipped_gradients(engine, local=local)
        fused, strategy.fused_norm_sq = strategy.fused_norm_sq, None
        if fused is not None:
            sq = fused
            break
        sq = squared_norm(counted, strategy.root_device)
        if local:  # DDP: every worker holds the reduced gradient, so no collective
            break
        if strategy.reduce_norm(sq):
            break
        # a worker was lost in that all-reduce: the step was redone under the rebuilt engine
        engine = strategy.engine
        assert engine is not None
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in scaled:
        g.mul_(coef.to(g.dtype))
    return norm


#: hooks between the training step and the clipping, where a module or callback may change gradients
_BETWEEN = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")


def norm_in_step(trainer: Any, module: Any, plugin: Any) -> bool:
    """Whether the clipping norm's squared shares may be summed in the training step's own
    all-reduce (:meth:`UnifiedStrategy.training_step`), one collective fewer per step: clipping
    by norm is on, every step steps the optimizer (no accumulation), no GradScaler unscales the
    gradients in between, and no hook that runs in between (on the module or a callback) is
    overridden, and Lightning runs the optimization (automatic), so the gradients the norm is taken
    of are those that are clipped."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not trainer.gradient_clip_val or (trainer.gradient_clip_algorithm or "norm") != "norm":
        return False
    if trainer.accumulate_grad_batches != 1 or getattr(plugin, "scaler", None) is not None:
        return False
    if not getattr(module, "automatic_optimization", True):  # the module clips itself, when it likes
        return False
    hooked = [(module, LightningModule)] + [(cb, Callback) for cb in trainer.callbacks]
    return not any(is_overridden(h, obj, parent) for obj, parent in hooked for h in _BETWEEN
                   if hasattr(parent, h))


def process_group_up() -> bool:
    """Whether the default process group is started (``torch.distributed`` may be built without
    it: ``is_initialized`` exists only where ``is_available``)."""
    return dist.is_available() and dist.is_initialized()


def all_reduce(t: torch.Tensor) -> None:
    """Sum ``t`` over the workers, marked as waiting on them: a rank that hangs meanwhile is named
    by the hang check (its peers are waiting here, not making progress)."""
    with blocked(current_watchdog()):
        dist.all_reduce(t)


class _SyncedScaler(FoundInfHookScaler):
    """A ``GradScaler`` whose inf/NaN check spans every worker (as FSDP's ``ShardedGradScaler``):
    each owner sees only its stages' gradients, so all must skip a step, or none, and update the
    scale alike; a worker that owns no gradient still takes part."""

    def combine_found_inf(self, per_device: dict[torch.device, torch.Tensor],
                          found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        total = torch.zeros_like(found_inf)
        for v in per_device.values():
            total += v.to(total.device)
        if process_group_up():
            all_reduce(total)
        return {total.device: total}


def with_synced_scaler(plugin: Any) -> None:
    """16-mixed: make the precision plugin's GradScaler agree across workers (:class:`_SyncedScaler`)."""
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, _SyncedScaler):
        retype_grad_scaler(scaler, _SyncedScaler)


@functools.lru_cache(maxsize=32)  # one subclass per precision plugin class, the same one each time
def _global_norm_class(cls: type) -> type:
    """``cls`` with :func:`clip_by_global_norm` as its ``clip_grad_by_norm``."""
    return type(f"GlobalNorm{cls.__name__}", (cls,), {"clip_grad_by_norm": _clip_grad_by_norm, "_global_norm": True})


def _clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float) -> None:
    clip_by_global_norm(plugin.unified_strategy, float(clip_val))


def loss_dtype(stages: Any, nominal: torch.dtype) -> torch.dtype:
    """The floating dtype of the last stage's weights (the stage that computes the loss), else of
    any stage's, else ``nominal``: the loss is reported in the precision one device computes it in."""
    for group in (list(stages)[-1:], list(stages)):
        for m in group:
            for p in m.parameters():
                if p.is_floating_point():
                    return p.dtype
    return nominal


def with_global_clipping(strategy: UnifiedStrategy) -> None:
    """Make the precision plugin clip by the global norm across owners (``gradient_clip_val``
    with ``gradient_clip_algorithm="norm"``). Lightning clips in the precision plugin, whatever
    the precision, so its class gets a subclass that overrides that one method; clipping by value
    is elementwise and stays as it is."""
    plugin = strategy.precision_plugin
    cls: Any = type(plugin)  # a class is hashable (mypy reads Precision's __hash__ as an instance's)
    if not getattr(cls, "_global_norm", False):  # not retyped already (a second setup of the same plugin)
        retype_precision_plugin(plugin, _global_norm_class(cls))
    setattr(plugin, "unified_strategy", strategy)  # read by _clip_grad_by_norm (the subclass is made at run time)
