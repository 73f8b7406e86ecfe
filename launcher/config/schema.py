"""The structured schema of the launcher's Hydra config: every key, its type and its default.

The step's keys take their defaults from :data:`launcher.schedule.settings.DEFAULT` (each default
is written there once); :data:`SETTING_KEYS` says which config key holds each field of
:class:`~launcher.schedule.settings.Settings`.

Registered in Hydra's ConfigStore as ``launcher_schema`` (the first entry of ``conf/config.yaml``'s
defaults list), so Hydra rejects a value of the wrong type while composing. The rules between keys
(``W = G * R``, ``R <= stages``, ...) live in :mod:`launcher.config.validate`.

``W`` is ``${mul:${G},${R}}``: the resolver ``mul`` is registered when this module is imported;
the code still checks ``W == G * R`` (a user may override ``W``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..schedule.run_settings import DEFAULT_RUN
from ..schedule.settings import DEFAULT, SCHEME_DEFAULT, Settings

SCHEMA_NAME = "launcher_schema"

#: the sizes of a step; each must be a positive integer
SIZES = ("G", "R", "stages", "microbatches")
MODES = ("train", "simulate", "plan")


@dataclass
class StrategyConf:
    """A named scheme, or ``placement``: a node that ``hydra.utils.instantiate`` turns into a
    callable ``(s, b, d) -> (w_owner, w_compute)`` (then ``name`` is only a label).
    ``ownership`` picks FSLPP's owner: ``seed`` = ``h(s, s)``, ``balanced`` = ``h(s, floor(s/R))``."""

    name: str = DEFAULT.name
    placement: Any = None
    ownership: str = DEFAULT.ownership


@dataclass
class OrderConf:
    """A named tie-break order, or ``n``: a node instantiated into a callable ``n(s, b, d)``, or
    ``path``: a schedule file (``order=file``); ``export``: where to write the step's schedule."""

    name: str = SCHEME_DEFAULT  # the scheme's own (Settings.default_order)
    n: Any = None
    path: Optional[str] = None  # order=file: each worker's job sequence (our action text; torch's CSV for a .csv)
    export: Optional[str] = None  # mode=simulate writes the step's job sequences here (same two forms)


@dataclass
class DurationsConf:
    """Time of one job of each kind, in duration units (``I``/``W`` when the backward is split)."""

    F: float = DEFAULT.durations["F"]
    B: float = DEFAULT.durations["B"]
    I: float = DEFAULT.durations["I"]  # noqa: E741 - the input-gradient job kind, a config key (durations.I)
    W: float = DEFAULT.durations["W"]


@dataclass
class PlanConf:
    """``mode=plan`` and ``strategy=auto`` (see :mod:`launcher.plan.from_config`): workers available
    (null: ``W``), micro-batch counts to try (null: ``microbatches``; an int or a list), the
    per-worker budget in live activations and/or bytes (``2GB``; needs a profile with bytes), the
    profile (a run's ``metrics.json`` or a bare profile JSON; null: ``durations`` and ``comm``),
    how many candidates to keep, and how many of them ``mode=plan`` trains to choose by measurement
    (:mod:`launcher.modes.trials`)."""

    workers: Optional[int] = None
    microbatches: Any = None
    max_activations: Optional[int] = None
    memory: Any = None
    profile: Optional[str] = None
    top: int = 20
    trials: int = 0  # mode=plan: train the top this many on real workers and keep the fastest measured
    trial_steps: int = 10  # steps of each trial run (its median step after the first is measured)
    trial_rounds: int = 2  # runs of each candidate tried, alternated; the median is kept


@dataclass
class CheckpointConf:
    """mode=train's checkpoints: ``format`` sharded (each stage's owner writes it, a directory) |
    single (one file, gathered at rank 0) | null (the scheme's default: sharded for fsdp, gpipe and
    fslpp); ``async_mode`` disabled | async (shards written in the background from a host copy).
    Typed and checked as :class:`~launcher.schedule.run_settings.CheckpointSettings`."""

    format: Optional[str] = DEFAULT_RUN.checkpoint.format
    async_mode: str = DEFAULT_RUN.checkpoint.async_mode


@dataclass
class FaultConf:
    """mode=train's recovery from a lost worker: ``restarts``, how many lost workers the run
    recovers from inside the job (0: the first failure ends it); ``copies`` 0 | 1, a copy of each
    stage held by one worker kept on the next worker, so such stages are recovered from memory;
    ``replace``, a fresh process forked for a lost worker's rank (W unchanged). Typed and checked
    as :class:`~launcher.schedule.run_settings.FaultSettings`."""

    restarts: int = DEFAULT_RUN.fault.restarts
    copies: int = DEFAULT_RUN.fault.copies
    replace: bool = DEFAULT_RUN.fault.replace


@dataclass
class RuntimeConf:
    """mode=train's workers: ``transport`` auto | gloo | shm, how activations and their gradients
    travel between workers (:data:`launcher.schedule.run_settings.Transport`)."""

    transport: str = DEFAULT_RUN.transport


