"""A stage's provisional optimizer step and its in-place rollback: the zero-bubble paper's
post-validation (seed 004, section 4 and Appendix C, Algorithm 1).

Under post-validation a stage steps as soon as its own gradients are final, clipped by the
coefficient of a *partially* reduced gradient norm (and skipped when a non-finite value was seen so
far); the fully reduced state comes back during the next step's warm-up. :class:`ProvisionalStep`
holds what that needs on one stage: :meth:`ProvisionalStep.take` scales the gradients by the
provisional coefficient and runs the optimizer's own ``step()``; :meth:`ProvisionalStep.validate`
compares it with the true coefficient and, when they differ, undoes the step **in place** by the
inverse arithmetic of the update (no copy of parameters or state is kept), then steps again with
the true coefficient from the same gradients, or, when a non-finite value appeared globally,
leaves the step undone (the non-finite skip).

Invertible here: ``torch.optim.SGD`` (momentum, 0 included, dampening, nesterov, weight decay,
``maximize``; the first step's momentum buffer is removed again) and ``torch.optim.Adam`` /
``AdamW`` (weight decay coupled or decoupled, ``maximize``, the step counter; a first step's state
is removed again), in their single-tensor and ``foreach`` implementations, which do the same
arithmetic per element (on CPU torch picks the single-tensor one). :func:`rollback_support` says in
one sentence why any other optimizer, or setting, cannot be rolled back, so that the caller falls
back to the synchronous step.

Exactness: the inverse recomputes the update from the state the step left (Adam's denominator from
the new ``exp_avg_sq``, exactly as the step computed it), so undoing it costs one rounding per
operation; the moments are recovered by ``(m' - (1 - b) g) / b``, which loses relative precision
only where the step's new term dominates the old moment (a gradient far larger than
the ones before: measured in :class:`ProvisionalStep`'s docstring and
``tests/torch_support/test_post_validation.py``). ``ProvisionalStep(..., keep_copy=True)`` is the
exact fallback: a copy of what the step changes, copied back on a rollback.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

#: the optimizers whose step is inverted here (exact types: a subclass may change ``step``)
INVERTIBLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
#: the group entries a step reads and a scheduler may change after it (recorded at the step)
HYPERPARAMETERS = ("lr", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps", "maximize",
                   "decoupled_weight_decay")


def rollback_support(optimizer: torch.optim.Optimizer) -> str | None:
    """``None`` when :class:`ProvisionalStep` can roll ``optimizer``'s step back in place, else one
    sentence naming the optimizer and why not (the caller then takes the synchronous step)."""
    name = type(optimizer).__name__
    if type(optimizer) not in INVERTIBLE:
        why = _WHY_NOT.get(name, "its update has no inverse implemented here (SGD, Adam and AdamW have)")
        return f"{name} cannot be rolled back in place: {why}."
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return f"{name} cannot be rolled back in place: it is driven by a gradient scaler (grad_scale/found_inf)."
    for i, group in enumerate(optimizer.param_groups):
        for key, rule in (("fused", "a fused kernel"), ("capturable", "the capturable (tensor step) arithmetic"),
                          ("differentiable", "the differentiable arithmetic"),
                          ("amsgrad", "amsgrad's running maximum, which a step overwrites")):
            if group.get(key):
                return f"{name} cannot be rolled back in place: param group {i} has {key}=True ({rule})."
        for key in ("lr", "momentum", "dampening", "weight_decay", "eps"):
            if isinstance(group.get(key), torch.Tensor):
                return f"{name} cannot be rolled back in place: param group {i} has a Tensor {key}."
        if type(optimizer) is not torch.optim.SGD:
            b1, b2 = group["betas"]
            if isinstance(b1, torch.Tensor) or isinstance(b2, torch.Tensor):
                return f"{name} cannot be rolled back in place: param group {i} has Tensor betas."
            if b1 == 0 or b2 == 0:
                return (f"{name} cannot be rolled back in place: param group {i} has betas=({b1}, {b2}), "
                        "and a beta of 0 forgets the moment the step overwrites.")
        for p in group["params"]:
            if p.is_complex():
                return f"{name} cannot be rolled back in place: param group {i} has a complex parameter."
    return None


_WHY_NOT = {
    "LBFGS": "it keeps a history of steps and gradients that a step overwrites, and its closure re-evaluates the loss",
    "Adagrad": "its accumulated squared gradients are not implemented here",
    "Rprop": "its step sizes change by the sign of the gradient, which a step overwrites",
    "ASGD": "its averaged parameters and decaying step size are not implemented here",
    "SparseAdam": "it updates sparse rows only, which is not implemented here",
}


@dataclass
class _Taken:
    """What a provisional step needs to be undone: per param group the hyperparameters it ran with,
    the gradients it read (references, scaled by ``coef``), and whether each parameter had state."""

    coef: float | None
    groups: list[dict[str, Any]]
    grads: dict[int, torch.Tensor]  # id(param) -> the gradient tensor the step read
    fresh: set[int]  # id(param) whose state (SGD: momentum buffer; Adam: everything) the step created
    steps: dict[int, float]  # id(param) -> Adam's step count the step ran at
    copies: dict[int, tuple[torch.Tensor, dict[str, Any]]]  # keep_copy: id(param) -> param and state before


class ProvisionalStep:
    """One stage's optimizer, stepped provisionally and validated one step later.

    ``take(c)`` scales every gradient by ``c`` (the clipping coefficient of the partially reduced
    norm; ``None``: a non-finite value seen so far, so no step) and steps; ``validate(c_true)``
    is a no-op when ``c_true`` equals ``c``, and otherwise rolls the step back in place and, unless
    ``c_true`` is ``None`` (a non-finite value appeared globally), steps again with ``c_true``.
    Between the two the gradient tensors the step read must not be written (``zero_grad()``, which
    sets them to ``None``, is fine: they are held by reference), and nothing else may step the
    optimizer; a learning-rate scheduler may change the groups (the values used are recorded).

    ``rollbacks`` counts the steps undone, ``skipped`` those of them not taken again (non-finite);
    ``redo_s`` is the CPU seconds (this thread's) the rollbacks took: undoing and stepping again.
    The extra memory is the gradients' lifetime until ``validate``, and nothing else.

    Precision: parameters come back within a rounding or two; Adam's ``exp_avg_sq`` (and, less so,
    ``exp_avg`` and SGD's momentum buffer) is recovered as ``(v' - (1 - b2) g^2) / b2``, which
    cancels where the new gradient dominates the old moment: after ten steps of gradients of one
    size, a step on a gradient 100x larger, undone, leaves ``exp_avg_sq`` within 7e-14 (norm-wise
    relative, float64), 10^4x larger within 7e-10 (parameters: 2e-21). ``keep_copy=True`` is the
    exact fallback: ``take`` copies every stepped parameter and its state tensors first and a
    rollback copies them back (bit-equal), at the cost of that copy on every step and its memory
    until ``validate``: 2x the stepped parameters' bytes for SGD with momentum (1x without),
    3x for Adam/AdamW.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, keep_copy: bool = False):
        why = rollback_support(optimizer)
        if why is not None:
            raise ValueError(why)
        self.optimizer = optimizer
        self.keep_copy = keep_copy
        #: keep_copy's buffers, reused from step to step (allocating them anew each step costs more)
        self._buffers: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self.rollbacks = 0
        self.skipped = 0
        self.redo_s = 0.0
        self._taken: _Taken | None = None

    @property
    def pending(self) -> bool:
        """Whether a step was taken and not yet validated."""
        return self._taken is not None

    def take(self, clip_coef: float | None) -> None:
        """Scale the gradients by ``clip_coef`` and step (``None``: skip the step, a non-finite
        value was seen); the previous step must have been validated."""
        if self._taken is not None:
            raise RuntimeError("ProvisionalStep.take: the previous step is not validated yet; call validate() first.")
        if clip_coef is not None and not (math.isfinite(clip_coef) and clip_coef > 0):
            raise ValueError(f"clip_coef={clip_coef} must be a finite positive number (or None for a skipped step).")
        opt = self.optimizer
        grads: dict[int, torch.Tensor] = {}
        fresh: set[int] = set()
        steps: dict[int, float] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("ProvisionalStep cannot roll back a step on a sparse gradient.")
                grads[id(p)] = p.grad
                state = opt.state.get(p, {})
                if (state.get("momentum_buffer") is None if isinstance(opt, torch.optim.SGD) else not state):
                    fresh.add(id(p))
        groups = [{k: _copy(g[k]) for k in HYPERPARAMETERS if k in g} for g in opt.param_groups]
        copies: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self._taken = _Taken(clip_coef, groups, grads, fresh, steps, copies)
        if clip_coef is None:
            return
        if self.keep_copy:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in grads:
                        old = self._buffers.get(id(p))
                        copies[id(p)] = self._buffers[id(p)] = (
                            _copy(p.detach(), old[0] if old else None),
                            {k: _copy(v, old[1].get(k) if old else None) for k, v in opt.state.get(p, {}).items()})
        if clip_coef != 1.0:
            for g in grads.values():
                g.mul_(clip_coef)
        opt.step()
        if not isinstance(opt, torch.optim.SGD):
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in grads:
                        steps[id(p)] = float(opt.state[p]["step"])

    def validate(self, true_coef: float | None) -> bool:
        """Keep the provisional step if ``true_coef`` is its coefficient, else roll it back and, unless
        ``true_coef`` is ``None``, step again with ``true_coef``. Returns whether it rolled back."""
        taken = self._taken
        if taken is None:
            raise RuntimeError("ProvisionalStep.validate: no step was taken since the last validate().")
        self._taken = None
        if true_coef == taken.coef:
            return False
        if taken.coef is None:
            raise ValueError(f"true_coef={true_coef} is finite, but the provisional step saw a non-finite value: "
                             "a partial state cannot be non-finite when the full one is finite.")
        if true_coef is not None and not (math.isfinite(true_coef) and true_coef > 0):
            raise ValueError(f"true_coef={true_coef} must be a finite positive number (or None: non-finite).")
        t0 = time.thread_time()
        try:
            self._undo(taken)
            self.rollbacks += 1
            if true_coef is None:
                self.skipped += 1
                if taken.coef != 1.0:
                    for g in taken.grads.values():
                        g.div_(taken.coef)
                return True
            scale = true_coef / taken.coef
            for g in taken.grads.values():
                g.mul_(scale)
            self._step_as(taken)
            return True
        finally:
            self.redo_s += time.thread_time() - t0

    def _undo(self, taken: _Taken) -> None:
        opt = self.optimizer
        with torch.no_grad():
            for group, hp in zip(opt.param_groups, taken.groups):
                for p in group["params"]:
                    g = taken.grads.get(id(p))
                    if g is None:
                        continue
                    if taken.copies:
                        _restore(p, opt.state, *taken.copies[id(p)])
                    elif isinstance(opt, torch.optim.SGD):
                        _undo_sgd(p, g, opt.state.get(p, {}), hp, id(p) in taken.fresh)
                    else:
                        _undo_adam(p, g, opt.state[p], hp, taken.steps[id(p)])
                        if id(p) in taken.fresh:
                            opt.state[p].clear()
                    if id(p) in taken.fresh and not opt.state.get(p, True):
                        del opt.state[p]  # the step created the parameter's state: none before it

    def _step_as(self, taken: _Taken) -> None:
        """The optimizer's own step again, with the groups' recorded hyperparameters and the kept
        gradients; the groups' current values (a scheduler's) and gradients are put back after."""
        opt = self.optimizer
        current = [{k: g[k] for k in hp} for g, hp in zip(opt.param_groups, taken.groups)]
        grads = {id(p): p.grad for g in opt.param_groups for p in g["params"]}
        try:
            for g, hp in zip(opt.param_groups, taken.groups):
                g.update(hp)
                for p in g["params"]:
                    p.grad = taken.grads.get(id(p))
            opt.step()
        finally:
            for g, cur in zip(opt.param_groups, current):
                g.update(cur)
                for p in g["params"]:
                    p.grad = grads[id(p)]


