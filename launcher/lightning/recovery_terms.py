"""Terms the two recoveries share (in place, :mod:`.recovery`; by re-entering ``fit``,
:mod:`.replacement`): where a survivor met the loss, and the error that ends a run that cannot
recover. A module of its own so that neither of the two
imports the other's terms back."""

from __future__ import annotations

#: where a survivor met the loss: inside a training step (between two updates, where the state after
#: the last completed step is whole), or inside a checkpoint save
TRAINING_STEP = "a training step"
SAVE = "a checkpoint save"


class Unrecoverable(RuntimeError):
    """The survivors cannot rebuild the training state (a stage's state after the last completed
    step is on no survivor): the run ends, naming the loss."""
