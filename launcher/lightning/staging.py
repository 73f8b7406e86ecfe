"""How a LightningModule becomes the engine's :class:`~launcher.runtime.StagedModel`.

- A module with ``self.stages`` (an ``nn.ModuleList``) and ``self.loss(output, target)``: the list
  is cut into ``S`` consecutive groups balanced by parameter count (or, with ``partition=time`` or
  ``memory``, by each module's profiled cost: :func:`profiled_partition`); each batch is split into
  ``(input, target)`` (:func:`split_batch`).
- Any other module, or any module given ``split`` (module paths where stages begin, or ``"auto"``):
  its ``training_step`` is traced on one example micro-batch and cut into ``S`` stages
  (:mod:`launcher.split`); the whole micro-batch goes to the first stage and the last stage returns
  the loss, so the module needs no rewrite at all.

The same function serves the strategy on every worker and the checks made before any worker
starts (:func:`check_staging`), so a module that cannot be staged is refused in one sentence
before a process is forked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..schedule.settings import DEFAULT
from ..torch_support.checks import ModelError, model_errors
from ..torch_support.init import init_units
from ..torch_support.rng import kept_random_state, peek
from ..torch_support.staged import StagedModel
from ..torch_support.streams import install_stages
from ..torch_support.values import as_tree, chunk
from .stage_groups import group_modules

#: the keys of a dict batch that hold the targets, in the order looked for (Hugging Face's first)
TARGET_KEYS = ("labels", "label", "targets", "target", "y")


@dataclass
class Staging:
    """A module's stages for the engine; ``traced``: cut from the traced training step (the whole
    micro-batch is the first stage's input, and the last stage's output is the loss)."""

    model: StagedModel
    traced: bool
    starts: list[str] | None = None  # traced: the module path each stage begins at
    groups: list[list[int]] | None = None  # else: the indices into ``self.stages`` of each stage
    costs: list[Any] | None = None  # profiled: each module's :class:`~launcher.split.cost.ModuleCost`
    units: dict[str, int] | None = None  # traced: random-stream units (:attr:`launcher.split.cut.Split.units`)

    @property
    def stage_durations(self) -> list[dict[str, float]] | None:
        """Per stage, its profiled seconds per job kind (the sums of its modules'); ``None``
        without a profile."""
        if self.costs is None or self.groups is None:
            return None
        from ..plan.partition import stage_durations

        return stage_durations([c.forward_s for c in self.costs], [c.backward_s for c in self.costs], self.groups)


def _loss_is_output(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The traced training step already returns the micro-batch's loss."""
    return output


def split_batch(module: Any, batch: Any, traced: bool = False) -> tuple[Any, Any]:
    """``(input, target)`` of a batch: for a traced module the whole batch is the input (its
    training step computes the loss), the first stage's one argument (``((batch,), None)``), so
    the step receives the batch as the DataLoader made it; else the module's own
    ``split_batch(batch)`` when it has one; else a tensor is an input with no target, a pair is
    ``(input, target)``, and a dict (or a ``transformers.BatchEncoding``) has its targets under
    ``labels`` (or ``label``, ``targets``, ``target``, ``y``) and its input in the other keys,
    passed to the first stage as keywords."""
    if traced:
        return (as_tree(batch),), None
    own = getattr(module, "split_batch", None)
    if callable(own):
        return own(batch)
    batch = as_tree(batch)
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) in (1, 2):
        return batch[0], batch[1] if len(batch) == 2 else None
    if isinstance(batch, dict):
        key = next((k for k in TARGET_KEYS if k in batch), None)
        return {k: v for k, v in batch.items() if k != key}, batch.get(key) if key is not None else None
    n = f" of {len(batch)}" if isinstance(batch, (tuple, list, dict)) else ""
    raise TypeError(f"UnifiedStrategy cannot tell input from target in a batch that is a {type(batch).__name__}{n}; "
                    f"give batches as (input, target), or a dict with a 'labels' key, or define "
                    f"{type(module).__name__}.split_batch(batch) -> (input, target).")


