"""``strategy=single`` as the oracle of every scheme, random draws included.

Lightning's single-device strategy, except that each training batch runs as the engine runs it:
cut into ``microbatches`` micro-batches (:func:`~launcher.torch_support.values.chunk`, as the engine
cuts them), each computing what every scheme computes for it (a model with ``self.stages``: its
stages in turn, then ``self.loss``; any other: its ``training_step``, whole) inside the job of
micro-batch ``b`` at global step ``t`` (:mod:`launcher.torch_support.streams`: unit ``i`` draws from
``(seed, t, b, i)``), and their losses weighed by their share of the step's items (:mod:`.items`,
as the engine weighs them) into the one loss Lightning's automatic optimization takes the backward
of, logged as ``train_loss``. Without randomness this is the whole batch's step up to rounding (the
sum is taken in another order), and BatchNorm's statistics are per micro-batch, as under every
scheme.

The units are those the strategies use (:mod:`launcher.torch_support.streams`): the modules of
``self.stages``, or, for a module without them, the segments its traced training step is cut at
(it is traced once, on the first micro-batch, at set-up).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from ..runtime.items import rows
from ..runtime.items import shares as item_shares
from ..split.capture import loss_module
from ..torch_support import streams
from ..torch_support.staged import run_stage
from ..torch_support.values import as_tree, chunk
from .item_counts import loss_items
from .lightning_private import batch_in_step, train_dataloaders
from .loader_position import KeepsLoaderPositions, Positions
from .staging import (
    _mapping_type,
    example_microbatch,
    first_batch,
    own_loss,
    own_stages,
    split_batch,
    stage_module,
    uses_trace,
)


class StreamedSingleDevice(KeepsLoaderPositions, SingleDeviceStrategy):
    """One device, each batch as ``microbatches`` micro-batches through the random streams."""

    strategy_name = "single_streams"

    def __init__(self, microbatches: int = 1, split: Sequence[str] | str | None = None, seed: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.microbatches, self.split = int(microbatches), split
        self.seed = seed  # None: torch's initial seed (seed_everything's) when training starts
        self.positions = Positions()  # the training loaders' positions, saved and restored with checkpoints
        self._head: int | None = None  # a traced module's unit before any submodule, seeded at job start
        self._units: tuple[Any, dict[str, int]] | None = None  # (module, its traced units), found before fit

    @property
    def _attached(self) -> LightningModule:
        """The LightningModule, which Lightning connects before any hook that reads it runs."""
        module = self.lightning_module
        assert module is not None
        return module

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A sharded checkpoint (a directory) read whole, in the single-device layout."""
        from . import sharded

        checkpoint = (sharded.read(checkpoint_path) if sharded.is_sharded(checkpoint_path)
                      else super().load_checkpoint(checkpoint_path, *args, **kwargs))
        self.positions.load(checkpoint)  # the training loaders' positions, for the loaders made next
        return checkpoint

    @override
    def setup_environment(self) -> None:
        # built before the trainer resolves its accelerator: its first device, as "auto" would pick
        if self.accelerator is not None:
            kind = type(self.accelerator)
            self._root_device = kind.get_parallel_devices(kind.parse_devices(1))[0]
        super().setup_environment()

    def check_before_fork(self, module: Any, datamodule: Any = None, train_dataloaders: Any = None) -> None:
        """Trace ``module`` (one without ``self.stages``) on the first micro-batch of its first
        training batch, in the trainer's precision, as :meth:`setup` would, so that a step the
        tracer refuses is refused before training, in one sentence, as under every scheme
        (:class:`~launcher.torch_support.checks.ModelError`); the units found are kept for :meth:`setup`.
        Every random state and the loaders are left as they were (:func:`~.staging.first_batch`)."""
        from .staging import training_loaders

        if not uses_trace(module, self.split) or (self._units is not None and self._units[0] is module):
            return
        loaders = training_loaders(module, train_dataloaders, datamodule)
        batch = self.precision_plugin.convert_input(first_batch(loaders)) if loaders is not None else None
        if batch is None:
            return  # nothing to train on: setup finds no batch either
        self.precision_plugin.convert_module(module)
        self._units = (module, self._traced_units(module, batch))

    def _traced_units(self, module: Any, batch: Any) -> dict[str, int]:
        """The random-stream units of ``module``'s traced training step (module path -> unit)."""
        example = example_microbatch(module, batch, self.microbatches, self.split)
        with self.precision_plugin.train_step_context():  # traced as the workers trace it
            return dict(stage_module(module, 1, "auto" if self.split is None else self.split, example).units or {})

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.seed is None:
            self.seed = torch.initial_seed()
        module = self._attached
        self._traced: Any = None  # a traced module's training step as a batch -> loss module
        if not uses_trace(module, self.split):
            streams.install_stages(own_stages(module))
            return
        loaders = train_dataloaders(trainer)
        batch = self.precision_plugin.convert_input(first_batch(loaders)) if loaders is not None else None
        self._traced = loss_module(module, _mapping_type(batch) if batch is not None else None)
        if batch is None:  # nothing to train on: no step will draw
            return
        if self._units is not None and self._units[0] is module:
            units = dict(self._units[1])
        else:
            units = self._traced_units(module, self.batch_to_device(batch))
        self._head = units.pop("", None)
        streams.install([(module.get_submodule(path), u) for path, u in units.items()])

    def _losses(self, batch: Any, pieces: int) -> Iterator[Callable[[], torch.Tensor]]:
        """Each micro-batch's loss, computed when called: what the strategies compute for it."""
        module = self._attached
        if self._traced is not None:  # the training step whole, as a traced module's stages run it
            for part in chunk(as_tree(batch), pieces, equal=False):
                yield functools.partial(self._traced, part)
            return
        x, y = split_batch(module, batch)  # a model with self.stages: its stages in turn, then its loss
        ys = chunk(y, pieces, equal=False) if y is not None else [None] * pieces
        for xb, yb in zip(chunk(x, pieces, equal=False), ys):
            def loss(xb: Any = xb, yb: Any = yb) -> torch.Tensor:
                out = xb
                for i, stage in enumerate(own_stages(module)):
                    out = run_stage(stage, None, [out]) if i else run_stage(stage, None, [xb])
                return own_loss(module)(out, yb)
            yield loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._attached
        batch = self.precision_plugin.convert_input(args[0])
        pieces = min(self.microbatches, rows(batch) or 1)  # a last batch smaller than B: a micro-batch per row
        weights = item_shares([None] * pieces, loss_items(module, batch, pieces) or
                              [rows(p) for p in chunk(as_tree(batch), pieces, equal=False)])
        trainer = module.trainer
        step = trainer.global_step
        # accumulate_grad_batches=k: the k batches of one step are its k * B micro-batches
        first = batch_in_step(trainer) * self.microbatches
        total: torch.Tensor | None = None
        seed = self.seed
        assert seed is not None  # set in setup
        with self.precision_plugin.train_step_context(), streams.kept_generators(self.root_device):
            for b, compute in enumerate(self._losses(batch, pieces)):
                with streams.job(seed, step, first + b, self.root_device):
                    if self._head is not None:
                        streams.seed_unit(self._head)
                    loss = compute()
                if weights is not None and weights[b] == 0:
                    continue  # no item: its mean over nothing adds nothing, as in the engine
                part = loss / pieces if weights is None else loss * weights[b]
                total = part if total is None else total + part
        if total is None:
            total = loss * 0.0
        module.log("train_loss", total, prog_bar=True)  # the step's loss, as the strategies log it
        return total
