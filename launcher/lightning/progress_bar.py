"""The progress bar of a training run: Lightning's rich bar, counting the run's steps when the run
ends at ``trainer.max_steps``.

Lightning's bar counts the batches of an epoch and titles it ``Epoch e/max_epochs-1``. The
launcher's runs end at ``trainer.max_steps`` with ``max_epochs=-1``, which that title shows as
``Epoch 0/-2``; and a run resumed mid-epoch counts on from the epoch's batch index against the
steps left (``6/3``). Here such a run's bar is titled ``Step`` and counts the run's steps,
``global_step`` of ``max_steps``, resumed or not. A run bounded by epochs keeps Lightning's bar.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from .lightning_private import RichProgressBarBase


class StepProgressBar(RichProgressBarBase):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` counting steps of ``max_steps`` when
    ``max_epochs`` is -1 (or unset)."""

    def _by_steps(self) -> bool:
        t = self.attached_trainer
        return t is not None and t.max_epochs in (None, -1) and (t.max_steps or 0) > 0

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    @override
    def train_title(self, current_epoch: int) -> str:
        if not self._by_steps():
            return super().train_title(current_epoch)
        # no epoch: Lightning counts one more when max_steps ends the run, so a run resumed from its
        # last.ckpt would say epoch 1 while its data is still in the first one
        text = "Step"
        # as Lightning pads it: the same width as the validation bar's title, so neither flickers
        return f"{text:{len(self.validation_description)}}" if len(self.validation_description) > len(text) else text

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self._by_steps() and not self.is_disabled:  # Lightning resets the bar to 0 each epoch
            self.set_train_bar(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._by_steps():
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:  # resumed mid-epoch
            self.start_train_bar()
        self.set_train_bar(trainer.global_step)
        self.show_metrics(trainer, pl_module)
        self.refresh()