def _copy(value: Any, into: Any = None) -> Any:
    """A copy of ``value`` (tensors cloned), into the tensor ``into`` where it fits."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(into, torch.Tensor) and into.shape == value.shape and into.dtype == value.dtype \
            and into.device == value.device:
        return into.copy_(value)
    return value.clone()


def _restore(p: torch.Tensor, states: dict, param: torch.Tensor, state: dict[str, Any]) -> None:
    """``keep_copy``'s rollback: the parameter and its state tensors copied back in place."""
    p.copy_(param)
    now = states.get(p, {})
    for k in [k for k in now if k not in state]:
        del now[k]
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and isinstance(now.get(k), torch.Tensor):
            now[k].copy_(v)
        else:
            now[k] = v


def _undo_sgd(p: torch.Tensor, g: torch.Tensor, state: dict, hp: dict[str, Any], fresh: bool) -> None:
    """Invert ``torch.optim.SGD``'s update of ``p`` (and its momentum buffer) from gradient ``g``."""
    lr, wd, momentum = float(hp["lr"]), float(hp["weight_decay"]), float(hp["momentum"])
    if hp["maximize"]:
        g = -g
    if momentum == 0:
        # p' = p - lr (g + wd p)
        p.add_(g, alpha=lr)
        if wd != 0:
            p.div_(1 - lr * wd)
        return
    buf = state["momentum_buffer"]
    if hp["nesterov"]:
        # p' = p - lr (g + wd p + momentum buf')
        p.add_(g, alpha=lr).add_(buf, alpha=lr * momentum)
        if wd != 0:
            p.div_(1 - lr * wd)
    else:
        p.add_(buf, alpha=lr)  # p' = p - lr buf'
    if fresh:
        del state["momentum_buffer"]  # the step created it as a copy of its gradient: none before
        return
    d = g.add(p, alpha=wd) if wd != 0 else g
    buf.sub_(d, alpha=1 - float(hp["dampening"])).div_(momentum)  # buf' = momentum buf + (1 - dampening) d