def training_loaders(module: Any, train_dataloaders: Any = None, datamodule: Any = None) -> Any:
    """What ``trainer.fit`` reads training batches from, resolved as Lightning resolves it (before
    any worker, where the trainer has not attached it yet): ``train_dataloaders`` (a loader, a
    collection of loaders, or a data module given in its place), else the data module's
    ``train_dataloader()`` after its ``setup("fit")``, else the module's own
    ``train_dataloader()``; ``None`` when there is none."""
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if isinstance(train_dataloaders, LightningDataModule):
        train_dataloaders, datamodule = None, train_dataloaders
    if train_dataloaders is not None:
        return train_dataloaders
    if datamodule is not None:
        with kept_random_state():  # a random split of the data set is drawn again by the trainer
            datamodule.setup("fit")
        return datamodule.train_dataloader()
    if is_overridden("train_dataloader", module):
        return module.train_dataloader()
    return None


def first_batch(loaders: Any) -> Any:
    """The first batch the training loop hands ``training_step`` from ``loaders`` (a loader or a
    collection of them, combined as Lightning combines them), read from a fresh iterator with
    every random state kept (:func:`launcher.torch_support.rng.peek`): the trainer's own iterator then
    yields the batches, in the order, that it would have without this look. Raises
    ``StopIteration`` for an empty loader."""
    from lightning.pytorch.utilities import CombinedLoader

    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
    return peek(combined, combined.flattened)[0]


def own_stages(module: nn.Module) -> nn.ModuleList:
    """``module.stages``, of a module that has them (one :func:`uses_trace` does not trace)."""
    stages = getattr(module, "stages", None)
    assert isinstance(stages, nn.ModuleList)
    return stages


