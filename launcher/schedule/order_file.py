"""Schedules as data: each worker's job sequence read from, and written to, a file.

Two forms:

- ours, :mod:`launcher.schedule.actions`' text (:func:`~launcher.schedule.actions.format_programs`):
  one ``w<k>:`` line per worker, jobs like ``F3.b1``. Its jobs make the order. A file of jobs
  only gets the communication the lowering derives from the jobs and the placement; a whole
  step (what ``mode=simulate`` writes to ``actions.txt``, maybe edited) runs as written, once
  :func:`place_our_actions` has checked it against the lowering of the same jobs.
- ``torch.distributed.pipelining``'s CSV (``_dump_csv`` / ``_load_csv``, ``compute_only``): one
  row per rank, cells like ``0F0``, ``1I3``, ``2W1``, ``0B2`` (stage, kind, micro-batch). Its
  stage is our stage and its rank our worker; ``B`` is the full backward, ``I``/``W`` the split
  one. Empty cells (torch's idle slots) and its communication or sharding actions
  (``SEND_F``, ``UNSHARD``, ``REDUCE_GRAD``, ...) are ignored for the order. The full CSV torch
  writes after lowering (``compute_comms``) also says where each rank sends and receives:
  :func:`torch_messages` reads that and :func:`place_torch_messages` puts our messages there.

A path ending in ``.csv`` is torch's form, any other ours. :class:`FileOrder` runs the sequences
(``order=file order.path=...``); :func:`write_schedule` writes a simulated step's.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

from .actions import (
    AFTER,
    JOBS,
    POSTED,
    RECV_ACT,
    RECV_GRAD,
    RECV_WEIGHTS,
    REDUCE,
    SEND_ACT,
    SEND_GRAD,
    SEND_WEIGHTS,
    SEND_WGRAD,
    Action,
    format_programs,
    parse_programs,
)
from .graph import JobSpace
from .order import Sequenced

_TORCH_CELL = re.compile(r"(\d+)([A-Z_]+?)(\d*)")

#: a file's jobs: per worker, (kind, stage, micro-batch) in the order it runs them
Jobs = list[list[tuple[str, int, int]]]

#: torch's point-to-point actions and ours: the stage is the local one on both sides (torch's
#: ``RECV_F`` names the receiving stage, ``SEND_B`` the stage whose backward sends), the micro-batch the same
TORCH_MESSAGES = {"SEND_F": SEND_ACT, "RECV_F": RECV_ACT, "SEND_B": SEND_GRAD, "RECV_B": RECV_GRAD}
#: torch's FSDP actions (per-stage all-gather, free, gradient reduction): they map onto ours where
#: the run's placement has the same thing (:func:`place_torch_messages`), else they are no-ops, as in
#: torch's own runtime for a stage that is not FSDP-sharded
UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"
TORCH_SHARDING = frozenset((UNSHARD, RESHARD, REDUCE_GRAD))
_MESSAGES = frozenset(TORCH_MESSAGES.values())


def is_torch_csv(path: str | Path) -> bool:
    """Whether ``path`` names torch's CSV form (by its suffix)."""
    return str(path).lower().endswith(".csv")


def parse_ours(text: str) -> Jobs:
    """The jobs of a file in our text form (its other actions, if any, are placed by
    :func:`place_our_actions`)."""
    return [[(a.op, a.stage, a.microbatch) for a in prog if a.is_job] for prog in parse_programs(text)]


def parse_torch_csv(text: str) -> Jobs:
    """The compute actions of torch's CSV, row ``r`` = rank ``r``."""
    return [[(d, s, b) for d, s, b, _ in row if d in JOBS] for row in _torch_cells(text)]


def torch_messages(text: str) -> list[list[tuple[str, int, int, int]]]:
    """Torch's CSV with its jobs, point-to-point actions and FSDP actions, row ``r`` = rank ``r``:
    each as (our kind, or torch's for the FSDP ones; stage; micro-batch, -1 for an FSDP one; the
    cell's position in the row); empty if the file has no point-to-point action (a ``compute_only``
    CSV)."""
    rows = [[(TORCH_MESSAGES.get(d, d), s, b, i) for d, s, b, i in row
             if d in JOBS or d in TORCH_MESSAGES or d in TORCH_SHARDING] for row in _torch_cells(text)]
    return rows if any(d in _MESSAGES for row in rows for d, *_ in row) else []


