"""What a step costs when consecutive steps run back to back: the steady state of several steps.

Two rules (``step_overlap``), both priced by replaying the step :data:`STEADY_STEPS` times, each
worker running its program (the simulated timeline's job sequence) strictly in order, every job as
early as its dependencies allow (what the runtime's programs do): the step's own dependencies
(``comm`` when one crosses workers), a worker's first job of step ``t+1`` after its last job of step
``t``, and ``F(s,b)`` of step ``t+1`` after stage ``s``'s optimizer step of step ``t`` (``comm`` more
when the weights' owner is not the job's worker: the updated copy travels). A stage's gradient is
final when its last weight-gradient job (``B``, or ``W`` when split) has ended, ``comm`` later when
it runs off the owner, ``comm`` more for the all-reduce when the stage has several owners.
Optimizer steps take no time (a redone one takes ``redo``, below).

- ``none``: what the runtime does. Every step ends on every worker with one all-reduce (the loss,
  the non-finite flag, the clipping norm: ``comm`` when ``W > 1``) after every gradient is final;
  then every owner steps, and the next step's jobs wait for it. A step costs its makespan plus that
  all-reduce (plus a weight fetch where a stage's first forward runs off its owner).
- ``post_validation``: the zero-bubble paper's section 4 (seed 004, Figure 4) as the runtime runs
  it (:mod:`launcher.lightning.step_overlap`). The workers form a chain in the order of their lowest
  owned stage; the partially reduced global state (the non-finite flag, the gradient norm) goes from
  the last worker to the first, ``comm`` a hop: each worker passes it on once its own gradients
  are final and the state of the workers after it has come, and then steps (provisionally: its
  step end, ``tails``, runs while the state travels on). The first worker then holds the full
  state, sends it to every other worker (``comm``) and steps exactly; every other worker validates
  its step when the full state is in, before its next step begins, and then spends ``redo``
  seconds (a rolled-back step's optimizer step taken again, priced as an expected share). No
  barrier otherwise. On a pipeline
  the first worker's next forward thus waits for every gradient of the step: overlapped steps
  save the all-reduce at best, and cost ``(W - 2) comm`` more than the barrier where the last
  worker's gradients are final last (ZB-H2); the paper's cost (the longest worker span,
  :func:`launcher.schedule.auto_order.span`, its formula 3) needs the state to flow the other way.
- ``post_validation_paper``: the paper's own chain (its Figure 4), priced only (``mode=simulate``,
  ``mode=plan``; training refuses it). The partial state goes from the first worker of the chain to
  the last, ``comm`` a hop, each worker stepping provisionally once its gradients are final and the
  state of the workers before it has come; its next step's forwards then run on those provisional
  weights, without waiting for the full state, which goes back from the last worker hop by hop
  during the next step and must be in before the worker's next optimizer step (which also pays its
  ``redo``). That is speculative: a rolled-back step would invalidate the forwards already run on
  its weights, so a step equal to one device's cannot start before the full state is known, which is
  why the runtime runs ``post_validation``. Its steady state tends to the longest worker span (the
  paper's cost): Table 5's ZB-2p column at the printed decimals.

Both rules replay the programs on a core per worker, or (``cores``) on fewer cores than workers
with processor sharing (:mod:`launcher.schedule.cores`): the workers with a task in hand share the
cores, so a later worker's next jobs and its redone steps slow the first worker's backward. Pure Python.

A step's end is its last job's or optimizer step's finish; the steady-state step cost is the time
between the last two steps' ends (on shared cores one step more is replayed, so that the last one
shares its cores with a next step as every other does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .rules import STEP_OVERLAPS
from .simulate import Timeline

__all__ = ["STEADY_STEPS", "STEP_OVERLAPS", "SteadyState", "last_two_steps", "priced", "steady_state"]

#: steps replayed: enough for the steady state of the orders here (the replay is linear in max-plus
#: algebra; on every step tried, its step cost had settled by the second step)
STEADY_STEPS = 4


@dataclass(frozen=True)
class SteadyState:
    """Consecutive steps under one rule: ``ends[t]`` is step ``t``'s end (the first step starts at 0),
    ``optimizer[t][s]`` stage ``s``'s optimizer step in step ``t``, ``starts[t][j]`` job ``j``'s start
    in step ``t`` (it takes as long as in the timeline)."""

    rule: str
    makespan: float  # one isolated step (the simulated timeline's latency)
    ends: tuple[float, ...]
    optimizer: tuple[tuple[float, ...], ...]
    starts: tuple[tuple[float, ...], ...] = ()

    @property
    def step_cost(self) -> float:
        """The time between consecutive steps' ends, in the steady state."""
        if len(self.ends) < 2:
            return self.makespan
        return self.ends[-1] - self.ends[-2]


