"""Every rank must train on the same micro-batches: a cheap check, once per step.

The plan assumes that micro-batch ``b`` is the same tensor on every rank (each rank reads the
inputs and targets of the jobs it runs from its own copy). A data function seeded by rank breaks
that silently: the step runs, the counts match the simulator, and the loss is wrong. So every rank
fingerprints its micro-batches (per tensor: a CRC of shape and dtype, the sum and the sum of
absolute values, in float64) and the ranks compare them with one small ``all_gather``: a few
dozen numbers per step, and one pass over the data, far less than a forward.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..torch_support.torch_private import pytree
from .failure import Watchdog, blocked


class BatchMismatch(ValueError):
    """The ranks were not given the same micro-batches."""


PARTS = ("input", "target")


def _fingerprint(x: Any) -> list[float]:
    """``[crc(shape, dtype), sum, sum of |x|]`` of a tensor; of a tuple, list or dict of them, the
    CRC of its structure and every leaf's, and the sums over its leaves (a CRC of its repr for
    anything else)."""
    if isinstance(x, (tuple, list, dict)):
        leaves, tree = pytree.tree_flatten(x)
        parts = [_fingerprint(leaf) for leaf in leaves]
        crc = zlib.crc32(f"{tree}|{[p[0] for p in parts]}".encode())
        return [float(crc), sum(p[1] for p in parts), sum(p[2] for p in parts)]
    if not isinstance(x, torch.Tensor):
        return [float(zlib.crc32(repr(x).encode())), 0.0, 0.0]
    t = x.detach()
    head = float(zlib.crc32(f"{tuple(t.shape)}|{t.dtype}".encode()))
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return [head, float(t.sum(dtype=torch.float64)), float(t.abs().sum(dtype=torch.float64))]


def fingerprints(microbatches: Sequence[Any]) -> torch.Tensor:
    """``(B, 2, 3)`` float64: the fingerprint of every micro-batch's input and target."""
    return torch.tensor([[_fingerprint(part) for part in mb[:2]] for mb in microbatches], dtype=torch.float64)


def mismatch(prints: Sequence[torch.Tensor]) -> str | None:
    """The sentence naming the first micro-batch that differs between ranks (compared with rank
    0's), or ``None`` when every rank has the same ones. NaN equals NaN here."""
    ref = prints[0]
    for b in range(ref.shape[0]):
        for i, part in enumerate(PARTS):
            differ = []
            what = "values"
            for r, p in enumerate(prints[1:], start=1):
                a, c = ref[b, i], p[b, i]
                same = (a == c) | (a.isnan() & c.isnan())
                if not bool(same.all()):
                    differ.append(r)
                    if not bool(same[0]):
                        what = "shape or dtype"
            if differ:
                ranks = f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))}"
                return (f"every rank must be given the same micro-batches, but the {part} of micro-batch {b} on "
                        f"{ranks} differs from rank 0's ({what}); give every rank the same data, e.g. seed it "
                        f"the same way on every rank.")
    return None


def check_same_batches(microbatches: Sequence[Any], group: dist.ProcessGroup | None, device: torch.device,
                       watchdog: Watchdog | None = None, step: int = 0) -> None:
    """Raise :class:`BatchMismatch` on every rank unless all ranks of ``group`` hold the same
    micro-batches (see the module doc). A collective: every rank of the group must call it."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = fingerprints(microbatches).to(device)
    if watchdog is not None:
        watchdog.set_job(f"the batch check of step {step}")
    allp = [torch.empty_like(mine) for _ in range(world)]
    with blocked(watchdog):
        dist.all_gather(allp, mine, group=group)
    msg = mismatch([p.cpu() for p in allp])
    if msg is not None:
        raise BatchMismatch(msg)
