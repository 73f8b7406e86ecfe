"""A lost worker, recovered at the training step's edge: :class:`~.strategy.UnifiedStrategy`'s side
of :mod:`launcher.runtime.recovery`.

When a step fails on a survivor because the launcher announced a recovery (a peer died, or hung and
was killed), :func:`recover`:

1. drops the engine (its sockets and subgroups must close) and joins the generation's group
   (:func:`launcher.runtime.recovery.rejoin`), taking its new rank and world size;
2. agrees on the state to resume from: every stage survives the loss on some worker (the schemes
   recovered: :func:`~launcher.schedule.run_settings.survives_a_loss`; or as a copy, with
   ``fault.copies=1``: :mod:`.copies`), but a survivor may have
   finished the optimizer step before the failure while another had not (an all-reduce can complete
   on one rank and fail on another). Each stage comes from the lowest survivor that held it after
   the most completed steps (:func:`_sources`);
3. re-plans the step for the survivors (:func:`replan`): the user's scheme when its layout has the
   new number of workers, else the planner's fastest layout for them that survives another loss,
   with the same stages and micro-batches, so the batch, its micro-batches and the data order stay
   those of an uninterrupted run; builds the engine again, broadcasts every stage one of its new
   owners lacks (:func:`_take_stages`: parameters, buffers, optimizer state), leaves on the module
   the stages it now owns and refills the trainer's optimizers with them (:func:`_refill_optimizers`);
4. records the recovery (cause, lost rank, step, seconds, steps lost, what moved, scheme before and
   after) for ``metrics.json`` and prints one line.

The caller then redoes the interrupted step; a survivor that was one step behind instead ends its
step without an update (it already holds the state after it), so both enter the next step together.
Where the survivors met the loss in different places, or a replacement joins, every survivor leaves
``fit`` instead and enters it again from one state (:mod:`.replacement`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..runtime.failure import Recovering, WorkerAborted, is_transport_error
from ..runtime.processes import PG_TIMEOUT
from ..runtime.recovery import announced, current_membership, rejoin, replaced_in
from .recovery_terms import SAVE, TRAINING_STEP, Unrecoverable
from .replacement import depart, in_place, places
from .replan import replan, scheme_label

if TYPE_CHECKING:
    from .strategy import UnifiedStrategy

log = logging.getLogger(__name__)


def recoverable(strategy: UnifiedStrategy, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a training step, is a lost peer the launcher is recovering from.
    Waits briefly for its announcement (it may come just after a connection broke)."""
    if strategy.run.fault.restarts <= 0 or current_membership() is None or strategy.engine is None:
        return False
    if not (isinstance(exc, Recovering) or is_transport_error(exc) or isinstance(exc, WorkerAborted)):
        return False
    return announced(strategy.engine.watchdog) is not None