def _torch_cells(text: str) -> list[list[tuple[str, int, int, int]]]:
    """Every non-empty cell of torch's CSV as (torch's kind, stage, micro-batch or -1, position)."""
    out = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        cells = []
        for i, cell in enumerate(map(str.strip, row)):
            if not cell:
                continue  # an idle slot
            m = _TORCH_CELL.fullmatch(cell)
            if m is None or not (m[2] in JOBS or m[2] in TORCH_MESSAGES or m[2] in TORCH_SHARDING):
                raise ValueError(f"row {r} cell {cell!r} is not a torch action (write it as 2F0: stage, kind, "
                                 f"micro-batch)")
            if (m[2] in JOBS or m[2] in TORCH_MESSAGES) and not m[3]:
                raise ValueError(f"row {r} cell {cell!r} names no micro-batch")
            cells.append((m[2], int(m[1]), int(m[3]) if m[3] else -1, i))
        out.append(cells)
    return out


def read_jobs(path: str | Path) -> Jobs:
    """A schedule file's jobs per worker; ``OSError`` if it cannot be read, ``ValueError`` if it is
    not in its form."""
    text = Path(path).read_text()
    return parse_torch_csv(text) if is_torch_csv(path) else parse_ours(text)


def to_sequences(jobs: Jobs, space: JobSpace, compute: Sequence[int], where: str) -> list[list[int]]:
    """The file's ``jobs`` as job ids of ``space``: each a kind, stage and micro-batch the step has.
    ``where`` names the file in the errors (``order.path=...``); that every job is listed once, on
    the worker that computes it, :func:`launcher.schedule.order.check_sequences` checks after."""
    W = max(compute, default=-1) + 1
    if len(jobs) > W and any(jobs[W:]):
        raise ValueError(f"{where} lists jobs for worker {len(jobs) - 1}, but the step has {W} workers")
    seqs: list[list[int]] = [[] for _ in range(W)]
    for w, row in enumerate(jobs[:W]):
        for d, s, b in row:
            if d not in space.kinds:
                split = "split_backward=true (F, I, W)" if space.K == 3 else "split_backward=false (F, B)"
                raise ValueError(f"{where} has a {d} job ({d}{s}.b{b}), which a step with {split} does not have")
            if not (0 <= s < space.S and 0 <= b < space.microbatches):
                raise ValueError(f"{where} names job {d}{s}.b{b}, outside the step's {space.S} stages and "
                                 f"{space.microbatches} micro-batches")
            seqs[w].append(space.id(s, b, d))
    return seqs


