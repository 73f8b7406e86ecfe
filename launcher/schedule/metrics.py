"""Metrics of a simulated step, per worker and in total, read off the timeline and the placement.

Traffic is derived from ``w(s, b, d)`` alone (docs/design.md, "Placement and data movement" and
"Traffic and memory"):

- ``act_recv``: forward activations received, one per edge ``F(p,b) -> F(s,b)`` that crosses workers;
- ``grad_recv``: gradients received, one per backward edge ``B(c,b) -> B(s,b)`` that crosses workers;
- ``stash_recv``: activations a backward needs from the worker that ran its forward (zero for every
  named scheme, where ``F(s,b)`` and ``B(s,b)`` share a worker);
- ``weight_fetch_jobs``: jobs that need a fetched copy of their stage's weights, under the cache
  policy. ``step``: every job with ``w_compute != w_owner`` (each reads the copy fetched once for
  the step). ``job``: the jobs that receive a copy of their own, i.e. the weight transfers: a job
  with ``w_compute != w_owner``, except a backward (``B``/``I``) whose ``F(s,b)`` ran on the same
  worker on weights that worker owns (it backpropagates through that forward's graph and weights,
  so it needs none), and except every ``W`` (it takes its gradient from its ``I``'s graph, on the
  copy that ``I`` kept, if any);
- ``weight_fetch_stages``: distinct stages among those jobs (``step``: the weight transfers);
- ``weight_grad_send``: stage gradients summed locally and sent to a different owner;
- ``weight_allreduce``: owned stages that other owners replicate, so owners all-reduce them.

Memory: ``peak_activations`` from the timeline; ``weights_owned`` the stages a worker is source of
truth for; ``weights_peak_resident`` owned plus the most fetched copies held at once. ``step``:
every fetched stage stays to the end of the step. ``job``: each copy is held from the start of the
job that fetches it to its end, except that an ``I``'s copy is held to the end of its ``W`` (so a
split backward can hold several): the value if every copy arrives just as its job starts, a lower
bound. A runtime that receives weights ahead of their job (lookahead, or a receive posted early so
a later message to the same peer can go out in order) holds more, so the runtime does not take
this value: :func:`launcher.schedule.lowering.lower` computes the exact one for its lookahead
(``prefetch``) and message order.
"""

from __future__ import annotations

from typing import Any

from .settings import DEFAULT
from .simulate import Timeline

PER_WORKER_KEYS = (
    "busy",
    "act_recv",
    "grad_recv",
    "stash_recv",
    "weight_fetch_stages",
    "weight_fetch_jobs",
    "weight_grad_send",
    "weight_allreduce",
    "peak_activations",
    "weights_owned",
    "weights_peak_resident",
)

from .rules import WEIGHT_CACHES  # noqa: E402  (one definition, shared with the rules)


