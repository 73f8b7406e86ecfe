"""Failures injected at a chosen (rank, step) of an in-process run with recovery (``fault.restarts``):
callbacks that make a worker send itself a real signal, the run's recoveries written where the test
reads them (the workers are forked processes), and what a run may leave running."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import OmegaConf

from helpers.training import Regressor, quiet_trainer, user_loader
from launcher.lightning.single import StreamedSingleDevice
from launcher.runtime.recovery import current_membership

#: the launcher's default gradient clipping (``conf/trainer/default.yaml``): recovery is tested at it
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)

#: float64 parameters after a recovery against one device's: only summation orders differ
TOL = 1e-10


def one_device(steps: int, total: int, microbatches: int) -> dict:
    """The oracle: one device's (``strategy=single``) float64 parameters after ``steps`` of a run of
    ``total`` (its learning-rate schedule), at the launcher's clipping, the user's shuffled loader."""
    L.seed_everything(0, verbose=False)
    model = Regressor(max_steps=total).double()
    tr = quiet_trainer(StreamedSingleDevice(microbatches=microbatches), 1, precision="64-true", max_steps=steps,
                       gradient_clip_val=CLIP, limit_val_batches=0)
    tr.fit(model, train_dataloaders=user_loader())
    return model.state_dict()


class LoseWorker(L.Callback):
    """Rank ``rank`` (its original number) sends itself ``sig`` as step ``step`` (1-based) begins,
    in the first generation only (``more``: further ``(rank, step)`` losses, one per later
    generation), and writes each worker's recoveries to ``out/rank<r>.txt`` at the end of training."""

    def __init__(self, rank: int, step: int, sig: int, out: Path, more: tuple[tuple[int, int], ...] = ()) -> None:
        self.losses, self.sig, self.out = [(rank, step), *more], sig, out

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        m = current_membership()
        if m is None or m.generation >= len(self.losses):
            return
        rank, step = self.losses[m.generation]
        if m.rank == rank and trainer.global_step + 1 == step:
            os.kill(os.getpid(), self.sig)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        m = current_membership()
        if m is not None:
            (self.out / f"rank{m.rank}.txt").write_text(repr(trainer.strategy.recoveries))


class LoseIn(L.Callback):
    """Rank ``rank`` sends itself ``SIGKILL`` as the first validation batch begins
    (``where="validation"``), inside the checkpoint save of step ``step`` (``where="save"``: Lightning
    calls ``on_save_checkpoint`` within ``Trainer.save_checkpoint``, between gathering the state and
    writing it), after the backward of step ``step`` (``where="clip"``: an ``on_after_backward``
    hook, so the clipping norm takes an all-reduce of its own, which the survivors meet the loss in),
    or at the end of step ``step``'s batch (``where="between"``: Lightning runs ``ModelCheckpoint``'s
    ``on_train_batch_end`` after every other callback's, so the survivors meet the loss in its
    agreement on whether the step's file exists, one of Lightning's collectives between steps), or at
    the end of step ``step``'s validation (``where="valend"``: before ``ModelCheckpoint``'s
    ``on_validation_end``, the same collective); in the first generation only."""

    def __init__(self, where: str, step: int = 0, rank: int = 2) -> None:
        self.where, self.step, self.rank = where, step, rank

    def _lose(self, trainer: L.Trainer, where: str, step: int) -> None:
        m = current_membership()
        if where == self.where and m is not None and m.rank == self.rank and m.generation == 0 and step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._lose(trainer, "validation", self.step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
        self._lose(trainer, "save", trainer.global_step)

    def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._lose(trainer, "clip", trainer.global_step + 1)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self._lose(trainer, "between", self.step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_step == self.step:
            self._lose(trainer, "valend", self.step)


def lose_while_rejoining(monkeypatch: Any, rank: int) -> None:
    """Rank ``rank`` sends itself ``SIGKILL`` as it starts to rejoin after the first loss (a second
    loss during the recovery, before the new group is formed): on the survivors' way
    (:func:`launcher.lightning.recovery.recover`) and on their way out of ``fit`` for a replacement
    (:func:`launcher.lightning.replacement.leave`). The forked workers inherit the patch."""
    import launcher.lightning.recovery as recovery
    import launcher.lightning.replacement as replacement

    for module in (recovery, replacement):
        rejoin = module.rejoin

        def lost_first(m: Any, *args: Any, _rejoin: Any = rejoin, **kwargs: Any) -> Any:
            if m.rank == rank and m.generation == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return _rejoin(m, *args, **kwargs)

        monkeypatch.setattr(module, "rejoin", lost_first)


class LoseInSharedReduce(LoseWorker):
    """As :class:`LoseWorker` with ``SIGKILL``, but inside step ``step``'s gradient all-reduce through
    shared memory (:mod:`launcher.runtime.shared_reduce`), once the rank has said its first bucket's
    share is complete, so the others meet the loss waiting there for its sum. The callback arms the
    loss as the step begins; :func:`lose_in_shared_reduce` patches the reduce to act on it."""

    armed = False

    def __init__(self, rank: int, step: int, out: Path) -> None:
        super().__init__(rank, step, signal.SIGKILL, out)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        m = current_membership()
        rank, step = self.losses[0]
        LoseInSharedReduce.armed = (m is not None and m.generation == 0 and m.rank == rank
                                    and trainer.global_step + 1 == step)


def lose_in_shared_reduce(monkeypatch: Any) -> None:
    """Make :class:`LoseInSharedReduce`'s armed rank die right after its first ``SHARE`` notice of the
    step (the forked workers inherit the patch)."""
    from launcher.runtime.shared_reduce import SharedReduce

    share = SharedReduce.share

    def share_then_die(self: SharedReduce, k: int) -> None:
        share(self, k)
        if LoseInSharedReduce.armed:
            os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(SharedReduce, "share", share_then_die)


def lossy_gpt(rank_env: str) -> str:
    """The source of a user's module ``LossyGPT``: the built-in GPT whose process with ``rank_env``
    (``RANK`` under torchrun, ``SLURM_PROCID`` under Slurm) equal to ``LOSE_RANK`` sends itself
    SIGKILL as step ``LOSE_STEP`` begins, once (the marker file ``LOSE_MARK`` keeps a restarted or
    requeued job from losing it again). For runs of the launcher as a command."""
    return f'''
import os
import signal
from pathlib import Path

from launcher.models import GPT


class LossyGPT(GPT):
    def on_train_batch_start(self, batch, batch_idx):
        mark = Path(os.environ["LOSE_MARK"])
        if os.environ.get("{rank_env}") == os.environ["LOSE_RANK"] and not mark.exists() \\
                and self.trainer.global_step + 1 == int(os.environ["LOSE_STEP"]):
            mark.write_text("lost")
            os.kill(os.getpid(), signal.SIGKILL)
'''


def read_records(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each worker's recoveries, by its original rank, as :class:`LoseWorker` wrote them."""
    return {int(p.stem[4:]): eval(p.read_text()) for p in out.glob("rank*.txt")}  # noqa: S307 - our own repr


def left_running() -> list[Any]:
    """The launcher's worker and spare processes still alive (none may be, once a run has ended)."""
    return [p for p in mp.active_children() if p.name.startswith(("launcher-worker", "launcher-spare"))]