def place_torch_messages(ours: Sequence[Sequence[Action]], latest: Sequence[Sequence[Action]],
                         rows: Sequence[Sequence[tuple[str, int, int, int]]], where: str) -> list[list[Action]]:
    """``ours`` (the step :func:`~launcher.schedule.lowering.lower_actions` lowers for the file's
    order; ``latest``: the same without lookahead) with its actions where torch's full CSV puts
    their counterparts (:func:`torch_messages`), between the same two jobs, in torch's order:

    - its activation and gradient messages: torch posts a receive as soon as its sender has run in
      its own lowering's pass over the ranks (``_add_send_recv``), ours ``prefetch`` jobs ahead of the
      job that needs it;
    - ``UNSHARD`` of a stage: the weight copy (``RECV_WEIGHTS``) of that stage's next job, where that
      job runs on a copy it receives; else (the worker owns the stage, or holds the copy already
      under ``weight_cache=step``) a no-op;
    - ``REDUCE_GRAD`` of a stage: this worker's ``SEND_WGRAD`` or ``REDUCE`` of it, which stand right
      after the last job that adds to the sum, where torch puts it (refused elsewhere); a no-op where
      there is none (one owner, computing it all);
    - ``RESHARD``: a no-op (ours frees a fetched copy as the job that used it ends, or keeps it to the
      end of the step).

    The rest of ours (weight hand-overs, the other copies, partial sums' receives) stays where ours
    has it. ``ValueError`` naming ``where``, the rank, the cell's position and both actions where a
    row's jobs are not the step's, it names a message the step does not have, lacks one it has, or
    puts a ``REDUCE_GRAD`` elsewhere than after the job that completes the sum."""
    out = []
    for w, prog in enumerate(ours):
        row = rows[w] if w < len(rows) else []
        msgs = {(a.op, a.stage, a.microbatch): a for a in prog if a.op in _MESSAGES}
        jobs = [a for a in prog if a.is_job]
        fed = _copies_fed(latest[w])
        sums = {a.stage: slot for a, slot in zip(prog, _slots(prog)) if a.op in (SEND_WGRAD, REDUCE)}
        claimed: set[tuple[Action, int]] = set()  # the copies placed at an UNSHARD: (action, its k-th equal)
        theirs: list[list[Action]] = [[] for _ in range(len(jobs) + 1)]  # per gap: torch's actions, in its order
        n = 0  # jobs so far in the row
        for d, s, b, i in row:
            if d in JOBS:
                if n >= len(jobs) or jobs[n] != Action(d, s, b):
                    ours_at = repr(jobs[n]) if n < len(jobs) else "nothing (its jobs are done)"
                    raise ValueError(f"{where}: rank {w} position {i} is torch's {_torch_name(d, s, b)}, where "
                                     f"worker {w} runs {ours_at}")
                n += 1
            elif d == UNSHARD:
                k = next((k for k in range(n, len(jobs)) if jobs[k].stage == s), None)
                if k is not None and k in fed and fed[k] not in claimed:
                    claimed.add(fed[k])
                    theirs[n].append(fed[k][0])
            elif d == REDUCE_GRAD:
                if s in sums and sums[s] != (n, 0):
                    his = next(x for x in prog if x.op in (SEND_WGRAD, REDUCE) and x.stage == s)
                    raise ValueError(f"{where}: rank {w} position {i} is torch's {s}{d}, where worker {w}'s {his!r} "
                                     f"stands {_place(sums[s], jobs)}: a stage's gradient sum is sent or reduced "
                                     f"right after the last job that adds to it")
            elif d == RESHARD:
                continue
            elif (msg := msgs.pop((d, s, b), None)) is None:
                raise ValueError(f"{where}: rank {w} position {i} is torch's {_torch_name(d, s, b)}, a message "
                                 f"worker {w} does not have in this step (its peer stage runs on the same worker)")
            else:
                theirs[n].append(msg)
        if n < len(jobs) or msgs:
            missing = jobs[n] if n < len(jobs) else next(a for a in prog if (a.op, a.stage, a.microbatch) in msgs)
            raise ValueError(f"{where}: rank {w} has no {_torch_name(*missing[:3])} (ours: {missing!r}), which "
                             f"worker {w} runs in this step")
        new: list[Action] = []
        gap: list[Action] = []
        n = 0
        seen: Counter[Action] = Counter()
        for a in [*prog, None]:  # None: the end of the step, the last gap's close
            if a is not None and not a.is_job:
                if a.op == RECV_WEIGHTS:
                    seen[a] += 1
                    if (a, seen[a] - 1) in claimed:  # it stands at torch's UNSHARD instead
                        continue
                if a.op not in _MESSAGES:
                    gap.append(a)
                continue
            k = next((m for m, x in enumerate(gap) if x.op not in AFTER), len(gap))  # the job before's, then the next's
            new += [x for x in theirs[n] if x.op in AFTER] + gap[:k] + [x for x in theirs[n] if x.op not in AFTER]
            new += gap[k:]
            if a is not None:
                new.append(a)
            gap = []
            n += 1
        out.append(new)
    return out


def _copies_fed(latest: Sequence[Action]) -> dict[int, tuple[Action, int]]:
    """Per job (its index among the worker's jobs) that runs on a copy it receives, that copy's
    ``RECV_WEIGHTS`` and which of the equal ones it is (the k-th, from 0), in ``latest``, where each
    receive stands just before the job it feeds (equal ones feed their jobs in order)."""
    out, k = {}, 0
    seen: Counter[Action] = Counter()
    for a in latest:
        if a.is_job:
            k += 1
        elif a.op == RECV_WEIGHTS:
            out[k] = (a, seen[a])
            seen[a] += 1
    return out


