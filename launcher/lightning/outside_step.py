"""A lost worker met outside a training step, recovered: in a checkpoint save, or in the clipping's
own all-reduce (:mod:`.recovery` does the recovery; this module is where it is caught and what is
redone after it).

- **A checkpoint save** (:func:`recovering_saves`): Lightning's ``Trainer.save_checkpoint`` (the
  gathered state, the sharded write's collectives, the barrier after it) on a survivor whose peer
  was lost. Both formats write under a temporary name and swap it in whole, so the failed save left
  nothing under the checkpoint's name (the previous checkpoint stays the last one; a sharded run's
  recovery reads it). After the recovery the survivors save again, under the new layout; the
  temporary file a lost writer left is removed first.
- **The clipping's own all-reduce** (:func:`reduce_norm_or_recover`): when the norm is not fused
  into the step's all-reduce (a hook between the backward and the clipping, such as
  ``on_after_backward``), a survivor meets the loss after its training step returned, inside
  Lightning's optimizer closure. After the recovery it redoes the step's closure as Lightning ran
  it (the step under the new engine, the backward hooks, ``on_before_optimizer_step``) and clips
  the new gradients.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..atomic import remove_leftovers

if TYPE_CHECKING:
    from .strategy import UnifiedStrategy


def recovering_saves(strategy: UnifiedStrategy, trainer: Any) -> None:
    """Make ``trainer.save_checkpoint`` recover from a worker lost during the save and save again.
    Wraps the trainer's bound method once (a second set-up of the same trainer keeps the wrapper)."""
    save: Callable[..., None] = trainer.save_checkpoint
    if getattr(save, "recovers", False):
        return

    def save_checkpoint(*args: Any, **kwargs: Any) -> None:
        from .recovery import recover, recoverable
        from .recovery_terms import SAVE

        path = kwargs.get("filepath", args[0] if args else None)
        while True:
            try:
                save(*args, **kwargs)
            except Exception as e:
                if not recoverable(strategy, e):
                    raise
                failed_at = time.monotonic()
            else:
                if strategy.run.checkpoint.async_mode == "disabled" and path:
                    # whole on disk: the save's barrier has passed, so its writer (rank 0) has written it;
                    # a recovery that enters fit again may resume from it (:mod:`.replacement`)
                    strategy.last_saved = (str(path), int(trainer.global_step))
                return
            # outside the except clause: the failure's traceback (and the old group it holds) is gone.
            # Every survivor had completed the same steps (the save comes after the step), so the
            # state is the one after the last step, whether this worker redoes a step or not.
            strategy.failed_save = None if path is None else str(path)
            recover(strategy, failed_at, during=SAVE)
            if strategy.global_rank == 0 and path is not None:
                # a single file's writer (the old rank 0) lost mid-write left its temporary file; a
                # sharded save's temporary directory is removed by the save itself
                remove_leftovers(path)

    save_checkpoint.recovers = True  # type: ignore[attr-defined]
    trainer.save_checkpoint = save_checkpoint


def reduce_norm_or_recover(strategy: UnifiedStrategy, sq: torch.Tensor,
                           all_reduce: Callable[[torch.Tensor], None]) -> bool:
    """Sum ``sq`` (this worker's squared share of the clipping norm) over the workers in place by
    ``all_reduce`` and return True; or, when a worker is lost meanwhile, recover, redo the step's
    closure up to the clipping (:func:`_redo_closure`) and return False: the caller clips the redone
    gradients."""
    from .recovery import recover, recoverable
    from .recovery_terms import Unrecoverable

    try:
        all_reduce(sq)
        return True
    except Exception as e:
        if not recoverable(strategy, e):
            raise
        failed_at = time.monotonic()
    if not recover(strategy, failed_at, during="the clipping's all-reduce"):
        # every survivor had finished the step's all-reduce and none its update: none is behind
        raise Unrecoverable("a survivor was a training step behind the others at the clipping")
    _redo_closure(strategy)
    return False


def _redo_closure(strategy: UnifiedStrategy) -> None:
    """The training step's closure again under the rebuilt engine, as Lightning's optimizer closure
    runs it: the step on the kept batch, the backward (with its hooks), ``on_before_optimizer_step``."""
    from lightning.pytorch.trainer import call

    module = strategy.lightning_module
    assert module is not None and strategy.step_args is not None
    trainer = module.trainer
    optimizer = trainer.optimizers[0]
    args, kwargs = strategy.step_args
    loss = strategy._training_step(*args, **kwargs)
    strategy.backward(loss, optimizer)
    call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
