"""Bytes a worker holds at its peak, from a simulated timeline and the model's profile.

For worker ``w`` (``p_s``, ``g_s``, ``o_s``: parameter, gradient and optimizer-state bytes of stage
``s``; ``a_s``: bytes of ``x_s^b`` for one micro-batch)::

    bytes(w) = sum over owned stages s of (p_s + g_s + o_s)          # the source of truth, stepped here
             + gradient buffers, swept over the timeline             # fetched stages' partial sums (step:
                                                                     #   all step; job: until handed over),
                                                                     #   an owner's receive buffers, and the
                                                                     #   weight gradient a backward returns
             + sum over owned stages s that others fetch of p_s      # the packed copy sent (kept all step)
             + fetched copies                                        # weight_cache=step: sum of p_s over
                                                                     #   fetched stages (kept all step);
                                                                     #   job: the most copies held at once
                                                                     #   x the largest fetched p_s
             + peak over time of sum of a_s over live x_s^b          # exact, from the timeline
               (+ the forwards' graphs, v_s each, unless recomputed)
             + with fault.copies=1: sum over the stages whose copy   # launcher.schedule.copies: the previous
               w keeps of (p_s + o_s)                                #   worker's lone stages (host memory
                                                                     #   on GPUs; counted here all the same)

Under cache ``step`` a fetched stage's gradient buffer lives to the end of the step, so it is
counted for every fetched stage the worker computes; under ``job`` the owner takes each sum in
during the step and the sender frees it (:func:`launcher.schedule.activations.sum_handovers`). Live
activations are swept exactly: ``x_s^b`` is held on ``F(s,b)``'s worker from that job's start to
the end of the backward that consumes it, a release at time t before an acquisition at t (as in the
simulator).
"""

from __future__ import annotations

from ..schedule.activations import activation_peaks, gradient_peaks, recomputed_forwards
from ..schedule.copies import ring_copies
from ..schedule.settings import DEFAULT
from ..schedule.simulate import Timeline
from .profile import Profile


def owned_and_fetched(tl: Timeline) -> tuple[list[set[int]], list[set[int]]]:
    """Stages each worker owns, and stages it computes on fetched weights."""
    space, W = tl.schedule.space, tl.schedule.workers
    SB = space.S * space.microbatches
    owned: list[set[int]] = [set() for _ in range(W)]
    fetched: list[set[int]] = [set() for _ in range(W)]
    for j in range(SB):  # the named schemes place every kind of (s, b) alike: the forwards say all
        s = j // space.microbatches
        owned[tl.owner[j]].add(s)
        if tl.compute[j] != tl.owner[j]:
            fetched[tl.compute[j]].add(s)
    return owned, fetched


def static_bytes(owned: list[set[int]], fetched: list[set[int]], prof: Profile,
                 cache: str = DEFAULT.weight_cache) -> list[float]:
    """Owned stages' parameters, gradients and optimizer state, plus fetched stages' gradient sums:
    all of them under cache ``step``; under ``job`` the largest (at least one is live at a time:
    a lower bound, without a timeline)."""
    sb = prof.stage_bytes
    fet = [[sb("grads", s) for s in f] for f in fetched]
    return [sum(sb("params", s) + sb("grads", s) + sb("optimizer", s) for s in own)
            + (sum(g) if cache == "step" else max(g, default=0.0)) for own, g in zip(owned, fet)]


def activation_bytes(tl: Timeline, prof: Profile, cache: str = DEFAULT.weight_cache) -> list[float]:
    """The exact peak of live activation bytes per worker: inputs, plus each forward's autograd
    graph (``saved``) unless it recomputes (the sweep the run report predicts with,
    :func:`launcher.schedule.activations.activation_peaks`)."""
    act = [prof.stage_bytes("activation", s) for s in range(tl.schedule.S)]
    saved = [prof.stage_bytes("saved", s) for s in range(tl.schedule.S)]
    return activation_peaks(tl, lambda s, b: act[s], (lambda s, b: saved[s]) if any(saved) else None,
                            recomputed_forwards(tl, cache))


def worker_bytes(tl: Timeline, prof: Profile, cache: str, peak_resident: list[int],
                 owned: list[set[int]], fetched: list[set[int]], act: list[float]) -> list[float]:
    """``bytes(w)`` of the module docstring for weight cache ``cache``."""
    sb = prof.stage_bytes
    state = [sum(sb("params", s) + sb("grads", s) + sb("optimizer", s) for s in own) for own in owned]
    grads = gradient_peaks(tl, lambda s: sb("grads", s), cache)
    sent = set().union(*fetched)  # stages some worker fetches: their owners pack a copy to send
    out = []
    for w in range(tl.schedule.workers):
        if cache == "step":
            copies = sum(sb("params", s) for s in fetched[w])
        else:
            largest = max((sb("params", s) for s in fetched[w]), default=0.0)
            copies = (peak_resident[w] - len(owned[w])) * largest
        packed = sum(sb("params", s) for s in owned[w] if s in sent)
        out.append(state[w] + grads[w] + packed + copies + act[w])
    return out


def copy_bytes(stages: list[set[int]], prof: Profile) -> list[float]:
    """Per worker, the bytes of a stage copy (``fault.copies``): parameters and optimizer state of
    each of its ``stages`` (buffers are not profiled)."""
    return [sum(prof.stage_bytes("params", s) + prof.stage_bytes("optimizer", s) for s in st) for st in stages]


def copies_of(owned: list[set[int]], prof: Profile) -> tuple[list[float], list[float]]:
    """``fault.copies=1``: per worker, the bytes it sends after each step and the bytes of the copy it
    keeps (:func:`launcher.schedule.copies.ring_copies`)."""
    sent, kept = ring_copies(owned)
    return copy_bytes(sent, prof), copy_bytes(kept, prof)
