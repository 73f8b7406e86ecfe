"""Non-finite values in a training step (``nonfinite=stop|skip``): where the first one appeared,
agreed by every rank, before any optimizer step.

The engine runs a step as jobs ``F``/``B`` of ``(stage s, micro-batch b)`` spread over workers, so
each worker marks what its own jobs produced (:class:`Finite`): the output of every forward, the
loss of every loss stage's forward, and the gradients of every backward (inputs' and weights'),
then each owned stage's gradient once summed over the micro-batches and the workers. A mark is a
sum taken on the device (:func:`_total`); nothing is read back until the step's end, where one look
at all of them finds this worker's first non-finite value. "First" is an order every scheme shares,
not the time a job ran: the lowest micro-batch, and within it forwards by stage, then the loss,
then backwards from the last stage down (how a NaN travels), then the summed gradients. The workers
agree on it within the step's existing loss all-reduce (:func:`agree`: one extra element, and a
second tiny all-reduce only in a step that has a non-finite value, :func:`lowest`), so every rank
stops, or skips, together. The same all-reduce carries the gradient-clipping norm's squared shares
where the strategy can compute them then; under ddp the flag is computed on the device
(:meth:`Finite.flag`) and the all-reduce launched beside the last gradient bucket's (see
docs/performance.md, "Collectives per step").

Under a GradScaler (``16-mixed``) gradients are not checked: an overflow there is the scaler's
to handle (it skips the step and lowers the scale); losses and activations still are.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ..torch_support.torch_private import pytree
from .failure import Stop

_KINDS = ("nan", "inf", "-inf")
_NONE = 2**62  # no non-finite value on this worker


class NonFiniteError(Stop):
    """A step produced a non-finite value under ``nonfinite=stop``; the message is one sentence."""


def _total(value: Any) -> torch.Tensor | None:
    """The sum of the floating-point tensors in ``value``, non-finite if one of them holds a NaN
    or an infinity, computed where they live; None if there is none. Summed in float32 (float64
    for float64 tensors; half types are widened, so their range is no limit): one pass, as cheap
    as reading the tensor, and only values near 1e38 / numel could overflow it."""
    with torch.no_grad():
        sums = [torch.sum(t, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
                for t in pytree.tree_leaves(value)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if len(sums) < 2:
            return sums[0] if sums else None
        return torch.stack(sums).sum()


class Finite:
    """This worker's marks of one training step (see the module docstring); ``grads``: whether
    gradients are checked (not under a GradScaler)."""

    def __init__(self, stages: int, microbatches: int, grads: bool = True) -> None:
        self.S, self.B, self.grads = stages, microbatches, grads
        self.marks: list[tuple[int, torch.Tensor]] = []

    # the order: per micro-batch, F(0..S-1), then the loss at each stage, then B(S-1..0);
    # after every micro-batch, the summed gradients from the last stage down
    def _key(self, b: int, pos: int) -> int:
        return b * 3 * self.S + pos

    def begin(self) -> None:
        self.marks = []

    def forward(self, s: int, b: int, out: Any, loss: torch.Tensor | None) -> None:
        t = _total(out)
        if t is not None:
            self.marks.append((self._key(b, s), t))
        if loss is not None:
            self.marks.append((self._key(b, self.S + s), loss.detach().to(torch.float64).reshape(())))

    def backward(self, s: int, b: int, grads: Iterable[Any]) -> None:
        if self.grads:
            t = _total([g for g in grads if g is not None])
            if t is not None:
                self.marks.append((self._key(b, 3 * self.S - 1 - s), t))

    def reduced(self, totals: Mapping[int, torch.Tensor]) -> None:
        if self.grads:
            for s, t in totals.items():
                total = _total(t)
                if total is not None:  # a stage with no floating-point gradient has nothing to mark
                    self.marks.append((self._key(self.B, self.S - 1 - s), total))

    def flag(self, device: torch.device) -> torch.Tensor:
        """1.0 if any mark so far is non-finite, else 0.0: a 0-d float64 tensor on ``device``,
        computed there, with no read back (:meth:`first` says which, when it is 1)."""
        if not self.marks:
            return torch.zeros((), dtype=torch.float64, device=device)
        values = torch.stack([v.to(device, torch.float64).reshape(()) for _, v in self.marks])
        return (~torch.isfinite(values)).any().to(torch.float64)

    def first(self) -> int | None:
        """This worker's first non-finite value of the step, as a code :func:`describe` reads
        (``3 * position + kind``), or None; reads the marks back once."""
        if not self.marks:
            return None
        values = torch.stack([v.to(self.marks[0][1].device) for _, v in self.marks]).cpu().tolist()
        bad = [(k, 0 if math.isnan(v) else 1 if v > 0 else 2) for (k, _), v in zip(self.marks, values)
               if not math.isfinite(v)]
        self.marks = []
        return min(3 * k + kind for k, kind in bad) if bad else None

    def describe(self, code: int) -> str:
        """Where the value ``code`` names appeared, and what it is, in words."""
        key, kind = divmod(code, 3)
        b, pos = divmod(key, 3 * self.S)
        what = _KINDS[kind]
        if b >= self.B:
            return f"the gradient of stage {self.S - 1 - pos}, summed over the micro-batches, is {what}"
        if pos < self.S:
            return f"the output of stage {pos}'s forward on micro-batch {b} is {what}"
        if pos < 2 * self.S:
            return f"the loss of micro-batch {b} (at stage {pos - self.S}) is {what}"
        return f"the gradient from stage {3 * self.S - 1 - pos}'s backward on micro-batch {b} is {what}"


def agree(share: float, code: int | None, device: torch.device, group: Any = None,
          extra: torch.Tensor | None = None) -> tuple[torch.Tensor, int | None, torch.Tensor | None]:
    """Every rank's loss share summed (the step's loss), the first non-finite value any rank
    found (the lowest code), the same on every rank, and ``extra`` (a 0-d float64 tensor, such
    as the clipping norm's squared share) summed in the same all-reduce; collective. One
    all-reduce and one read back to the host; a second tiny all-reduce only in a step with a
    non-finite value."""
    t = torch.tensor([share, 0.0 if code is None else 1.0, 0.0], dtype=torch.float64, device=device)
    if extra is not None:
        t[2] = extra
    dist.all_reduce(t, group=group)
    summed = t[2] if extra is not None else None
    if t[1].item() == 0:
        return t[0], None, summed
    return t[0], lowest(code, device, group), summed


def lowest(code: int | None, device: torch.device, group: Any = None) -> int:
    """The lowest of every rank's first non-finite code (``None``: none on this rank), in a step
    where some rank has one; collective."""
    c = torch.tensor([_NONE if code is None else code], dtype=torch.int64, device=device)
    dist.all_reduce(c, op=dist.ReduceOp.MIN, group=group)
    return int(c.item())


def undo_statistics(stats: Any) -> None:
    """Put every BatchNorm's running statistics back where the step began
    (:class:`~launcher.runtime.stats.RunningStats`): a dropped step changes nothing."""
    from .stats import _set

    if not getattr(stats, "on", False):
        return
    for s, r0 in stats.r0.items():
        for k, (m0, v0, n0) in enumerate(r0):
            for holder in stats.layers[s]:
                _set(holder[k], m0.clone(), v0.clone(), n0)
