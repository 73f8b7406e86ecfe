"""Collectives of the step: the replicas' gradient all-reduce, and NCCL's pair communicators.

Replicas: the owners of a replicated stage (DDP, LPP with G > 1) sum its gradient with one
``all_reduce`` on a process group of exactly those workers (the backend's ring: each sends and
receives ``2 (n - 1) / n`` of the gradient, instead of ``n - 1`` copies through one root). The
groups are made at construction, one per distinct owner set of the plan, in sorted order, by every
process of the default group (``new_group`` is collective over it, members or not; making only the
members' groups locally can hang gloo when one worker is in two sets), so every process of the
world builds its engine, ranks with no worker too. The stages of one owner set are packed into buckets of about ``BUCKET_BYTES``
and reduced asynchronously, so the buckets' transfers overlap; every member packs the same stages
in the same order, so the collectives match.

NCCL pairs: point-to-point communicators are created lazily on a pair's first message, which
blocks both ends; two pairs whose first messages form a cycle deadlock. :func:`warm_pairs`
creates every pair a plan uses up front, in one global order.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .failure import Watchdog, blocked
from .plan import Plan

BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's default bucket

# engines built one after another in a process (every process builds the same ones, so every
# process makes the same calls) share their groups instead of making new ones each time
_made: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    key = (id(dist.group.WORLD), ranks)
    if key not in _made:
        _made[key] = dist.new_group(list(ranks))
    return _made[key]


class Replicas:
    """This worker's replica groups: owner set -> process group."""

    def __init__(self, plan: Plan, worker: int | None, ranks: Sequence[int], group: dist.ProcessGroup | None) -> None:
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        sets = sorted({tuple(o) for o in plan.owners if len(o) > 1})
        if not sets:
            return
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("the schedule has replicated stages, whose owners all-reduce on groups made over "
                             "the whole default process group; build the engine on it (group=None)")
        globals_ = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
        for owners in sets:
            pg = _group(tuple(sorted(globals_[o] for o in owners)))
            if worker in owners:
                self.groups[owners] = pg

    def all_reduce(self, totals: dict[int, torch.Tensor], replicas: dict[int, tuple[int, ...]],
                   watchdog: Watchdog | None) -> None:
        """Sum ``totals[s]`` in place across ``replicas[s]`` for every replicated stage ``s``."""
        buckets: list[tuple[dist.ProcessGroup, list[int]]] = []
        for owners, pg in self.groups.items():
            stages = sorted(s for s, o in replicas.items() if o == owners)
            bucket: list[int] = []
            size = 0
            for s in stages:
                nbytes = totals[s].numel() * totals[s].element_size()
                if bucket and size + nbytes > BUCKET_BYTES:
                    buckets.append((pg, bucket))
                    bucket, size = [], 0
                bucket.append(s)
                size += nbytes
            if bucket:
                buckets.append((pg, bucket))
        pending = []
        for pg, stages in buckets:
            # one stage: reduce its buffer itself; several: one flat copy, viewed back after
            flat = totals[stages[0]] if len(stages) == 1 else torch.cat([totals[s] for s in stages])
            pending.append((dist.all_reduce(flat, group=pg, async_op=True), flat, stages))
        with blocked(watchdog):
            for work, flat, stages in pending:
                work.wait()
                if len(stages) > 1:
                    for s, part in zip(stages, flat.split([totals[s].numel() for s in stages])):
                        totals[s] = part


def warm_pairs(plan: Plan, worker: int | None, ranks: Sequence[int], group: dist.ProcessGroup | None,
               device: torch.device) -> None:
    """Open every pair communicator this worker's plan uses, in one global order (NCCL only).

    Pairs go in increasing ``(low, high)`` order; each is one tiny exchange from the lower worker to
    the higher. Every worker walks the same global list and takes part in its own pairs, so the
    first contacts cannot form a cycle (a worker only ever waits on the earliest pair still open)."""
    if worker is None:
        return
    pairs = sorted({(min(m.src, m.dst), max(m.src, m.dst)) for m in plan.messages})
    token = torch.zeros(1, device=device)
    for lo, hi in pairs:
        if worker == lo:
            dist.send(token, ranks[hi], group=group)
        elif worker == hi:
            dist.recv(token, ranks[lo], group=group)