def own_loss(module: nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """``module.loss(output, target)``, of a module with ``self.stages`` (:func:`stage_module` checks it)."""
    loss = getattr(module, "loss", None)
    assert callable(loss)
    return loss


def unit_init(module: nn.Module, groups: list[list[int]]) -> Callable[[Sequence[int]], None]:
    """How a worker materialises the stages it owns of a module built on the meta device: the
    units (modules of ``self.stages``) of those stages, by the rule of :mod:`launcher.torch_support.init`
    under this process's seed (``seed_everything``), with the module's ``reset_stage`` if it has one."""
    units, seed = list(own_stages(module)), torch.initial_seed()
    reset = getattr(module, "reset_stage", None)
    return lambda stages: init_units(units, seed, [i for s in stages for i in groups[s]], reset)


def uses_trace(module: nn.Module, split: Sequence[str] | str | None) -> bool:
    return split is not None or not isinstance(getattr(module, "stages", None), nn.ModuleList)


def example_microbatch(module: nn.Module, batch: Any, microbatches: int, split: Sequence[str] | str | None) -> Any:
    """The first micro-batch's input of ``batch``, as the engine will cut it; for a traced module
    ``(micro-batch,)``, a mapping of the batch's own class (a ``BatchEncoding``) kept as one."""
    traced = uses_trace(module, split)
    x, _ = split_batch(module, batch, traced)
    first = chunk(x, microbatches)[0]
    kind = _mapping_type(batch) if traced else None
    return (kind(first[0]),) if kind is not None else first


def _mapping_type(batch: Any) -> type | None:
    """The class of a batch that is a mapping but not a ``dict`` (``transformers.BatchEncoding``)
    and can be built again from a dict, else ``None``."""
    kind = type(batch)
    if not isinstance(batch, Mapping) or kind is dict:
        return None
    try:
        kind({})
    except Exception:  # noqa: BLE001 - a mapping class that cannot be rebuilt: the step gets a dict
        return None
    return kind


def stage_module(module: nn.Module, S: int, split: Sequence[str] | str | None = None, example: Any = None,
                 groups: Sequence[Sequence[int]] | None = None, costs: list[Any] | None = None) -> Staging:
    """``module``'s stages (see the module doc); ``example``: one micro-batch's input, needed to
    trace; ``groups``: the cut of ``self.stages`` chosen already (:func:`profiled_partition`; else
    balanced by parameter count), ``costs``: the profile it came from. Raises :class:`ModelError`
    with one sentence per problem."""
    name = type(module).__name__
    if not uses_trace(module, split):
        stages = own_stages(module)
        loss = getattr(module, "loss", None)
        if not callable(loss):
            raise ModelError([f"{name} has self.stages but no self.loss(output, target); the last stage's output "
                              f"goes into it (or give split=auto to trace {name}.training_step instead)."])
        if len(stages) < S:
            raise ModelError([f"stages={S} is invalid: {name}.stages has only {len(stages)} modules; use "
                              f"stages <= {len(stages)}."])
        outside = [n for n, _ in module.named_parameters() if not n.startswith("stages.")]
        if outside:
            raise ModelError([f"{name} has parameter {outside[0]} outside self.stages; put every layer in "
                              f"self.stages (or give split=auto to trace the whole module)."])
        grouped, cut = group_modules(list(stages), S, groups)
        install_stages(stages)  # random streams: each module of self.stages is a unit
        return Staging(StagedModel(grouped, loss, init=unit_init(module, cut)), False, groups=cut, costs=costs)
    from ..split import SplitError, loss_module, split_module

    if example is None:
        raise ModelError([f"{name} has no self.stages, so it is traced and cut at split points on one example "
                          f"batch, and it was given no training data (pass trainer.fit(model, train_dataloaders=...) "
                          f"or a datamodule)."])
    batch = example[0]  # traced: the micro-batch, stage 0's one argument (example_microbatch)
    kind = _mapping_type(batch)
    try:
        with kept_random_state():  # tracing and its checks run the step: one device would not have
            traced = split_module(loss_module(module, kind), (as_tree(batch),), S, "auto" if split is None else split)
    except SplitError as e:
        raise ModelError([str(e)]) from e
    return Staging(StagedModel(traced.stages, _loss_is_output, traced.graph, traced.picks), True, list(traced.starts),
                   units=dict(traced.units))


def profiled_partition(module: nn.Module, S: int, by: str, batch: Any, microbatches: int,
                       cap: float | None = None) -> tuple[list[list[int]], list[Any]]:
    """The cut of ``module.stages`` into ``S`` stages by measured cost (``by``: ``time`` or
    ``memory``, :mod:`launcher.plan.partition`), and each module's profile
    (:func:`launcher.split.cost.profile_chain`, on the first micro-batch of ``batch``). A stage's
    bytes count every micro-batch's activations live at once (GPipe's peak, the most any order
    holds), within ``cap`` bytes per worker when given. Raises :class:`ModelError`."""
    from ..plan.partition import PartitionError, cut
    from ..split.cost import profile_chain
    from .stage_groups import param_sizes

    name = type(module).__name__
    stages, loss = getattr(module, "stages", None), getattr(module, "loss", None)
    if not isinstance(stages, nn.ModuleList) or not callable(loss):
        raise ModelError([f"partition={by} is invalid for {name}: it cuts a model's self.stages (with self.loss) by "
                          f"measured cost; leave partition at params for a traced model."])
    if batch is None:
        raise ModelError([f"partition={by} profiles {name}.stages on one example micro-batch: give the trainer a "
                          f"datamodule (its first batch is the example)."])
    try:
        x, y = split_batch(module, batch)
        x = chunk(x, microbatches)[0]
        y = chunk(y, microbatches)[0] if y is not None else None
    except (TypeError, ValueError) as e:
        raise ModelError([" ".join(str(e).split())]) from e
    with kept_random_state():  # profiling runs the stages (dropout draws): one device would not have
        costs = profile_chain(list(stages), x, loss, y, reset=getattr(module, "reset_stage", None))
    try:
        groups = cut(by, S, param_sizes(list(stages)), [c.seconds for c in costs],
                     [c.memory(microbatches) for c in costs], cap)
    except PartitionError as e:
        raise ModelError([f"{e}."]) from e
    return groups, costs


def check_staging(module: nn.Module, S: int, split: Sequence[str] | str | None, batch: Any,
                  microbatches: int, partition: str = DEFAULT.partition, cap: float | None = None,
                  profile: bool = True) -> Staging:
    """``module`` staged on one process as every worker will, with one micro-batch of ``batch``
    (if given) through the stages on the meta device (or for real, where a stage reads values;
    tracing runs it already). ``partition``: cut ``self.stages`` by measured ``time`` or ``memory``
    (profiled here, unless ``profile`` is false: the workers then profile on their own devices),
    else by parameter count; ``cap``: per-worker bytes. Raises :class:`ModelError` with one
    sentence per problem."""
    try:
        example = example_microbatch(module, batch, microbatches, split) if batch is not None else None
    except (TypeError, ValueError) as e:
        raise ModelError([" ".join(str(e).split())]) from e
    groups = costs = None
    if partition != "params" and profile:
        groups, costs = profiled_partition(module, S, partition, batch, microbatches, cap)
    staging = stage_module(module, S, split, example, groups, costs)
    if not staging.traced and example is not None:
        with kept_random_state():
            found = model_errors(staging.model, S, example)
        if found:
            raise ModelError(found)
    return staging


def loader_batch_sizes(loaders: Any) -> list[int] | None:
    """The sizes of the batches a plain ``DataLoader`` over a sized data set yields in an epoch:
    its ``batch_size``, then a last, smaller one unless ``drop_last``; None where that cannot be
    told without reading it (an iterable data set, a batch sampler of the user's, several loaders)."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loaders, DataLoader) or isinstance(loaders.dataset, IterableDataset):
        return None
    size = loaders.batch_size
    try:
        n = len(loaders.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    if size is None:
        return None
    sizes = [size] if n >= size else []
    if n % size and not loaders.drop_last:
        sizes.append(n % size)
    return sizes


def ragged_errors(module: nn.Module, staging: Staging, batch: Any, sizes: Sequence[int],
                  microbatches: int) -> list[str]:
    """A traced graph whose code fixes the batch size, and training batches of ``sizes`` samples
    that the step cuts into micro-batches of another size (a last, smaller batch): the sentence
    stage 0 would raise at that step, said before training (naming ``drop_last=True``)."""
    from ..runtime.items import rows
    from ..torch_support.torch_private import pytree

    check = getattr(staging.model.stages[0], "_input_check", None) if staging.traced else None
    have = rows(batch)
    if check is None or have is None:
        return []
    for size in sizes:
        pieces = max(1, min(microbatches, size))
        for k in sorted({size // pieces, -(-size // pieces)}):
            if k > have:
                continue
            part = pytree.tree_map(lambda x: x[:k] if isinstance(x, torch.Tensor) and x.dim() else x, as_tree(batch))
            args = split_batch(module, part, traced=True)[0]
            try:
                check(*pytree.tree_leaves((tuple(args), {})))
            except ValueError as e:
                return [f"the training DataLoader's batches of {size} samples are cut into micro-batches of {k}, "
                        f"and {e}"]
    return []


#: the parameter a worker that owns no stage registers, so ``configure_optimizers`` still builds an optimizer
PLACEHOLDER = "_launcher_nothing_owned"


def keep_owned(module: nn.Module, groups: Sequence[Sequence[int]], owned: Sequence[int], owners: Sequence[list[int]],
               device: torch.device) -> None:
    """Leave on ``module`` only the stages this worker owns (``groups``: each stage's indices in
    ``module.stages``): the others' modules become stand-ins that name their owners, and a worker
    that owns none registers an empty parameter, so the module's own ``configure_optimizers``
    builds an optimizer over owned parameters only."""
    stages = getattr(module, "stages", None)
    for s, g in enumerate(groups):
        if s not in owned:
            assert stages is not None  # groups cut module.stages
            for i in g:
                stages[i] = _Elsewhere(i, owners[s])
    if not owned:
        module.register_parameter(PLACEHOLDER, nn.Parameter(torch.zeros(0, device=device)))


class _Elsewhere(nn.Module):
    """Stands in, on this worker, for a stage module whose weights live on other workers."""

    def __init__(self, index: int, owners: list[int]) -> None:
        super().__init__()
        self.index, self.owners = index, owners

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(f"module stages[{self.index}] lives on worker(s) {self.owners}; under UnifiedStrategy "
                           f"run it through the trainer (fit, validate, test, predict)")

    def extra_repr(self) -> str:
        return f"on workers {self.owners}"
