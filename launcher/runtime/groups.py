"""Collectives of the step: the replicas' gradient all-reduce, and NCCL's pair communicators.

Replicas: the owners of a replicated stage (DDP, LPP with G > 1) sum its gradient across
themselves. Stages of one owner set are merged, in the step's
:attr:`~launcher.schedule.program.Lowered.reduce_order`, into buckets (DistributedDataParallel's sizes:
the first closes at 1 MiB so it starts early, the others at 25 MiB so they are few); the gradient
is accumulated straight into its bucket's buffer (allocated once, as DDP's), so a bucket costs no
copy. Every owner launches a bucket's all-reduce as soon as its own share is complete (its
``REDUCE`` action, :meth:`~launcher.schedule.program.Program.reduce_points`), so the transfer of the
last stages overlaps the backward of the first
ones. The order, the buckets, their members and their algorithm follow from the program and the
stages' sizes, so they are the same on every worker and the collectives match.

Algorithm, per bucket:

- on one host's CPUs under ``transport`` ``shm`` or ``auto`` (every worker of the group on this
  host, gloo: :meth:`~launcher.runtime.engine.Engine._links`), through shared memory
  (:mod:`.shared_reduce`): the bucket's buffer lives in a memory file its owners map, and is reduced
  by a reduce-scatter then an all-gather through them, started as soon as this worker's share is
  complete and advanced at every later ``REDUCE``, finished at the end of the step. No socket
  carries the gradient: gloo's ring pushed about ``2 (n - 1) / n`` times its bytes per worker
  through loopback TCP, which cost kernel copies and gloo's threads CPU on the cores the workers
  share (docs/performance.md, "Collectives per step");
- under NCCL, ``all_reduce`` on a process group of exactly the owners (NCCL's ring or tree),
  asynchronous on NCCL's stream, launched at the end of the step once every point-to-point
  message of the step is issued (kernels of two communicators that wait on each other across
  ranks are not promised to progress);
- under gloo, gloo's own asynchronous ``all_reduce`` (its ring runs on gloo's threads, as
  DistributedDataParallel's does) as soon as this worker's share is complete: during the backward
  for a bucket some owner completes before its last job, after the last job otherwise;
- except, under gloo, a *small* bucket that every owner completes only with its last job
  (``ROOT_BYTES``: the root moves at most that much each way): it goes through one root in two
  rounds of point-to-point messages (:func:`~launcher.runtime.collectives.through_root`), where
  gloo's ring takes ``2 (n - 1)``. On workers that share cores a round costs a peer's turn on a
  core, so few rounds win: DDP on 8 workers, 264 KB of gradient, 36 ms a step with gloo's ring and
  20 ms through a root (``benchmarks/vs_torch_native.py``). A large one is bandwidth-bound: it
  used to be reduced by recursive halving-doubling on the compute thread, which cost that thread
  its sends and adds (0.7 to 1 ms a step on the MLP benchmark's 3 MB bucket among 4 workers) where
  DDP's ring costs its compute thread nothing (docs/performance.md, "Collectives per step").

Which is which follows from the program and the stages' sizes, so every owner of a bucket reduces
it the same way. Under gloo, the ring's all-reduces are waited for before the rounds through a root
(no collective in flight on gloo's thread while a rank waits for point-to-point messages: a failed
rank's group could not close, :meth:`Replicas.finish`).

NCCL pairs: point-to-point communicators are created lazily on a pair's first message, which
blocks both ends; two pairs whose first messages form a cycle deadlock. :func:`warm_pairs`
creates every pair a program uses up front, in one global order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from launcher.schedule.link import ROOT_BYTES
from launcher.schedule.program import Lowered

from .collectives import through_root
from .failure import Watchdog, blocked
from .shared_links import SharedLinks
from .shared_reduce import SharedReduce

if TYPE_CHECKING:
    from .comm import Clock

#: buckets close once they hold this many bytes, the first one sooner: DistributedDataParallel's
#: sizes (``bucket_cap_mb`` and its first bucket), so the first stages' transfer starts early and
#: the rest go in few collectives
BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20

# engines built one after another in a process (every process builds the same ones, so every
# process makes the same calls) share their groups instead of making new ones each time
_made: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    key = (id(dist.group.WORLD), ranks)
    if key not in _made:
        _made[key] = dist.new_group(list(ranks))
    return _made[key]


def forget_groups() -> None:
    """Drop the cached subgroups: a new process group (a recovery, :mod:`.recovery`) makes them
    stale, and their sockets must close with the old group."""
    _made.clear()


@dataclass
class Bucket:
    """Replicated stages of one owner set and dtype, all-reduced as one flat buffer."""

    index: int  # place among all buckets of the step, the same on every worker (message tags)
    owners: tuple[int, ...]
    stages: list[int]
    numels: list[int]
    ready: int = -1  # this worker's job index after which its share of every stage is complete
    at_end: bool = False  # every owner completes it with its last job: nothing left to overlap
    small: bool = False  # its root would move at most ROOT_BYTES each way (through a root, at the end)

    @property
    def numel(self) -> int:
        return sum(self.numels)


def plan_buckets(lowered: Lowered, nbytes: Sequence[int], numels: Sequence[int], dtypes: Sequence[torch.dtype],
                 bucket_bytes: int) -> list[Bucket]:
    """Every bucket of the step, in the launch order common to all workers. Stages share a
    bucket only with stages of the same owners and dtype (one flat buffer each, as DDP's)."""
    order = {s: k for k, s in enumerate(lowered.reduce_order)}
    open_: dict[tuple, tuple[Bucket, int]] = {}
    every: list[Bucket] = []
    for s in lowered.reduce_order:
        owners = tuple(lowered.owners[s])
        key = (owners, dtypes[s])
        b, size = open_.pop(key, (Bucket(-1, owners, [], []), 0))
        b.stages.append(s)
        b.numels.append(numels[s])
        size += nbytes[s]
        if size >= (min(FIRST_BUCKET_BYTES, bucket_bytes) if not every else bucket_bytes):
            every.append(b)
        else:
            open_[key] = (b, size)
    every += [b for b, _ in open_.values()]
    every.sort(key=lambda b: order[b.stages[-1]])  # launch order: when its last stage is ready
    points = {o: lowered.programs[o].reduce_points() for b in every for o in b.owners}
    for i, b in enumerate(every):
        b.index = i
        b.at_end = all(max(points[o][s] for s in b.stages) >= len(lowered.programs[o].jobs) - 1 for o in b.owners)
        b.small = (len(b.owners) - 1) * sum(nbytes[s] for s in b.stages) <= ROOT_BYTES
    return every


class Replicas:
    """This worker's all-reduces of replicated stages: buckets, launch, and the wait at the end."""

    def __init__(self, lowered: Lowered, worker: int | None, ranks: Sequence[int], group: dist.ProcessGroup | None,
                 layouts: Sequence, device: torch.device, bucket_bytes: int = BUCKET_BYTES, shared: bool = False,
                 links: SharedLinks | None = None, watchdog: Watchdog | None = None) -> None:
        """``shared``: every bucket of the group is reduced through shared memory (the same on
        every rank: every worker is on this host's CPUs, :meth:`~launcher.runtime.engine.Engine._links`),
        over this worker's ``links``."""
        self.lowered, self.worker, self.ranks, self.group = lowered, worker, list(ranks), group
        self.nccl = dist.get_backend(group) == "nccl"
        self.shared = shared
        # a stage's gradient is its trainable parameters' (:class:`~launcher.runtime.layout.StageLayout`)
        nbytes = [L.grad_numel * torch.empty(0, dtype=L.dtype).element_size() for L in layouts]
        every = plan_buckets(lowered, nbytes, [L.grad_numel for L in layouts], [L.dtype for L in layouts], bucket_bytes)
        self.buckets = [b for b in every if worker in b.owners]
        if worker is not None:  # a rank that is no worker has no buckets
            points = lowered.programs[worker].reduce_points()
            for b in self.buckets:
                b.ready = max(points[s] for s in b.stages)
        dtypes = [layouts[b.stages[0]].dtype for b in self.buckets]
        self.shm: SharedReduce | None = None
        if shared and self.buckets:  # the buffers live in memory every owner of the bucket maps
            assert links is not None  # every worker of a shared group has links
            self.shm = SharedReduce(links, [b.index for b in self.buckets], [b.owners for b in self.buckets],
                                    [b.numel for b in self.buckets], dtypes, watchdog, lowered.reduce_tag, self.ranks)
            self.flats = list(self.shm.flats)
        else:
            self.flats = [torch.empty(b.numel, dtype=dt, device=device) for b, dt in zip(self.buckets, dtypes)]
        self.slices: dict[int, torch.Tensor] = {}  # stage -> its slice of its bucket's buffer
        for b, flat in zip(self.buckets, self.flats):
            for s, part in zip(b.stages, flat.split(b.numels)):
                self.slices[s] = part
        self.groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._make_groups(every, worker, group)
        #: called at the end of each step once every collective of the step's buckets is launched
        #: (under gloo, once the rounds through a root are done), before the rest are waited for
        #: (:meth:`~launcher.runtime.engine.Engine.after_reduce_launched`)
        self.on_launched: Callable[[], None] | None = None
        # what the point-to-point all-reduces receive into, allocated once (a fresh megabyte
        # buffer each step costs a page fault per 4 KiB on first touch)
        sizes = [(len(b.owners) - 1) * f.numel() for b, f in zip(self.buckets, self.flats) if self._by_root(b)]
        dtype = self.flats[0].dtype if self.flats else torch.float32
        self.scratch = torch.empty(max(sizes, default=0), dtype=dtype, device=device)
        self.reset()

    def _by_root(self, b: Bucket) -> bool:
        """Whether ``b`` is reduced through one root at the end of the step (gloo, small, and
        nothing to overlap): every other bucket is a collective of the backend."""
        return not self.nccl and not self.shared and b.at_end and b.small

    def _make_groups(self, every: list[Bucket], worker: int | None, group: dist.ProcessGroup | None) -> None:
        """A process group per owner set that some bucket all-reduces with a collective.

        ``new_group`` is collective over the default group, members or not (making only the
        members' groups locally can hang when one worker is in two sets), so every process of
        the world builds its engine, ranks with no worker too, and makes every such group; the
        decision is the program's, the same on every process. A set of every rank of the engine's
        group uses that group."""
        sets = sorted({b.owners for b in every if not self._by_root(b)})  # those with a collective
        if not sets or self.shared:  # through shared memory: no collective (decided alike on every rank)
            return
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("the schedule has replicated stages, whose owners all-reduce on groups made over "
                             "the whole default process group; build the engine on it (group=None)")
        globals_ = [dist.get_global_rank(group, r) if group is not None else r for r in self.ranks]
        for owners in sets:
            members = tuple(sorted(globals_[o] for o in owners))
            pg = None if len(members) == dist.get_world_size() else _group(members)
            if worker in owners:
                self.groups[owners] = pg

    # ---- per step ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a step: nothing written, nothing launched. The buffers are reused, so a step's
        totals are valid until the next step starts."""
        self.filled: set[int] = set()
        self.next = 0
        self.pending: list = []
        if self.shm is not None:
            self.shm.reset()

    def timed_by(self, clock: Clock) -> None:
        """Time this step's rounds through shared memory on ``clock`` (a
        :class:`~launcher.runtime.comm.Clock`), as the rounds through a root are."""
        if self.shm is not None:
            self.shm.clock = clock

    def buffer(self, s: int) -> torch.Tensor | None:
        """Where stage ``s``'s gradient total accumulates on this worker (a slice of its bucket's
        buffer, whose first write must overwrite), or ``None`` if ``s`` is not replicated here."""
        return self.slices.get(s)

    def fill(self, s: int) -> bool:
        """Mark ``s``'s slice as written; True the first time (the caller overwrites, not adds)."""
        first = s not in self.filled
        self.filled.add(s)
        return first

    def _overlaps(self, b: Bucket) -> bool:
        """Whether ``b`` is launched as soon as this worker's share is complete: under gloo every
        bucket not reduced through a root (gloo's own all-reduce, on its threads). Under NCCL every
        bucket waits for the end of the step: an all-reduce kernel on its group's communicator while
        the step's point-to-point kernels still run on the pairs' could wait on each other across ranks."""
        return not self.nccl and not self._by_root(b)

    def launch_ready(self, done: int) -> None:
        """Launch, in order, every bucket reduced during the step whose shares are complete once
        job ``done`` has ended (at a ``REDUCE`` of the program; those reduced at the end are
        :meth:`finish`'s, whatever their place: the two kinds never wait on each other)."""
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if self._overlaps(b):
                if b.ready > done:
                    break
                self._zero_unwritten(b)
                if self.shm is not None:  # its owners sum it through shared memory
                    self.shm.share(self.next)
                else:
                    self.pending.append(dist.all_reduce(self.flats[self.next], group=self.groups[b.owners],
                                                        async_op=True))
            self.next += 1
        if self.shm is not None:  # sum and gather what the peers' shares already allow
            self.shm.advance(wait=False)

    def _zero_unwritten(self, b: Bucket) -> None:
        for s in b.stages:  # a stage this worker adds nothing to (nor receives for) counts zero
            if self.fill(s):
                self.slices[s].zero_()

    def finish(self, watchdog: Watchdog | None, clock=None) -> None:
        """Reduce what is left and wait for every all-reduce of the step (``clock``: a
        :class:`~launcher.runtime.comm.Clock` that times the point-to-point rounds)."""
        if self.worker is None:
            return
        self.launch_ready(len(self.lowered.programs[self.worker].jobs))
        ends = [i for i, b in enumerate(self.buckets) if not self._overlaps(b)]  # the end of the step's
        for i in ends:
            self._zero_unwritten(self.buckets[i])
            if self.nccl:  # in the common order
                self.pending.append(dist.all_reduce(self.flats[i], group=self.groups[self.buckets[i].owners],
                                                    async_op=True))
        if self.shm is not None:
            # Every bucket through shared memory, to its end, before the step's small collective
            # (on_launched) is launched: these waits are interruptible (select, the watchdog) and
            # read a dead peer's end of stream, but a gloo collective in flight meanwhile could
            # still hold a failed rank's group from closing, as below. So none is.
            self.shm.advance(wait=True)
        with blocked(watchdog):
            # Under gloo, no collective of this rank may be in flight on gloo's thread while ranks
            # wait, uninterruptibly, for point-to-point messages (the rounds through a root): when a
            # rank fails there on a lost peer's message, destroying its group joins that thread,
            # stuck in the collective on a live peer that still waits for the failed rank's message,
            # so no socket closes and the recovery hangs (tests/lightning/test_recovery.py, the
            # command line under ddp). So the ring buckets are waited for before those rounds, and
            # the step's small collective (on_launched) is launched after them.
            if not self.nccl and ends:
                for work in self.pending:
                    work.wait()
                self.pending.clear()
                for i in ends:  # through a root, in the common order
                    b, flat = self.buckets[i], self.flats[i]
                    through_root(flat, [self.ranks[o] for o in b.owners], b.owners.index(self.worker),
                                 functools.partial(self.lowered.reduce_tag, b.index), self.group, clock,
                                 self.scratch if self.scratch.dtype == flat.dtype else None)
            if self.on_launched is not None:  # every collective of the buckets is on its way
                self.on_launched()
            for work in self.pending:
                work.wait()


def warm_pairs(lowered: Lowered, worker: int | None, ranks: Sequence[int], group: dist.ProcessGroup | None,
               device: torch.device) -> None:
    """Open every pair communicator this worker's program uses, in one global order (NCCL only).

    Pairs go in increasing ``(low, high)`` order; each is one tiny exchange from the lower worker to
    the higher. Every worker walks the same global list and takes part in its own pairs, so the
    first contacts cannot form a cycle (a worker only ever waits on the earliest pair still open)."""
    if worker is None:
        return
    pairs = sorted({(min(m.src, m.dst), max(m.src, m.dst)) for m in lowered.messages})
    token = torch.zeros(1, device=device)
    for lo, hi in pairs:
        if worker == lo:
            dist.send(token, ranks[hi], group=group)
        elif worker == hi:
            dist.recv(token, ranks[lo], group=group)
