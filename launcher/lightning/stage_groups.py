"""Cut a module's ``stages`` list into ``S`` consecutive groups: balanced by parameter count, or as
a partition chosen by measured cost gives them (:mod:`launcher.plan.partition`)."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ..plan.partition import balanced_groups
from ..torch_support.staged import run_stage

__all__ = ["Chain", "balanced_groups", "group_modules", "param_sizes"]


class Chain(nn.Sequential):
    """Modules applied in turn, each called with what the one before returned as stages are (a
    tuple is unpacked into positional arguments, a dict into keyword arguments)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out: Any = None
        for i, m in enumerate(self):
            out = m(*args, **kwargs) if i == 0 else run_stage(m, None, [out])
        return out


def param_sizes(modules: Sequence[nn.Module]) -> list[int]:
    """Parameters of each module; one shared by several modules counts once, where first used."""
    seen: set[int] = set()
    sizes = []
    for m in modules:
        sizes.append(sum(p.numel() for p in m.parameters() if id(p) not in seen))
        seen.update(id(p) for p in m.parameters())
    return sizes


def group_modules(modules: Sequence[nn.Module], S: int,
                  groups: Sequence[Sequence[int]] | None = None) -> tuple[list[nn.Module], list[list[int]]]:
    """``S`` stage modules from ``modules`` (each module itself when its group has one, else a
    :class:`Chain` of the group) and the module indices of each stage. ``groups``: a partition
    chosen already (:mod:`launcher.plan.partition`, e.g. by measured time); else the groups
    balanced by parameter count (a parameter shared by several modules counts once, where it is
    first used)."""
    if groups is None:
        groups = balanced_groups(param_sizes(modules), S)
    flat = [i for g in groups for i in g]
    if len(groups) != S or flat != list(range(len(modules))) or not all(groups):
        raise ValueError(f"groups={[list(g) for g in groups]} is not a cut of {len(modules)} modules into {S} "
                         f"consecutive non-empty stages")
    cut = [list(g) for g in groups]
    stages = [modules[g[0]] if len(g) == 1 else Chain(*(modules[i] for i in g)) for g in cut]
    return stages, cut