def recover(strategy: UnifiedStrategy, failed_at: float, during: str = TRAINING_STEP) -> bool:
    """Re-form the group without the lost worker and rebuild the step (the module docstring);
    collective over the survivors. Returns True when this worker must redo the interrupted step,
    False when it was one step behind and now holds the state after it. ``during``: where the loss
    met this worker (a training step, a checkpoint save, ...: :mod:`.outside_step`), which is redone."""
    m = current_membership()
    engine = strategy.engine
    assert m is not None and engine is not None and engine.watchdog is not None
    watchdog = engine.watchdog
    announcement = watchdog.recovery
    assert announcement is not None
    generation, survivors, cause = announcement
    if replaced_in(m.store, generation):  # fault.replace: a fresh process takes the lost rank
        from .replacement import leave

        leave(strategy, failed_at, during)  # raises Replaced: every process enters fit again
    before_members = list(m.members)
    held = sorted(engine.owned)  # the stages whose state this worker holds
    kept = strategy.copies.tags() if strategy.copies is not None else {}  # fault.copies: stage -> its copy's step
    if engine.links is not None:
        engine.links.close()
    strategy.engine = None
    del engine
    # a further loss while the group re-forms is folded in: the generation joined may be a later one
    first = m.generation + 1  # not the generation announced: a later one may have come first
    generation, survivors, causes = rejoin(m, watchdog, generation, survivors, PG_TIMEOUT)
    cause = "; then ".join(causes) or cause
    lost = sorted(set(before_members) - set(survivors))
    new_rank, world = m.new_rank, len(survivors)
    strategy.rejoined(new_rank, world)
    # where each survivor met the loss: each redoes in place what it was in, so all must have been in
    # the same kind of thing; else (or with a replacement folded in) every survivor leaves fit and
    # enters it again from one state (:mod:`.replacement`), where it no longer matters where each was
    if not in_place(places(during)):
        depart(strategy, first, generation, before_members, cause, during, failed_at, None)

    module = strategy.lightning_module
    assert module is not None
    trainer = module.trainer
    done = trainer.global_step
    found: list[Any] = [None] * world
    dist.all_gather_object(found, (done, held, kept))
    ahead = max(f[0] for f in found)
    behind = done < ahead

    sources = _sources(found, ahead, strategy.settings.stages)
    before = strategy.settings
    after, how = replan(before, world)
    if sources is not None:
        # the stages taken from a copy (fault.copies): their source does not hold them itself
        copied = {s for s, src in enumerate(sources) if not (found[src][0] == ahead and s in found[src][1])}
        # what this worker sends, copied before the new engine's set-up syncs replicas from their
        # first owner (who may hold a stage it did not own before, not yet filled)
        mine = {s: strategy.copies.stages[s] if s in copied and strategy.copies is not None
                else _stage_payload(strategy, s) for s, src in enumerate(sources) if src == new_rank}
        strategy.rebuild(after)
        states, moved = _take_stages(strategy, sources, mine, found, ahead)
        strategy.own_stages()
        _refill_optimizers(module, trainer, states)
        where, lost_steps = "memory (copy)" if copied else "memory", 0
    else:  # a stage was only on the lost worker: every stage back to the last checkpoint, the steps since replayed
        strategy.rebuild(after)
        strategy.own_stages()
        _refill_optimizers(module, trainer, {})
        try:
            where, lost_steps, moved = _from_checkpoint(strategy, trainer, ahead)
        except Unrecoverable as e:  # the run ends: name the loss it could not recover from
            raise Unrecoverable(f"after the loss of rank {', '.join(map(str, lost))} ({cause}), {e}") from None
    if strategy.copies is not None:
        strategy.copies.reset()  # of the old ring: the redone step copies the state anew
    box: list[Any] = [strategy.last_loss]
    dist.broadcast_object_list(box, [f[0] for f in found].index(ahead))
    if behind:  # the loss of the step this worker now holds the result of
        strategy.last_loss = box[0]

    if not behind and min(f[0] for f in found) < ahead and trainer.world_size > 1:
        # Lightning's loop broadcasts a SIGTERM flag from rank 0 before every batch
        # (``_broadcast_sigterm_tensor``): the survivors behind will, before their next batch, which
        # is the one this worker redoes now; this is its side of that broadcast
        dist.broadcast(torch.tensor([0], device=strategy.root_device), src=0)
    if not strategy._keeps_batches:  # the new layout survives a loss from memory: no replay to keep them for
        strategy.since_checkpoint.clear()
    seconds = time.monotonic() - failed_at
    m.seconds.append(seconds)
    # the step the loss interrupted; a save's loss came after the step whose state it saved
    at = ahead if during == SAVE else ahead + 1
    record = {"generation": generation, "cause": cause, "lost_ranks": lost, "step": at,
              "seconds": round(seconds, 3), "steps_lost": lost_steps, "redone": 1, "during": during, "from": where,
              "moved_stages": moved["stages"], "moved_bytes": moved["bytes"],
              "scheme_before": scheme_label(before), "scheme_after": scheme_label(after), "chosen_by": how,
              "workers": [len(survivors) + len(lost), len(survivors)]}
    strategy.recoveries.append(record)
    if new_rank == 0:
        log.warning("recovered from the loss of rank %s at step %d in %.2f s: W %d -> %d, %s -> %s (%s); state "
                    "from %s, the interrupted %s redone, %d steps lost and replayed. Cause: %s",
                    ", ".join(map(str, lost)), at, seconds, len(survivors) + len(lost), len(survivors),
                    scheme_label(before), scheme_label(after), how, where,
                    during.removeprefix("a ").removeprefix("the "), lost_steps, cause)
    return not behind


