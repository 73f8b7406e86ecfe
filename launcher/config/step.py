"""Config -> :class:`launcher.schedule.Step`: the one place a launcher config becomes a schedule.

The simulator, the runtime and the Lightning strategy all start from :func:`to_step`, so they plan
the same step from the same config.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from ..schedule import Step, make_step
from .validate import ConfigError, validate


def _instantiate(node: Any, key: str, what: str) -> Callable:
    from hydra.utils import instantiate

    target = node.get("_target_")
    try:
        obj = instantiate(node)
    except Exception as e:  # import errors, bad arguments: one sentence, the cause's first line
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError([f"{key}._target_={target} could not be built: {first.rstrip('.')}."]) from e
    if not callable(obj):
        raise ConfigError([f"{key}._target_={target} is invalid: it built {obj!r}, which is not a callable {what}."])
    return obj


def to_step(cfg: DictConfig | Mapping[str, Any], check: bool = True) -> Step:
    """The step a (composed) config describes; validated first unless ``check`` is false."""
    if check:
        validate(cfg)
    c = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    placement = c.strategy.get("placement")
    strategy: Any = c.strategy.name
    if placement is not None:
        place = _instantiate(placement, "strategy.placement", "(s, b, d) -> (w_weights, w_compute)")
        strategy = _named(place, c.strategy.name)
    n = c.order.get("n")
    order: Any = c.order.name
    if n is not None:
        order = _named(_instantiate(n, "order.n", "n(s, b, d)"), c.order.name)
    memory_limit = OmegaConf.to_container(c.memory_limit) if OmegaConf.is_list(c.memory_limit) else c.memory_limit
    return make_step(
        strategy,
        stages=c.stages,
        microbatches=c.microbatches,
        G=c.G,
        R=c.R,
        order=order,
        warmup=c.warmup,
        durations=dict(c.durations),
        comm=float(c.comm),
        memory_limit=memory_limit,
        split_backward=bool(c.split_backward),
    )


def _named(fn: Callable, name: str) -> Callable:
    """Give a callable (a ``functools.partial`` has no ``__name__``) the config's label."""
    if getattr(fn, "__name__", None):
        return fn
    try:
        fn.__name__ = name  # type: ignore[attr-defined]
        return fn
    except (AttributeError, TypeError):
        def wrapped(s: int, b: int, d: str) -> Any:
            return fn(s, b, d)

        wrapped.__name__ = name
        return wrapped
