"""The position of the user's own training DataLoader, kept in a checkpoint so that a resumed run
reads the rest of the epoch, and every later one, as the uninterrupted run reads them.

Lightning restores a loader's position only when the loader has ``state_dict``/``load_state_dict``;
a plain ``DataLoader(shuffle=True)`` restarts its epoch with a new permutation. Both strategies
(:class:`~.strategy.UnifiedStrategy`, :class:`~.single.StreamedSingleDevice`) therefore hand the
training loop each training loader as a :class:`ResumableLoader`, and write its position into the
checkpoint under its own key (:data:`KEY`, which Lightning's default strategy ignores, so the file
still resumes there, as before). What it saves is what decides an epoch's order, not the order itself:

- the states of the torch generators the loader draws from (the global one, the loader's
  ``generator=``, its sampler's) when the epoch's iterator was made (the workers' base seed is
  drawn then) and when its first batch was read (a ``RandomSampler`` draws its permutation then);
- how many batches of the epoch the training loop has taken (those read ahead are not counted);
- the generators' states at the save, so that the draws after it (the next epoch's permutation,
  validation loaders' seeds) are the uninterrupted run's too.

On resume the epoch's iterator is made again from those states and moved past the batches taken:
without loading them when the loader reads in this process from a map-style dataset (only its
index sampler moves); by reading them again otherwise (``num_workers>0``, an iterable dataset),
which is exact when the order depends only on torch's generators, and is said once in a warning.
Not kept: draws from Python's ``random`` or numpy in a sampler of the user's own, and the state of
``persistent_workers`` kept between epochs (a resumed run starts them afresh). A loader that has
``state_dict`` itself (``torchdata``'s ``StatefulDataLoader``) is left to Lightning.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from ..models.data import EpochSampler
from ..torch_support.torch_private import skip_indices
from .lightning_private import continues_epoch, prefetched_batches

log = logging.getLogger(__name__)

States = list[torch.Tensor]

#: the start of Lightning's warning on resuming mid-epoch with a loader that has no ``state_dict``
LIGHTNING_RESTART_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"

#: the checkpoint's key for the training loaders' positions (one per loader, in the loop's order)
KEY = "loader_positions"


def generators(loader: DataLoader) -> list[torch.Generator]:
    """The CPU generators ``loader``'s epoch order can draw from: torch's global one, the loader's
    own and its samplers' (each once)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = [torch.default_generator, getattr(loader, "generator", None), getattr(loader, "sampler", None),
             getattr(batch_sampler, "sampler", None)]
    out: dict[int, torch.Generator] = {}
    for g in found:
        g = g if isinstance(g, torch.Generator) else getattr(g, "generator", None)
        if isinstance(g, torch.Generator) and g.device.type == "cpu":
            out.setdefault(id(g), g)
    return list(out.values())


def _get(gens: list[torch.Generator]) -> States:
    return [g.get_state() for g in gens]


def _set(gens: list[torch.Generator], states: States) -> None:
    for g, s in zip(gens, states):
        g.set_state(s)


@dataclass
class _Epoch:
    """One epoch's iterator: the generators' states when it was made and when its first batch was
    read (None: not yet), and the batches it has yielded."""

    made: States
    first: States | None = None
    yielded: int = 0