def _sources(found: list[Any], ahead: int, S: int) -> list[int] | None:
    """Per stage, the new rank it is taken from: the lowest survivor that held it after the last
    completed step, else the lowest that keeps a copy of it of that step (``found``: per new rank,
    its completed steps, the stages it held, and its copies' steps by stage, :mod:`.copies`); None
    when some stage is on no such survivor (it was only on the lost worker)."""
    held_by: dict[int, list[int]] = {}
    for r, (d, held, _) in enumerate(found):
        if d == ahead:
            for s in held:
                held_by.setdefault(s, []).append(r)
    for r, (_, _, kept) in enumerate(found):  # after every holder: a copy is the fallback
        for s, step in kept.items():
            if step == ahead and s not in held_by:
                held_by[s] = [r]
    if any(s not in held_by for s in range(S)):
        return None
    return [held_by[s][0] for s in range(S)]


def _from_checkpoint(strategy: UnifiedStrategy, trainer: Any, ahead: int) -> tuple[str, int, dict[str, int]]:
    """Every worker's (new) stages, their optimizer state and the learning-rate schedules from the
    last sharded checkpoint, each worker reading only its own stages; then the steps since it
    replayed from the batches kept (:attr:`UnifiedStrategy.since_checkpoint`) up to ``ahead``
    completed steps, as Lightning's loop ran them (the loss, the clipping, the optimizer and
    scheduler steps). Returns where the state came from, the steps replayed, and what was read."""
    from .checkpoint_hooks import CheckpointingStrategy
    from .precision import clip_by_global_norm

    if trainer.accumulate_grad_batches > 1:
        raise Unrecoverable("a stage held only by the lost worker is recovered from the last checkpoint by "
                            "replaying the steps since, which this version does not do under "
                            "accumulate_grad_batches > 1")
    if strategy.last_checkpoint is None:
        raise Unrecoverable(f"a stage was held only by the lost worker and no sharded checkpoint was written yet "
                            f"(before step {ahead + 1}), so training cannot go on")
    path, step = strategy.last_checkpoint
    missing = [k for k in range(step, ahead) if k not in strategy.since_checkpoint]
    if missing:
        raise Unrecoverable(f"the batch of step {missing[0] + 1} since the checkpoint {path} is not kept, so the "
                            f"steps since it cannot be replayed")
    ckpt = CheckpointingStrategy.load_checkpoint(strategy, path)  # this worker's stages only
    strategy.load_model_state_dict(ckpt)
    strategy.load_optimizer_state_dict(ckpt)
    for config, state in zip(trainer.lr_scheduler_configs, ckpt.get("lr_schedulers", [])):
        config.scheduler.load_state_dict(state)
    read = sum(t.numel() * t.element_size() for t in ckpt["state_dict"].values() if torch.is_tensor(t))
    clip = trainer.gradient_clip_val
    for k in range(step, ahead):
        strategy.replay_step = k
        try:
            strategy._training_step(strategy.since_checkpoint[k])
        finally:
            strategy.replay_step = None
        assert strategy.engine is not None
        strategy.engine.install_grads()
        if clip:
            clip_by_global_norm(strategy, float(clip))
        else:
            strategy.fused_norm_sq = None
        for opt in trainer.optimizers:
            opt.step()
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and (k + 1) % config.frequency == 0:
                config.scheduler.step()
    strategy.records.clear()  # the replayed steps are not the run's measured ones
    return f"checkpoint {path}", ahead - step, {"stages": len(strategy.engine.owned if strategy.engine else []),
                                                 "bytes": read}


