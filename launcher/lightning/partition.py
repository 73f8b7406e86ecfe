"""Cut a module's ``stages`` list into ``S`` consecutive groups of balanced parameter count."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ..runtime.model import run_stage


def balanced_groups(sizes: Sequence[int], S: int) -> list[list[int]]:
    """Consecutive, non-empty groups of ``range(len(sizes))`` minimising the largest group's
    total size (the linear partition problem, solved exactly by dynamic programming)."""
    n = len(sizes)
    if not 1 <= S <= n:
        raise ValueError(f"cannot cut {n} modules into {S} non-empty stages")
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[k][i]: the smallest largest-group size cutting the first i modules into k groups
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    cut = [[0] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0
    for k in range(1, S + 1):
        for i in range(k, n - (S - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    groups: list[list[int]] = []
    i = n
    for k in range(S, 0, -1):
        j = cut[k][i]
        groups.append(list(range(j, i)))
        i = j
    return groups[::-1]


class Chain(nn.Sequential):
    """Modules applied in turn, each called with what the one before returned as stages are (a
    tuple is unpacked into positional arguments, a dict into keyword arguments)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out: Any = None
        for i, m in enumerate(self):
            out = m(*args, **kwargs) if i == 0 else run_stage(m, None, [out])
        return out


def group_modules(modules: Sequence[nn.Module], S: int) -> tuple[list[nn.Module], list[list[int]]]:
    """``S`` stage modules from ``modules`` (each module itself when there are exactly ``S``, else
    a :class:`Chain` of a balanced consecutive group) and the module indices of each stage. A
    parameter shared by several modules counts once, where it is first used."""
    seen: set[int] = set()
    sizes = []
    for m in modules:
        sizes.append(sum(p.numel() for p in m.parameters() if id(p) not in seen))
        seen.update(id(p) for p in m.parameters())
    groups = balanced_groups(sizes, S)
    stages = [modules[g[0]] if len(g) == 1 else Chain(*(modules[i] for i in g)) for g in groups]
    return stages, groups
