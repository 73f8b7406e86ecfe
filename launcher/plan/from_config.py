"""The planner from a launcher config: ``plan.*`` keys -> profile, budget, search -> the best.

Keys (schema: :class:`launcher.config.schema.PlanConf`): ``plan.workers`` (null: the config's
``W``), ``plan.microbatches`` (null: ``microbatches``; or a list to try), ``plan.max_activations``
and/or ``plan.memory`` (e.g. ``2GB``, needs a profile with bytes), ``plan.profile`` (a run's
``metrics.json`` or a bare profile JSON; null: the config's ``durations`` and ``comm``),
``plan.top`` (candidates kept); ``fault.copies`` (1: each candidate's copies counted,
:class:`~launcher.plan.search.Budget`).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..schedule.settings import DEFAULT
from .profile import Profile, load, parse_bytes, unit
from .search import Budget, Candidate, Ranking, search


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    node = cfg
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return default
    return default if node is None else node


def profile_of(cfg: Mapping[str, Any]) -> Profile:
    """The profile ``plan.profile`` names, or the config's unit-cost model."""
    path = _get(cfg, "plan.profile")
    if path:
        return load(path)
    return unit(dict(_get(cfg, "durations")), float(_get(cfg, "comm", DEFAULT.comm)))


def budget_of(cfg: Mapping[str, Any]) -> Budget:
    memory = _get(cfg, "plan.memory")
    # fault.copies=1: every candidate also keeps (and sends) a copy of its lone stages
    return Budget(_get(cfg, "plan.max_activations"), float(parse_bytes(memory)) if memory is not None else None,
                  copies=int(_get(cfg, "fault.copies", 0)))


def microbatches_of(cfg: Mapping[str, Any]) -> list[int]:
    mb = _get(cfg, "plan.microbatches")
    if mb is None:
        return [int(_get(cfg, "microbatches"))]
    return [int(mb)] if isinstance(mb, int) else [int(x) for x in mb]


def plan(cfg: Mapping[str, Any]) -> Ranking:
    """Search the space the config's ``plan.*`` keys describe (the config must be valid)."""
    workers = _get(cfg, "plan.workers") or int(_get(cfg, "G")) * int(_get(cfg, "R"))
    return search(int(_get(cfg, "stages")), microbatches_of(cfg), int(workers), profile_of(cfg), budget_of(cfg),
                  top=int(_get(cfg, "plan.top", 20)), step_overlap=_get(cfg, "step_overlap", DEFAULT.step_overlap))


def choose(cfg: Mapping[str, Any]) -> Candidate | None:
    """The best candidate (its ``overrides`` reproduce it under ``mode=simulate`` or training), or
    ``None`` when nothing fits the budget."""
    return plan(cfg).best
