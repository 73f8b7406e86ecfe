"""The :class:`~launcher.schedule.settings.Settings` that ``UnifiedStrategy``'s keywords describe,
checked by the rules the command line's settings are checked by."""

from __future__ import annotations

from typing import Any, Mapping

from ..config import ConfigError, LauncherConf, settings_of, step_errors
from ..schedule.settings import CUSTOM, OrderLike, SchemeLike, Settings


def keyword_settings(scheme: SchemeLike, G: int | None, R: int | None, stages: int, microbatches: int,
                     order: OrderLike, extra: Mapping[str, Any]) -> Settings:
    """The :class:`Settings` ``UnifiedStrategy``'s keywords describe, checked by the config's rules
    (:func:`launcher.config.step_errors`) as the command line's are; raises :class:`ConfigError`
    with one sentence per broken rule. A callable placement or order is checked as a custom one.
    ``G`` and ``R`` left out are the sizes a named scheme fixes, else 1 (:meth:`Settings.of`)."""
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.structured(LauncherConf)
    if "runtime" in extra:  # the run's settings are UnifiedStrategy's own keywords (RunSettings)
        raise ConfigError([f"UnifiedStrategy got runtime={extra['runtime']!r}: give the transport as "
                           f"transport=... (the config's runtime.transport)."])
    unknown = sorted(set(extra) - set(cfg.keys()) - {"mode", "ownership"})
    if unknown:
        raise ConfigError([f"UnifiedStrategy got {unknown[0]}={extra[unknown[0]]!r}, which is not a launcher config "
                           f"key; use one of {', '.join(k for k in cfg.keys() if k not in ('mode', 'W'))}."])
    extra = dict(extra)
    sized = Settings.of(scheme, stages, microbatches, G, R)
    cfg.strategy.name = CUSTOM if callable(scheme) else scheme
    if "ownership" in extra:  # FSLPP's owner formula: a key of the strategy node
        cfg.strategy.ownership = extra.pop("ownership")
    cfg.stages, cfg.microbatches, cfg.G, cfg.R = stages, microbatches, sized.G, sized.R
    cfg.order.name = CUSTOM if callable(order) else order
    try:
        cfg = OmegaConf.merge(cfg, dict(extra))
    except Exception as e:  # noqa: BLE001 - omegaconf's type check of a keyword: one sentence
        raise ConfigError([f"UnifiedStrategy got an invalid value: {' '.join(str(e).split())}."]) from e
    assert isinstance(cfg, DictConfig)  # merged into a structured config
    checked = cfg.copy()
    # a callable is checked as a custom node of the config is (no rule of a named scheme or order applies)
    if callable(scheme):
        checked.strategy.placement = {"_target_": getattr(scheme, "__name__", CUSTOM)}
    if callable(order):
        checked.order.n = {"_target_": getattr(order, "__name__", CUSTOM)}
    found = step_errors(checked)
    if found:
        raise ConfigError(found)
    callables = {k: v for k, v in (("scheme", scheme), ("order", order)) if callable(v)}
    return settings_of(cfg, check=False, **callables)
