"""Bytes a worker holds at its peak, from a simulated timeline and the model's profile.

For worker ``w`` (``p_s``, ``g_s``, ``o_s``: parameter, gradient and optimizer-state bytes of stage
``s``; ``a_s``: bytes of ``x_s^b`` for one micro-batch)::

    bytes(w) = sum over owned stages s of (p_s + g_s + o_s)          # the source of truth, stepped here
             + sum over fetched stages s of g_s                      # gradient summed here, sent at the end
             + fetched copies                                        # weight_cache=step: sum of p_s over
                                                                     #   fetched stages (kept all step);
                                                                     #   job: the most copies held at once
                                                                     #   x the largest fetched p_s
             + peak over time of sum of a_s over live x_s^b          # exact, from the timeline
               (+ the forwards' graphs, v_s each, unless recomputed)

A fetched stage's gradient buffer lives to the end of the step (sums reach owners after the step),
so it is counted for every fetched stage the worker computes. Live activations are swept exactly:
``x_s^b`` is held on ``F(s,b)``'s worker from that job's start to the end of the backward that
consumes it, a release at time t before an acquisition at t (as in the simulator).
"""

from __future__ import annotations

from ..schedule.memory import activation_peaks, recomputed_forwards
from ..schedule.simulate import Timeline
from .profile import Profile


def owned_and_fetched(tl: Timeline) -> tuple[list[set[int]], list[set[int]]]:
    """Stages each worker owns, and stages it computes on fetched weights."""
    space, W = tl.step.space, tl.step.workers
    SB = space.S * space.B
    owned: list[set[int]] = [set() for _ in range(W)]
    fetched: list[set[int]] = [set() for _ in range(W)]
    for j in range(SB):  # the named schemes place every kind of (s, b) alike: the forwards say all
        s = j // space.B
        owned[tl.weights[j]].add(s)
        if tl.compute[j] != tl.weights[j]:
            fetched[tl.compute[j]].add(s)
    return owned, fetched


def static_bytes(owned: list[set[int]], fetched: list[set[int]], prof: Profile) -> list[float]:
    """Owned stages' parameters, gradients and optimizer state, plus fetched stages' gradients."""
    sb = prof.stage_bytes
    return [sum(sb("params", s) + sb("grads", s) + sb("optimizer", s) for s in own) + sum(sb("grads", s) for s in fet)
            for own, fet in zip(owned, fetched)]


def activation_bytes(tl: Timeline, prof: Profile, cache: str = "step") -> list[float]:
    """The exact peak of live activation bytes per worker: inputs, plus each forward's autograd
    graph (``saved``) unless it recomputes (the sweep the run report predicts with,
    :func:`launcher.schedule.memory.activation_peaks`)."""
    act = [prof.stage_bytes("activation", s) for s in range(tl.step.S)]
    saved = [prof.stage_bytes("saved", s) for s in range(tl.step.S)]
    return activation_peaks(tl, lambda s, b: act[s], (lambda s, b: saved[s]) if any(saved) else None,
                            recomputed_forwards(tl, cache))


def worker_bytes(tl: Timeline, prof: Profile, cache: str, peak_resident: list[int],
                 owned: list[set[int]], fetched: list[set[int]], act: list[float]) -> list[float]:
    """``bytes(w)`` of the module docstring for weight cache ``cache``."""
    base = static_bytes(owned, fetched, prof)
    out = []
    for w in range(tl.step.workers):
        if cache == "step":
            copies = sum(prof.stage_bytes("params", s) for s in fetched[w])
        else:
            largest = max((prof.stage_bytes("params", s) for s in fetched[w]), default=0.0)
            copies = (peak_resident[w] - len(owned[w])) * largest
        out.append(base[w] + copies + act[w])
    return out
