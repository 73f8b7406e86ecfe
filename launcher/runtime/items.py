"""How much each micro-batch weighs in the step's loss.

A loss that is a mean over a count that depends on the data (tokens with a label, masked
positions, valid pixels; rows, when micro-batches differ in size) is, on one device, the sum over
the whole batch's ``N`` items divided by ``N``. Micro-batch ``b``'s loss is the mean over its own
``n_b`` items, so the step's loss is::

    L = sum_b L_b * n_b / N        (N = sum_b n_b)

and not the mean of the micro-batches' means (Hugging Face's ``num_items_in_batch`` mends the same
thing in gradient accumulation). With equal counts every weight is ``1 / B``: the engine then
divides by ``B``, bit for bit what it always did. A micro-batch with no item weighs nothing: its
loss (a mean over nothing, often NaN) is left out and its backward gives zero gradients.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..torch_support.torch_private import pytree

Count = int | float | torch.Tensor


def rows(value: Any) -> int | None:
    """The samples (first dimension) of the first tensor in ``value`` that has one; None if none has."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def numbers(items: Sequence[Count]) -> list[float]:
    """Counts as Python numbers; tensor counts (on a GPU, say) are read in one transfer."""
    tensors = [n.detach().reshape(()).to(torch.float64) for n in items if isinstance(n, torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(n, torch.Tensor) else float(n) for n in items]


def shares(microbatches: Sequence[Any], items: Sequence[Count] | None = None) -> list[float] | None:
    """Each micro-batch's share ``n_b / N`` of the step's items, or None when the counts are all
    equal (each weighs ``1 / B``). ``items``: the count of each micro-batch; None counts the rows
    of each micro-batch's input (``microbatches[b][0]``). Raises ``ValueError`` for a count that
    is negative or not finite, or a list of the wrong length."""
    B = len(microbatches)
    if items is None:
        found = [rows(mb[0]) for mb in microbatches]
        if any(n is None for n in found):
            return None
        counts = [float(n) for n in found]  # type: ignore[arg-type]
    else:
        if len(items) != B:
            raise ValueError(f"items has {len(items)} counts for {B} micro-batches; give one count per micro-batch")
        counts = numbers(items)
    bad = next((n for n in counts if not n >= 0 or n == float("inf")), None)
    if bad is not None:
        raise ValueError(f"a micro-batch's item count is {bad}; counts must be finite and >= 0")
    if all(n == counts[0] for n in counts):
        return None
    total = sum(counts)
    return [n / total for n in counts]
