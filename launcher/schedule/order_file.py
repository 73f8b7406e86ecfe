"""Schedules as data: each worker's job sequence read from, and written to, a file.

Two forms:

- ours, :mod:`launcher.schedule.actions`' text (:func:`~launcher.schedule.actions.format_programs`):
  one ``w<k>:`` line per worker, jobs like ``F3.b1``. A file may be a whole lowered step: its
  communication actions are ignored (they follow from the jobs and the placement; the
  lowering derives them again), only its jobs make the order.
- ``torch.distributed.pipelining``'s CSV (``_dump_csv`` / ``_load_csv``, ``compute_only``): one
  row per rank, cells like ``0F0``, ``1I3``, ``2W1``, ``0B2`` (stage, kind, micro-batch). Its
  stage is our stage and its rank our worker; ``B`` is the full backward, ``I``/``W`` the split
  one. Empty cells (torch's idle slots) and its communication or sharding actions
  (``SEND_F``, ``UNSHARD``, ``REDUCE_GRAD``, ...) are ignored.

A path ending in ``.csv`` is torch's form, any other ours. :class:`FileOrder` runs the sequences
(``order=file order.path=...``); :func:`write_schedule` writes a simulated step's.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

from .actions import JOBS, Action, format_programs, parse_programs
from .graph import JobSpace
from .order import Sequenced

_TORCH_CELL = re.compile(r"(\d+)([A-Z_]+?)(\d*)")

#: a file's jobs: per worker, (kind, stage, micro-batch) in the order it runs them
Jobs = list[list[tuple[str, int, int]]]


def is_torch_csv(path: str | Path) -> bool:
    """Whether ``path`` names torch's CSV form (by its suffix)."""
    return str(path).lower().endswith(".csv")


def parse_ours(text: str) -> Jobs:
    """The jobs of a file in our text form (communication actions dropped)."""
    return [[(a.op, a.stage, a.microbatch) for a in prog if a.is_job] for prog in parse_programs(text)]


def parse_torch_csv(text: str) -> Jobs:
    """The compute actions of torch's CSV, row ``r`` = rank ``r``."""
    out: Jobs = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        jobs = []
        for cell in map(str.strip, row):
            if not cell:
                continue  # an idle slot
            m = _TORCH_CELL.fullmatch(cell)
            if m is None:
                raise ValueError(f"row {r} cell {cell!r} is not a torch action (write it as 2F0: stage, kind, "
                                 f"micro-batch)")
            if m[2] in JOBS:
                if not m[3]:
                    raise ValueError(f"row {r} cell {cell!r} names no micro-batch")
                jobs.append((m[2], int(m[1]), int(m[3])))
        out.append(jobs)
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
