"""Tie-break orders ``n(s, b, d)``: which ready job a free worker takes first (smaller first).

An order never overrides ``pred``; it only ranks jobs that are ready on the same worker at the
same time.

- ``1f1b``: backward before forward, then the older micro-batch first. By default it also applies
  the classic warm-up limit (a worker whose lowest stage is ``s`` keeps at most ``S - s``
  micro-batches in flight), which is where 1F1B's low memory comes from; ``warmup="none"`` gives
  the pure tie-break.
- ``breadth_first``: forward before backward; every micro-batch of a lower stage before the next
  stage (GPipe's fill-drain; looped breadth-first for LPP).
- ``depth_first``: the job that has waited longest since it became ready (ties as ``1f1b``).
- ``zb_h1``: ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), on the split
  backward: 1F1B's classic warm-up, then each stage alternating ``F`` and ``I`` (ranks from the
  paper's per-stage sequence, :func:`_zb_h1_keys`), and the weight-gradient jobs ``W`` deferred.
  A worker whose lowest stage is ``s`` keeps up to ``height(0) - height(s)`` (``s`` on a
  chain) ready ``W`` jobs waiting; one more, and the oldest runs before anything else; once the
  worker has no ``F`` or ``I`` left, the rest are flushed. Every worker then has the same number
  of micro-batches in flight counting deferred ``W`` (the paper's memory argument), and the ``W``
  jobs fill the tail of the step. :mod:`launcher.schedule.simulate` applies the deferral.
- any callable ``n(s, b, d) -> comparable``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .graph import JobSpace

#: rank of each kind: 1F1B drains (backward first), breadth-first fills (forward first).
#: ``W`` is last in both: it is off the critical path and fills bubbles.
_RANK_1F1B = {"B": 0, "I": 0, "F": 1, "W": 2}
_RANK_BREADTH = {"F": 0, "B": 1, "I": 1, "W": 2}

WARMUPS = ("classic", "none")


@dataclass(frozen=True)
class Order:
    """A tie-break rule; ``by_ready_time`` puts the job's ready time ahead of ``n``."""

    name: str
    n: Callable[[int, int, str], Any] | None  # None: one of the built-in integer keys below
    by_ready_time: bool = False
    warmup: str = "none"
    defer_w: bool = False  # ZB-H1's deferral of weight-gradient jobs (needs the split backward)

    def keys(self, space: JobSpace) -> list:
        """``n`` of every job, indexed by job id."""
        if self.n is not None:
            return [self.n(*space.job(j)) for j in range(space.N)]
        if self.name == "zb_h1":
            return _zb_h1_keys(space)
        rank = _RANK_BREADTH if self.name == "breadth_first" else _RANK_1F1B
        S, B = space.S, space.B
        out: list[int] = []
        for kind in space.kinds:
            r = rank[kind]
            for s in range(S):
                # forward walks stages upward, the backward downward
                level = s if kind == "F" else S - 1 - s
                if self.name == "breadth_first":
                    base = (r * S + level) * B
                    out.extend(range(base, base + B))
                else:  # 1f1b, depth_first: kind, then older micro-batch, then stage
                    out.extend((r * B + b) * S + level for b in range(B))
        return out


def _zb_h1_keys(space: JobSpace) -> list[int]:
    """ZB-H1's per-stage sequence as ranks: after its warm-up of ``height(s) - 1`` forwards, stage
    ``s`` alternates ``F(s, b + height(s) - 1)`` then ``I(s, b)``. So ``F(s, b)`` takes slot
    ``2 (b - height(s) + 1) - 1`` and ``I(s, b)`` slot ``2 b``; a ``W`` only ranks among ``W`` jobs
    (oldest first: the deferral itself is the simulator's). Plain 1F1B ranks (every ``I`` before
    any ``F``) would let early gradients starve the forwards once ``W`` jobs take slots."""
    S, B = space.S, space.B
    height = space.graph.height()
    out: list[int] = []
    for kind in space.kinds:
        for s in range(S):
            level = s if kind == "F" else S - 1 - s
            for b in range(B):
                if kind == "F":
                    slot = 2 * (b - height[s] + 1) - 1
                elif kind == "W":
                    slot = 2 * b + 2 * B
                else:
                    slot = 2 * b
                out.append((slot + 2 * S) * S + level)  # + 2S: keep keys non-negative
    return out


BUILTIN = ("1f1b", "breadth_first", "depth_first", "zb_h1")
#: built-in orders that only exist on the split backward
SPLIT_ONLY = ("zb_h1",)


def make_order(spec: str | Callable[[int, int, str], Any], warmup: str | None = None) -> Order:
    """Build an order from a built-in name or a callable ``n(s, b, d)``.

    ``warmup`` defaults to ``classic`` for ``1f1b`` and ``zb_h1``, ``none`` for every other order.
    """
    if warmup is not None and warmup not in WARMUPS:
        raise ValueError(f"warmup={warmup!r} is not valid; choose one of {list(WARMUPS)}")
    if callable(spec):
        return Order(getattr(spec, "__name__", "custom"), spec, warmup=warmup or "none")
    if spec not in BUILTIN:
        raise ValueError(f"order={spec!r} is not a known order; choose one of {list(BUILTIN)}")
    default_warmup = "classic" if spec in ("1f1b", "zb_h1") else "none"
    return Order(spec, None, by_ready_time=spec == "depth_first", warmup=warmup or default_warmup,
                 defer_w=spec == "zb_h1")
