"""Per-worker action lists: the form a step takes between the timeline and the workers' programs.

Pure Python, no torch. :mod:`launcher.schedule.lowering` lowers a timeline by passes over one list of
:class:`Action` per worker (its jobs in timeline order, then the messages, weight copies and
reductions around them) and turns the finished lists into a :class:`~launcher.schedule.program.Lowered`.
Every action has a compact text form that :meth:`Action.from_str` reads back, and a whole step
prints one line per worker (:func:`format_programs`, :func:`parse_programs`); GPipe, two stages,
one micro-batch::

    w0: F0.b0  SEND_ACT s0.b0 ->w1.s1  RECV_GRAD s0.b0 <-w1.s1  B0.b0
    w1: RECV_ACT s1.b0 <-w0.s0  F1.b0  B1.b0  SEND_GRAD s1.b0 ->w0.s0

``SEND_ACT s0.b0 ->w1.s1``: after its job of stage 0, micro-batch 0, this worker sends the
activation to worker 1's job of stage 1. A weight copy names the stage, the micro-batch of the job
it is for and the other worker (``RECV_WEIGHTS s3.b1 <-w0``: the copy for the next job of stage 3,
micro-batch 1, that runs on another worker's weights); a partial sum names the stage and the other
worker (``SEND_WGRAD s1 ->w0``).

This is the form the workers run: each action happens where it stands, in order. The kinds in
:data:`AFTER` belong to the job before them (what it sends or frees when it ends, and ``REDUCE``:
its share of a replicated stage is complete); the rest happen before the job after them (after the
last job: at the end of the step). A receive (``RECV_ACT``, ``RECV_GRAD``, ``RECV_WEIGHTS``) is
*posted* where it stands, which lowering puts ``prefetch`` jobs ahead of the job that needs it
(:func:`launcher.schedule.lowering.post_early`); that job waits for the data. An owner's
``SEND_WEIGHTS`` stands where it hands the copy over, ``prefetch`` jobs ahead of its release point.
A ``RECV_WGRAD`` before a job is posted there and added into the owner's total once that job and
its own actions are done; at the end of the step, once every job is. ``FREE_WGRAD`` waits until the
sum it names is delivered and frees it.
"""

from __future__ import annotations

import re
from itertools import compress
from operator import itemgetter
from typing import Mapping, NamedTuple, Sequence

COMPUTE = ("F", "B", "I", "W")
JOBS = frozenset(COMPUTE)
SEND_ACT, RECV_ACT = "SEND_ACT", "RECV_ACT"  # a forward's output to the consumer stage's worker
SEND_GRAD, RECV_GRAD = "SEND_GRAD", "RECV_GRAD"  # a backward's input gradient to the producer's worker
SEND_WEIGHTS, RECV_WEIGHTS = "SEND_WEIGHTS", "RECV_WEIGHTS"  # an owner's copy of a stage to a job elsewhere
FREE_WEIGHTS = "FREE_WEIGHTS"  # the job before drops its fetched copy once done with it (an I: after its W)
SEND_WGRAD, RECV_WGRAD = "SEND_WGRAD", "RECV_WGRAD"  # a worker's weight-gradient sum of a stage to its owner
FREE_WGRAD = "FREE_WGRAD"  # wait until that sum is delivered and free it
REDUCE = "REDUCE"  # this worker's share of a replicated stage is complete: its all-reduce may start

#: every send: the one operation that hands a message's data over (:meth:`launcher.runtime.step_state.StepState.send`)
SENDS = frozenset((SEND_ACT, SEND_GRAD, SEND_WEIGHTS, SEND_WGRAD))
#: receives posted ahead of the job that needs them (by the engine's lookahead), which that job waits for
POSTED = frozenset((RECV_ACT, RECV_GRAD, RECV_WEIGHTS))

