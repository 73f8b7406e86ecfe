""":class:`Settings`: the settings of one step, typed and frozen, each default written here once.

Every entry point builds one: the command line (:func:`launcher.config.spec.settings_of`, from the
composed Hydra config, whose schema takes its defaults from :data:`DEFAULT`), ``UnifiedStrategy``'s
keywords, and the Python API (:func:`make_schedule`). The rules of :mod:`.rules` check its fields
(:meth:`Settings.errors`), and :meth:`Settings.schedule` is the one way to build a
:class:`~launcher.schedule.simulate.Schedule`. Pure Python: no torch, no omegaconf.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence, Union

from .auto_order import auto_sequences
from .graph import JobSpace, StageGraph
from .order import SCHEME_DEFAULT, AutoOrder, Order, make_order
from .placement import Placement
from .rules import StepError, looped_order_error, step_errors
from .schemes import SCHEMES, named
from .simulate import GRAPH_SHARE, Schedule

#: ``scheme`` and ``order`` as a config names a placement or order callable of the user's
CUSTOM = "custom"
#: time of one job of each kind, in duration units (``I`` and ``W`` when the backward is split)
DEFAULT_DURATIONS: Mapping[str, float] = MappingProxyType({"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5})

#: the schemes whose default order is ``interleaved_1f1b`` where it is valid (looped pipelines)
LOOPED = ("lpp", "fslpp")

#: a scheme by name, or a placement callable ``(s, b, d) -> (w_owner, w_compute)``
SchemeLike = Union[str, Placement, Callable[[int, int, str], Any]]
#: an order by name, an :class:`Order`, or a callable ``n(s, b, d)``
OrderLike = Union[str, Order, Callable[[int, int, str], Any]]


@dataclass(frozen=True)
class Settings:
    """The settings of one step (the config keys of the same names; ``scheme`` is ``strategy``,
    ``ownership`` is ``strategy.ownership``, ``plan_memory`` is ``plan.memory``).

    Built unchecked: :meth:`errors` lists the rules it breaks and :meth:`checked` raises them, so an
    entry point checks once where the settings enter and every later reader trusts them.
    """

    scheme: SchemeLike = "lpp"
    G: int = 2  # groups (replicas of the pipeline)
    R: int = 4  # workers per group
    stages: int = 8
    microbatches: int = 16
    order: OrderLike = SCHEME_DEFAULT  # a name, "default" (the scheme's: :meth:`default_order`), a callable
    warmup: str | None = None  # None: the order's own (classic for 1f1b) | classic | none
    #: a partial mapping is completed from :data:`DEFAULT_DURATIONS`
    durations: Mapping[str, float] = field(default_factory=lambda: DEFAULT_DURATIONS)
    comm: float = 0.0  # delay added when a dependency crosses workers
    memory_limit: int | tuple[int, ...] | None = None  # live activation units per worker (schedule.activations)
    #: the share of a stage's micro-batch activations that is its forward's graph, held from F to W;
    #: the rest, its input, from F to I (:mod:`.activations`, the one memory model)
    graph_share: float | tuple[float, ...] = GRAPH_SHARE  # one for every stage, or one per stage
    split_backward: bool = False
    weight_cache: str = "step"  # fetched weights kept for the step | for one job
    prefetch: int = 1  # jobs of lookahead for inputs and weights on the workers
    ownership: str = "seed"  # FSLPP's owner: seed = h(s, s) | balanced = h(s, floor(s/R))
    recompute: str | tuple[int, ...] = "none"  # none | full | stage indices
    partition: str = "params"  # how a model's self.stages are cut: params | time | memory
    plan_memory: str | None = None  # the bytes a stage may hold under partition=time (plan.memory)
    #: how one step's end meets the next step's start (:mod:`.overlap`): none (a barrier: a step
    #: costs its makespan, what the runtime does) | post_validation (the zero-bubble paper's section
    #: 4: each stage steps as soon as its own gradients are final; priced by the simulator only)
    step_overlap: str = "none"
    #: per stage, its own time per job kind (profiled stages differ); ``None``: ``durations``
    stage_durations: tuple[Mapping[str, float], ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # frozen and plain: lists become tuples, durations a read-only mapping over the defaults
        d = self.durations
        if isinstance(d, Mapping):
            object.__setattr__(self, "durations", MappingProxyType({**DEFAULT_DURATIONS, **d}))
        for k in ("memory_limit", "recompute", "stage_durations", "graph_share"):
            if isinstance(v := getattr(self, k), list):
                object.__setattr__(self, k, tuple(v))

    # ---- building ------------------------------------------------------------------------
    @classmethod
    def of(cls, scheme: SchemeLike, stages: int, microbatches: int, G: int | None = None, R: int | None = None,
           **kw: Any) -> Settings:
        """The settings of the Python API: ``G`` and ``R`` left out are the sizes a named scheme
        fixes (DDP: ``G = microbatches``), else 1; every other setting keeps its default."""
        registered = SCHEMES.get(scheme) if isinstance(scheme, str) else None
        fixed = (registered.sizes(stages, microbatches) if registered is not None else None) or (1, 1)
        return cls(scheme=scheme, stages=stages, microbatches=microbatches,
                   G=fixed[0] if G is None else G, R=fixed[1] if R is None else R, **kw)

    def replace(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    # ---- reading -------------------------------------------------------------------------
    @property
    def workers(self) -> int:
        return self.G * self.R

    @property
    def name(self) -> str:
        """The scheme's name (a callable's ``__name__``)."""
        return self.scheme if isinstance(self.scheme, str) else getattr(self.scheme, "__name__", CUSTOM)

    @property
    def order_name(self) -> str:
        """The order's name; the scheme's default order's when none is named."""
        o = self.resolved_order
        return o if isinstance(o, str) else o.name if isinstance(o, Order) else getattr(o, "__name__", CUSTOM)

    @property
    def order_named(self) -> bool:
        """Whether an order was named (not left to the scheme's default)."""
        return not (isinstance(self.order, str) and self.order == SCHEME_DEFAULT)

    @property
    def resolved_order(self) -> OrderLike:
        """The order the step runs: the one named, else :meth:`default_order`'s."""
        return self.order if self.order_named else self.default_order()[0]

    def default_order(self) -> tuple[str, str]:
        """The order a step gets when none is named, and why, in words (docs/configuration.md,
        "Default orders"). Measured on the vs-native benchmarks, Megatron's ``interleaved_1f1b``
        is the fastest order of a looped pipeline (issue 47: 0.89 of PyTorch's
        ``ScheduleInterleaved1F1B`` where ``1f1b`` took 1.14 to 1.18), so ``lpp`` and ``fslpp``
        get it wherever it is valid; every other scheme, and a looped one where it is not, gets
        ``1f1b`` with its classic warm-up."""
        if not (isinstance(self.scheme, str) and self.scheme in LOOPED):
            return "1f1b", "the default order of every scheme that is not a looped pipeline"
        if not all(type(v) is int for v in (self.R, self.stages)):  # the size rules say why, in their words
            return "1f1b", "the sizes are invalid"
        if self.split_backward is True:
            return "1f1b", ("interleaved_1f1b does not defer the weight-gradient jobs that split_backward=true "
                            "makes, so 1f1b with its classic warm-up keeps them for the bubbles")
        if self.memory_limit is not None:
            return "1f1b", ("interleaved_1f1b follows its own warm-up, not memory_limit, so the order that "
                            "keeps to the limit is 1f1b")
        if looped_order_error(self.scheme, "interleaved_1f1b", self.R, self.stages) is not None:
            return "1f1b", (f"interleaved_1f1b needs 1 < R < stages with stages a multiple of R, and here R={self.R} "
                            f"stages={self.stages}")
        return "interleaved_1f1b", f"the fastest measured order of a looped pipeline ({self.name} R={self.R})"

    @property
    def overlapped(self) -> bool:
        """Whether consecutive steps overlap (``step_overlap`` is not ``none``)."""
        return self.step_overlap != "none"

    @property
    def recompute_stages(self) -> frozenset[int]:
        from .rules import recompute_stages

        return recompute_stages(self.recompute, self.stages)

    def values(self) -> dict[str, Any]:
        """The settings by the rules' key names (:func:`launcher.schedule.rules.step_errors`); an
        :class:`Order` object is the caller's own and has no rule."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                               if f.name not in ("scheme", "order", "stage_durations", "plan_memory")}
        out["strategy"] = self.scheme
        if not isinstance(self.order, Order):
            out["order"] = self.resolved_order
        for k in ("recompute", "memory_limit", "graph_share"):
            if isinstance(out[k], tuple):
                out[k] = list(out[k])
        out["durations"] = dict(self.durations) if isinstance(self.durations, Mapping) else self.durations
        return out

    # ---- checking ------------------------------------------------------------------------
    def errors(self, **extra: Any) -> list[str]:
        """One sentence per rule of :mod:`.rules` these settings break (``extra``: more values to
        check with them, such as the config's ``W``)."""
        return step_errors({**self.values(), **extra})

    def checked(self) -> Settings:
        """These settings, or :class:`StepError` with every rule they break."""
        found = self.errors()
        if found:
            raise StepError(found)
        return self

    def ignored(self) -> list[str]:
        """One sentence per setting that has no effect under the named scheme (its run goes on);
        the scheme registry says what a scheme ignores (:class:`~launcher.schedule.schemes.Scheme`)."""
        registered = SCHEMES.get(self.scheme) if isinstance(self.scheme, str) else None
        if registered is None:
            return []
        out: list[str] = []
        s = registered.name
        if not registered.has_order and self.order_named:
            out.append(f"order={self.order_name} has no effect with strategy={s}: {registered.why_no_order}; "
                       "the run goes on.")
        if not registered.fetches and self.weight_cache != DEFAULT.weight_cache:
            out.append(f"weight_cache={self.weight_cache} has no effect with strategy={s}: every {s} worker holds the "
                       f"weights of the stages it computes, so no weights are fetched and none are cached; the run "
                       f"goes on (it matters under {', '.join(n for n, x in SCHEMES.items() if x.fetches)} and custom "
                       f"placements).")
        if not registered.fetches and not registered.passes and self.prefetch != DEFAULT.prefetch:
            out.append(f"prefetch={self.prefetch} has no effect with strategy={s}: its workers neither fetch weights "
                       f"nor receive activations, so there is nothing to look ahead for; the run goes on.")
        return out

    # ---- the schedule --------------------------------------------------------------------
    def schedule(self, graph: StageGraph | None = None) -> Schedule:
        """The schedule these settings describe, on the stage ``graph`` (a chain when ``None``).
        Trusts the settings (:meth:`checked` them first): analyses may study steps the launcher
        refuses on purpose (workers without a stage)."""
        graph = graph or StageGraph.chain(self.stages)
        if graph.stages != self.stages:
            raise StepError([f"stages={self.stages} is invalid: the stage graph has {graph.stages} stages."])
        placement: Placement = named(self.scheme, self.G, self.R, self.ownership) if isinstance(self.scheme, str) \
            else self.scheme  # type: ignore[assignment]  # a user's callable, as Placement describes it
        order = self.resolved_order
        o = order if isinstance(order, Order) else make_order(order, self.warmup)
        if o.split_only and not self.split_backward:
            raise ValueError(f"order={o.name} runs the weight-gradient jobs W apart, so it needs split_backward=True")
        step = Schedule(JobSpace(graph, self.microbatches, self.split_backward), placement, self.workers, o,
                    dict(self.durations), self.comm, self.memory_limit, self.name,
                    list(self.stage_durations) if self.stage_durations is not None else None,
                    self.recompute_stages, graph_share=self.graph_share)
        if isinstance(o, AutoOrder) and o.seqs is None:  # search the sequences for this step's own profile
            # overlapping steps pay the longest worker span (its steady state, :mod:`.overlap`), else the makespan
            step.order = replace(o, seqs=auto_sequences(step, "span" if self.overlapped else "makespan"))
            if step.order.in_sequence:
                step.memory_limit = None  # the sequences keep to it themselves, counted the same way
        return step


#: every default, once: the config's schema and every entry point read them from here
DEFAULT = Settings()


def make_schedule(strategy: SchemeLike, stages: int, microbatches: int, G: int | None = None, R: int | None = None,
              order: OrderLike = DEFAULT.order, graph: StageGraph | None = None,
              stage_durations: Sequence[Mapping[str, float]] | None = None, **settings: Any) -> Schedule:
    """The step of :meth:`Settings.of` (a named scheme or a placement callable on ``W = G * R``
    workers; any other field of :class:`Settings` as a keyword), checked by the rules the command
    line applies, with the same sentences: :class:`StepError`, one per broken rule."""
    return _settings(strategy, stages, microbatches, G, R, order, stage_durations, settings).checked().schedule(graph)


def unchecked_schedule(strategy: SchemeLike, stages: int, microbatches: int, G: int | None = None, R: int | None = None,
                   order: OrderLike = DEFAULT.order, graph: StageGraph | None = None,
                   stage_durations: Sequence[Mapping[str, float]] | None = None, **settings: Any) -> Schedule:
    """:func:`make_schedule` without the rules a config must meet: for analyses that study steps the
    launcher refuses on purpose (the LPP configuration ``G = B/2, R = 2S/M`` of docs/design.md,
    "Closed forms", leaves workers without a stage)."""
    return _settings(strategy, stages, microbatches, G, R, order, stage_durations, settings).schedule(graph)


def _settings(strategy: SchemeLike, stages: int, microbatches: int, G: int | None, R: int | None, order: OrderLike,
              stage_durations: Sequence[Mapping[str, float]] | None, settings: dict[str, Any]) -> Settings:
    if settings.get("recompute", "") is None:  # the API's "no recompute"
        settings["recompute"] = DEFAULT.recompute
    if isinstance(settings.get("recompute"), (set, frozenset)):
        settings["recompute"] = sorted(settings["recompute"])
    if settings.get("durations", "") is None:
        settings["durations"] = DEFAULT.durations
    return Settings.of(strategy, stages, microbatches, G, R, order=order,
                       stage_durations=tuple(stage_durations) if stage_durations is not None else None, **settings)
