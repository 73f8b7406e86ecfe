"""The :class:`~launcher.schedule.settings.Settings` that ``UnifiedStrategy``'s keywords describe,
checked by the rules the command line's settings are checked by."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..config import ConfigError, LauncherConf, settings_of, step_errors
from ..config.schema import SETTING_KEYS
from ..schedule.rules import shown, unknown_key
from ..schedule.settings import CUSTOM, OrderLike, SchemeLike, Settings

#: the step's settings ``UnifiedStrategy`` takes as keywords beyond its named parameters (``scheme``,
#: ``G``, ``R``, ``stages``, ``microbatches``, ``order``), by their config keys: ``ownership`` is
#: ``strategy.ownership``, ``plan`` takes ``{"memory": ...}`` (``plan.memory``)
STEP_KEYWORDS: tuple[str, ...] = tuple(
    f if f == "ownership" else key.split(".")[0] for f, key in SETTING_KEYS.items()
    if f not in ("scheme", "G", "R", "stages", "microbatches", "order"))
#: the one key of ``plan`` a training run reads (the planner's other keys are the command line's)
PLAN_KEYS = ("plan.memory",)


def keyword_errors(extra: Mapping[str, Any], named: Sequence[str]) -> list[str]:
    """One sentence per keyword of ``extra`` that ``UnifiedStrategy`` does not take (``named``: its
    own parameters), with the closest keyword when one is close: a misspelt or misplaced keyword
    would otherwise be dropped silently."""
    known = [*named, *STEP_KEYWORDS]
    config_keys = {f.name for f in dataclasses.fields(LauncherConf)}
    out: list[str] = []
    for k, v in extra.items():
        if k == "runtime":  # the run's settings are UnifiedStrategy's own keywords (RunSettings)
            out.append(f"runtime={shown(v)} is invalid: UnifiedStrategy has no runtime keyword; give the transport "
                       f"as transport=... (the config's runtime.transport).")
        elif k == "plan" and isinstance(v, Mapping):
            out += [unknown_key(f"plan.{p}", v[p], PLAN_KEYS, "a keyword of UnifiedStrategy's plan",
                                "a training run reads plan.memory only")
                    for p in v if f"plan.{p}" not in PLAN_KEYS]
        elif k == "strategy":  # the command line's name for the scheme
            out.append(unknown_key(k, v, (), "a keyword of UnifiedStrategy", "its keyword for the scheme is scheme"))
        elif k in config_keys and k not in STEP_KEYWORDS:  # a close keyword would be a wrong guess (seed: scheme)
            out.append(unknown_key(k, v, (), "a keyword of UnifiedStrategy",
                                   f"{k} is a key of the command line's config that the strategy does not read "
                                   f"(give it to the Trainer, the module or the data)"))
        elif k not in STEP_KEYWORDS:
            out.append(unknown_key(k, v, known, "a keyword of UnifiedStrategy", f"it takes {', '.join(known)}"))
    return out


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