#: what a whole step in our text may place elsewhere than the lowering does, as long as it stands no
#: later: a receive (posting one never waits, and the job that needs it waits for the data where it
#: stands) and an owner's hand-over of its weights (their data exists all step). Everything else
#: stays where the lowering puts it: a later send, or a wait moved, can make two workers wait on
#: each other, which the order of the lowering's messages rules out only for its own places.
MOVABLE = POSTED | {SEND_WEIGHTS}
_AFTER_KINDS = frozenset(AFTER)

Slot = tuple[int, int]  # (jobs before an action, 0: among the job before's own actions, 1: after them)


def _slots(prog: Sequence[Action]) -> list[Slot]:
    """Per action, where it stands between the jobs: the jobs before it, and whether it is in the
    leading run of the job before's own kinds (:data:`~launcher.schedule.actions.AFTER`) or after."""
    out, g, part = [], 0, 0
    for a in prog:
        if a.op in JOBS:
            g, part = g + 1, 0
        elif part == 0 and a.op not in _AFTER_KINDS:
            part = 1
        out.append((g, part))
    return out


def _place(slot: Slot, jobs: Sequence[Action]) -> str:
    """Where ``slot`` is, in words."""
    g, part = slot
    if part == 0:
        return f"right after {jobs[g - 1]!r}" if g > 0 else "at the start of the step"
    return f"before {jobs[g]!r}" if g < len(jobs) else "at the end of the step"


def place_our_actions(latest: Sequence[Sequence[Action]], theirs: Sequence[Sequence[Action]],
                      where: str) -> list[list[Action]]:
    """A whole step in our text (``theirs``, one action list per worker) as it is written, once
    checked against ``latest``, the lowering of the same jobs with no lookahead (every receive just
    before the job that needs it, every weight hand-over at its owner's release point): each worker
    has the same actions, its jobs in the same order; a :data:`MOVABLE` action stands no later than
    in ``latest`` (the k-th of equal actions against the k-th); every other action stands where
    ``latest`` has it, between the same jobs and in the same order. ``ValueError``, one sentence
    naming ``where``, the worker, the action's position in its line (from 0), the action and the
    rule, for the first action that does not fit."""
    W = len(latest)
    if len(theirs) > W and any(theirs[W:]):
        raise ValueError(f"{where} has actions for worker {len(theirs) - 1}, but the step has {W} workers")
    out = []
    for w, ours in enumerate(latest):
        prog = list(theirs[w]) if w < len(theirs) else []
        jobs = [a for a in ours if a.is_job]
        head = f"{where}: worker {w}"
        mine = [(n, a) for n, a in enumerate(prog) if a.is_job]
        for k, (n, a) in enumerate(mine):
            if k >= len(jobs) or a != jobs[k]:
                want = repr(jobs[k]) if k < len(jobs) else "no job (its jobs are done)"
                raise ValueError(f"{head} position {n} is {a!r} where the step runs {want}: a whole step's jobs run "
                                 f"in the file's order (under warmup=classic, the default)")
        extra, missing = Counter(prog) - Counter(ours), Counter(ours) - Counter(prog)
        if extra:
            n = next(n for n, a in enumerate(prog) if a in extra)
            raise ValueError(f"{head} position {n} is {prog[n]!r}, an action the step does not have there: a whole "
                             f"step's actions are those the lowering gives these jobs under this placement")
        if missing:
            a = next(a for a in ours if a in missing)
            raise ValueError(f"{head} has no {a!r}, which the lowering gives it: a whole step lists every action "
                             f"of each worker (a file of jobs only gets them all from the lowering)")
        theirs_at, ours_at = _slots(prog), _slots(ours)
        fixed = [(a, slot) for a, slot in zip(ours, ours_at) if not a.is_job and a.op not in MOVABLE]
        stay = [(n, a, slot) for n, (a, slot) in enumerate(zip(prog, theirs_at)) if not a.is_job and
                a.op not in MOVABLE]
        for k, (n, a, slot) in enumerate(stay):
            if (a, slot) != fixed[k]:
                put = next(s for b, s in fixed[k:] if b == a)
                rule = (f", after {fixed[k][0]!r}" if put == slot else "")
                raise ValueError(f"{head} position {n} is {a!r}, which the lowering puts {_place(put, jobs)}{rule}: "
                                 f"only a receive or an owner's weight hand-over may stand elsewhere (earlier), every "
                                 f"other action stands where the lowering puts it, in its order")
        latest_of: defaultdict[Action, list[Slot]] = defaultdict(list)
        for a, slot in zip(ours, ours_at):
            if a.op in MOVABLE:
                latest_of[a].append(slot)
        seen: Counter[Action] = Counter()
        for n, (a, slot) in enumerate(zip(prog, theirs_at)):
            if a.op not in MOVABLE:
                continue
            last = latest_of[a][seen[a]]
            seen[a] += 1
            if slot > last:
                if a.op in POSTED:
                    raise ValueError(f"{head} position {n} is {a!r}, after {jobs[last[0]]!r}, the job that needs it: "
                                     f"a receive is posted no later than just before the job that needs it")
                raise ValueError(f"{head} position {n} is {a!r}, later than its owner's release point "
                                 f"({_place(last, jobs)}): an owner hands a copy over no later than that, or the "
                                 f"worker that needs it may wait on this one while this one waits on it")
        out.append(prog)
    return out


