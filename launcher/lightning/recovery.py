"""A lost worker, recovered at the training step's edge: :class:`~.strategy.UnifiedStrategy`'s side
of :mod:`launcher.runtime.recovery`.

When a step fails on a survivor because the launcher announced a recovery (a peer died, or hung and
was killed), :func:`recover`:

1. drops the engine (its sockets and subgroups must close) and joins the generation's group
   (:func:`launcher.runtime.recovery.rejoin`), taking its new rank and world size;
2. agrees on the state to resume from: every survivor holds every stage (the schemes recovered are
   replicated: :func:`~launcher.schedule.run_settings.every_worker_holds_every_stage`), but a
   survivor may have finished the optimizer step before the failure while another had not (an
   all-reduce can complete on one rank and fail on another). The survivor that completed the most
   steps (the lowest such rank) broadcasts its module state and optimizer state; the others take them;
3. re-plans the step for the survivors (:func:`replan`): the user's scheme when its layout has the
   new number of workers, else the planner's fastest replicated layout for them, with the same stages
   and micro-batches, so the batch, its micro-batches and the data order stay those of an
   uninterrupted run; and builds the engine again;
4. records the recovery (cause, lost rank, step, seconds, steps lost, scheme before and after) for
   ``metrics.json`` and prints one line.

The caller then redoes the interrupted step; a survivor that was one step behind instead ends its
step without an update (it already holds the state after it), so both enter the next step together.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..runtime.failure import Recovering, WorkerAborted, is_transport_error
from ..runtime.processes import PG_TIMEOUT
from ..runtime.recovery import announced, current_membership, rejoin
from ..schedule.schemes import SCHEMES
from ..schedule.settings import SCHEME_DEFAULT, Settings

if TYPE_CHECKING:
    from .strategy import UnifiedStrategy

log = logging.getLogger(__name__)


def replan(settings: Settings, workers: int) -> tuple[Settings, str]:
    """The step for ``workers`` survivors, and how it was chosen: the same scheme when its layout
    fits them, else the planner's fastest layout that keeps every stage on every worker."""
    S, B = settings.stages, settings.microbatches
    registered = SCHEMES.get(settings.name)
    fixed = registered.sizes(S, B) if registered is not None else None
    if fixed is not None and fixed[0] * fixed[1] == workers:
        return settings.replace(G=fixed[0], R=fixed[1]), "the same scheme"
    if fixed is None and settings.R == 1 and settings.name == "lpp":
        return settings.replace(G=workers), "the same scheme"
    from ..plan.profile import unit
    from ..plan.search import Budget, search

    ranking = search(S, [B], workers, unit(settings.durations, settings.comm), Budget(), top=50)
    for c in ranking.candidates:
        p = c.point
        if p.scheme.name == "lpp" and p.R == 1 and p.G == workers:
            return settings.replace(scheme="lpp", G=p.G, R=1, order=SCHEME_DEFAULT), "the planner's choice"
    return settings.replace(scheme="lpp", G=workers, R=1, order=SCHEME_DEFAULT), "the data-parallel layout"


def recoverable(strategy: UnifiedStrategy, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a training step, is a lost peer the launcher is recovering from.
    Waits briefly for its announcement (it may come just after a connection broke)."""
    if strategy.run.fault.restarts <= 0 or current_membership() is None or strategy.engine is None:
        return False
    if not (isinstance(exc, Recovering) or is_transport_error(exc) or isinstance(exc, WorkerAborted)):
        return False
    return announced(strategy.engine.watchdog) is not None


def _label(s: Settings) -> str:
    return f"{s.name} G={s.G} R={s.R} (W={s.W})"


def recover(strategy: UnifiedStrategy, failed_at: float) -> bool:
    """Re-form the group without the lost worker and rebuild the step (the module docstring);
    collective over the survivors. Returns True when this worker must redo the interrupted step,
    False when it was one step behind and now holds the state after it."""
    m = current_membership()
    engine = strategy.engine
    assert m is not None and engine is not None and engine.watchdog is not None
    watchdog = engine.watchdog
    announcement = watchdog.recovery
    assert announcement is not None
    generation, survivors, cause = announcement
    lost = sorted(set(m.members) - set(survivors))
    if engine.links is not None:
        engine.links.close()
    strategy.engine = None
    del engine
    rejoin(m, watchdog, generation, survivors, PG_TIMEOUT)
    new_rank, world = m.new_rank, len(survivors)
    strategy.rejoined(new_rank, world)

    module = strategy.lightning_module
    assert module is not None
    trainer = module.trainer
    done = trainer.global_step
    found: list[Any] = [None] * world
    dist.all_gather_object(found, done)
    ahead = max(found)
    src = found.index(ahead)
    for t in module.state_dict().values():  # every survivor holds every stage: the same keys, in order
        if torch.is_tensor(t):
            dist.broadcast(t, src)
    behind = done < ahead
    box: list[Any] = [([opt.state_dict()["state"] for opt in trainer.optimizers], strategy.last_loss)]
    dist.broadcast_object_list(box, src)
    if behind:  # its parameters came with the module's state; its hyperparameters (lr) stay its own,
        # as its scheduler steps after this step as the others' did
        states, strategy.last_loss = box[0]
        for opt, state in zip(trainer.optimizers, states):
            full = opt.state_dict()
            full["state"] = state
            opt.load_state_dict(full)

    before = strategy.settings
    after, how = replan(before, world)
    strategy.rebuild(after)
    seconds = time.monotonic() - failed_at
    m.seconds.append(seconds)
    record = {"generation": generation, "cause": cause, "lost_ranks": lost, "step": ahead + 1,
              "seconds": round(seconds, 3), "steps_lost": 0, "redone": 1, "from": "memory",
              "scheme_before": _label(before), "scheme_after": _label(after), "chosen_by": how,
              "workers": [len(survivors) + len(lost), len(survivors)]}
    strategy.recoveries.append(record)
    if new_rank == 0:
        log.warning("recovered from the loss of rank %s at step %d in %.2f s: W %d -> %d, %s -> %s (%s); state "
                    "from memory, the interrupted step redone, 0 steps lost. Cause: %s",
                    ", ".join(map(str, lost)), ahead + 1, seconds, len(survivors) + len(lost), len(survivors),
                    _label(before), _label(after), how, cause)
    return not behind
