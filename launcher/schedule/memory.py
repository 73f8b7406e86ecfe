"""Live activation bytes per worker, swept exactly over a simulated timeline: the one sweep the
run report's prediction (:mod:`launcher.report.metrics`) and the planner's memory model
(:mod:`launcher.plan.memory`) share, and that the runtime's meter reproduces.

For each micro-batch ``b`` of stage ``s``, on the worker of ``F(s,b)``:

- its input ``x_s^b`` (``inputs[s][b]`` bytes) from the start of ``F(s,b)`` to the end of the
  backward that consumes it (``B``, or ``I`` when split);
- the forward's autograd graph (``saved[s][b]`` bytes): from the start of ``F(s,b)``, or, when
  the forward recomputes (activation checkpointing), from the start of that backward, which
  rebuilds it; to the end of ``B``, or of ``W`` when split (``I``'s graph is kept for ``W``).

A release at time t comes before an acquisition at t. Pure Python.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .simulate import Timeline

Bytes = Callable[[int, int], float]


def activation_peaks(tl: Timeline, inputs: Bytes, saved: Bytes | None = None,
                     recomputed: Sequence[bool] | None = None) -> list[float]:
    """Peak live activation bytes per worker. ``inputs(s, b)``, ``saved(s, b)``: bytes per
    micro-batch; ``recomputed[j]`` for each forward job id ``j = s * B + b`` (default: none)."""
    space = tl.step.space
    B, SB = space.B, space.S * space.B
    last = 2 * SB if space.split_backward else SB  # the job that frees the graph: W, else B
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(tl.step.workers)]
    for j in range(SB):
        s, b = divmod(j, B)
        ev = events[tl.compute[j]]
        a = inputs(s, b)
        ev.append((tl.start[j], 1, a))
        ev.append((tl.finish[SB + j], 0, -a))  # B(s,b), or I(s,b) when split
        g = saved(s, b) if saved is not None else 0
        if g:
            rc = recomputed is not None and recomputed[j]
            ev.append((tl.start[SB + j] if rc else tl.start[j], 1, g))
            ev.append((tl.finish[last + j], 0, -g))
    peaks = []
    for ev in events:
        ev.sort()
        live = peak = 0
        for _, _, n in ev:
            live += n
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def recomputed_forwards(tl: Timeline, weight_cache: str = "step") -> list[bool]:
    """Per forward job ``j = s * B + b``: whether it keeps only its input, its backward
    recomputing it: its stage is in ``step.recompute``, or, under ``weight_cache="job"``, it runs
    on a fetched copy that it frees when it ends (the runtime's rule)."""
    space, rc = tl.step.space, tl.step.recompute
    B = space.B
    return [j // B in rc or (weight_cache == "job" and tl.compute[j] != tl.weights[j])
            for j in range(space.S * B)]