#: kinds that belong to the job before them ...
AFTER = (SEND_ACT, SEND_GRAD, FREE_WEIGHTS, SEND_WGRAD, REDUCE)
#: ... and kinds that belong to the job after them (or to the end of the step)
BEFORE = (SEND_WEIGHTS, RECV_ACT, RECV_GRAD, RECV_WEIGHTS, RECV_WGRAD, FREE_WGRAD)
OUTGOING = frozenset((SEND_ACT, SEND_GRAD, SEND_WEIGHTS, SEND_WGRAD, FREE_WGRAD))  # peer printed as ``->w``
# print order of the kinds between two jobs, the engine's: REDUCE last, as at the end of the step
# it follows the partial sums it waits for
_RANK = {op: n for n, op in enumerate(AFTER[:-1] + BEFORE + (REDUCE,))}
# which fields each kind's text carries: micro-batch, peer worker, peer stage
_SHAPE = {
    **{op: (True, True, True) for op in (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)},
    **{op: (True, True, False) for op in (SEND_WEIGHTS, RECV_WEIGHTS)},
    **{op: (False, True, False) for op in (SEND_WGRAD, RECV_WGRAD, FREE_WGRAD)},
    FREE_WEIGHTS: (False, False, False),
    REDUCE: (False, False, False),
}
_JOB_RE = re.compile(r"([FBIW])(\d+)\.b(\d+)")
_OTHER_RE = re.compile(r"([A-Z_]+) s(\d+)(?:\.b(\d+))?(?: (->|<-)w(\d+)(?:\.s(\d+))?)?")
_MARK = (">>", "<<")


class Action(NamedTuple):
    """One thing a worker does in a step (a tuple: cheap to make by the hundred thousand). -1
    marks a field the kind does not use.

    ``stage``/``microbatch``: the job's, or the local job's for a message; ``peer``: the worker at
    the other end of a message; ``peer_stage``: the stage of the job at the other end (act/grad).
    """

    op: str
    stage: int
    microbatch: int = -1
    peer: int = -1
    peer_stage: int = -1

    @property
    def is_job(self) -> bool:
        return self.op in JOBS

    def __repr__(self) -> str:
        if self.is_job:
            return f"{self.op}{self.stage}.b{self.microbatch}"
        text = f"{self.op} s{self.stage}"
        if self.microbatch >= 0:
            text += f".b{self.microbatch}"
        if self.peer >= 0:
            text += f" {'->' if self.op in OUTGOING else '<-'}w{self.peer}"
        if self.peer_stage >= 0:
            text += f".s{self.peer_stage}"
        return text

    @staticmethod
    def from_str(text: str) -> Action:
        """The action ``text`` prints as (the reverse of ``repr``); ValueError if it is none."""
        text = text.strip()
        if m := _JOB_RE.fullmatch(text):
            return Action(m[1], int(m[2]), int(m[3]))
        m = _OTHER_RE.fullmatch(text)
        shape = _SHAPE.get(m[1]) if m else None
        if m is None or shape is None or shape != (m[3] is not None, m[5] is not None, m[6] is not None) or \
                (m[4] is not None and (m[4] == "->") != (m[1] in OUTGOING)):
            raise ValueError(f"{text!r} is not an action: write a job as F3.b1, a message as SEND_ACT s3.b1 ->w2.s4, "
                             f"RECV_WEIGHTS s3.b1 <-w0 or REDUCE s3 (kinds: {', '.join(COMPUTE + tuple(_SHAPE))})")
        return Action(m[1], int(m[2]), *(int(g) if g is not None else -1 for g in (m[3], m[5], m[6])))


