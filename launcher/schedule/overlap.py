"""What a step costs when consecutive steps run back to back: the steady state of several steps.

Two rules (``step_overlap``), both priced by replaying the step :data:`STEADY_STEPS` times, each
worker running its program (the simulated timeline's job sequence) strictly in order, every job as
early as its dependencies allow (what the runtime's programs do): the step's own dependencies
(``comm`` when one crosses workers), a worker's first job of step ``t+1`` after its last job of step
``t``, and ``F(s,b)`` of step ``t+1`` after stage ``s``'s optimizer step of step ``t`` (``comm`` more
when the weights' owner is not the job's worker: the updated copy travels). A stage's gradient is
final when its last weight-gradient job (``B``, or ``W`` when split) has ended, ``comm`` later when
it runs off the owner, ``comm`` more for the all-reduce when the stage has several owners.
Optimizer steps take no time.

- ``none``: what the runtime does. Every step ends on every worker with one all-reduce (the loss,
  the non-finite flag, the clipping norm: ``comm`` when ``W > 1``) after every gradient is final;
  then every owner steps, and the next step's jobs wait for it. A step costs its makespan plus that
  all-reduce (plus a weight fetch where a stage's first forward runs off its owner).
- ``post_validation``: the zero-bubble paper's section 4 (seed 004, Figure 4). Stage ``s`` steps as
  soon as its own gradient is final and the partially reduced global state (the non-finite flag,
  the gradient norm) has come from every stage feeding it, which it combines with its own and
  passes on: a small message along the pipeline, ``comm`` when the two stages' owners differ. The
  fully reduced state goes back from the loss stages to the first during the next step's warm-up;
  a stage validates its step when it arrives, and its next optimizer step waits for that (a
  rollback, when one is needed, is the exception and is not priced). No barrier: a worker's next
  step begins as soon as its own dependencies allow.

A step's end is its last job's or optimizer step's finish; the steady-state step cost is the time
between the last two steps' ends. For a fixed order this tends to the longest worker's span when
nothing but the step's own dependencies binds (:func:`launcher.schedule.auto_order.span`: the
paper's cost, its formula 3). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def steady_state(tl: Timeline, rule: str = "post_validation", steps: int = STEADY_STEPS) -> SteadyState:
    """The steady state of ``steps`` consecutive steps of ``tl``'s programs under ``rule``
    (:data:`STEP_OVERLAPS`; module docstring)."""
    if rule not in STEP_OVERLAPS:
        raise ValueError(f"step_overlap={rule!r} is invalid: use {' or '.join(STEP_OVERLAPS)}")
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid: replay at least one step")
    step, space = tl.schedule, tl.schedule.space
    S, B, N, W = space.S, space.microbatches, space.N, step.workers
    SB = S * B
    comm = float(step.comm)
    overlap = rule != "none"
    dur = [tl.finish[j] - tl.start[j] for j in range(N)]
    grad_kind = space.K - 1  # B, or W when split: the job whose end makes a gradient final
    owners: list[set[int]] = [set() for _ in range(S)]
    for j in range(N):
        owners[(j // B) % S].add(tl.owner[j])
    preds = [[(k, comm if tl.compute[k] != tl.compute[j] else 0.0) for k in space.pred(j)] for j in range(N)]
    order = sorted(range(N), key=lambda j: (tl.start[j], j))  # dependencies and programs both go forward
    prev = [-1] * N  # the job before j on its worker
    for prog in tl.sequences:
        for a, b in zip(prog, prog[1:]):
            prev[b] = a
    last_on = [prog[-1] if prog else -1 for prog in tl.sequences]
    grads: list[list[tuple[int, float]]] = [[] for _ in range(S)]  # per stage: (job, what its gradient adds)
    for j in range(grad_kind * SB, (grad_kind + 1) * SB):
        s = (j // B) % S
        if s not in step.frozen:
            reduce = comm if len(owners[s]) > 1 else 0.0  # replicas all-reduce
            grads[s].append((j, (comm if tl.compute[j] != tl.owner[j] else 0.0) + reduce))
    # the barrier's all-reduce (loss, non-finite flag, clipping norm) crosses workers when there are several
    allreduce = comm if W > 1 else 0.0

    def hop(a: int, b: int) -> float:  # the global state's message from stage a's owners to stage b's
        return 0.0 if owners[a] == owners[b] else comm

    stage_preds, stage_succs = space.stage_preds, space.graph.succs
    sinks = [s for s in range(S) if space.is_sink[s]]
    fin_prev: list[float] | None = None
    starts: list[tuple[float, ...]] = []
    opt_prev: list[float] | None = None
    val_prev: list[float] = [0.0] * S
    barrier = 0.0
    ends: list[float] = []
    optimizer: list[tuple[float, ...]] = []
    for _ in range(steps):
        fin = [0.0] * N
        for j in order:
            t = barrier  # 0 under post_validation
            p = prev[j]
            if p >= 0:
                t = max(t, fin[p])
            elif fin_prev is not None:  # the worker's first job of this step follows its last of the one before
                t = max(t, fin_prev[last_on[tl.compute[j]]])
            for k, c in preds[j]:
                if fin[k] + c > t:
                    t = fin[k] + c
            if opt_prev is not None and j < SB:  # a forward needs its stage's updated weights
                t = max(t, opt_prev[j // B] + (comm if tl.owner[j] != tl.compute[j] else 0.0))
            fin[j] = t + dur[j]
        arrived = [max((fin[j] + d for j, d in grads[s]), default=0.0) for s in range(S)]
        if overlap:
            opt = [0.0] * S
            for s in range(S):  # stages are numbered in a topological order: the partial state flows up
                opt[s] = max([val_prev[s], arrived[s], *(opt[p] + hop(p, s) for p in stage_preds[s])])
            full = max(opt[s] for s in sinks)
            val = [0.0] * S
            for s in reversed(range(S)):  # the fully reduced state comes back down
                val[s] = max([full if space.is_sink[s] else 0.0, *(val[c] + hop(c, s) for c in stage_succs[s])])
            val_prev = val
        else:  # every worker waits for the step's all-reduce, then every owner steps
            barrier = max(max(fin), max(arrived)) + allreduce
            opt = [barrier] * S
        ends.append(max(max(fin), max(opt)))
        optimizer.append(tuple(opt))
        starts.append(tuple(f - d for f, d in zip(fin, dur)))
        fin_prev, opt_prev = fin, opt
    return SteadyState(rule, tl.latency, tuple(ends), tuple(optimizer), tuple(starts))


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