def _undo_adam(p: torch.Tensor, g: torch.Tensor, state: dict, hp: dict[str, Any], step: float) -> None:
    """Invert ``torch.optim.Adam``/``AdamW``'s update of ``p``, ``exp_avg``, ``exp_avg_sq`` and
    ``step`` from gradient ``g`` (Algorithm 1 of seed 004, with Adam's coupled weight decay)."""
    lr, wd, eps = float(hp["lr"]), float(hp["weight_decay"]), float(hp["eps"])
    beta1, beta2 = (float(b) for b in hp["betas"])
    m, v, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
    if float(step_t) != step:
        raise RuntimeError(f"the optimizer stepped again (step {float(step_t)}, provisional step {step}) "
                           "before the provisional step was validated.")
    if hp["maximize"]:
        g = -g
    # the update exactly as the step computed it, from the moments it left
    step_size = lr / (1 - beta1**step)
    denom = v.sqrt().div_((1 - beta2**step) ** 0.5).add_(eps)  # the same values, one temporary
    p.addcdiv_(m, denom, value=step_size)
    if wd != 0:
        if hp.get("decoupled_weight_decay", False):
            p.div_(1 - lr * wd)
        else:
            g = g.add(p, alpha=wd)
    w = 1 - beta1
    m.sub_(g, alpha=w).div_(1 - w)  # m' = lerp(m, g, w) = m + w (g - m)
    v.addcmul_(g, g, value=-(1 - beta2)).div_(beta2)  # v' = beta2 v + (1 - beta2) g^2
    step_t -= 1
