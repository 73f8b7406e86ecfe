"""Start the workers of a :class:`~launcher.lightning.UnifiedStrategy` by forking this process.

Lightning's own ``_MultiProcessingLauncher`` is the model: the same result hand-over (rank 0's
trainer state, callback metrics and trained weights back to the launching process), but the
processes come from :func:`launcher.runtime.launch`, which already sets up the process group,
watches every worker, stops them all when one fails (naming the rank, its job and its error), and
stops them all, with one line, on Ctrl-C or SIGTERM. Forking, unlike Lightning's default of
re-running ``sys.argv``, works inside a Hydra multirun and inside a Slurm job.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from ..runtime.processes import launch
from ..runtime.recovery import current_membership
from .lightning_private import Launcher, WorkerOutput, leave_fit
from .recovery import recoverable
from .recovery_terms import BETWEEN
from .replacement import Replaced, leave, places, resume_path

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .strategy import UnifiedStrategy


class ForkLauncher(Launcher):
    """Forks ``strategy.num_processes`` workers and runs the trainer's function on each.

    Not a subclass of Lightning's ``_MultiProcessingLauncher``: Lightning refuses to return
    predictions from those, and this one returns them (rank 0's, which every rank holds)."""

    def __init__(self, strategy: "UnifiedStrategy", timeout: float) -> None:
        self._strategy = strategy
        self.timeout = timeout
        self._already_fit = False

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def kill(self, signum: signal.Signals | int) -> None:
        pass  # launch() stops every worker itself before it returns or raises

    @override
    def launch(self, function: Callable, *args: Any, trainer: "pl.Trainer | None" = None, **kwargs: Any) -> Any:
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "calling trainer.fit() twice on one Trainer with UnifiedStrategy is not supported; create a new "
                "Trainer and pass fit(ckpt_path=...)"
            )
        strategy: UnifiedStrategy = self._strategy
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and args:
            # trainer.fit's arguments: (model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
            strategy.check_before_fork(args[0], args[3] if len(args) > 3 else None, args[1] if len(args) > 1 else None)
        results = launch(self._work, strategy.num_processes, trainer, function, args, kwargs,
                         backend=strategy.backend, timeout=self.timeout, restarts=strategy.run.fault.restarts,
                         replace=strategy.run.fault.replace)
        output = results[0]
        if trainer is None:
            return output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        # the workers converted the module to the trainer's precision (e.g. 64-true): do the same
        # here before the trained weights come back, or loading them would round them
        strategy.precision_plugin.convert_module(trainer.lightning_module)
        self._recover_results_in_main_process(output, trainer)
        return output.trainer_results

    def _work(self, trainer: "pl.Trainer | None", function: Callable, args: tuple, kwargs: dict) -> Any:
        """One worker: run the function, then (on every rank: it is collective) gather what rank 0
        hands back.

        ``fault.replace`` (:mod:`.replacement`): a fresh process for a lost rank enters ``fit`` from
        the state the survivors agree on; a survivor leaves ``fit`` (:class:`Replaced`), has its run
        torn down as Lightning tears one down, and enters ``fit`` again with the replacement, from
        that state (``ckpt_path``, trainer.fit's fifth argument). So does every survivor, without a
        replacement, where a loss met it outside what the in-place recovery redoes (Lightning's
        collectives between steps) or met the survivors in different places."""
        os.environ["LOCAL_RANK"] = str(dist.get_rank())
        m = current_membership()
        if trainer is not None and m is not None and m.replacement:
            places(None)  # the survivors' agreement on where they met the loss (a replacement met none)
            args = (*args[:4], resume_path(self._strategy), *args[5:])
        while True:
            failed_at = None
            try:
                results = function(*args, **kwargs)
                break
            except Replaced:
                pass
            except Exception as e:
                # a loss met in one of Lightning's own collectives between steps (ModelCheckpoint's
                # agreement on whether a file exists, the loop's set-up barriers): every survivor
                # leaves fit and enters it again from one state
                if trainer is None or trainer.state.fn != TrainerFn.FITTING or not recoverable(self._strategy, e):
                    raise
                failed_at = time.monotonic()
            # outside the except clause: the failed run's traceback (and the old group it holds) is gone
            assert trainer is not None
            if failed_at is not None:
                with contextlib.suppress(Replaced):
                    leave(self._strategy, failed_at, BETWEEN)
            leave_fit(trainer)
            self._strategy.whole_stages()
            args = (*args[:4], resume_path(self._strategy), *args[5:])
        if trainer is None:
            return move_data_to_device(results, "cpu") if dist.get_rank() == 0 else None
        return self._collect(trainer, results)

    def _collect(self, trainer: "pl.Trainer", results: Any) -> WorkerOutput | None:
        strategy: UnifiedStrategy = self._strategy
        fitting = trainer.state.fn == TrainerFn.FITTING
        # every stage from its owner: collective, so every rank takes part. A module built on the
        # meta device stays there in the launching process: no process ever holds all of it (its
        # trained weights are in the run's checkpoints)
        back = fitting and not strategy.meta
        state = strategy.gathered_module_state() if back else None
        if dist.get_rank() != 0:
            return None
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", None) if ckpt is not None else None
        weights_path = None
        if state is not None:  # back
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state, weights_path)
        buffer = io.BytesIO()
        torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in trainer.callback_metrics.items()}, buffer)
        return WorkerOutput(best, weights_path, trainer.state, move_data_to_device(results, "cpu"),
                             {"callback_metrics_bytes": buffer.getvalue()})

    def _recover_results_in_main_process(self, output: WorkerOutput, trainer: "pl.Trainer") -> None:
        """What Lightning's multiprocessing launcher hands back: best checkpoint path, trained
        weights, trainer state and callback metrics."""
        if trainer.checkpoint_callback is not None and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(output.best_model_path)
        if output.weights_path is not None:
            ckpt = self._strategy.checkpoint_io.load_checkpoint(output.weights_path)
            trainer.lightning_module.load_state_dict(ckpt, strict=False)
            self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
            with contextlib.suppress(OSError):  # the temporary directory it was written into
                os.rmdir(os.path.dirname(output.weights_path))
        trainer.state = output.trainer_state
        metrics = torch.load(io.BytesIO(output.extra["callback_metrics_bytes"]), weights_only=True)
        trainer.callback_metrics.update(metrics)
