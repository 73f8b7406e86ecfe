"""Cut a module's ``stages`` list into ``S`` consecutive groups of balanced parameter count."""

from __future__ import annotations

from typing import Sequence

from torch import nn


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


def group_modules(modules: Sequence[nn.Module], S: int) -> tuple[list[nn.Module], list[list[int]]]:
    """``S`` stage modules from ``modules`` (each module itself when there are exactly ``S``, else
    an ``nn.Sequential`` of a balanced consecutive group) and the module indices of each stage."""
    groups = balanced_groups([sum(p.numel() for p in m.parameters()) for m in modules], S)
    stages = [modules[g[0]] if len(g) == 1 else nn.Sequential(*(modules[i] for i in g)) for g in groups]
    return stages, groups
