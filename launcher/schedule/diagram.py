"""Text pipeline diagrams: one row per worker, one column per time slot (docs/design.md, "The greedy
simulator").

A cell names the job's direction (``f``, ``b``, ``i``, ``w``) and stage, and shows the micro-batch:
``cells="both"`` writes ``f3:5`` (forward of stage 3 on micro-batch 5), ``"stage"`` writes ``f3``
(the micro-batch left out, for a picture that shows it as a colour), ``"microbatch"`` writes ``f5``.
"""

from __future__ import annotations

import math

from .simulate import Timeline

CELLS = ("both", "stage", "microbatch")


def _label(kind: str, stage: int, mb: int, cells: str) -> str:
    d = kind.lower()
    if cells == "stage":
        return f"{d}{stage}"
    if cells == "microbatch":
        return f"{d}{mb}"
    return f"{d}{stage}:{mb}"


def slot(tl: Timeline) -> float:
    """The time one column stands for: the shortest job duration in use."""
    return min(tl.schedule.durations[k] for k in tl.schedule.space.kinds)


def _col(t: float, unit: float) -> int:
    # round to the nearest slot edge: monotone, so jobs that do not overlap in time never share a
    # cell, and every job (at least one slot long) keeps at least one cell
    return math.floor(t / unit + 0.5)


def columns(tl: Timeline) -> int:
    """How many time slots the diagram has, without drawing it."""
    return _col(tl.latency, slot(tl))


def grid(tl: Timeline, cells: str = "both") -> list[list[str]]:
    """Rows of cell labels (``""`` = idle); a job spans ``duration / slot`` columns."""
    if cells not in CELLS:
        raise ValueError(f"cells={cells!r} is not valid; choose one of {list(CELLS)}")
    unit = slot(tl)

    def col(t: float) -> int:
        return _col(t, unit)

    ncols = col(tl.latency)
    rows: list[list[str]] = []
    for prog in tl.sequences:
        row = [""] * ncols
        for j in prog:
            s, b, k = tl.schedule.space.job(j)
            first, last = col(tl.start[j]), col(tl.finish[j])
            for c in range(first, max(last, first + 1)):
                row[c] = _label(k, s, b, cells)
        rows.append(row)
    return rows


def ascii_diagram(tl: Timeline, cells: str = "both", max_columns: int | None = 240, max_rows: int | None = 256) -> str:
    """The whole diagram as text, or a one-line note when it has more than ``max_columns`` slots
    or ``max_rows`` workers (decided before anything is drawn, so a huge step costs nothing)."""
    ncols = columns(tl)
    if max_columns is not None and ncols > max_columns:
        return f"(diagram omitted: {ncols} time slots > {max_columns})"
    if max_rows is not None and tl.schedule.workers > max_rows:
        return f"(diagram omitted: {tl.schedule.workers} workers > {max_rows})"
    rows = grid(tl, cells)
    width = max([2] + [len(c) for r in rows for c in r] + [len(str(ncols))])
    name_w = len(f"w{len(rows) - 1}")
    header = " " * name_w + " " + " ".join(str(c + 1).rjust(width) for c in range(ncols))
    lines = [header.rstrip()]
    for w, row in enumerate(rows):
        cells_txt = " ".join((c or ".").rjust(width) for c in row)
        lines.append(f"{f'w{w}'.ljust(name_w)} {cells_txt}".rstrip())
    return "\n".join(lines)


def legend(cells: str = "both") -> str:
    example = _label("F", 3, 5, cells)
    what = {
        "both": "forward of stage 3 on micro-batch 5",
        "stage": "forward of stage 3",
        "microbatch": "forward of micro-batch 5",
    }[cells]
    return f"{example} = {what}; b = backward (i/w: input/weight gradient when split); . = idle"
