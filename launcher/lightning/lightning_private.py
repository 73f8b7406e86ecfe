"""Every private name of Lightning that the launcher relies on, in one place: each behind a small
function (or a named alias, for the classes subclassed) saying what it wraps and why no public API
does the job.

Private names may change in any release: pyproject.toml keeps Lightning to the tested minor version
(>=2.6.6,<2.7; checked with 2.6.6). A new version that moves one of them breaks here, not across the
package.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from typing_extensions import override

#: ``lightning.pytorch.strategies.launchers.launcher._Launcher``: the interface a strategy's launcher
#: implements (``launch``, ``kill``, ``is_interactive_compatible``). Lightning has no public base for
#: a launcher of one's own; :class:`~launcher.lightning.launcher.ForkLauncher` subclasses this.
Launcher = _Launcher

#: ``lightning.pytorch.strategies.launchers.multiprocessing._WorkerOutput``: what a worker hands back
#: to the launching process (best checkpoint, weights, trainer state, results, extras), the record
#: Lightning's multiprocessing launcher restores the trainer from. No public type carries it; the
#: fork launcher builds the same record so its hand-over matches Lightning's.
WorkerOutput = _WorkerOutput


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Start the default process group from a cluster environment's rank, world size and main
    address (``lightning.fabric.utilities.distributed._init_dist_connection``).

    This is what Lightning's own DDP strategy calls: it sets ``MASTER_ADDR``/``MASTER_PORT`` from
    the environment (torchrun, Slurm) and logs as Lightning does; there is no public function for
    it, and calling ``torch.distributed.init_process_group`` directly would lose the environment's
    address handling. Tested with Lightning 2.6 (>=2.6.6,<2.7)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: Any, group: Any = None, reduce_op: Any = None) -> Any:
    """``tensor`` reduced over the process group, when there is one
    (``lightning.fabric.utilities.distributed._sync_ddp_if_available``).

    It is what ``Strategy.reduce`` does in Lightning's DDP strategy, with its reduce-op spellings
    (``"mean"``, ``"avg"``, ``"sum"``, a ``ReduceOp``); no public function takes them. Tested with
    Lightning 2.6 (>=2.6.6,<2.7)."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def hpc_save_path(trainer: Any, folder: Any) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` path in ``folder``
    (``trainer._checkpoint_connector.hpc_save_path``).

    A run resumes from the highest-numbered of these when requeued on Slurm (Lightning's own rule);
    the name is only computed by the trainer's private checkpoint connector. Tested with
    Lightning 2.6 (>=2.6.6,<2.7)."""
    return trainer._checkpoint_connector.hpc_save_path(folder)


def started_experiment(logger: Any) -> Any:
    """A ``WandbLogger``'s run if one was started, else None (``WandbLogger._experiment``).

    The public ``WandbLogger.experiment`` starts a run when there is none; ending one must not
    start one first. Tested with Lightning 2.6 (>=2.6.6,<2.7)."""
    return logger._experiment


def skips_saving(callback: ModelCheckpoint, trainer: Any) -> bool:
    """Whether ``callback`` saves nothing at this point of ``trainer``'s run: a ``fast_dev_run``,
    anything but fitting, a sanity check, or a step saved already
    (``ModelCheckpoint._should_skip_saving_checkpoint``).

    The public hooks of ``ModelCheckpoint`` decide this internally; a subclass that saves at
    another point needs the same rule, and none is public. Tested with Lightning 2.6
    (>=2.6.6,<2.7)."""
    return callback._should_skip_saving_checkpoint(trainer)


def save_last_checkpoint(callback: ModelCheckpoint, trainer: Any) -> None:
    """Write ``callback``'s ``last.ckpt`` now, with the metrics it would name it by
    (``ModelCheckpoint._save_last_checkpoint`` with ``_monitor_candidates``).

    ``ModelCheckpoint`` writes ``last.ckpt`` only from its own hooks; no public method writes it
    at another point (the end of training). Tested with Lightning 2.6 (>=2.6.6,<2.7)."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def retype_precision_plugin(plugin: Any, cls: type) -> None:
    """Make ``plugin``, the precision plugin the Trainer built, an instance of ``cls``, a subclass
    of its class that only overrides methods (it adds no state), by assigning ``__class__``.

    The Trainer builds its precision plugin from ``precision=...`` itself; the strategy only gets
    it afterwards, and replacing it with a new object would drop what the Trainer set on it (the
    GradScaler of ``16-mixed``, say). This relies on the plugin classes keeping their state in
    ``__dict__`` (no ``__slots__``), true of every precision plugin in Lightning 2.6
    (>=2.6.6,<2.7)."""
    plugin.__class__ = cls


class RichProgressBarBase(RichProgressBar):
    """Lightning's ``RichProgressBar`` with the private members a subclass changing the training
    bar needs, under public names: :meth:`train_title` (``_get_train_description``),
    :attr:`attached_trainer` (``_trainer``), :meth:`start_train_bar`
    (``_initialize_train_progress_bar_id``), :meth:`set_train_bar` (``_update``) and
    :meth:`show_metrics` (``_update_metrics``).

    The bar's title and count are only set through these private methods; the public callback
    hooks call them. Tested with Lightning 2.6 (>=2.6.6,<2.7)."""

    @property
    def attached_trainer(self) -> Any:
        """The trainer, or None before the callback is attached (``trainer`` raises then)."""
        return self._trainer

    def train_title(self, current_epoch: int) -> str:
        """The training bar's title; Lightning's is ``Epoch <current_epoch>/<max_epochs - 1>``."""
        return super()._get_train_description(current_epoch)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return self.train_title(current_epoch)

    def start_train_bar(self) -> None:
        """Create the training bar's task, titled by :meth:`train_title`."""
        self._initialize_train_progress_bar_id()

    def set_train_bar(self, completed: int) -> None:
        """Set how far the training bar has counted."""
        self._update(self.train_progress_bar_id, completed)

    def show_metrics(self, trainer: Any, pl_module: Any) -> None:
        """Show the current metrics beside the bars."""
        self._update_metrics(trainer, pl_module)


def train_dataloaders(trainer: Any) -> Any:
    """The training loaders the trainer will read, as its fit loop requests them
    (``trainer.fit_loop._data_source``): ``trainer.fit``'s ``train_dataloaders``, or what the
    datamodule's or the module's ``train_dataloader()`` returns; ``None`` where none is defined.

    A strategy's ``setup`` runs before the fit loop builds its loaders, and no public API says where
    ``fit`` was told to read from; Lightning's data connector keeps it there. Tested with Lightning
    2.6 (>=2.6.6,<2.7)."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() and source.instance is not None else None


def batch_in_step(trainer: Any) -> int:
    """Which of the ``accumulate_grad_batches`` batches of the current optimizer step the training
    loop is on (``0 .. k-1``): its batch index within the epoch (``fit_loop.epoch_loop.batch_idx``,
    restored on resume) modulo ``k``, as Lightning's automatic optimization counts the batches it
    accumulates (a new epoch starts a new step; the epoch's last batch steps whatever its place).
    ``training_step`` is handed ``batch_idx`` only when the module's own takes it, hence the loop."""
    return int(trainer.fit_loop.epoch_loop.batch_idx) % int(trainer.accumulate_grad_batches)


def prefetched_batches(trainer: Any) -> int:
    """Batches the training loop's data fetcher has read ahead and not handed to ``training_step``
    yet (``fit_loop._data_fetcher.batches``): a loader of unknown length is read one batch ahead,
    to know its last batch (a loader with a length is not). No public API says how many."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    return len(getattr(fetcher, "batches", None) or [])


def continues_epoch(trainer: Any) -> bool:
    """Whether a resumed fit loop goes on with the checkpoint's epoch (``fit_loop.restarting``, the
    condition under which Lightning itself hands a stateful loader its saved state) rather than
    beginning the next one."""
    return bool(trainer.fit_loop.restarting)


def optimizer_step_of_batch(trainer: Any) -> int:
    """The optimizer step (from 1) the batch just trained belongs to, read after it
    (``on_train_batch_end``): ``global_step`` when it stepped, the next one while its gradient is
    still accumulated (``fit_loop._should_accumulate()``, Lightning's own decision; no public API)."""
    return int(trainer.global_step) + int(trainer.fit_loop._should_accumulate())


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict Lightning saves (``trainer._checkpoint_connector.dump_checkpoint``): the
    module's and optimizers' state as the strategy hands them, the loops, callbacks, schedulers."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def as_between_batches(checkpoint: dict[str, Any]) -> None:
    """A checkpoint dumped inside a training step (the batch fetched and begun, its update not taken)
    made to read as one saved after the previous batch's end (and its validation): the training
    batch progress's ``ready``, ``started`` and ``processed`` counts set back to ``completed``, which
    a resumed loop reads as a save at the end (``RestartStage.RESTARTED_ON_LAST``), going on with the
    next batch. Lightning's optimizer progress is set back to its completed count on every resume."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for part in ("total", "current"):
        counts = progress[part]
        for key in ("ready", "started", "processed"):
            counts[key] = counts["completed"]
    progress["is_last_batch"] = False


def leave_fit(trainer: Any) -> None:
    """Tear the trainer's run down as Lightning does after ``fit`` stops (``trainer._teardown``: the
    strategy, the active loop, the logger and signal connectors), and forget the training and
    validation loaders the loop combined, so that ``fit`` entered again makes them anew (and the
    strategy hands the training loop a loader at the resumed position). The trainer's state is set
    back to fitting as ``Trainer.fit`` sets it before it launches the workers: a loss met during a
    validation left it validating (``fit`` entered again would run the validation alone and return),
    and the module in eval mode (dropout off in the steps after)."""
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if trainer.validating:  # left in a validation: its modules back to the modes they trained in, as its end does
        val_loop._on_evaluation_model_train()
    trainer._teardown()
    trainer.fit_loop._combined_loader = None
    val_loop._combined_loader = None
    trainer.state.fn, trainer.state.status = TrainerFn.FITTING, TrainerStatus.RUNNING
    trainer.training = True
