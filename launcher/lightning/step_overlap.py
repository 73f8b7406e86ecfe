"""``step_overlap=post_validation`` under :class:`~.strategy.UnifiedStrategy` (``strategy=gpipe``, and
``lpp`` with ``G=1``: every stage has one owner, the loss stage on the last worker): the zero-bubble
paper's post-validation (seed 004, section 4) in place of the step's closing all-reduce.

A step ends, on each worker, as soon as its own gradients are final. The workers form a chain in the
order of their lowest stage (a worker's gradients are final with its lowest stage's, so the later
ones' are final first). The partially reduced global state (loss, non-finite flag with the lowest
non-finite code, squared clipping norm) goes from the last worker to the first, one small
point-to-point message per hop: each worker waits for the state of the workers after it, adds its
own, passes it on, and steps provisionally
(:class:`~launcher.torch_support.post_validation.ProvisionalStep`) with the clipping coefficient of
that partial norm, or not at all when a non-finite value was seen. The first worker then holds the
full state, steps exactly, and sends the full state to every other worker. Each validates its step
when it arrives, at the end of its own optimizer step (before Lightning's batch-end hooks, so
checkpoints, validation loops and the end of ``fit`` see validated weights): a step whose
coefficient was not the true one is rolled back in place and taken again; a step with a non-finite
value elsewhere is rolled back and dropped (``nonfinite=skip``) or rolled back and then stopped on
(``nonfinite=stop``). The wait is off the critical path: a later worker's next forward waits for the
first worker's next activation anyway, which it sends after its step.

The messages travel on a process group of their own (gloo, host tensors), so their tags never meet
the engine's (:data:`launcher.schedule.assembly.TAG_LIMIT`). Under ``step_overlap=none`` nothing here
is built.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.failure import blocked, current_watchdog
from ..torch_support.post_validation import ProvisionalStep, rollback_support
from .precision import _BETWEEN, clip_coef

log = logging.getLogger(__name__)

#: a state slot's "no non-finite value" code (above any real one; float64 holds it exactly)
NO_CODE = float(2**52)
_PARTIAL, _FULL = 1, 2  # the two messages' tags on the group of their own


def synchronous_reason(trainer: Any, module: Any, plugin: Any, optimizers: list[Any]) -> str | None:
    """``None`` when a step of this run can be taken provisionally and validated one message later,
    else one sentence saying why it takes the synchronous step (the all-reduce) instead."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    head = "step_overlap=post_validation takes the synchronous step here"
    if not getattr(module, "automatic_optimization", True):
        return f"{head}: the module runs its own optimization (automatic_optimization=False)."
    if len(optimizers) != 1:
        return f"{head}: the module has {len(optimizers)} optimizers, and post-validation rolls back one."
    if trainer.accumulate_grad_batches != 1:
        return f"{head}: accumulate_grad_batches={trainer.accumulate_grad_batches} steps once per several batches."
    if getattr(plugin, "scaler", None) is not None:
        return f"{head}: a GradScaler (precision=16-mixed) decides each step after an all-reduce of its own."
    if trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") != "norm":
        return f"{head}: gradient_clip_algorithm={trainer.gradient_clip_algorithm} is not clipping by the global norm."
    hooked = [(module, LightningModule)] + [(cb, Callback) for cb in trainer.callbacks]
    for obj, parent in hooked:
        for h in _BETWEEN:
            if hasattr(parent, h) and is_overridden(h, obj, parent):
                return f"{head}: {type(obj).__name__} overrides {h}, which may change the gradients the norm is of."
    why = rollback_support(optimizers[0])
    return f"{head}: {why}" if why is not None else None


class PostValidation:
    """One worker's half of post-validation: the partial state along the pipeline, its stage's
    provisional step and the validation (module docstring). Collective to build (a process group)."""

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer) -> None:
        owners, ranks = engine.lowered.owners, engine.ranks
        # one owner per stage (rules.OVERLAP_TRAINING_SCHEMES); the workers in the order of their lowest
        # stage: a worker's gradients are final with its lowest stage's, so the later ones' come first
        lowest: dict[int, int] = {}
        for s, (w, *replicas) in enumerate(owners):
            assert not replicas, "post-validation needs one owner per stage"
            lowest.setdefault(w, s)
        chain = sorted(lowest, key=lowest.__getitem__)
        if owners[-1][0] != chain[-1]:  # the loss travels with the partial state: every worker logs it whole
            raise ValueError(f"step_overlap=post_validation is invalid with stages={len(owners)} on {len(chain)} "
                             f"workers: the loss stage must be on the pipeline's last worker (lpp: stages a "
                             f"multiple of R).")
        i = chain.index(engine.worker)
        #: this worker's lowest stage (under gpipe its one stage)
        self.lowest = lowest[engine.worker]
        self.group = dist.new_group(backend="gloo")  # collective, on every rank
        self.later = ranks[chain[i + 1]] if i + 1 < len(chain) else None
        self.earlier = ranks[chain[i - 1]] if i > 0 else None
        self.first = ranks[chain[0]]
        self.others = [ranks[w] for w in chain[1:]]
        self.step = ProvisionalStep(optimizer)
        self.max_norm: float | None = None  # Lightning's gradient_clip_val, as the clipping passes it
        self.coef: float = 1.0  # the provisional coefficient, from the partial norm
        self.partial = torch.zeros(4, dtype=torch.float64)  # loss, non-finite flag, squared norm, lowest code
        self.full: torch.Tensor | None = None
        self._sends: list[Any] = []

    def reduce_partial(self, loss: float, code: int | None, sq: float) -> torch.Tensor:
        """This stage's partial state: the later stages' (waited for) plus its own, passed on to the
        earlier stage; the first stage sends the full state to every other one."""
        self._wait_sends()
        t = torch.tensor([loss, 0.0 if code is None else 1.0, sq, NO_CODE if code is None else float(code)],
                         dtype=torch.float64)
        if self.later is not None:
            got = torch.empty(4, dtype=torch.float64)
            with blocked(current_watchdog()):
                dist.recv(got, self.later, group=self.group, tag=_PARTIAL)
            code_min = min(float(got[3]), float(t[3]))
            t += got
            t[3] = code_min
        if self.earlier is not None:
            self._sends.append(dist.isend(t, self.earlier, group=self.group, tag=_PARTIAL))
            self.full = None
        else:
            self.full = t
            self._sends += [dist.isend(t, r, group=self.group, tag=_FULL) for r in self.others]
        self.partial = t
        self.coef = 1.0
        return t

    def receive_full(self) -> torch.Tensor:
        """The full state of this step (the first stage's, sent once it had it)."""
        if self.full is None:
            got = torch.empty(4, dtype=torch.float64)
            with blocked(current_watchdog()):
                dist.recv(got, self.first, group=self.group, tag=_FULL)
            self.full = got
        return self.full

    def take(self, skipped: bool) -> None:
        """The provisional step: the partial norm's coefficient, or none when a non-finite value was seen."""
        self.step.take(None if skipped else self.coef)

    def validate(self) -> tuple[bool, int | None]:
        """Validate the provisional step against the full state; returns (rolled back, the lowest
        non-finite code of the step or None)."""
        full = self.receive_full()
        bad = float(full[1]) > 0
        rolled = self.step.validate(None if bad else clip_coef(full[2], self.max_norm))
        return rolled, int(full[3]) if bad else None

    def _wait_sends(self) -> None:
        with blocked(current_watchdog()):
            for w in self._sends:
                w.wait()
        self._sends = []

    def close(self) -> None:
        """Wait for this worker's last messages (their buffers stay alive until sent)."""
        self._wait_sends()
