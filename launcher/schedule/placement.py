"""Placements: ``w(s, b, d) = (w_owner, w_compute)``.

``w_compute(s, b, d)`` is the worker that runs job ``(s, b, d)``; ``w_owner(s, b, d)`` is the
worker holding the source of truth of stage ``s``'s weights for that job. Every data movement of a
scheme follows from these two functions (see :mod:`launcher.schedule.metrics`).

The named schemes, with ``W = G * R`` workers and the looped hash ``h``:

    DDP    w(s, b, d) = (b, b)                 W = B
    FSDP   w(s, b, d) = (s mod W, b)           W = B
    GPipe  w(s, b, d) = (s, s)                 W = S
    LPP    w(s, b, d) = (h(s, b), h(s, b))
    FSLPP  w(s, b, d) = (h(s, s), h(s, b))     weights: the batch id replaced by the stage id
    VShape w(s, b, d) = (v(s), v(s))           S = 2W, v(s) = min(s, 2W - 1 - s)

The order of the tuple is weights first, then compute (docs/design.md, "Placements").

FSLPP's owner ``h(s, s)`` sits in group ``s mod G``, so when ``S > G`` the owners crowd into few
workers (with ``G = 1`` every stage is owned inside the only group, and with ``S = G R`` most workers
own nothing). ``ownership="balanced"`` uses ``h(s, floor(s / R))`` instead: the owner is still one of
stage ``s``'s compute workers (group ``floor(s / R) mod G``), and with ``S = G R`` every worker owns
exactly one stage. ``"seed"``, the reference formula ``h(s, s)``, is the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

Worker = int


class Placement(Protocol):
    """``(s, b, d) -> (w_owner, w_compute)``. A placement whose answer does not depend on ``d``
    may say so with a ``same_for_every_direction = True`` attribute: it is then asked once per
    ``(s, b)`` instead of once per job."""

    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]: ...


def h(s: int, b: int, G: int, R: int) -> Worker:
    """The looped-pipeline hash: group ``b mod G``, position ``s mod R`` inside the group."""
    return R * (b % G) + (s % R)


@dataclass(frozen=True)
class DDP:
    same_for_every_direction: ClassVar[bool] = True
    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]:
        return (b, b)


@dataclass(frozen=True)
class FSDP:
    same_for_every_direction: ClassVar[bool] = True
    W: int

    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]:
        return (s % self.W, b)


@dataclass(frozen=True)
class GPipe:
    same_for_every_direction: ClassVar[bool] = True
    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]:
        return (s, s)


@dataclass(frozen=True)
class LPP:
    same_for_every_direction: ClassVar[bool] = True
    G: int
    R: int

    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]:
        w = h(s, b, self.G, self.R)
        return (w, w)


@dataclass(frozen=True)
class VShape:
    """The V-shaped placement of ZBV and DualPipeV: ``S = 2W`` stages, worker ``w`` holds stages
    ``w`` and ``2W - 1 - w``, so the first and the last stage share worker 0 and stages ``W - 1``
    and ``W`` share worker ``W - 1`` (that activation never leaves its worker)."""

    same_for_every_direction: ClassVar[bool] = True
    W: int

    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]:
        w = min(s, 2 * self.W - 1 - s)
        return (w, w)


OWNERSHIPS = ("seed", "balanced")


@dataclass(frozen=True)
class FSLPP:
    same_for_every_direction: ClassVar[bool] = True
    G: int
    R: int
    ownership: str = "seed"  # seed: h(s, s); balanced: h(s, floor(s / R))

    def __post_init__(self) -> None:
        if self.ownership not in OWNERSHIPS:
            raise ValueError(f"ownership={self.ownership!r} is not valid; choose one of {list(OWNERSHIPS)}")

    def owner(self, s: int) -> Worker:
        """``w_owner`` of stage ``s``: ``h(s, s)`` (seed) or ``h(s, floor(s / R))`` (balanced)."""
        return h(s, s if self.ownership == "seed" else s // self.R, self.G, self.R)

    def __call__(self, s: int, b: int, d: str) -> tuple[Worker, Worker]:
        return (self.owner(s), h(s, b, self.G, self.R))
