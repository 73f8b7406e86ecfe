"""The checkpoint hooks of :class:`~launcher.lightning.UnifiedStrategy`: what each worker saves
and loads of the module and its optimizers, in either format (``checkpoint.format``): ``sharded``,
each stage written by its first owner (:mod:`.sharded`), or ``single``, one file in the
single-device layout gathered at rank 0 (:mod:`.state`); either loads under any scheme."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch.distributed as dist
from lightning.pytorch import LightningModule
from typing_extensions import override

from ..runtime import Engine
from ..runtime.failure import busy, current_watchdog
from ..schedule.run_settings import RunSettings
from . import sharded
from .process_group import ProcessGroupStrategy
from .state import (
    ALONE,
    Layout,
    gather_module_state,
    gather_optimizer_state,
    load_stage_state,
    local_module_state,
    scatter_optimizer_state,
)


class CheckpointingStrategy(ProcessGroupStrategy):
    """The process group's strategy with the checkpoint hooks of a staged module: ``engine`` and
    ``layout`` are set up by the subclass (each worker's stages and their names), before
    Lightning restores or saves anything."""

    run: RunSettings  # its ``checkpoint``: the format and async mode
    engine: Engine | None
    layout: Layout | None
    _pending: Callable[[], None] | None  # a background checkpoint save to finish
    #: while a worker that holds every stage dumps the whole state alone (:mod:`.replacement`): its
    #: layout writing every stage; the state hooks then gather nothing from the others
    _alone: Layout | None = None

    @property
    def _attached(self) -> LightningModule:
        """The LightningModule, which Lightning connects before any hook that reads it runs."""
        module = self.lightning_module
        assert module is not None
        return module

    @property
    def scheme(self) -> str:
        """The scheme's name, whose default checkpoint format applies (the subclass's settings)."""
        raise NotImplementedError

    @property
    def checkpoint_format(self) -> str:
        """``sharded`` (each stage's first owner writes it, :mod:`.sharded`) or ``single`` (one file
        in the single-device layout, gathered at rank 0): ``checkpoint.format``, else the scheme's
        default (:meth:`launcher.schedule.run_settings.CheckpointSettings.format_for`). The one
        reader of ``checkpoint.format``: the hooks below ask it."""
        return self.run.checkpoint.format_for(self.scheme)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.engine is not None and self.layout is not None
        if self._alone is not None:
            return gather_module_state(self._attached, self._alone, self.engine.modules, self.engine.stages, ALONE)
        if self.checkpoint_format == "sharded":  # this worker's share only: nobody gathers the model
            return local_module_state(self._attached, self.layout, self.engine.modules, self.engine.stages,
                                      self.global_rank == 0)
        return gather_module_state(self._attached, self.layout, self.engine.modules, self.engine.stages)

    def gathered_module_state(self) -> dict[str, Any]:
        """The whole module's state dict at rank 0, whatever the checkpoint format (collective): the
        trained weights handed back to a launching process that holds the whole module anyway."""
        assert self.engine is not None and self.layout is not None
        return gather_module_state(self._attached, self.layout, self.engine.modules, self.engine.stages)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        assert self.layout is not None
        opt = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the real one
        if self._alone is not None:
            return gather_optimizer_state(opt, self._attached, self._alone, ALONE)
        if self.checkpoint_format == "sharded":
            names = {id(p): self.layout.canonical(n) for n, p in self._attached.named_parameters()}
            return sharded.optimizer_entries(opt, names, self.layout.written)
        return gather_optimizer_state(opt, self._attached, self.layout)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # a large model's write may take longer than the watchdog's timeout: it is work, not a hang
        with busy(current_watchdog()):
            if self.checkpoint_format != "sharded":
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            assert self.layout is not None
            self.finish_checkpoint()  # the previous background save, if any, is complete first
            background = self.run.checkpoint.async_mode == "async"
            self._pending = sharded.save(checkpoint, filepath, self.layout.staged_names, self.layout.names,
                                         self.layout.aliases, self.global_rank, async_save=background,
                                         group=self._save_group() if background else None)
        return None

    def _save_group(self) -> Any:
        """A gloo group for background saves' collectives (as torchtitan does), apart from the
        training's own traffic: made by every rank together at the first such save, and kept by this
        strategy (not the process: a later run's process group is a new one)."""
        group = getattr(self, "_save_pg", None)
        if group is None and dist.is_available() and dist.is_initialized():
            group = self._save_pg = dist.new_group(backend="gloo")
        return group

    def finish_checkpoint(self) -> None:
        """Wait for a background save (``checkpoint.async_mode=async``) and put it in place."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            with busy(current_watchdog()):
                pending()

    @override
    def on_train_end(self) -> None:
        self.finish_checkpoint()
        super().on_train_end()

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A sharded checkpoint: only the stages this worker owns (and every stage's buffers)."""
        if not sharded.is_sharded(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
        assert self.engine is not None and self.layout is not None
        names = {n for s in self.engine.owned for n in self.layout.stage_names[s]}
        names |= {n for buffers in self.layout.stage_buffers for n in buffers if n is not None}
        return sharded.read(checkpoint_path, names)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.engine is not None and self.layout is not None
        state = checkpoint["state_dict"]
        mine = {n for s in self.engine.owned for n in self.layout.stage_names[s]}
        missing = sorted(mine - set(state))
        if strict and missing:
            raise KeyError(f"the checkpoint has no {missing[0]} (and {len(missing) - 1} more of this worker's stages)")
        load_stage_state(state, self.layout, self.engine.modules, self.engine.stages + self.engine.skeletons)
        staged = self.layout.staged_names
        rest = {k: v for k, v in state.items() if k not in staged}  # the module's own entries outside the stages
        if rest:
            self._attached.load_state_dict(rest, strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.layout is not None
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(scatter_optimizer_state(optimizer, self._attached, self.layout, full))