class ResumableLoader:
    """A training DataLoader whose position in its epoch can be saved (:meth:`position`) and
    restored (:meth:`restore`). Everything else is the loader's (attributes are passed through), so
    the loop sees its length, sampler and dataset."""

    def __init__(self, loader: DataLoader, trainer: Any) -> None:
        self.loader = loader
        self._trainer = trainer
        self._epoch: _Epoch | None = None
        self._pending: dict[str, Any] | None = None  # a checkpoint's position, for the next iterator
        self._warned = False

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        gens = generators(self.loader)
        pending, self._pending = self._pending, None
        if pending is not None and len(pending["made"]) != len(gens):
            self._warn("its loader draws from other generators than the saved one's, so the epoch restarts")
            pending = None
        if pending is not None and not continues_epoch(self._trainer):
            _set(gens, pending["now"])  # the saved epoch is over: the next one draws where the run stood
            pending = None
        if pending is not None:
            # Lightning warns that a loader without state_dict restarts its epoch: this one does not
            warnings.filterwarnings("ignore", message=LIGHTNING_RESTART_WARNING)
            _set(gens, pending["made"])
        epoch = self._epoch = _Epoch(_get(gens))
        it = iter(self.loader)
        taken = int(pending["taken"]) if pending is not None else 0
        if pending is not None and pending["first"] is not None and not taken:
            _set(gens, pending["first"])  # read ahead, none trained: the first batch draws as it drew
        elif pending is not None:
            if pending["first"] is not None:
                _set(gens, pending["first"])
                epoch.first = pending["first"]
                try:
                    if not skip_indices(it, taken):
                        self._warn(f"the {taken} batches already trained on are read again to reach the next one "
                                   f"({self._why_read()}); the order is the uninterrupted run's as long as it "
                                   f"depends only on torch's generators")
                        for _ in range(taken):
                            next(it)
                except StopIteration:  # another, shorter dataset than the checkpoint's: its epoch is over
                    self._warn(f"the checkpoint had trained on {taken} batches of the epoch, more than this loader "
                               f"holds, so its epoch ends here")
                epoch.yielded = taken
            _set(gens, pending["now"])
        return self._batches(it, epoch, gens)

    @staticmethod
    def _batches(it: Iterator[Any], epoch: _Epoch, gens: list[torch.Generator]) -> Iterator[Any]:
        while True:
            if epoch.first is None:  # the sampler draws its permutation when the first batch is read
                epoch.first = _get(gens)
            try:
                batch = next(it)
            except StopIteration:
                return
            epoch.yielded += 1
            yield batch

    def _why_read(self) -> str:
        if isinstance(getattr(self.loader, "dataset", None), IterableDataset):
            return "an iterable dataset has no indices to skip"
        return f"num_workers={self.loader.num_workers}: worker processes read the indices ahead"

    def _warn(self, what: str) -> None:
        if not self._warned and getattr(self._trainer, "is_global_zero", True):
            log.warning("warning: resuming the training DataLoader mid-epoch: %s.", what)
        self._warned = True

    # not ``state_dict``/``load_state_dict``: Lightning would take the loader for a stateful one and
    # save its state with the fit loop, where Lightning's default strategy, given the file, finds a
    # state for a loader it holds none of and refuses to resume
    def position(self) -> dict[str, Any]:
        """Where the epoch stands: the generators' states when its iterator was made, when its first
        batch was read and now, and the batches the training loop has taken of it."""
        gens = generators(self.loader)
        epoch = self._epoch
        if epoch is None:  # no epoch begun: the next one draws from the generators as they are now
            return {"made": _get(gens), "first": None, "taken": 0, "now": _get(gens)}
        taken = max(0, epoch.yielded - prefetched_batches(self._trainer))
        return {"made": epoch.made, "first": epoch.first, "taken": taken, "now": _get(gens)}

    def restore(self, state: dict[str, Any]) -> None:
        """Take a saved position for the next iterator: the saved epoch's, past the batches taken,
        when the training loop goes on with that epoch; else a new epoch drawn as the
        uninterrupted run draws it."""
        self._pending = dict(state) if state else None
        if (self._pending is not None and getattr(self.loader, "persistent_workers", False)
                and self.loader.num_workers > 0):
            self._warn("persistent_workers=True: its worker processes start afresh, so random draws inside them "
                       "differ from the uninterrupted run's after the first epoch")


def keeps_position(loader: DataLoader) -> bool:
    """Whether ``loader`` resumes where it stood without help: it has ``state_dict`` itself (Lightning
    restores it), or its sampler has (torchdata's), or its sampler is the built-in data's
    :class:`~launcher.models.data.EpochSampler`, which starts from the data module's saved position."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = [getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    return isinstance(loader, _Stateful) or any(isinstance(s, (_Stateful, EpochSampler)) for s in samplers)


class Positions:
    """What a strategy keeps of its training loaders' positions: those a loaded checkpoint held,
    until the loaders they belong to are made (the fit loop makes them after loading it)."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, Any]] = []

    def resumable(self, dataloader: Any, trainer: Any) -> Any:
        """``dataloader`` as the strategy hands it to the training loop: a training ``DataLoader``
        that does not keep its position (:func:`keeps_position`) becomes a :class:`ResumableLoader`
        (given the loaded checkpoint's next position, if any); anything else (an evaluation
        loader, a stateful loader, another iterable) is returned as it is."""
        stage = getattr(getattr(trainer, "state", None), "stage", None)
        if stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader) or keeps_position(dataloader):
            return dataloader
        wrapped = ResumableLoader(dataloader, trainer)
        if self.loaded:
            wrapped.restore(self.loaded.pop(0))
        return wrapped

    @staticmethod
    def save(checkpoint: dict[str, Any], trainer: Any) -> None:
        """Write the positions of the loaders ``trainer`` trains on into ``checkpoint`` (:data:`KEY`)."""
        loaders = [x for x in _leaves(getattr(trainer, "train_dataloader", None)) if isinstance(x, ResumableLoader)]
        if loaders:
            checkpoint[KEY] = [loader.position() for loader in loaders]

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Keep ``checkpoint``'s positions for the training loaders made next."""
        self.loaded = list(checkpoint.get(KEY) or [])


class KeepsLoaderPositions(Strategy):
    """The two hooks both of the launcher's strategies add to Lightning's: a training DataLoader
    handed to the loop keeps its position, and a checkpoint holds it. The strategy sets
    ``positions`` and loads them in its own ``load_checkpoint`` (the two read checkpoints apart)."""

    positions: Positions

    def _trainer(self) -> Any:
        module = self.lightning_module
        assert module is not None  # Lightning connects the module before either hook runs
        return module.trainer

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """A training DataLoader keeps its position in checkpoints (:class:`Positions`)."""
        return self.positions.resumable(dataloader, self._trainer())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.positions.save(checkpoint, self._trainer())
        super().save_checkpoint(checkpoint, filepath, storage_options)


def _leaves(x: Any) -> list[Any]:
    """The loaders in a collection of them (a loader, or dicts, lists and tuples of loaders), in order."""
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in _leaves(v)]
    return [] if x is None else [x]
