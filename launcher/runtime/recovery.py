"""Recovery inside the job: when a worker is lost, the survivors re-form the group and train on.

The local launcher (:class:`~launcher.runtime.processes.Supervisor`) with ``fault.restarts`` left,
on a worker's death (or a hang, once it has killed the stuck worker), does not abort the run: it
writes a new *generation* to the store's :data:`~launcher.runtime.failure.RECOVERY_KEY`, with the
surviving ranks (their original numbers) and the cause. Every survivor's watchdog reads it; the
step stops (the backend raises on the dead peer's connection, or :class:`~.failure.Recovering` at
the next check), and the caller, at the step's edge, calls :func:`rejoin`:

- the old process group is destroyed and every reference to it dropped, so its sockets close and a
  survivor still blocked on a live peer's message (gloo cannot be interrupted) gets an error too;
- the survivors join a new group through a ``PrefixStore`` of the generation, each at its position
  among the survivors (the new rank), and say so (``recovered/<generation>/<original rank>``), which
  the launcher waits for within ``timeout`` before it gives up and ends the run as before.

With ``fault.replace`` the generation keeps every rank: a fresh process (a spare the launcher forked
with the workers) takes the lost rank, says so as the survivors do, and joins the same group; the
store's :func:`replaced_key` of the generation names that rank (:func:`replaced_in`).

What state the survivors resume from, and which scheme they train under, is the caller's: the
Lightning side (:mod:`launcher.lightning.recovery`, :mod:`launcher.lightning.replacement`). Pure
process bookkeeping here.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from .failure import Watchdog, WorkerAborted

#: how long a survivor waits for the launcher's announcement after its step failed: the launcher
#: writes it as soon as it sees the death, so this only bounds a failure that is not a lost worker
ANNOUNCE_S = 10.0


def replaced_key(generation: int) -> str:
    """The key naming the rank a fresh process took in ``generation`` (``fault.replace``)."""
    return f"replaced/{generation}"


def cause_key(generation: int) -> str:
    """The key holding the cause of the loss that ``generation`` recovers from, which the launcher sets
    before it announces the generation: a survivor that missed an announcement (a later one came
    first) still reads every cause folded into the generation it joins."""
    return f"cause/{generation}"


def replaced_in(store: dist.Store, generation: int) -> list[int]:
    """The ranks a fresh process took in ``generation`` (none: the survivors go on without the lost)."""
    key = replaced_key(generation)
    return [int(r) for r in store.get(key).decode().split(",")] if store.check([key]) else []


def recovered_key(generation: int, rank: int) -> str:
    """The key a survivor (``rank``: its original number) sets once it has joined ``generation``."""
    return f"recovered/{generation}/{rank}"


@dataclass
class Membership:
    """This process's place in the job: the launcher's store, the backend, its original rank, and
    the survivors (original ranks, in new-rank order) of the generation it is in."""

    store: dist.Store
    backend: str
    rank: int
    members: list[int]
    generation: int = 0
    #: seconds each recovery took on this worker, from its step's failure to the new group's barrier
    seconds: list[float] = field(default_factory=list)
    #: a fresh process that took a lost worker's rank (``fault.replace``): it enters training from
    #: the state the survivors hand it (:mod:`launcher.lightning.replacement`)
    replacement: bool = False

    @property
    def new_rank(self) -> int:
        return self.members.index(self.rank)


_CURRENT: Membership | None = None


def current_membership() -> Membership | None:
    """This process's membership, where the local launcher started it (recovery is possible)."""
    return _CURRENT


def set_membership(m: Membership | None) -> None:
    global _CURRENT
    _CURRENT = m


def announced(watchdog: Watchdog | None, seconds: float = ANNOUNCE_S) -> tuple[int, list[int], str] | None:
    """The recovery the launcher announced after this worker's step failed, waiting up to
    ``seconds`` for it (the launcher may see the death a moment after a peer's connection broke);
    None when none comes (the failure is not a lost worker's: the caller re-raises)."""
    if watchdog is None:
        return None
    deadline = time.monotonic() + seconds
    while watchdog.recovery is None and watchdog.aborted is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return watchdog.recovery if watchdog.aborted is None else None


def joining_key(generation: int, rank: int) -> str:
    """The key a survivor (``rank``: its original number) sets as it starts to join ``generation``."""
    return f"joining/{generation}/{rank}"


def rejoin(m: Membership, watchdog: Watchdog, generation: int, survivors: list[int],
           pg_timeout: timedelta) -> tuple[int, list[int], list[str]]:
    """Leave the old group and join ``generation``'s, of ``survivors``; collective over them.
    Returns the generation joined, its survivors and the causes of the losses folded into it.

    Everything holding the old group (the engine, its subgroups) must be dropped by the caller
    first: its sockets close only when the last reference goes.

    A survivor lost meanwhile (before every survivor is there) is not waited for: each survivor
    first says it is joining and waits, in Python, for all the others to say so too; when the launcher
    announces a later generation meanwhile (without the one lost), it joins that one instead. Only
    then is the group formed (the backend's own rendezvous cannot be interrupted)."""
    from . import groups

    groups.forget_groups()  # the engine's cached subgroups of the old group: their sockets must close too
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    since = m.generation  # the losses folded in are those of every generation after it
    while True:
        m.store.set(joining_key(generation, m.rank), "1")
        later = _gathered(m.store, watchdog, generation, survivors)
        if later is None:
            break
        generation, survivors, _ = later  # a further loss: the next generation, without it
    # from the store, not the announcements this process saw: it may have missed one (a later came
    # first), and every process's record of the recovery must read the same
    causes = [m.store.get(cause_key(g)).decode() for g in range(since + 1, generation + 1)]
    m.generation, m.members = generation, list(survivors)
    dist.init_process_group(m.backend, store=dist.PrefixStore(f"pg{generation}", m.store), rank=m.new_rank,
                            world_size=len(survivors), timeout=pg_timeout)
    dist.barrier()
    watchdog.generation, watchdog.recovery = generation, None
    m.store.set(recovered_key(generation, m.rank), "1")
    return generation, list(survivors), causes


def _gathered(store: dist.Store, watchdog: Watchdog, generation: int,
              survivors: list[int]) -> tuple[int, list[int], str] | None:
    """Wait until every survivor of ``generation`` says it is joining (None), or the launcher
    announces a later generation (returned). The launcher ends the run (the watchdog's ``aborted``,
    or this process killed) when neither comes within its bound."""
    keys = [joining_key(generation, r) for r in survivors]
    with watchdog.blocked():  # waiting for peers: one that hangs meanwhile is named as in a collective
        while True:
            found = watchdog.recovery
            if found is not None and found[0] > generation:
                return found
            if watchdog.aborted is not None:
                raise WorkerAborted(watchdog.aborted)
            if store.check(keys):
                return None
            time.sleep(0.02)
