"""The :class:`~launcher.schedule.settings.Settings` of a composed config, checked once where they
enter and trusted after.

A run's schedule settings arrive from the command line (a composed Hydra config) or from
``UnifiedStrategy``'s keywords. Either edge checks them once (:mod:`launcher.config.validate`,
whose step rules are :mod:`launcher.schedule.rules`), builds any custom placement or order once,
says in one warning line each setting that has no effect under the scheme, and hands on frozen
:class:`Settings`. The strategy, the forked workers (which inherit them) and the simulator read
them without checking again; :meth:`Settings.schedule` builds the schedule from them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from ..schedule import Schedule
from ..schedule.settings import CUSTOM, Settings
from .sentences import one_line, target_error
from .validate import ConfigError, raw_settings, validate

log = logging.getLogger(__name__)

__all__ = ["CUSTOM", "settings_of", "to_schedule"]


def settings_of(cfg: DictConfig | Mapping[str, Any], check: bool = True, **given: Any) -> Settings:
    """The settings of a composed config; its rules are checked first unless ``check`` is false
    (the caller checked them). A custom placement or order is built here, and only here; a setting
    the scheme ignores is said in one warning line. ``given``: fields the caller has built (a
    placement or order callable given from Python)."""
    if check:
        validate(cfg)
    c = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    if c.strategy.name == "auto" and c.strategy.get("placement") is None:
        raise ConfigError(["strategy=auto is chosen by the planner: apply launcher.plan.choose(cfg)'s "
                           "overrides first."])
    node, n = c.strategy.get("placement"), c.order.get("n")
    built: dict[str, Any] = dict(given)
    if node is not None:
        placement = _instantiate(node, "strategy.placement", "(s, b, d) -> (w_owner, w_compute)")
        built["scheme"] = _guarded(placement, "strategy.placement", node.get("_target_"), c.strategy.name, pair=True)
    if n is not None:
        order = _instantiate(n, "order.n", "n(s, b, d)")
        built["order"] = _guarded(order, "order.n", n.get("_target_"), c.order.name)
    if c.order.get("name") == "file" and "order" not in built:
        from ..schedule.order_file import FileOrder

        warmup = c.get("warmup")
        built["order"] = FileOrder(path=str(c.order.path), **({"warmup": warmup} if warmup is not None else {}))
    settings = raw_settings(c, **built)
    for sentence in settings.ignored():
        log.warning("warning: %s", sentence)
    return settings


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
                               f"(w_owner, w_compute), two ints."])
        return out

    call.__name__ = name
    return call


def to_schedule(cfg: DictConfig | Mapping[str, Any], check: bool = True, graph: Any = None) -> Schedule:
    """The step a (composed) config describes; validated first unless ``check`` is false.
    ``graph``: the model's stage graph, when it is not a chain (a traced model's)."""
    step = settings_of(cfg, check).schedule(graph)
    if step.order.name == "file":  # the file's placement must be the scheme's: refuse before any worker starts
        from ..schedule.order_file import FileOrder
        from ..schedule.simulate import place_all

        assert isinstance(step.order, FileOrder)
        try:
            step.order.placed_keys(step.space, place_all(step)[0])  # reads the file and checks its sequences
        except ValueError as e:
            raise ConfigError([str(e).rstrip(".") + "."]) from e
    return step