def _stage_payload(strategy: UnifiedStrategy, s: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stage ``s``'s parameters and buffers (copies) and its optimizer state by parameter name."""
    assert strategy._staged_model is not None and strategy.lightning_module is not None
    stage = strategy._staged_model.stages[s]
    by_param = {id(p): st for opt in strategy.lightning_module.trainer.optimizers for p, st in opt.state.items()}
    tensors = {k: v.detach().to("cpu", copy=True) for k, v in stage.state_dict().items()}
    opt = {n: {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in by_param[id(p)].items()}
           for n, p in stage.named_parameters() if id(p) in by_param}
    return tensors, opt


def _take_stages(strategy: UnifiedStrategy, sources: list[int], mine: dict[int, Any], found: list[Any],
                 ahead: int) -> tuple[dict[int, dict[int, Any]], dict[str, int]]:
    """Every stage this worker owns under the new layout that one of its new owners lacks, from its
    source (``mine``: the payloads this worker is the source of): its parameters and buffers written
    into the staged stage, and its optimizer state returned by parameter ``id``. A stage every new
    owner already held after the last step moves nothing. Collective: one broadcast per stage moved.
    Also returns what moved: ``stages`` and ``bytes`` (parameters, buffers, optimizer state)."""
    assert strategy._staged_model is not None and strategy.engine is not None
    stages = strategy._staged_model.stages
    owners, owned = strategy.engine.lowered.owners, set(strategy.engine.owned)
    out: dict[int, dict[int, Any]] = {}
    moved = {"stages": 0, "bytes": 0}
    for s, src in enumerate(sources):
        if all(found[r][0] == ahead and s in found[r][1] for r in owners[s]):
            continue  # its new owners hold it, and its optimizer state, as it was after the last step
        payload: list[Any] = [mine.get(s)]
        dist.broadcast_object_list(payload, src)
        tensors, opt_state = payload[0]
        moved["stages"] += 1
        moved["bytes"] += sum(t.numel() * t.element_size() for t in [*tensors.values(),
                              *(v for st in opt_state.values() for v in st.values())] if torch.is_tensor(t))
        if s not in owned:
            continue
        stages[s].load_state_dict(tensors)
        named = dict(stages[s].named_parameters())
        out[s] = {id(named[n]): {k: v.to(named[n].device) if torch.is_tensor(v) and v.dim() else v
                                 for k, v in st.items()} for n, st in opt_state.items() if n in named}
    return out, moved


def _refill_optimizers(module: Any, trainer: Any, states: dict[int, dict[int, Any]]) -> None:
    """The trainer's optimizers (the same objects: Lightning's loop and schedulers hold them) over
    the parameters now on the module, grouped as the module's ``configure_optimizers`` groups them,
    each parameter's state its own, or the one taken with its stage; hyperparameters (the scheduled learning
    rate) stay as they were."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    fresh, _ = _init_optimizers_and_lr_schedulers(module)
    state = {pid: st for per_stage in states.values() for pid, st in per_stage.items()}
    for old, new in zip(trainer.optimizers, fresh):
        for p, st in old.state.items():  # a stage kept: its own state
            state.setdefault(id(p), st)
        if len(old.param_groups) != len(new.param_groups):
            raise Unrecoverable("configure_optimizers made a different number of parameter groups for the new "
                                "layout, so the optimizer state cannot be carried over")
        old.state.clear()
        for g_old, g_new in zip(old.param_groups, new.param_groups):
            g_old["params"] = list(g_new["params"])
            for p in g_old["params"]:
                if id(p) in state:
                    old.state[p] = state[id(p)]
