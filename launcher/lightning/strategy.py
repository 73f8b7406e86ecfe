"""``UnifiedStrategy``: any scheme of the schedule engine as a Lightning strategy.

    trainer = Trainer(strategy=UnifiedStrategy(scheme="fslpp", G=2, R=2, stages=4, microbatches=4),
                      accelerator="cpu", devices=4)
    trainer.fit(model)        # any LightningModule with self.stages and self.loss(output, target)

What it does, as a thin adapter over :class:`launcher.runtime.Engine` (NeMo's ``MegatronStrategy``
is the model: the strategy runs the whole schedule in ``training_step`` and takes over backward):

- launching: forks ``W = G*R`` workers itself (:class:`ForkLauncher`), or joins the processes
  torchrun or Slurm started (Lightning's cluster environments);
- set-up: cuts ``module.stages`` into ``stages`` consecutive groups balanced by parameter count,
  builds the engine, and leaves on the module only the stages this worker owns, so the module's
  own ``configure_optimizers`` builds an optimizer over owned parameters only;
- ``training_step``: cuts the batch into ``microbatches`` micro-batches and runs the step
  through the engine, each micro-batch's loss weighted by its share of the batch's items
  (:mod:`.item_counts`: rows, labelled tokens, or the module's ``loss_items``); the loss (summed from
  whichever workers computed it) is returned and logged as ``train_loss``. Lightning's automatic
  optimization then runs as usual: ``backward`` installs the engine's reduced gradients,
  ``gradient_clip_val`` clips by the global norm across owners (:func:`.precision.clip_by_global_norm`), the
  optimizer and learning-rate schedulers step as Lightning steps them. ``accumulate_grad_batches=k``
  is Lightning's own: each batch runs as one engine step (its ``B`` micro-batches draw as micro-batches
  ``j*B ..`` of the optimizer step), its gradient added in divided by ``k``, the optimizer stepping
  (and clipping) after the ``k``-th batch or the epoch's last;
- ``validation_step``/``test_step``/``predict_step``: a forward-only pass of the same schedule
  (:meth:`Engine.evaluate`); ``val_loss``/``test_loss`` logged, predictions gathered;
- checkpoints (:mod:`.checkpoint_hooks`): ``checkpoint.format``: sharded (each stage's owner writes
  it, :mod:`.sharded`) or one file in the single-device layout (:mod:`.state`); either loads under
  any scheme;
- precision: the trainer's plugin. ``bf16-mixed``/``16-mixed`` (autocast): owners keep fp32 master
  weights and optimizer state, fetched weights, activations and their gradients cross in the
  compute dtype (:func:`.precision.compute_dtype`), weight-gradient sums and all-reduces stay fp32; 16-mixed's
  GradScaler scales the engine's backward and skips a step on every worker alike. ``bf16-true``
  converts the module: everything is bf16.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from ..config import ConfigError
from ..runtime import Engine
from ..runtime.failure import blocked
from ..runtime.items import rows
from ..runtime.measure import resident_bytes
from ..runtime.nonfinite import Finite, NonFiniteError, agree, lowest, undo_statistics
from ..schedule import Schedule
from ..schedule.rules import StepError, overlap_training_errors
from ..schedule.run_settings import CheckpointSettings, RunSettings, survives_a_loss, survives_losses
from ..schedule.schemes import SCHEMES
from ..schedule.settings import DEFAULT, SCHEME_DEFAULT, OrderLike, SchemeLike, Settings
from ..torch_support.init import empty_init, has_meta
from ..torch_support.values import chunk, joined, to_device
from .checkpoint_hooks import CheckpointingStrategy
from .copies import StageCopies, after_step, exchange
from .item_counts import loss_items
from .keywords import keyword_errors, keyword_settings
from .launcher import ForkLauncher
from .lightning_private import batch_in_step, train_dataloaders
from .loader_position import KeepsLoaderPositions, Positions
from .outside_step import recovering_saves, reduce_norm_or_recover
from .precision import (
    all_reduce,
    clipped_gradients,
    compute_dtype,
    loss_dtype,
    norm_in_step,
    norm_is_local,
    squared_norm,
    with_global_clipping,
    with_synced_scaler,
)
from .process_group import agreed_seed
from .replacement import MEMORY, Offer, Pending, finish, handed_over
from .staging import (
    PLACEHOLDER,
    example_microbatch,
    first_batch,
    keep_owned,
    split_batch,
    stage_module,
    uses_trace,
)
from .state import Layout
from .step_overlap import PostValidation, synchronous_reason

log = logging.getLogger(__name__)


class UnifiedStrategy(KeepsLoaderPositions, CheckpointingStrategy):
    """Train any LightningModule with stages under any scheme of the schedule engine.

    ``scheme``: ddp, fsdp, gpipe, lpp, fslpp, or a placement callable ``(s, b, d) -> (w_owner,
    w_compute)`` (then ``G * R`` is the worker count). ``stages`` defaults to ``len(module.stages)``.
    The step's other settings are keywords named as their config keys (:data:`.keywords.STEP_KEYWORDS`:
    ``memory_limit``, ``split_backward``, ``weight_cache``, ``prefetch``, ``warmup``, ``durations``,
    ``comm``, ``recompute``, ``partition``, ``plan={"memory": ...}``, and ``ownership`` for FSLPP); any
    other keyword is refused (:class:`~launcher.config.ConfigError`, the closest keyword suggested).
    ``order`` also takes a callable ``n(s, b, d)``. ``partition="time"`` (or ``"memory"``)
    cuts ``module.stages`` by each module's cost, profiled once on the launching process (on rank 0
    under torchrun or Slurm, and broadcast), each stage within ``plan={"memory": "2GB"}`` when given.

    ``settings``: the step's :class:`~launcher.schedule.settings.Settings`, checked already (the
    command line's), in place of the keywords, which build the same object.

    The run's settings (:class:`~launcher.schedule.run_settings.RunSettings`): ``run=RunSettings(...)``,
    or its fields as keywords, each left out keeping its default there: ``checkpoint`` (a mapping
    ``{"format": "sharded" | "single" | None, "async_mode": "disabled" | "async"}`` or
    :class:`~launcher.schedule.run_settings.CheckpointSettings`), ``nonfinite`` (stop | skip),
    ``timeout`` (seconds within which every worker stops after one fails), ``transport`` (auto |
    gloo | shm) and ``fault`` (``{"restarts": N}``: recover from N lost workers inside the job,
    :mod:`.recovery`; ``"copies": 1``: with a copy of each lone stage on the next worker,
    :mod:`.copies`). Checked here, once: :class:`~launcher.config.ConfigError` with one sentence per
    broken rule, the command line's sentences.
    """

    strategy_name = "unified"

    def __init__(
        self,
        scheme: SchemeLike = DEFAULT.name,
        G: int | None = None,
        R: int | None = None,
        stages: int | None = None,
        microbatches: int = 1,
        order: OrderLike = SCHEME_DEFAULT,
        *,
        settings: Settings | None = None,
        split: Sequence[str] | str | None = None,
        run: RunSettings | None = None,
        checkpoint: CheckpointSettings | Mapping[str, Any] | None = None,
        nonfinite: str | None = None,
        timeout: float | None = None,
        transport: str | None = None,
        fault: Any = None,
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **config: Any,
    ) -> None:
        # a keyword it does not take is refused now, whether or not the stage count is known yet
        unknown = keyword_errors(config, [p for p in inspect.signature(UnifiedStrategy).parameters if p != "config"])
        if unknown:
            raise ConfigError(unknown)
        named = settings.name if settings is not None else getattr(scheme, "__name__", scheme)
        overlap = overlap_training_errors(settings.step_overlap if settings is not None else config.get("step_overlap"),
                                          named, *((settings.G, settings.R, settings.stages) if settings is not None
                                                   else (G, R, stages)))
        if overlap:
            raise ConfigError(overlap)
        #: the run's settings, typed and checked once here; every later reader trusts them
        self.run = _run_settings(run, checkpoint=checkpoint, nonfinite=nonfinite, timeout=timeout,
                                 transport=transport, fault=fault)
        super().__init__(self.run.timeout, process_group_backend, accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if settings is not None and (config or stages is not None or G is not None or R is not None):
            raise TypeError("UnifiedStrategy takes the step's settings either as settings=Settings(...) or as "
                            "keywords, not both")
        #: the keywords' settings but the stage count, when that is the module's (``stages=None``)
        self._keywords: dict[str, Any] = dict(scheme=scheme, G=G, R=R, microbatches=microbatches, order=order,
                                              extra=config)
        self.split = list(split) if isinstance(split, (list, tuple)) else split
        self.traced = False  # set up from a traced training step: the batch goes whole to stage 0
        #: the dtype the loss has on one device: its stage's weights', which may differ from the
        #: module's nominal dtype (a model built in float64 under 32-true keeps a float64 loss)
        self.loss_dtype = torch.get_default_dtype()
        self._staged: tuple[Any, Any] | None = None  # (module, its Staging), made before the fork
        #: per stage, profiled seconds per job kind (partition=time/memory), the same on every worker
        self.stage_durations_s: list[dict[str, float]] | None = None
        self.module_costs: list[Any] | None = None  # each module's profile, when profiled
        self.graph: Any = None  # the stage graph, when not a chain
        self.step_skipped = False  # the last training step was dropped (nonfinite=skip)
        #: the clipping norm's squared shares, summed in the training step's all-reduce, until the
        #: clipping reads them (None: the clipping sums them itself; :func:`.precision.norm_in_step`)
        self.fused_norm_sq: torch.Tensor | None = None
        self._norm_in_step = False
        #: where every worker holds every gradient (DDP, :func:`.precision.norm_is_local`): the step's
        #: all-reduce of the loss and the non-finite flag, launched with the last gradient bucket's
        #: (:meth:`_launch_agree`), and the tensor it sums, until the step waits for it
        self._early: tuple[Any, torch.Tensor] | None = None
        #: step_overlap=post_validation, when this run's steps overlap (:mod:`.step_overlap`); else None
        self.post_validation: PostValidation | None = None
        #: the step's settings: given (trusted: the command line checked them), or the keywords'
        #: once the stage count is known (here, or from the module: :meth:`_settings_for`)
        self._settings = settings if settings is not None or stages is None else self._from_keywords(stages)
        self.engine = None
        self.layout = None
        self.records: list[dict[str, Any]] = []  # this worker's record of every training step
        self.meta = False  # the module was built on the meta device: no process holds all of it
        self.base_memory = 0  # bytes this worker held before its stages were materialised
        self._last_batch: list[tuple[torch.Tensor, Any]] | None = None  # for message sizes: the largest
        self._stand_ins = 0  # micro-batches of the last batch cut that repeat another and weigh nothing
        self._pending = None
        self.positions = Positions()  # the training loaders' positions, saved and restored with checkpoints
        self._in_step = 0  # which of the accumulate_grad_batches batches of its optimizer step this batch is
        self._staged_model: Any = None  # the staged model the engine runs (rebuilt on it after a recovery)
        self._groups: list[list[int]] = []  # each stage's indices into module.stages
        self._stage_modules: list[Any] = []  # module.stages as the user made it, before keep_owned
        #: each recovery from a lost worker (:mod:`.recovery`), as ``metrics.json`` lists them
        self.recoveries: list[dict[str, Any]] = []
        self.last_loss = 0.0  # the last training step's loss, summed over workers
        self._caught_up = False  # this step ends without an update: a recovery gave this worker its result
        #: with fault.restarts: the batches of the steps since the last checkpoint (step -> batch), and
        #: that checkpoint (path, step), so that a recovery from it can replay them (:mod:`.recovery`)
        self.since_checkpoint: dict[int, Any] = {}
        self.last_checkpoint: tuple[str, int] | None = None
        #: the last checkpoint of either format written whole in the foreground (path, step), once every
        #: worker is past its save: a replacement after a loss met in a later save resumes from it
        self.last_saved: tuple[str, int] | None = None
        self.failed_save: str | None = None  # the path of the save a loss interrupted (for a replacement)
        self.replay_step: int | None = None  # the step a recovery replays, while it does
        self.step_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the training step's arguments
        self._keeps_batches = False  # a loss could take a stage with it: keep the batches since the checkpoint
        #: with fault.copies=1: the copies of the previous worker's lone stages this worker keeps (:mod:`.copies`)
        self.copies: StageCopies | None = StageCopies() if self.run.fault.copies else None
        #: with fault.replace, while a fresh process takes a lost rank (:mod:`.replacement`): what this
        #: survivor offers, the whole state it may hand over, and the recovery until its state is loaded
        self.offer: Offer | None = None
        self.handover: dict[str, Any] | None = None
        self.pending: Pending | None = None

    # ---- configuration -------------------------------------------------------------------
    def _from_keywords(self, stages: int) -> Settings:
        k = self._keywords
        return keyword_settings(k["scheme"], k["G"], k["R"], stages, k["microbatches"], k["order"], k["extra"])

    def _settings_for(self, module: Any) -> Settings | None:
        """The settings, the keywords' completed with the stage count of ``module`` when it has
        ``self.stages`` (a traced module's count is ``split``'s); ``None`` when it is not known."""
        if self._settings is None:
            if not uses_trace(module, self.split):
                self._settings = self._from_keywords(len(module.stages))
            elif isinstance(self.split, list):
                self._settings = self._from_keywords(len(self.split) + 1)
        return self._settings

    @property
    def settings(self) -> Settings:
        """The step's settings (set once the stage count is known)."""
        assert self._settings is not None, "the strategy is configured when its module's stages are known"
        return self._settings

    @property
    @override
    def scheme(self) -> str:
        """The scheme's name (a placement callable's ``__name__``)."""
        s = self._settings
        return s.name if s is not None else Settings.of(self._keywords["scheme"], 1, 1).name

    @property
    def workers(self) -> int:
        return self.settings.workers

    @property
    def microbatches(self) -> int:
        return self.settings.microbatches

    def make_schedule(self) -> Schedule:
        """The schedule this strategy runs (the same every worker derives)."""
        return self._timed(self.settings.schedule(self.graph))

    def _timed(self, step: Schedule) -> Schedule:
        """``step`` with the profiled stages' own durations (``partition=time``/``memory``), in the
        config's units (its ``comm`` is in them): an uneven cut has uneven stages."""
        if self.stage_durations_s is not None:
            from ..plan.partition import scaled

            step.stage_durations = scaled(self.stage_durations_s, step.durations)
        return step

    @property
    def partition(self) -> str:
        return self.settings.partition

    @property
    def memory_cap(self) -> float | None:
        """Per-worker bytes a stage may hold under ``partition=time``: ``plan.memory``, when set."""
        from ..plan.profile import parse_bytes

        memory = self.settings.plan_memory
        return float(parse_bytes(memory)) if memory is not None else None

    # ---- processes ----------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ForkLauncher(self, self.timeout)

    # ---- set-up: partition the module, build the engine ----------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.base_memory = resident_bytes(self.root_device)  # the process before any stage is materialised
        self.accelerator.setup(trainer)
        module = self._attached
        traced = uses_trace(module, self.split)
        if self._settings_for(module) is None:
            raise ValueError(f"{type(module).__name__} is traced and cut into stages: "
                             f"give UnifiedStrategy(stages=...) or split=[module paths where stages begin]")
        S = self.settings.stages
        if self.workers > self.world_size:
            raise ValueError(f"the scheme needs W=G*R={self.workers} workers but {self.world_size} processes "
                             "were started")
        self.precision_plugin.convert_module(module)
        if self._staged is not None and self._staged[0] is module:  # staged before the fork
            staging = self._staged[1]
        else:
            example = self._example(trainer) if traced else None
            groups, costs = self._shared_partition(trainer, module, S) if self.partition != "params" else (None, None)
            with self.precision_plugin.train_step_context():  # traced as it runs: 64-true's default dtype is float64
                staging = stage_module(module, S, self.split, example, groups, costs)
        self.traced, self.graph = staging.traced, staging.model.graph
        nominal = module.dtype
        assert isinstance(nominal, torch.dtype)  # Lightning types it str | dtype; a module's is a dtype
        self.loss_dtype = loss_dtype(staging.model.stages, nominal)
        self.module_costs, self.stage_durations_s = staging.costs, staging.stage_durations
        found = self.run.fault.scheme_errors(self.settings.name, self.settings.G, self.settings.R, self.run.checkpoint)
        if found:  # refused before any step (the command line refuses it before the fork)
            raise ConfigError(found)
        self._staged_model = staging.model
        self._build_engine()
        assert self.engine is not None
        owners = self.engine.lowered.owners
        me = self.engine.worker
        self.layout = Layout.of(module, staging.model.stages, [s for s in self.engine.owned if owners[s][0] == me],
                                self.engine.ties)
        self._groups = staging.groups or []
        # every stage's modules, before keep_owned (a traced module has no list of stages: None)
        self._stage_modules = list(getattr(module, "stages", None) or [])
        keep_owned(module, self._groups, self.engine.owned, owners, self.root_device)
        self.model_to_device()
        self.setup_precision_plugin()
        if self.run.fault.restarts:  # a worker lost during a checkpoint save is recovered, the save redone
            recovering_saves(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            with_global_clipping(self)
            with_synced_scaler(self.precision_plugin)
            self._norm_in_step = norm_in_step(trainer, module, self.precision_plugin)
            if self.settings.step_overlap != "none":
                st = self.settings
                refused = overlap_training_errors(st.step_overlap, st.name, st.G, st.R, st.stages)
                if refused:  # G was left to the scheme's default when the strategy was made
                    raise ConfigError(refused)
                why = synchronous_reason(trainer, module, self.precision_plugin, self.optimizers)
                if why is None:
                    self.post_validation = PostValidation(self.engine, self.optimizers[0])  # collective
                elif self.global_rank == 0:
                    log.warning("warning: %s", why)

    def _build_engine(self) -> None:
        """The engine of the current settings over the staged model (at set-up, and after a recovery)."""
        S = self.settings.stages
        self.engine = Engine(self._staged_model, self.make_schedule(), None, prefetch=self.settings.prefetch,
                             weight_cache=self.settings.weight_cache, device=self.root_device,
                             recompute=self.settings.recompute_stages,
                             compute_dtype=compute_dtype(self.precision_plugin), transport=self.run.transport)
        # every job's values are marked, and the step's first NaN or infinity agreed, before any update;
        # under a GradScaler (16-mixed) overflowing gradients are the scaler's to skip
        self.engine.finite = Finite(S, self.microbatches, grads=getattr(self.precision_plugin, "scaler", None) is None)
        # random streams (launcher.torch_support.streams): every job's draws from (seed, step, micro-batch,
        # unit), the seed rank 0's (seed_everything's), so processes started apart agree
        self.engine.streams = agreed_seed(self.root_device)
        # DDP: the loss and the non-finite flag ride beside the last gradient bucket (overlapped),
        # and the clipping norm needs no collective (every worker holds every gradient)
        self.engine.after_reduce_launched(self._launch_agree if norm_is_local(self.engine) else None)
        s = self.settings
        # with fault.copies=1 the last checkpoint is only a fallback, where one is written to fall back to
        c = self.run.checkpoint
        usable = c.format_for(s.name) == "sharded" and c.async_mode == "disabled"
        restarts = self.run.fault.restarts
        # also where only losses at once (a second during the recovery, fault.restarts>=2) take every
        # holder of a stage, as both owners of one under lpp G=2 R=2: the last checkpoint serves then
        self._keeps_batches = bool(restarts) and (
            (not survives_a_loss(s.name, s.G, s.R) and (usable or not self.run.fault.copies))
            or (usable and not survives_losses(s.name, s.G, s.R, min(restarts, s.workers - 1))))

    def rejoined(self, rank: int, world: int) -> None:
        """After a recovery (:mod:`.recovery`): this worker's new rank in a group of ``world``."""
        import os

        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(rank)
        self.cluster_environment.set_world_size(world)
        os.environ["LOCAL_RANK"] = str(rank)
        rank_zero_only.rank = rank  # type: ignore[attr-defined]  # Lightning's own attribute of the function
        self.records.clear()  # measured under the old schedule: metrics.json reports the new one's
        self._save_pg = None  # the background saves' group belonged to the old process group

    def rebuild(self, settings: Settings) -> None:
        """Train on under ``settings`` (a recovery's re-planned step): the engine built again over
        the staged model; the caller fills the newly owned stages, then calls :meth:`own_stages`."""
        self.replan_to(settings)
        self._build_engine()

    def replan_to(self, settings: Settings) -> None:
        """Take ``settings`` (a recovery's re-planned step) for the engine built next: now
        (:meth:`rebuild`), or by ``fit``'s set-up when every survivor enters it again (:mod:`.replacement`)."""
        import dataclasses

        # the run's checkpoints keep the format they started in (last.ckpt is overwritten in place)
        kept = {"format": self.run.checkpoint.format_for(self.scheme), "async_mode": self.run.checkpoint.async_mode}
        self.run = dataclasses.replace(self.run, checkpoint=CheckpointSettings.of(kept))
        self._settings = settings

    def whole_stages(self) -> None:
        """Put every stage's module back on the module (undoing :func:`~.staging.keep_owned`), for a
        new placement of them: after a recovery, or before ``fit`` is entered again (:mod:`.replacement`)."""
        module = self._attached
        stages: Any = getattr(module, "stages", None)
        for i, m in enumerate(self._stage_modules):
            stages[i] = m
        module._parameters.pop(PLACEHOLDER, None)  # a worker that owned nothing had one; keep_owned makes it anew

    def own_stages(self) -> None:
        """Leave on the module the stages the (re-built) engine owns, as set-up does: the others'
        modules become stand-ins again, so the module's parameters are the owned ones."""
        assert self.engine is not None and self._staged_model is not None
        module = self._attached
        self.whole_stages()
        owners, me = self.engine.lowered.owners, self.engine.worker
        # who writes each stage into checkpoints and the gathered state: its first owner, under the new layout
        self.layout = Layout.of(module, self._staged_model.stages,
                                [s for s in self.engine.owned if owners[s][0] == me], self.engine.ties)
        keep_owned(module, self._groups, self.engine.owned, owners, self.root_device)
        self.model_to_device()

    def check_before_fork(self, module: Any, datamodule: Any = None, train_dataloaders: Any = None) -> None:
        """Stage ``module`` on this process as every worker will (in the trainer's precision), and
        run one micro-batch of the first training batch (of ``train_dataloaders``, else of the
        datamodule, else of the module's own ``train_dataloader``) through the stages: a module
        that cannot be trained is refused here, in one sentence per problem
        (:class:`~launcher.torch_support.checks.ModelError`), before any worker starts. The staging is
        kept: forked workers inherit it rather than trace the module again. Every random state
        and the trainer's loaders are left as they were (:func:`~.staging.first_batch`)."""
        from ..torch_support.checks import ModelError
        from .staging import check_staging, loader_batch_sizes, ragged_errors, training_loaders

        if self._staged is not None and self._staged[0] is module:
            return
        if is_overridden("configure_model", module):  # as Lightning will call it in every worker
            with self.model_sharded_context():
                module.configure_model()
        self.meta = has_meta(module)
        settings = self._settings_for(module)
        if settings is not None and (found := self.run.fault.scheme_errors(settings.name, settings.G, settings.R,
                                                                          self.run.checkpoint)):
            raise ConfigError(found)
        S = settings.stages if settings is not None else None
        if S is None:
            raise ModelError([f"{type(module).__name__} is traced and cut into stages: "
                              f"give UnifiedStrategy(stages=...) or split=[module paths where stages begin]."])
        batch, unread, loaders = None, False, None
        try:
            loaders = training_loaders(module, train_dataloaders, datamodule)
            if loaders is not None:
                unread = True
                batch = self.precision_plugin.convert_input(first_batch(loaders))
                unread = False
        except Exception:  # noqa: BLE001 - the workers will meet it again and report it with its rank
            batch = None
        if unread and uses_trace(module, self.split):
            return  # nothing to trace on here: each worker traces on the trainer's first batch
        self.precision_plugin.convert_module(module)
        with self.precision_plugin.train_step_context():  # as the workers will trace and run it
            staging = check_staging(module, S, self.split, batch, self.microbatches, self.partition, self.memory_cap)
        sizes = loader_batch_sizes(loaders) if batch is not None else None
        if sizes:  # a graph of a fixed batch size, and a last, smaller batch: said before any worker starts
            found = ragged_errors(module, staging, batch, sizes, self.microbatches)
            if found:
                raise ModelError(found)
        self._staged = (module, staging)

    def adopt(self, other: UnifiedStrategy) -> None:
        """Take over the staging another strategy of the same settings made of its module
        (:meth:`check_before_fork`), instead of staging the module again."""
        self._staged, self.meta = other._staged, other.meta

    def _shared_partition(self, trainer: Any, module: Any, S: int) -> tuple[list[list[int]], list[Any]]:
        """Processes started outside (torchrun, Slurm) were not staged before a fork: rank 0
        profiles the modules and every rank takes its cut (collective), so no two ranks cut the
        model differently, even where their timings would differ. A failure on rank 0 is raised
        on every rank, with its sentences."""
        from ..torch_support.checks import ModelError
        from .staging import profiled_partition

        found: Any = None
        if self.global_rank == 0:
            try:
                loaders = train_dataloaders(trainer)
                batch = self.precision_plugin.convert_input(first_batch(loaders)) if loaders is not None else None
                with self.precision_plugin.train_step_context():
                    found = ("ok",) + profiled_partition(module, S, self.partition, batch, self.microbatches,
                                                         self.memory_cap)
            except ModelError as e:
                found = ("error", e.sentences)
        found = self.broadcast(found, 0)
        if found[0] == "error":
            raise ModelError(list(found[1]))
        return found[1], found[2]

    def _example(self, trainer: Any) -> Any:
        """One micro-batch's input of the first training batch, to trace the module on: from the
        loaders the trainer will train on (a fresh iterator, every random state kept)."""
        loaders = train_dataloaders(trainer)
        if loaders is None:
            raise ValueError(f"{type(self._attached).__name__} is traced on an example batch: pass "
                             f"trainer.fit(model, train_dataloaders=...) or a datamodule")
        batch = first_batch(loaders)
        return example_microbatch(self._attached, self.precision_plugin.convert_input(batch), self.microbatches,
                                  self.split)

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        """Where Lightning calls ``configure_model``: layers made there get their parameters on the
        meta device, and each worker materialises only the stages it owns (:mod:`launcher.torch_support.init`)."""
        with empty_init():
            yield

    # ---- the training loaders' positions (:class:`.loader_position.KeepsLoaderPositions`) ---
    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A checkpoint file or directory; or, as a fresh process replaces a lost one
        (:mod:`.replacement`), a survivor's state handed over in memory (``MEMORY``)."""
        if checkpoint_path == MEMORY:
            checkpoint = handed_over(self)
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self.positions.load(checkpoint)
        if self.pending is not None:
            finish(self, checkpoint)
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        foreground_sharded = self.checkpoint_format == "sharded" and self.run.checkpoint.async_mode == "disabled"
        if self.run.fault.restarts and foreground_sharded:
            # written whole (in the foreground): a recovery may take lost stages from it and replay
            # the steps since (:mod:`.recovery`)
            step = int(checkpoint.get("global_step", 0))
            self.last_checkpoint = (str(filepath), step)
            self.since_checkpoint = {k: v for k, v in self.since_checkpoint.items() if k >= step}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # each worker takes its own stages back, so the partition must exist first

    # ---- the step --------------------------------------------------------------------------
    def _microbatches(self, batch: Any, weigh: bool = True) -> tuple[list[tuple[Any, Any]], list[Any] | None]:
        """The batch cut into ``microbatches`` (input, target) pieces (:func:`split_batch`), as equal
        as they can be (a last batch may not divide), and the items each one's loss averages over
        (:func:`~launcher.lightning.item_counts.loss_items`; None: its rows), by which the engine weighs
        it; not counted unless ``weigh`` (a prediction batch may hold no target to count).

        A batch of fewer samples than ``microbatches`` (a last batch of 2 under DDP on 4 workers) is
        cut into one micro-batch per sample, and the schedule's other micro-batches repeat the last
        one with a count of 0 items: they weigh nothing (no loss, no gradient), so the step equals
        one device's on the batch (:meth:`_stand_ins` says how many there are)."""
        batch = self.precision_plugin.convert_input(batch)
        x, y = split_batch(self._attached, batch, self.traced)
        n = rows(x)
        pieces = self.microbatches if n is None or n >= self.microbatches else max(n, 1)
        xs = chunk(x, pieces, equal=False)
        ys = chunk(y, pieces, equal=False) if y is not None else [None] * pieces
        items = loss_items(self._attached, batch, pieces) if weigh else None
        self._stand_ins = self.microbatches - pieces
        if self._stand_ins:
            if weigh:  # the real micro-batches' counts (their rows by default), then none for the stand-ins
                counts = items if items is not None else [rows(part) for part in xs]
                items = [*counts, *[0] * self._stand_ins]
            xs += [xs[-1]] * self._stand_ins
            ys += [ys[-1]] * self._stand_ins
        return list(zip(xs, ys)), items

    def _sum_over_workers(self, value: float) -> torch.Tensor:
        t = torch.tensor([value], dtype=torch.float64, device=self.root_device)
        all_reduce(t)
        return t[0]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One step through the engine; with ``fault.restarts``, a step a lost worker interrupted is
        taken up again in the re-formed group (:mod:`.recovery`)."""
        self._caught_up = False
        self.step_args = (args, kwargs)  # the step's batch, for a redo after a loss met in its closure
        while True:
            try:
                step = self._attached.trainer.global_step
                if self.copies is not None and self.copies.sent_step != step:  # first step, after a resume or recovery
                    exchange(self, step)
                return self._training_step(*args, **kwargs)
            except Exception as e:
                from .recovery import recoverable

                if not recoverable(self, e):
                    raise
                failed_at = time.monotonic()
            # outside the except clause: the failure's traceback (and the old group it holds) is gone;
            # so is the step's small all-reduce launched beside the gradient's (a work of the old group)
            self._early = None
            from .recovery import recover

            if not recover(self, failed_at):
                return self._caught_up_step()

    def _caught_up_step(self) -> torch.Tensor:
        """This worker was one step behind when a worker was lost and took the state after that
        step from a survivor: the step ends without an update (no gradient, no clipping norm to sum)."""
        self._caught_up = True
        self.fused_norm_sq = torch.zeros((), dtype=torch.float64, device=self.root_device)
        loss = torch.tensor(self.last_loss, dtype=self.loss_dtype, device=self.root_device)
        self._attached.log("train_loss", loss, prog_bar=True)
        return loss

    def _training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.engine is not None
        trainer = self._attached.trainer
        step = trainer.global_step if self.replay_step is None else self.replay_step
        if self._keeps_batches and self.replay_step is None:
            self.since_checkpoint[step] = args[0]
        mbs, items = self._microbatches(args[0])
        self._early = None  # none from a step a failure interrupted: this step's is launched in it
        with self.precision_plugin.train_step_context():
            scaler = getattr(self.precision_plugin, "scaler", None)
            if scaler is not None:  # 16-mixed: the backward runs here, on the scaled loss; the step unscales
                self.engine.loss_scale = float(scaler.get_scale())
            # accumulate_grad_batches=k: the j-th batch of an optimizer step draws as micro-batches j*B ..
            self._in_step = batch_in_step(trainer) if trainer.accumulate_grad_batches > 1 else 0
            record = self.engine.compute_step(mbs, items, step=step,
                                              first_microbatch=self._in_step * self.microbatches,
                                              stand_ins=self._stand_ins)
        self.records.append(record)
        if self._last_batch is None or _samples(mbs) >= _samples(self._last_batch):
            self._last_batch = mbs
        elif record:  # a last, smaller batch stands neither for the run's messages nor for its job times
            record["measured_only"]["short_batch"] = True
        finite = self.engine.finite
        if self.post_validation is not None:
            return self._partial_step(record, finite)
        if norm_is_local(self.engine):
            loss, bad, self.fused_norm_sq = self._agreed_locally(finite)
        else:
            # one all-reduce for the loss, the non-finite check and the clipping norm (docs/performance.md,
            # "Collectives per step"); the gradients are those the backward hook installs next
            share = None
            if self._norm_in_step:
                grads = {s: self.engine.grad_views(s) for s in self.engine.owned}
                share = squared_norm(clipped_gradients(self.engine, grads)[0], self.root_device)
            loss, bad, self.fused_norm_sq = agree(record["measured_only"]["loss"] if record else 0.0,
                                                  finite.first() if finite else None, self.root_device, extra=share)
            self.last_loss = float(loss)
        self.step_skipped = bad is not None
        if bad is not None:
            self.fused_norm_sq = None  # the step's gradients are dropped, not clipped
        if bad is not None:
            self._nonfinite(finite.describe(bad))
        loss = loss.to(self.loss_dtype)
        if self.replay_step is None:
            self._attached.log("train_loss", loss, prog_bar=True)
        return loss

    def _launch_agree(self) -> None:
        """At the end of the engine's step, once its gradient buckets' all-reduces are launched
        (:meth:`Engine.after_reduce_launched`): launch the all-reduce of this worker's loss share
        and its non-finite flag (of its jobs' marks), both still on the device, so that it runs
        beside the gradient's."""
        assert self.engine is not None
        finite, device = self.engine.finite, self.root_device
        flag = finite.flag(device) if finite is not None else torch.zeros((), dtype=torch.float64, device=device)
        # the third element: agree's layout, so the loss is summed in the same order
        t = torch.stack([self.engine.loss_share(), flag, torch.zeros((), dtype=torch.float64, device=device)])
        self._early = (dist.all_reduce(t, async_op=True), t)

    def reduce_norm(self, sq: torch.Tensor) -> bool:
        """The clipping norm's own all-reduce, when the step's did not carry it: True once ``sq`` is
        summed; False when a worker was lost in it and the step was redone under the rebuilt engine
        (:func:`~.outside_step.reduce_norm_or_recover`)."""
        return reduce_norm_or_recover(self, sq, all_reduce)

    def _agreed_locally(self, finite: Any) -> tuple[torch.Tensor, int | None, torch.Tensor | None]:
        """:func:`~launcher.runtime.nonfinite.agree`'s result where every worker holds every
        gradient (DDP): the loss and the flag from the all-reduce :meth:`_launch_agree` launched
        (launched here if the step had none, e.g. nothing to reduce), the flag of the reduced
        gradients' marks and the clipping norm computed on this worker (the same bits on every
        worker), and one read back to the host for the loss and the flag together."""
        assert self.engine is not None
        if self._early is None:
            self._launch_agree()
        assert self._early is not None
        (work, t), self._early = self._early, None
        with blocked(self.engine.watchdog):
            work.wait()
        device = self.root_device
        flag = t[1] + (finite.flag(device) if finite is not None else 0.0)  # the reduced gradients' marks too
        sq = None
        if self._norm_in_step:
            grads = {s: self.engine.grad_views(s) for s in self.engine.owned}
            sq = squared_norm(clipped_gradients(self.engine, grads, local=True)[0], device)
        self.last_loss, bad = torch.stack([t[0], flag]).tolist()
        if bad == 0:
            return t[0], None, sq
        return t[0], lowest(finite.first() if finite is not None else None, device), sq

    def _partial_step(self, record: dict[str, Any] | None, finite: Any) -> torch.Tensor:
        """``step_overlap=post_validation``: the partial state from the later stages in place of the
        all-reduce (:mod:`.step_overlap`). The loss logged is this worker's and the later workers' share:
        the loss stage is on the last worker, so every worker logs the step's whole loss."""
        pv = self.post_validation
        assert pv is not None and self.engine is not None
        sq = 0.0
        if self._attached.trainer.gradient_clip_val:
            grads = {s: self.engine.grad_views(s) for s in self.engine.owned}
            sq = float(squared_norm(clipped_gradients(self.engine, grads)[0], self.root_device))
        code = finite.first() if finite else None
        state = pv.reduce_partial(record["measured_only"]["loss"] if record else 0.0, code, sq)
        self.step_skipped = float(state[1]) > 0
        if self.step_skipped:
            if self.run.nonfinite == "stop":  # stopped on with the full state's sentence, as every worker is
                full = pv.receive_full()
                self._nonfinite(finite.describe(int(full[3])))
            self._nonfinite(finite.describe(int(state[3])))
        loss = state[0].to(self.root_device, self.loss_dtype)
        self._attached.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """``step_overlap=post_validation``: the optimizer's step taken provisionally (the partial
        norm's coefficient), then validated against the full state, rolled back and taken again (or
        dropped, or stopped on) where it was wrong, before Lightning's batch-end hooks run."""
        pv = self.post_validation
        if pv is None:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self.copies is not None:  # the state after this step, copied before the next can lose it
                after_step(self, self._attached.trainer.global_step + 1)  # Lightning counts the step after this
            return out
        raw = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, or the optimizer itself

        def provisional(closure: Any = None, **_: Any) -> Any:
            del raw.step  # the optimizer's own step again, for ProvisionalStep to call
            out = closure() if closure is not None else None
            pv.take(self.step_skipped)
            return out

        raw.step = provisional
        try:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            raw.__dict__.pop("step", None)
        was_skipped = self.step_skipped
        rolled, code = pv.validate()
        if code is not None and not was_skipped:  # a non-finite value at an earlier stage: undone, then as before
            self.step_skipped = True
            assert self.engine is not None and self.engine.finite is not None
            self._nonfinite(self.engine.finite.describe(code))
        if self.copies is not None:
            after_step(self, self._attached.trainer.global_step + 1)
        return out

    def _nonfinite(self, what: str) -> None:
        """A step with a non-finite value, the same on every rank: stop (raise, before any weight
        or checkpoint changes), or drop the step (no gradient is installed, so the optimizer leaves
        every parameter as it is, as a GradScaler does; running statistics go back too)."""
        step = self._attached.trainer.global_step + 1
        if self.run.nonfinite == "stop":
            if self.engine is not None and self.engine.watchdog is not None:
                self.engine.watchdog.set_job(f"the non-finite check of step {step}")
            raise NonFiniteError(f"step {step}: {what}, so training stopped before the step's update "
                                 f"(nonfinite=stop; nonfinite=skip drops such steps and goes on).")
        assert self.engine is not None  # a step ran
        undo_statistics(self.engine.stats)
        if self.global_rank == 0:
            log.warning("warning: step %d skipped (nonfinite=skip): %s.", step, what)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The engine has run the backward already: install its reduced gradients, with the hooks
        Lightning calls around a backward (none in a dropped step: the optimizer then changes nothing).

        ``accumulate_grad_batches=k``: Lightning calls this for each of the step's ``k`` batches and
        steps the optimizer (clipping first) after the ``k``-th, or after the epoch's last batch; each
        batch's gradient is added in divided by ``k``, as Lightning divides each batch's loss. A
        dropped batch adds nothing (the step's other batches still count)."""
        assert self.engine is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._attached)
        k = self._attached.trainer.accumulate_grad_batches
        if self.step_skipped or self._caught_up:
            if self._in_step == 0:  # the step's first batch: no earlier batch's gradient to keep
                for s in self.engine.owned:
                    for p in self.engine.modules[s].parameters():
                        p.grad = None
        elif k > 1:
            self.engine.install_grads(scale=1.0 / k, accumulate=self._in_step > 0)
        else:
            self.engine.install_grads()
        return self.precision_plugin.post_backward(closure_loss, self._attached)

    def _evaluate(self, batch: Any, key: str | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A forward-only step; with ``fault.restarts``, one a lost worker interrupted is taken up
        again in the re-formed group (:mod:`.recovery`), as a training step is."""
        while True:
            try:
                return self._evaluate_once(batch, key)
            except Exception as e:
                from .recovery import recoverable

                if not recoverable(self, e):
                    raise
                failed_at = time.monotonic()
            from .recovery import recover
            from .recovery_terms import Unrecoverable

            # every survivor finished the last training step before evaluating
            if not recover(self, failed_at, during="an evaluation step"):
                raise Unrecoverable("a survivor was a training step behind the others while they evaluated")

    def _evaluate_once(self, batch: Any, key: str | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        assert self.engine is not None
        mbs, items = self._microbatches(batch, weigh=key is not None)
        with self.precision_plugin.val_step_context():
            share, preds = self.engine.evaluate(mbs, items)
        loss = self._sum_over_workers(share).to(self.loss_dtype)
        if key is not None and (mbs[0][1] is not None or self.traced):  # traced: the stages' output is the loss
            self._attached.log(key, loss, prog_bar=key == "val_loss")  # the same on every worker
        return loss, preds

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._evaluate(args[0], "val_loss")[0]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._evaluate(args[0], "test_loss")[0]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The loss stage's outputs for the whole batch, on every rank."""
        _, preds = self._evaluate(args[0], None)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, {b: to_device(t, torch.device("cpu")) for b, t in preds.items()})
        merged = {b: t for part in every for b, t in part.items()}
        return joined([merged[b] for b in range(self.microbatches - self._stand_ins)], self.root_device)

    # ---- metrics ---------------------------------------------------------------------------
    def sizes(self) -> tuple[list[int], list[list[int]], list[int]]:
        """Bytes of every planned message, of every stage input ``x_s^b`` (per micro-batch) and of
        every stage's parameters, for the shapes of the last training batch of the most samples."""
        assert self.engine is not None and self._last_batch is not None
        e, mbs = self.engine, self._last_batch
        return e.sizes(mbs)

    def saved_sizes(self) -> list[list[int]]:
        """Bytes each stage's forward graph saves for its backward, per micro-batch, for the shapes
        of the last training batch of the most samples (:meth:`Engine.saved_sizes`)."""
        assert self.engine is not None and self._last_batch is not None
        return self.engine.saved_sizes(self._last_batch)

    @override
    def teardown(self) -> None:
        if self.post_validation is not None:
            self.post_validation.close()
        self.finish_checkpoint()
        self.stop_watchdog()
        module = self._attached
        if module is not None and has_meta(module):  # the launching process's meta module: nothing to move
            module.cpu = lambda: module  # type: ignore[method-assign]
            try:
                super().teardown()
            finally:
                del module.cpu
            return
        super().teardown()


def _samples(microbatches: Sequence[tuple[Any, Any]]) -> int:
    """The samples of a step's micro-batches (stand-ins counted: they are computed too)."""
    return sum(rows(mb[0]) or 0 for mb in microbatches)


StrategyRegistry.register("unified", UnifiedStrategy,
                          description=f"the schedule engine: {', '.join(SCHEMES)} or a custom placement",
                          override=True)


def _run_settings(run: RunSettings | None, **fields: Any) -> RunSettings:
    """``run``, or the run settings of the keywords given (``None``: the field's default)."""
    given = {k: v for k, v in fields.items() if v is not None}
    if run is not None:
        if given:
            raise TypeError(f"UnifiedStrategy takes the run's settings either as run=RunSettings(...) or as "
                            f"keywords, not both (got run and {', '.join(given)})")
        if not isinstance(run, RunSettings):
            raise TypeError(f"UnifiedStrategy's run takes a RunSettings, not {type(run).__name__}; give plain values "
                            f"as the keywords checkpoint=, nonfinite=, timeout=, transport=")
        return run
    try:
        return RunSettings(**given)
    except StepError as e:
        raise ConfigError(e.sentences) from None
