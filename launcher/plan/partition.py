"""Cut a chain of ``n`` modules into ``S`` consecutive, non-empty stages. Pure Python, no torch.

Three objectives, each solved exactly by dynamic programming over ``(stages so far, modules so
far)`` in ``O(S n^2)``:

- :func:`balanced_groups`: the largest stage's parameter count as small as it can be (``partition=params``);
- :func:`time_groups`: the slowest stage's time (forward plus backward) as small as it can be,
  with every stage's bytes within a per-worker cap (``partition=time``);
- :func:`memory_groups`: the largest stage's bytes as small as they can be (``partition=memory``).

A pipeline step lasts at least its slowest stage times the micro-batches, so the time partition is
the one that shortens the step; the others balance what a worker holds.
"""

from __future__ import annotations

from typing import Mapping, Sequence

PARTITIONS = ("params", "time", "memory")


class PartitionError(ValueError):
    """No partition meets the constraints (one sentence)."""


def _check(n: int, S: int) -> None:
    if not 1 <= S <= n:
        raise PartitionError(f"cannot cut {n} modules into {S} non-empty stages")


def _prefix(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _minmax(cost: Sequence[float], S: int, allowed: Sequence[float] | None = None,
            cap: float | None = None) -> list[list[int]] | None:
    """Consecutive groups minimising the largest group's total ``cost``, every group's total of
    ``allowed`` at most ``cap`` (``None``: no constraint); ``None`` when no cut meets the cap."""
    n = len(cost)
    _check(n, S)
    pc = _prefix(cost)
    pa = _prefix(allowed) if allowed is not None and cap is not None else None
    inf = float("inf")
    limit = cap if cap is not None else inf  # read only where pa (so cap) is given
    # best[k][i]: the smallest largest-group cost cutting the first i modules into k groups
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    cut = [[-1] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        for i in range(k, n - (S - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or (pa is not None and pa[i] - pa[j] > limit):
                    continue
                v = max(best[k - 1][j], pc[i] - pc[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    if best[S][n] == inf:
        return None
    groups: list[list[int]] = []
    i = n
    for k in range(S, 0, -1):
        j = cut[k][i]
        groups.append(list(range(j, i)))
        i = j
    return groups[::-1]


def balanced_groups(sizes: Sequence[float], S: int) -> list[list[int]]:
    """Consecutive, non-empty groups of ``range(len(sizes))`` minimising the largest group's
    total size (the linear partition problem, solved exactly by dynamic programming)."""
    groups = _minmax(sizes, S)
    assert groups is not None  # no cap: every cut into S non-empty groups is allowed
    return groups


def memory_groups(memory: Sequence[float], S: int) -> list[list[int]]:
    """Consecutive, non-empty groups minimising the largest group's bytes."""
    return balanced_groups(memory, S)


def time_groups(seconds: Sequence[float], S: int, memory: Sequence[float] | None = None,
                cap: float | None = None) -> list[list[int]]:
    """Consecutive, non-empty groups minimising the slowest group's ``seconds`` (per module:
    forward plus backward), every group's ``memory`` at most ``cap`` bytes (when both are given);
    :class:`PartitionError` when no cut fits the cap."""
    if cap is not None and memory is not None and len(memory) != len(seconds):
        raise PartitionError(f"memory has {len(memory)} entries but seconds has {len(seconds)}; give one per module")
    groups = _minmax(seconds, S, memory, cap)
    if groups is None:
        assert memory is not None and cap is not None  # only a memory cap can leave no cut
        need = memory_groups(memory, S)
        least = max(sum(memory[i] for i in g) for g in need)
        raise PartitionError(f"partition=time cannot fit every stage within the memory cap of {cap:.4g} bytes per "
                             f"worker: the best cut into {S} stages needs {least:.4g} bytes on its largest stage; "
                             f"raise plan.memory or use more stages")
    return groups


def cut(by: str, S: int, params: Sequence[float], seconds: Sequence[float] | None = None,
        memory: Sequence[float] | None = None, cap: float | None = None) -> list[list[int]]:
    """The groups of partition ``by`` (``params``, ``time`` or ``memory``; per module: parameter
    counts, seconds of forward plus backward, bytes)."""
    if by == "params":
        return balanced_groups(params, S)
    if by == "memory":
        if memory is None:
            raise PartitionError("partition=memory needs each module's bytes; profile the modules first")
        return memory_groups(memory, S)
    if by == "time":
        if seconds is None:
            raise PartitionError("partition=time needs each module's seconds; profile the modules first")
        return time_groups(seconds, S, memory, cap)
    raise PartitionError(f"partition={by} is invalid: use {', '.join(PARTITIONS)}")


def group_sums(values: Sequence[float], groups: Sequence[Sequence[int]]) -> list[float]:
    """Per group, the sum of its modules' ``values``."""
    return [float(sum(values[i] for i in g)) for g in groups]


def stage_durations(forward: Sequence[float], backward: Sequence[float],
                    groups: Sequence[Sequence[int]]) -> list[dict[str, float]]:
    """Per stage, its ``F`` and ``B`` (the sums of its modules'), and the split backward's ``I`` and
    ``W`` as half a ``B`` each (the profile does not split the backward)."""
    out = []
    for f, b in zip(group_sums(forward, groups), group_sums(backward, groups)):
        out.append({"F": f, "B": b, "I": b / 2, "W": b / 2})
    return out


def scaled(per_stage: Sequence[Mapping[str, float]], durations: Mapping[str, float]) -> list[dict[str, float]]:
    """``per_stage`` in the units of ``durations`` (a config's ``F``/``B``, in which its ``comm``
    is given): one factor for every stage and kind, so that the mean stage's ``F + B`` is the
    config's ``F + B``; the stages' ratios, and F's to B's, are the profile's."""
    mean = sum(d["F"] + d["B"] for d in per_stage) / max(1, len(per_stage))
    k = (float(durations["F"]) + float(durations["B"])) / mean if mean > 0 else 1.0
    return [{key: v * k for key, v in d.items()} for d in per_stage]