def file_placed(order: object, progs: list[list[Action]], latest: list[list[Action]]) -> list[list[Action]]:
    """``progs`` (the lowered step of ``order``; ``latest``: the same without lookahead) with its
    actions where ``order``'s file puts them: a torch full CSV's message places
    (:func:`place_torch_messages`), or a whole step in our text as written
    (:func:`place_our_actions`); ``progs`` itself for any other order or file. ``ValueError`` as
    there, or if the file cannot be read."""
    if not isinstance(order, FileOrder):
        return progs
    try:
        text = Path(order.path).read_text()
    except OSError as e:
        raise ValueError(f"{order.where} cannot be read: {e.strerror or e}") from e
    if not is_torch_csv(order.path):
        try:
            theirs = parse_programs(text)
        except ValueError as e:
            raise ValueError(f"{order.where} is not a schedule: {e}") from e
        whole = any(not a.is_job for prog in theirs for a in prog)
        return place_our_actions(latest, theirs, order.where) if whole else progs
    rows = torch_messages(text)
    return place_torch_messages(progs, latest, rows, order.where) if rows else progs


def _torch_name(kind: str, stage: int, microbatch: int) -> str:
    """Our kind of job or message as torch's CSV writes it (``1RECV_F0``)."""
    torch_kind = next((t for t, o in TORCH_MESSAGES.items() if o == kind), kind)
    return f"{stage}{torch_kind}{microbatch}"


@dataclass(frozen=True)
class FileOrder(Sequenced):
    """Each worker's job sequence, read from ``path`` (our text form, or torch's CSV for a
    ``.csv``). With ``warmup="classic"`` (the default) each worker runs exactly its sequence."""

    warmup: str = "classic"
    path: str = ""
    name: ClassVar[str] = "file"

    @property
    def where(self) -> str:
        return f"order.path={self.path}"

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        where = self.where
        try:
            jobs = read_jobs(self.path)
        except OSError as e:
            raise ValueError(f"{where} cannot be read: {e.strerror or e}") from e
        except ValueError as e:
            raise ValueError(f"{where} is not a schedule: {e}") from e
        return to_sequences(jobs, space, compute, where)


def programs_of(space: JobSpace, program: Sequence[Sequence[int]]) -> list[list[Action]]:
    """Each worker's jobs (``Timeline.sequences``: job ids in the order it runs them) as actions."""
    out = []
    for seq in program:
        row = []
        for j in seq:
            s, b, d = space.job(j)
            row.append(Action(d, s, b))
        out.append(row)
    return out


def format_torch_csv(programs: Sequence[Sequence[Action]]) -> str:
    """The jobs of ``programs`` as torch's ``compute_only`` CSV (what its ``_dump_csv`` writes)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for prog in programs:
        writer.writerow([f"{a.stage}{a.op}{a.microbatch}" for a in prog if a.is_job])
    return buf.getvalue()


def write_schedule(space: JobSpace, program: Sequence[Sequence[int]], path: str | Path) -> Path:
    """Write each worker's job sequence to ``path``: torch's CSV for a ``.csv``, else our text form
    (which ``order=file`` reads back into the same timeline)."""
    progs = programs_of(space, program)
    text = format_torch_csv(progs) if is_torch_csv(path) else format_programs(progs) + "\n"
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p
