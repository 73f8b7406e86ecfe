""":class:`RunSpec`: a step's settings, validated once where they enter and trusted after.

A run's schedule settings arrive from the command line (a composed Hydra config) or from
``UnifiedStrategy``'s keywords. Either edge checks them once (:mod:`launcher.config.validate`,
whose step rules are :mod:`launcher.schedule.rules`), builds any custom placement or order once,
and hands on a frozen :class:`RunSpec`. The strategy, the forked workers (which inherit it) and the
simulator read it without checking again; :meth:`RunSpec.step` builds the schedule from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from ..schedule import Step
from ..schedule.rules import StepError, recompute_stages
from ..schedule.simulate import unchecked_step
from .step import one_line, target_error
from .validate import ConfigError, validate

#: ``scheme`` and ``order`` of a spec whose placement or order is a callable of the user's
CUSTOM = "custom"


@dataclass(frozen=True)
class RunSpec:
    """The settings of one step (the config keys of the same names); see ``conf/config.yaml``."""

    scheme: str  # a registered scheme (launcher.schedule.SCHEMES) or "custom"
    G: int
    R: int
    stages: int
    microbatches: int
    order: str = "1f1b"  # a built-in order or "custom"
    warmup: str | None = None
    durations: Mapping[str, float] = field(default_factory=dict)
    comm: float = 0.0
    memory_limit: int | tuple[int, ...] | None = None
    split_backward: bool = False
    weight_cache: str = "step"
    prefetch: int = 1
    ownership: str = "seed"
    recompute: str | tuple[int, ...] = "none"
    partition: str = "params"
    plan_memory: str | None = None  # plan.memory: the bytes a stage may hold under partition=time
    placement: Callable[[int, int, str], Any] | None = field(default=None, compare=False)  # scheme == "custom"
    order_fn: Callable[[int, int, str], Any] | None = field(default=None, compare=False)  # order == "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "durations", MappingProxyType(dict(self.durations)))

    @property
    def W(self) -> int:
        return self.G * self.R

    @property
    def recompute_stages(self) -> frozenset[int]:
        return recompute_stages(list(self.recompute) if isinstance(self.recompute, tuple) else self.recompute,
                                self.stages)

    def step(self, graph: Any = None) -> Step:
        """The schedule these settings describe, on the stage ``graph`` (a chain when ``None``)."""
        if graph is not None and graph.stages != self.stages:
            raise StepError([f"stages={self.stages} is invalid: the stage graph has {graph.stages} stages."])
        return unchecked_step(
            self.placement if self.placement is not None else self.scheme, self.stages, self.microbatches,
            self.G, self.R, self.order_fn if self.order_fn is not None else self.order, self.warmup,
            dict(self.durations), self.comm, self.memory_limit, self.split_backward, graph, self.ownership,
            recompute=list(self.recompute) if isinstance(self.recompute, tuple) else self.recompute)

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any], check: bool = True) -> RunSpec:
        """The spec of a composed config; its rules are checked first unless ``check`` is false (the
        caller checked them). A custom placement or order is built here, and only here."""
        if check:
            validate(cfg)
        c = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
        if c.strategy.name == "auto" and c.strategy.get("placement") is None:
            raise ConfigError(["strategy=auto is chosen by the planner: apply launcher.plan.choose(cfg)'s "
                               "overrides first."])
        node, n = c.strategy.get("placement"), c.order.get("n")
        placement = order_fn = None
        if node is not None:
            built = _instantiate(node, "strategy.placement", "(s, b, d) -> (w_weights, w_compute)")
            placement = _guarded(built, "strategy.placement", node.get("_target_"), c.strategy.name, pair=True)
        if n is not None:
            order_fn = _guarded(_instantiate(n, "order.n", "n(s, b, d)"), "order.n", n.get("_target_"), c.order.name)
        plan = c.get("plan")
        return cls(
            scheme=CUSTOM if placement is not None else str(c.strategy.name),
            G=int(c.G), R=int(c.R), stages=int(c.stages), microbatches=int(c.microbatches),
            order=CUSTOM if order_fn is not None else str(c.order.name),
            warmup=c.warmup, durations=dict(c.durations), comm=float(c.comm),
            memory_limit=_plain(c.memory_limit), split_backward=bool(c.split_backward),
            weight_cache=str(c.get("weight_cache", "step")), prefetch=int(c.get("prefetch", 1)),
            ownership=str(c.strategy.get("ownership") or "seed"), recompute=_plain(c.get("recompute", "none")),
            partition=str(c.get("partition", "params")),
            plan_memory=plan.get("memory") if plan is not None else None,
            placement=placement, order_fn=order_fn)


def _plain(v: Any) -> Any:
    """A list node as a tuple (a spec is frozen); anything else as it is."""
    return tuple(OmegaConf.to_container(v)) if OmegaConf.is_list(v) else tuple(v) if isinstance(v, list) else v


def _instantiate(node: Any, key: str, what: str) -> Callable:
    from hydra.utils import instantiate

    target = node.get("_target_")
    missing = target_error(str(target))
    if missing:
        raise ConfigError([f"{key}._target_={target} could not be built: {missing}."])
    try:
        obj = instantiate(node)
    except Exception as e:  # import errors, bad arguments: one sentence, the cause's first line
        raise ConfigError([f"{key}._target_={target} could not be built: {one_line(e)}."]) from e
    if not callable(obj):
        raise ConfigError([f"{key}._target_={target} is invalid: it built {obj!r}, which is not a callable {what}."])
    return obj


def _guarded(fn: Callable, key: str, target: str, name: str, pair: bool = False) -> Callable:
    """``fn`` under the config's label, turning its failures (and, for a placement, a result that
    is not a pair of ints) into one sentence naming the job."""
    def call(s: int, b: int, d: str) -> Any:
        try:
            out = fn(s, b, d)
        except Exception as e:
            raise ConfigError([f"{key}._target_={target} failed on job ({s}, {b}, {d}): {one_line(e)}."]) from e
        ints = isinstance(out, tuple) and all(isinstance(w, int) and not isinstance(w, bool) for w in out)
        if pair and not (ints and len(out) == 2):
            raise ConfigError([f"{key}._target_={target} returned {out!r} for job ({s}, {b}, {d}); it must return "
                               f"(w_weights, w_compute), two ints."])
        return out

    call.__name__ = name
    return call