def steady_state(tl: Timeline, rule: str = "post_validation", steps: int = STEADY_STEPS, *,
                 cores: int | None = None, work: Sequence[float] | None = None,
                 redo: Sequence[float] | None = None, tails: Sequence[float] | None = None,
                 state_comm: float | None = None) -> SteadyState:
    """The steady state of ``steps`` consecutive steps of ``tl``'s programs under ``rule``
    (:data:`STEP_OVERLAPS`; module docstring). ``work``: per job, its seconds (default: the
    timeline's durations); ``cores``: the cores the workers share (``None``, or at least ``W``: a
    core each; fewer: processor sharing, as :mod:`launcher.schedule.cores`); ``redo``: per worker,
    the seconds it spends after its step's validation (a rolled-back step's optimizer step taken
    again, times the share of steps rolled back; only under ``post_validation``); ``tails``: per
    worker, the seconds of work at its step's end (its optimizer step, the framework's work around
    the step; default none); ``state_comm``: what a message of the global state takes (the
    barrier's all-reduce, a hop of the chain, the full state back; default ``comm``, the step's
    messages: a few bytes may travel faster than an activation)."""
    if rule not in STEP_OVERLAPS:
        raise ValueError(f"step_overlap={rule!r} is invalid: use {' or '.join(STEP_OVERLAPS)}")
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid: replay at least one step")
    if cores is not None and cores < 1:
        raise ValueError(f"cores={cores} is invalid: the workers share at least one core")
    step, space = tl.schedule, tl.schedule.space
    S, B, N, W = space.S, space.microbatches, space.N, step.workers
    SB = S * B
    comm = float(step.comm)
    dur = [tl.finish[j] - tl.start[j] for j in range(N)] if work is None else [float(x) for x in work]
    redo = [0.0] * W if redo is None else [float(x) for x in redo]
    tails = [0.0] * W if tails is None else [float(x) for x in tails]
    grad_kind = space.K - 1  # B, or W when split: the job whose end makes a gradient final
    owners: list[set[int]] = [set() for _ in range(S)]
    for j in range(N):
        owners[(j // B) % S].add(tl.owner[j])
    grads: list[list[tuple[int, float]]] = [[] for _ in range(S)]  # per stage: (job, what its gradient adds)
    for j in range(grad_kind * SB, (grad_kind + 1) * SB):
        s = (j // B) % S
        if s not in step.frozen:
            reduce = comm if len(owners[s]) > 1 else 0.0  # replicas all-reduce
            grads[s].append((j, (comm if tl.compute[j] != tl.owner[j] else 0.0) + reduce))
    # the runtime's chain (launcher.lightning.step_overlap): workers in the order of their lowest
    # owned stage; the partial state goes from the last to the first, who steps exactly
    lowest = {w: min(s for s in range(S) if w in owners[s]) for w in set().union(*owners)}
    chain = sorted(lowest, key=lambda w: (lowest[w], w))
    own_grads = {w: [g for s in range(S) if w in owners[s] for g in grads[s]] for w in chain}
    hop = comm if state_comm is None else float(state_comm)  # a message of the global state
    allreduce = hop if W > 1 else 0.0  # the barrier's all-reduce (loss, non-finite flag, clipping norm)

    # the steps unrolled into tasks: (worker, seconds, dependencies (task, delay)), run per worker in program order
    worker: list[int] = []
    secs: list[float] = []
    deps: list[list[tuple[int, float]]] = []
    programs: list[list[int]] = [[] for _ in range(W)]

    def task(w: int, x: float, d: list[tuple[int, float]]) -> int:
        worker.append(w)
        secs.append(x)
        deps.append(d)
        return len(worker) - 1

    gate_prev: dict[int, int] = {}  # per owner, the task after which its stages' updated weights exist
    firsts: list[int] = []
    gates: list[dict[int, int]] = []
    # on shared cores a step's end depends on the next step's jobs taking cores from it: one more is replayed
    shared = cores is not None and cores < W
    for _ in range(steps + shared):
        base = len(worker)
        firsts.append(base)
        for j in range(N):
            d = [(base + k, comm if tl.compute[k] != tl.compute[j] else 0.0) for k in space.pred(j)]
            if j < SB and gate_prev:  # a forward needs its stage's updated weights
                d.append((gate_prev[tl.owner[j]], comm if tl.owner[j] != tl.compute[j] else 0.0))
            task(tl.compute[j], dur[j], d)
        for w, prog in enumerate(tl.sequences):
            programs[w] += [base + j for j in prog]
        gate: dict[int, int] = {}  # per owner, the task after which its weights are the step's (validated)
        stepped: dict[int, int] = gate  # per owner, its optimizer step (provisional under post_validation)
        if rule == "none":  # every worker waits for the step's all-reduce, then every owner steps
            every = [(base + g, c + allreduce) for s in range(S) for g, c in grads[s]]
            every += [(base + prog[-1], allreduce) for prog in tl.sequences if prog]
            for w in range(W):
                gate[w] = task(w, tails[w], every)
                programs[w].append(gate[w])
        elif rule == "post_validation_paper":  # the paper's chain: first to last, the next step on provisional weights
            earlier: int | None = None
            for i, w in enumerate(chain):
                d = [(base + g, c) for g, c in own_grads[w]] + ([(earlier, hop)] if earlier is not None else [])
                if gate_prev:  # the step before validated: its full state back from the last worker, hop by hop
                    d.append((gate_prev[chain[-1]], (len(chain) - 1 - i) * hop))
                gate[w] = earlier = task(w, tails[w] + redo[w], d)
                programs[w].append(earlier)
        else:
            stepped = {}
            # each passes the state on once its gradients and the later workers' state are in, then
            # steps (its step end, ``tails``): the runtime sends before its optimizer step
            later: int | None = None
            for w in reversed(chain):
                d = [(base + g, c) for g, c in own_grads[w]] + ([(later, hop)] if later is not None else [])
                later = task(w, 0.0, d)
                programs[w].append(later)
                gate[w] = stepped[w] = task(w, tails[w], [])
                programs[w].append(gate[w])
            for w in range(W):  # the first sends the full state to every other, who validates after its step
                if later is not None and w != chain[0]:
                    gate[w] = task(w, redo[w], [(later, hop)])
                    programs[w].append(gate[w])
        gate_prev = gate
        gates.append(stepped)
    start, finish = _run(worker, secs, deps, programs, W if cores is None else cores)
    firsts.append(len(worker))
    gates = gates[:steps]
    ends = tuple(max(finish[firsts[t]:firsts[t + 1]]) for t in range(steps))
    optimizer = tuple(tuple(max((finish[g[o]] for o in owners[s]), default=0.0) for s in range(S)) for g in gates)
    starts = tuple(tuple(start[firsts[t]:firsts[t] + N]) for t in range(steps))
    return SteadyState(rule, tl.latency, ends, optimizer, starts)


def _run(worker: list[int], secs: list[float], deps: list[list[tuple[int, float]]], programs: list[list[int]],
         cores: int) -> tuple[list[float], list[float]]:
    """Each worker's tasks in program order, each once its dependencies are in: with a core each,
    at its worker's previous finish or its inputs' (longest paths); on fewer cores than workers,
    the workers with a task in hand share the cores (processor sharing, as
    :func:`launcher.schedule.cores.replay`)."""
    W = len(programs)
    n = len(worker)
    start, finish = [math.nan] * n, [math.nan] * n
    pos = [0] * W

    def ready(k: int) -> float:
        r = 0.0
        for p, c in deps[k]:
            f = finish[p]
            if f != f:  # NaN: not yet done
                return math.inf
            r = max(r, f + c)
        return r

    if cores >= W:
        free = [0.0] * W
        left = n
        while left:
            moved = False
            for w, prog in enumerate(programs):
                while pos[w] < len(prog):
                    k = prog[pos[w]]
                    r = ready(k)
                    if r == math.inf:
                        break
                    start[k] = max(free[w], r)
                    finish[k] = free[w] = start[k] + secs[k]
                    pos[w] += 1
                    left -= 1
                    moved = True
            if not moved:
                raise ValueError("the programs wait on one another: not a simulated timeline")
        return start, finish
    left_w: list[float | None] = [None] * W
    t = 0.0
    while any(pos[w] < len(programs[w]) for w in range(W)):
        running: list[int] = []
        wake = math.inf
        for w in range(W):
            if pos[w] == len(programs[w]):
                continue
            k = programs[w][pos[w]]
            if left_w[w] is None:
                r = ready(k)
                if r > t:
                    wake = min(wake, r)
                    continue
                left_w[w] = secs[k]
                start[k] = t
            running.append(w)
        if not running:
            if wake == math.inf:
                raise ValueError("the programs wait on one another: not a simulated timeline")
            t = wake
            continue
        rate = min(1.0, cores / len(running))
        dt = min(min(left_w[w] or 0.0 for w in running) / rate, wake - t)
        t += dt
        for w in running:
            x = (left_w[w] or 0.0) - dt * rate
            if x <= 1e-12 * max(1.0, t):
                k = programs[w][pos[w]]
                finish[k] = t
                left_w[w] = None
                pos[w] += 1
            else:
                left_w[w] = x
    return start, finish


def last_two_steps(tl: Timeline, ss: SteadyState) -> list[tuple[int, int, int, str, int, float, float]]:
    """The steady state's last two steps, interleaved as they run: per job ``(worker, stage,
    micro-batch, kind, step (0 or 1), start, end)``, times from the earlier step's first start."""
    if len(ss.starts) < 2:
        raise ValueError("two steps need a steady state of at least two replayed steps")
    space = tl.schedule.space
    a, b = ss.starts[-2], ss.starts[-1]
    t0 = min(a)
    out = []
    for k, st in enumerate((a, b)):
        for j in range(space.N):
            s, mb, kind = space.job(j)
            d = tl.finish[j] - tl.start[j]
            out.append((tl.compute[j], s, mb, kind, k, st[j] - t0, st[j] - t0 + d))
    return out


def priced(tl: Timeline, rule: str, steps: int = STEADY_STEPS) -> dict[str, Any]:
    """The step's cost under ``rule``, for a report: ``step_overlap`` (the rule priced),
    ``step_cost`` (the steady state's, :class:`SteadyState`), ``step_bubble_fraction`` (the idle
    share of ``W x step_cost``: the paper's bubble rate on equal stages) and ``steady_steps``
    (the steps replayed)."""
    ss = steady_state(tl, rule, steps)
    busy = sum(tl.finish[j] - tl.start[j] for j in range(len(tl.start)))
    cost, W = ss.step_cost, tl.schedule.workers
    return {"step_overlap": rule, "step_cost": cost,
            "step_bubble_fraction": 1.0 - busy / (W * cost) if cost else 0.0,
            "steady_steps": steps}