def traffic(tl: Timeline) -> dict[str, list[int]]:
    """Counts of every transfer the placement implies, per receiving (or sending) worker."""
    space, W = tl.schedule.space, tl.schedule.workers
    S, B, SB = space.S, space.microbatches, space.S * space.microbatches
    comp, wts = tl.compute, tl.owner
    act = [0] * W
    grad = [0] * W
    stash = [0] * W
    fetch_jobs = [0] * W
    fetched: list[set[int]] = [set() for _ in range(W)]
    owned: list[set[int]] = [set() for _ in range(W)]
    sends: list[set[tuple[int, int]]] = [set() for _ in range(W)]
    owners: list[set[int]] = [set() for _ in range(S)]
    grad_kind = space.K - 1  # B, or W when split: the job that makes stage s's weight gradient
    frozen = tl.schedule.frozen
    for j in range(space.N):
        k, s = divmod(j // B, S)
        w, o = comp[j], wts[j]
        owned[o].add(s)
        owners[s].add(o)
        if o != w:
            fetch_jobs[w] += 1
            fetched[w].add(s)
        if k == grad_kind and o != w and s not in frozen:
            sends[w].add((s, o))
        for p in space.pred(j):
            if comp[p] == w:
                continue
            kp = p // SB
            if k == 0:
                act[w] += 1
            elif kp == 0 or (k == 2 and kp == 1):  # loss-stage F->B, or I->W across workers
                stash[w] += 1
            else:
                grad[w] += 1
        if k == 1 and not space.is_sink[s] and comp[j - SB] != w:
            stash[w] += 1  # B(s,b) away from F(s,b) needs x_s^b moved
    allreduce = [sum(1 for s in owned[w] if len(owners[s]) > 1 and s not in frozen) for w in range(W)]
    return {
        "act_recv": act,
        "grad_recv": grad,
        "stash_recv": stash,
        "weight_fetch_stages": [len(f) for f in fetched],
        "weight_fetch_jobs": fetch_jobs,
        "weight_grad_send": [len(x) for x in sends],
        "weight_allreduce": allreduce,
        "weights_owned": [len(x) for x in owned],
    }


def _job_cache(tl: Timeline) -> tuple[list[int], list[int], list[int]]:
    """Under ``weight_cache="job"``: fetching jobs, their distinct stages, and the most copies held
    at once with no lookahead, per worker (see the module docstring)."""
    space, W = tl.schedule.space, tl.schedule.workers
    SB = space.S * space.microbatches
    comp, wts = tl.compute, tl.owner
    jobs, peak = [0] * W, [0] * W
    stages: list[set[int]] = [set() for _ in range(W)]
    for w, prog in enumerate(tl.sequences):
        held, kept = 0, set()  # copies held now; (s, b) whose I keeps its copy until W
        for j in prog:
            s, b, d = space.job(j)
            f = j % SB  # F(s, b)
            own_graph = comp[f] == w and wts[f] == w
            if d == "W" or wts[j] == w or (d != "F" and own_graph):
                if d == "W" and (s, b) in kept:
                    kept.discard((s, b))
                    held -= 1
                continue
            jobs[w] += 1
            stages[w].add(s)
            held += 1
            peak[w] = max(peak[w], held)
            if d == "I":
                kept.add((s, b))
            else:
                held -= 1
    return jobs, [len(x) for x in stages], peak


def per_worker(tl: Timeline, weight_cache: str = DEFAULT.weight_cache) -> dict[str, list]:
    """Every per-worker metric, keyed as in ``simulation.json``'s ``per_worker``."""
    if weight_cache not in WEIGHT_CACHES:
        raise ValueError(f"weight_cache={weight_cache!r} is not valid; choose one of {list(WEIGHT_CACHES)}")
    W = tl.schedule.workers
    busy = [0.0] * W
    for w, prog in enumerate(tl.sequences):
        busy[w] = sum(tl.finish[j] - tl.start[j] for j in prog)
    out: dict[str, list] = {"busy": busy}
    out.update(traffic(tl))
    out["peak_activations"] = list(tl.peak_activations)
    if weight_cache == "job":
        jobs, stages, held = _job_cache(tl)
        out["weight_fetch_jobs"], out["weight_fetch_stages"] = jobs, stages
    else:
        held = out["weight_fetch_stages"]
    out["weights_peak_resident"] = [o + f for o, f in zip(out["weights_owned"], held)]
    return {k: out[k] for k in PER_WORKER_KEYS}


def summarize(tl: Timeline, weight_cache: str = DEFAULT.weight_cache) -> dict[str, Any]:
    """Latency, utilization, throughput and the per-worker metrics of one simulated step.

    ``latency`` is in duration units; ``latency_fb`` in units where a forward plus a backward is 1,
    as in the closed forms (docs/design.md, "Closed forms"); ``rho = S * B / (latency_fb * W)`` is
    the throughput per worker, equal to ``utilization`` when every job kind takes the same time per
    stage.
    """
    step = tl.schedule
    S, B, W = step.S, step.microbatches, step.workers
    pw = per_worker(tl, weight_cache)
    latency = tl.latency
    busy = sum(pw["busy"])
    fb = step.durations["F"] + (
        step.durations["I"] + step.durations["W"] if step.space.split_backward else step.durations["B"]
    )
    latency_fb = latency / fb
    utilization = busy / (W * latency) if latency else 0.0
    return {
        "latency": latency,
        "latency_fb": latency_fb,
        "utilization": utilization,
        "bubble_fraction": 1.0 - utilization,
        "rho": S * B / (latency_fb * W) if latency else 0.0,
        "workers": W,
        "jobs": step.space.N,
        "per_worker": pw,
        "total": {k: sum(v) for k, v in pw.items()},
    }
