"""Every process enters ``fit`` again after a loss: ``fault.replace`` (a fresh process takes a lost
worker's rank, and the run goes on under the user's scheme at the same W: the Lightning side of the
launcher's spares, :class:`~launcher.runtime.processes.Supervisor`), and a loss the survivors cannot
recover from in place (:func:`in_place`: met in Lightning's collectives between steps, or by the
survivors in different places), where they go on alone under the scheme re-planned for them.

A fresh process enters Lightning's ``fit`` from the top, and its set-up makes collectives (the
engine's subgroups, the agreed seed, Lightning's set-up barriers, the loop's per-batch SIGTERM
broadcast) that survivors in the middle of a step do not make. So every process enters ``fit``
together, from one state:

1. **The survivors leave** (:func:`leave`, from :func:`~.recovery.recover`): each meets the loss as
   without a replacement, keeps what it can hand over (a worker that holds every stage, under ``ddp``
   or ``lpp`` with ``R=1``: Lightning's whole checkpoint dict of its state after its last completed
   step, dumped alone, in CPU memory), joins the generation's group (the replacement joins it too:
   every rank is a member) and raises :class:`Replaced`, which leaves ``fit``.
2. **Every process agrees where to resume** (:func:`resume_path`, from
   :meth:`~.launcher.ForkLauncher._work`, which has torn the survivors' run down as Lightning does
   at the end of ``fit``): the survivors say what they hold; the source is the lowest survivor with the
   most completed steps; the state is its memory (:data:`MEMORY`, a ``ckpt_path`` the strategy
   resolves by a broadcast from it, :func:`handed_over`) or else the last sharded checkpoint the run
   wrote (the steps since it are trained again by the resumed loop: ``steps_lost``).
3. **Every process enters ``fit`` again** with that ``ckpt_path``: Lightning's set-up runs everywhere
   at once, and the loop resumes mid-epoch as a resume from a checkpoint does (the training loader's
   position, :mod:`.loader_position`). The recovery's record (``replaced``: the rank) is finished
   once the state is loaded (:func:`finish`) and goes into ``metrics.json`` with the earlier ones.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection

from ..runtime.processes import PG_TIMEOUT
from ..runtime.recovery import current_membership, rejoin, replaced_in
from ..schedule.run_settings import one_holds_every_stage
from .lightning_private import as_between_batches, dump_checkpoint
from .loader_position import KEY, Positions
from .recovery_terms import BETWEEN, SAVE, TRAINING_STEP, Unrecoverable
from .replan import replan, scheme_label

if TYPE_CHECKING:
    from .strategy import UnifiedStrategy

log = logging.getLogger(__name__)

#: the ``ckpt_path`` of a state handed over in memory by a survivor (:func:`handed_over`)
MEMORY = "memory://a-survivor"


class Replaced(Exception):
    """Raised on a survivor once it has joined the new group (with a replacement, or where the
    survivors cannot recover in place, :func:`in_place`): it leaves ``fit``, to enter it again with
    every other process (:meth:`~.launcher.ForkLauncher._work`)."""


@dataclass
class Offer:
    """What a survivor brings to the agreement on where to resume (:func:`resume_path`)."""

    done: int  # its completed optimizer steps
    during: str  # where the loss met it
    last_checkpoint: tuple[str, int] | None  # the last sharded checkpoint the run wrote, and its step
    last_saved: tuple[str, int] | None  # the last checkpoint of either format written whole, and its step
    failed_save: str | None  # the path of the save the loss met it in, if it did
    holds_state: bool  # it dumped its whole state (it holds every stage)
    recoveries: list[dict[str, Any]]  # the run's recoveries so far
    generation: int
    cause: str
    replaced: list[int]
    failed_at: float  # when its step failed (time.monotonic(); read on this process only)
    lost: list[int]  # the ranks lost (replaced or not)
    scheme_before: str
    scheme_after: str  # the scheme fit is entered again under (re-planned for the survivors alone)
    chosen_by: str
    workers: list[int]  # [before, after]
    rank: int  # its original rank (the loss's record names survivors by theirs)


@dataclass
class Pending:
    """The recovery under way on this process, from the agreement until the state is loaded."""

    source: int  # the rank the state comes from
    record: dict[str, Any]
    failed_at: float | None  # on the source: when its step failed (it measures the seconds)


def places(during: str | None) -> list[str | None]:
    """Where the loss met each process of the new group (None: a replacement process, which met
    none); collective, the first one over the new group on every path (:func:`~.recovery.recover`,
    :func:`leave`, a replacement's :meth:`~.launcher.ForkLauncher._work`), so every process learns
    the same and takes the same path."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, during)
    return found


def in_place(points: list[str | None]) -> bool:
    """Whether the survivors recover in place (:func:`~.recovery.recover`: cheaper, no re-entry):
    no replacement joins, and every survivor met the loss in the same kind of thing, one it can redo.
    A collective completes on some ranks and fails on others, so one survivor may be in a save while
    another is in the next step; redone, their collectives would not match."""
    return None not in points and len(set(points)) == 1 and points[0] != BETWEEN


def leave(strategy: UnifiedStrategy, failed_at: float, during: str) -> NoReturn:
    """A survivor's side of a loss it cannot recover from in place (a fresh process replaces the
    lost one, or the loss met it in Lightning's collectives between steps): keep the state to hand
    over, join the generation's group, agree where each met it (:func:`places`), and leave
    (:func:`depart`)."""
    m = current_membership()
    engine = strategy.engine
    assert m is not None and engine is not None and engine.watchdog is not None
    watchdog = engine.watchdog
    assert watchdog.recovery is not None
    generation, members, cause = watchdog.recovery
    module = strategy.lightning_module
    assert module is not None
    trainer = module.trainer
    s = strategy.settings
    state = None
    if during == TRAINING_STEP and one_holds_every_stage(s.name, s.G, s.R) and replaced_in(m.store, generation):
        state = _whole_state(strategy, trainer)  # the replacement may start from it (:func:`resume_path`)
    if engine.links is not None:
        engine.links.close()
    strategy.engine = None
    del engine
    before = list(m.members)
    first = m.generation + 1  # not the generation announced: a later one may have come first
    generation, members, causes = rejoin(m, watchdog, generation, members, PG_TIMEOUT)
    strategy.rejoined(m.new_rank, len(members))
    places(during)
    depart(strategy, first, generation, before, "; then ".join(causes) or cause, during, failed_at, state)


def depart(strategy: UnifiedStrategy, first: int, generation: int, before: list[int], cause: str, during: str,
           failed_at: float, state: dict[str, Any] | None) -> NoReturn:
    """Once in the new group (generation ``generation``, the loss announced in ``first``; ``before``:
    the members before it): re-plan the step for the new group when it is smaller, offer what this
    survivor holds for the agreement on where to resume (:func:`resume_path`), and raise
    :class:`Replaced`, which leaves ``fit``."""
    m = current_membership()
    assert m is not None
    module = strategy.lightning_module
    assert module is not None
    # a loss during the rejoin is folded into a later generation, whose record names only its own
    # replaced rank: the recovery replaced those of every generation since the first
    replaced = sorted({r for g in range(first, generation + 1) for r in replaced_in(m.store, g)})
    lost = sorted((set(before) - set(m.members)) | set(replaced))
    old = strategy.settings
    if len(m.members) == len(before):
        new, how = old, "the user's scheme, kept (a fresh process took the lost rank)"
    else:  # the survivors alone: fit is entered again under the scheme for them
        new, how = replan(old, len(m.members))
        strategy.replan_to(new)
    if strategy.copies is not None:
        strategy.copies.reset()  # of the old ring: the resumed loop's first step copies the state anew
    strategy.handover = state
    strategy.offer = Offer(module.trainer.global_step, during, strategy.last_checkpoint, strategy.last_saved,
                           strategy.failed_save if during == SAVE else None, state is not None,
                           list(strategy.recoveries), generation, cause, replaced, failed_at, lost,
                           scheme_label(old), scheme_label(new), how, [len(before), len(m.members)], m.rank)
    raise Replaced(f"after the loss of rank {', '.join(map(str, lost))}: every process enters fit again")


def _whole_state(strategy: UnifiedStrategy, trainer: Any) -> dict[str, Any]:
    """Lightning's checkpoint dict of this worker's state after its last completed step, taken
    alone (it holds every stage) in the single-device layout, as if saved after that step's batch."""
    assert strategy.layout is not None
    strategy._alone = dataclasses.replace(strategy.layout, writers=list(range(strategy.settings.stages)))
    try:
        checkpoint = dump_checkpoint(trainer)
    finally:
        strategy._alone = None
    # copies: on the CPU the dump's tensors are the live ones, and the engine built when fit is entered
    # again sets every replica from its first owner, which may be the replacement's fresh parameters
    checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
    as_between_batches(checkpoint)
    Positions.save(checkpoint, trainer)
    for position in checkpoint.get(KEY, []):  # the batch of the interrupted step was read, not trained
        position["taken"] = max(0, int(position["taken"]) - 1)
    return checkpoint


def resume_path(strategy: UnifiedStrategy) -> str:
    """Every process's ``ckpt_path`` to enter ``fit`` again from (the module docstring, 2); collective
    over the new group. Also sets the run's recoveries, this one included, on every process."""
    mine = strategy.offer
    offers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(offers, mine)
    strategy.offer = None
    survivors = [r for r, o in enumerate(offers) if o is not None]
    if not survivors:
        raise Unrecoverable("a replacement process joined a group with no survivor to take the state from")
    first = offers[survivors[0]]
    lost = f"after the loss of rank {', '.join(map(str, first.lost))} ({first.cause})"
    places = {offers[r].during for r in survivors}
    where_met = "; ".join(f"rank {offers[r].rank} in {offers[r].during}" for r in survivors)
    ahead = max(offers[r].done for r in survivors)
    source = min(r for r in survivors if offers[r].done == ahead)
    o = offers[source]
    if places == {TRAINING_STEP} and o.holds_state:
        path, steps_lost, where = MEMORY, 0, "memory"
    elif places == {TRAINING_STEP} and o.last_checkpoint is not None:
        path, step = o.last_checkpoint
        steps_lost, where = ahead - step, f"checkpoint {path}"
    elif places != {TRAINING_STEP}:
        # a loss in a save, between steps, or met in different places: not from memory (the resumed
        # loop would go on after the save it met, never writing it) but from the last checkpoint of
        # either format written whole (its save's barrier passed on some survivor), any scheme and W
        # loading it; the resumed loop trains the steps since and writes the saves since again
        saved = [offers[r].last_saved for r in survivors if offers[r].last_saved is not None]
        if not saved:
            raise Unrecoverable(f"{lost}, met in {where_met}: the run then goes on from the last checkpoint "
                                f"written whole, and none was, so training cannot go on")
        path, step = max(saved, key=lambda p: p[1])
        steps_lost, where = ahead - step, f"checkpoint {path}"
        if dist.get_rank() == 0:
            # under an interrupted save's name: a single file its writer finished before the save's
            # barrier failed, or a writer's temporary file. Removed, or ModelCheckpoint would write the
            # save again under another name (``-v1``). (The same name as the last whole save, as
            # ``last.ckpt`` saved alone: kept, whole either way, old or new, and resumed from.)
            for failed in sorted({offers[r].failed_save for r in survivors} - {None, path}):
                _remove_save(failed)
    else:
        raise Unrecoverable(f"{lost}, a stage was held only by the lost worker and no sharded checkpoint was "
                            f"written yet (before step {ahead + 1}), so training cannot go on")
    during = o.during if len(places) == 1 else f"different places ({where_met})"
    record = {"generation": o.generation, "cause": o.cause, "lost_ranks": o.lost,
              **({"replaced": o.replaced} if o.replaced else {}),
              # the step the loss interrupted; met after a step (in its save, between steps): that step
              "step": ahead + 1 if o.during == TRAINING_STEP else ahead,
              "seconds": 0.0, "steps_lost": steps_lost, "redone": 1, "during": during,
              "from": where, "moved_stages": 0, "moved_bytes": 0, "scheme_before": o.scheme_before,
              "scheme_after": o.scheme_after, "chosen_by": o.chosen_by, "workers": o.workers}
    strategy.recoveries = [*o.recoveries, record]
    strategy.pending = Pending(source, record, mine.failed_at if mine is not None else None)
    if dist.get_rank() != source:
        strategy.handover = None  # only the source's state is handed over
    return path


def _remove_save(path: str) -> None:
    """Remove the checkpoint at ``path`` (a file or a sharded checkpoint's directory) and the
    temporary files killed writers of it left."""
    import shutil
    from pathlib import Path

    from ..atomic import remove_leftovers

    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()
    remove_leftovers(p)


def handed_over(strategy: UnifiedStrategy) -> dict[str, Any]:
    """The :data:`MEMORY` checkpoint: the source survivor's state, broadcast to every process (collective)."""
    pending = strategy.pending
    assert pending is not None
    box: list[Any] = [strategy.handover if dist.get_rank() == pending.source else None]
    dist.broadcast_object_list(box, pending.source)
    strategy.handover = None
    return box[0]


def _state_bytes(checkpoint: dict[str, Any]) -> int:
    """Bytes of a checkpoint's tensors (its module state and optimizer states)."""
    found = [*checkpoint.get("state_dict", {}).values()]
    for opt in checkpoint.get("optimizer_states", []):
        found += [v for st in opt.get("state", {}).values() for v in st.values()]
    return sum(t.numel() * t.element_size() for t in found if torch.is_tensor(t))


def finish(strategy: UnifiedStrategy, checkpoint: dict[str, Any]) -> None:
    """Once every process has its state (``checkpoint``, loaded): the record's seconds (the source's,
    from its step's failure), what was moved or read, and the console line (rank 0); collective."""
    pending, strategy.pending = strategy.pending, None
    assert pending is not None
    source = pending.source
    mine = None
    if dist.get_rank() == source:
        assert pending.failed_at is not None
        # from memory every stage was sent; from a checkpoint, the source read its own stages
        stages = strategy.settings.stages if pending.record["from"] == "memory" else \
            len(strategy.engine.owned if strategy.engine is not None else [])
        mine = (round(time.monotonic() - pending.failed_at, 3), stages, _state_bytes(checkpoint))
    box: list[Any] = [mine]
    dist.broadcast_object_list(box, source)
    seconds, stages, moved = box[0]
    record = pending.record
    record.update(seconds=seconds, moved_stages=stages, moved_bytes=moved)
    m = current_membership()
    if m is not None:
        m.seconds.append(seconds)
    if dist.get_rank() == 0:
        lost = ", ".join(map(str, record["lost_ranks"]))
        if "replaced" in record:
            log.warning("recovered from the loss of rank %s at step %d in %.2f s: a fresh process took rank %s, W %d "
                        "-> %d, %s kept; state from %s, the interrupted training step redone, %d steps lost and "
                        "trained again. Cause: %s", lost, record["step"], seconds, lost, *record["workers"],
                        record["scheme_after"], record["from"], record["steps_lost"], record["cause"])
        else:
            log.warning("recovered from the loss of rank %s at step %d in %.2f s: W %d -> %d, %s -> %s (%s); met in "
                        "%s, every survivor entered fit again, state from %s, %d steps lost and trained again. "
                        "Cause: %s", lost, record["step"], seconds, *record["workers"], record["scheme_before"],
                        record["scheme_after"], record["chosen_by"], record["during"], record["from"],
                        record["steps_lost"], record["cause"])
