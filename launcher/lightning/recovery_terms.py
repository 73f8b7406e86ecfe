"""Terms the two recoveries share (in place, :mod:`.recovery`; by re-entering ``fit``,
:mod:`.replacement`): where a survivor met the loss, and the error that ends a run that cannot
recover. A module of its own so that neither of the two
imports the other's terms back."""

from __future__ import annotations

#: where a survivor met the loss: inside a training step (between two updates, where the state after
#: the last completed step is whole), inside a checkpoint save, or between steps
TRAINING_STEP = "a training step"
SAVE = "a checkpoint save"
#: in one of Lightning's own collectives between steps (``ModelCheckpoint``'s agreement on whether a
#: file exists, the loop's set-up barriers): nothing to redo in place, so every survivor leaves ``fit``
#: and enters it again (:mod:`.replacement`)
BETWEEN = "Lightning's collectives between steps"


class Unrecoverable(RuntimeError):
    """The survivors cannot rebuild the training state (a stage's state after the last completed
    step is on no survivor): the run ends, naming the loss."""