def weave(programs: Sequence[Sequence[Action]], before: Sequence[Mapping[int, Sequence[Action]]],
          after: Sequence[Mapping[int, Sequence[Action]]]) -> list[list[Action]]:
    """``programs`` with ``before[w][i]`` put ahead of worker ``w``'s job ``i`` (``i`` = its job
    count: at the end) and ``after[w][i]`` behind it (``i = -1``: at the start).

    Between two jobs, the earlier job's actions (the leading run of :data:`AFTER` kinds) come
    first, then the later job's; each part is stably sorted by kind, so the print order does not
    depend on which pass added what."""
    out = []
    for w, prog in enumerate(programs):
        aft, bef = after[w], before[w]
        if not aft and not bef:
            out.append(list(prog))
            continue
        jobs = job_positions(prog)
        new: list[Action]
        if len(jobs) == len(prog):  # jobs only (before the first pass): each job between its own
            new = []
            done = 0  # the jobs up to job ``done`` are in ``new``
            for g in sorted({*aft, *(i - 1 for i in bef)}):  # the gap after job g
                new += prog[done : g + 1]
                done = max(done, g + 1)
                if (part := aft.get(g)) is not None:
                    new += _sorted(part)
                if (part := bef.get(g + 1)) is not None:
                    new += _sorted(part)
            new += prog[done:]
            out.append(new)
            continue
        # gap g (between job g and job g + 1) is prog[bounds[g+1]+1 : bounds[g+2]]
        bounds = [-1, *jobs, len(prog)]
        new = []
        done = 0
        for g in sorted({*aft, *(i - 1 for i in bef)}):
            lo, hi = bounds[g + 1] + 1, bounds[g + 2]
            new += prog[done:lo]
            if lo == hi:  # an empty gap (every gap, before the first pass): nothing to interleave
                if (part := aft.get(g)) is not None:
                    new += _sorted(part)
                if (part := bef.get(g + 1)) is not None:
                    new += _sorted(part)
            else:
                gap = prog[lo:hi]
                k = next((n for n, a in enumerate(gap) if a.op not in AFTER), len(gap))
                new += _sorted([*gap[:k], *aft.get(g, ())])
                new += _sorted([*gap[k:], *bef.get(g + 1, ())])
            done = hi
        new += prog[done:]
        out.append(new)
    return out


def job_positions(prog: Sequence[Action]) -> list[int]:
    """The indices of ``prog``'s jobs."""
    return list(compress(range(len(prog)), map(JOBS.__contains__, map(_OP, prog))))


_OP = itemgetter(0)  # an action's ``op``


def _rank(a: Action) -> int:
    return _RANK[a.op]


def _sorted(part: Sequence[Action]) -> Sequence[Action]:
    return sorted(part, key=_rank) if len(part) > 1 else part


def format_programs(programs: Sequence[Sequence[Action]], mark: tuple[int, int] | None = None,
                    around: int | None = None, align: bool = False) -> str:
    """Every worker's actions, one line per worker (``w<k>:``), two spaces apart; with ``align``,
    as a grid of aligned columns (a program of jobs only: the k-th column is each worker's k-th job).

    ``mark=(worker, index)`` prints that action as ``>>F3.b1<<``; with ``around`` only the columns
    within ``around`` of the marked one are shown (``...`` stands for the rest), so a large step
    still reads in an error message."""
    lo, hi = 0, max((len(prog) for prog in programs), default=0)
    if mark is not None and around is not None:
        lo, hi = max(0, mark[1] - around), min(hi, mark[1] + around + 1)
    cells = [[(_MARK[0] + repr(a) + _MARK[1]) if (w, n) == mark else repr(a) for n, a in enumerate(prog[lo:hi], lo)]
             for w, prog in enumerate(programs)]
    widths = [max((len(row[c]) for row in cells if c < len(row)), default=0) if align else 0 for c in range(hi - lo)]
    lines = []
    for w, (prog, row) in enumerate(zip(programs, cells)):
        shown = ["..."] * (lo > 0 and len(prog) > 0) + [cell.ljust(widths[c]) for c, cell in enumerate(row)] + \
            ["..."] * (len(prog) > hi)
        lines.append(" ".join([f"w{w}:", "  ".join(shown)]).rstrip())
    return "\n".join(lines)


def parse_programs(text: str) -> list[list[Action]]:
    """The programs :func:`format_programs` printed (without ``mark``): one ``w<k>:`` line per
    worker, in worker order, actions two or more spaces apart."""
    programs: list[list[Action]] = []
    for line in filter(str.strip, text.splitlines()):
        head, _, rest = line.strip().partition(":")
        if head != f"w{len(programs)}":
            raise ValueError(f"line {line!r} should start with 'w{len(programs)}:' (one line per worker, in order)")
        programs.append([Action.from_str(cell) for cell in re.split(r"\s{2,}", rest.strip()) if cell])
    return programs