@dataclass
class LauncherConf:
    mode: str = "train"
    strategy: StrategyConf = field(default_factory=StrategyConf)
    order: OrderConf = field(default_factory=OrderConf)
    G: int = DEFAULT.G
    R: int = DEFAULT.R
    W: int = "${mul:${G},${R}}"  # type: ignore[assignment]  # interpolation, resolved to an int
    stages: int = DEFAULT.stages
    microbatches: int = DEFAULT.microbatches
    durations: DurationsConf = field(default_factory=DurationsConf)
    comm: float = DEFAULT.comm
    memory_limit: Any = DEFAULT.memory_limit  # null | int | list of ints, one per worker
    graph_share: Any = DEFAULT.graph_share  # of a stage's micro-batch activations, the graph's part (held to W)
    warmup: Optional[str] = DEFAULT.warmup  # null = the order's default; classic | none
    split_backward: bool = DEFAULT.split_backward
    weight_cache: str = DEFAULT.weight_cache  # step | job
    recompute: Any = DEFAULT.recompute  # none | full | [stage indices]: their backward recomputes the forward
    step_overlap: str = DEFAULT.step_overlap  # none | post_validation | post_validation_paper (priced only)
    prefetch: int = DEFAULT.prefetch  # jobs of lookahead of the runtime; mode=simulate reports its resident weights
    seed: int = 0  # mode=train: seed_everything(seed) before the model and data are built
    png: Any = "auto"  # pipeline.png: true | false | auto (drawn up to report.png.AUTO_MAX_JOBS jobs)
    # mode=train: groups instantiated with hydra.utils.instantiate (conf/model, conf/data, conf/logger)
    # and the keyword arguments of lightning's Trainer (conf/trainer)
    model: Any = None
    data: Any = None
    trainer: Any = None
    logger: Any = None
    split: Any = None  # mode=train: null (the model's self.stages) | auto | [module paths where stages begin]
    partition: str = DEFAULT.partition  # mode=train: self.stages cut balanced by params | time (profiled) | memory
    timeout: float = DEFAULT_RUN.timeout  # seconds without progress while peers wait, after which a worker is hung
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)  # mode=train: how checkpoints are written
    fault: FaultConf = field(default_factory=FaultConf)  # mode=train: recovery from a lost worker
    runtime: RuntimeConf = field(default_factory=RuntimeConf)  # mode=train: how the workers exchange messages
    ckpt_path: Optional[str] = None  # resume from this checkpoint (trainer.fit(ckpt_path=...))
    nonfinite: str = DEFAULT_RUN.nonfinite  # a NaN/inf loss or gradient: stop the run | skip the step
    plan: PlanConf = field(default_factory=PlanConf)  # mode=plan (and strategy=auto)
    # what a run returns to a sweeper (hparams_search=optuna): a metric's name or a list of them
    # (launcher.hparams.METRICS), one hydra.sweeper.direction per metric
    optimized_metric: Any = "val_loss"


#: the config key that holds each field of :class:`Settings` (the key of the same name otherwise)
_RENAMED = {"scheme": "strategy.name", "order": "order.name", "ownership": "strategy.ownership",
            "plan_memory": "plan.memory"}
SETTING_KEYS: dict[str, str] = {f.name: _RENAMED.get(f.name, f.name) for f in dataclasses.fields(Settings)
                                if f.name != "stage_durations"}  # measured on the workers, never configured


def _mul(*xs: Any) -> Any:
    """``${mul:${G},${R}}``; ``None`` when a factor is not an integer (validation reports it)."""
    if all(isinstance(x, int) and not isinstance(x, bool) for x in xs):
        return math.prod(xs)
    return None


def _div(a: Any, b: Any) -> Any:
    """``${div:a,b}``: integer division for recipes (``R = 2S/M``); ``None`` unless both are
    integers and ``b`` divides ``a`` (validation reports the key that got it)."""
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)) and b and a % b == 0:
        return a // b
    return None


def _scheme_size(key: str, *, _root_: Any) -> Any:
    """``${scheme_size:G}`` (or ``R``): the size the scheme named by ``strategy.name`` fixes, from
    the registry (:data:`launcher.schedule.SCHEMES`), so ``conf/strategy/ddp.yaml`` and the rules
    cannot disagree; ``None`` when the scheme fixes none or a size is not an integer (validation
    reports it)."""
    from ..schedule.schemes import SCHEMES

    named = SCHEMES.get(str(_root_.strategy.name))
    S, B = _root_.stages, _root_.microbatches
    sizes = named.sizes(S, B) if named is not None and all(isinstance(x, int) for x in (S, B)) else None
    return None if sizes is None else sizes[("G", "R").index(key)]


def register() -> None:
    """Register the resolvers (``mul``, ``div``, ``scheme_size``) and the schema; safe to call more than once."""
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", _mul)
    if not OmegaConf.has_resolver("div"):
        OmegaConf.register_new_resolver("div", _div)
    if not OmegaConf.has_resolver("scheme_size"):
        OmegaConf.register_new_resolver("scheme_size", _scheme_size)
    ConfigStore.instance().store(name=SCHEMA_NAME, node=LauncherConf)
    # an open node (not in struct mode): under model=custom and data=custom (their defaults list
    # it) the user's own arguments are set as model.x=... and data.x=..., without Hydra's +
    ConfigStore.instance().store(name=OPEN_NODE, node=_open_node())


#: the config an option of the model/data groups lists first to take keys the launcher does not know
OPEN_NODE = "launcher_open_node"


def _open_node() -> Any:
    node = OmegaConf.create({})
    OmegaConf.set_struct(node, False)
    return node


register()
