"""The schedule space the planner searches, and the Hydra overrides that name one point of it.

Every compute placement of the named schemes but one is the looped hash ``h(s, b)`` for some
``(G, R)``: DDP and FSDP compute at ``b`` (= ``h`` with ``G = B, R = 1``), GPipe at ``s``
(``G = 1, R = S``), LPP and FSLPP at ``h(s, b)``. Timing in the simulator depends only on where
jobs run (a weight fetch costs no time there), so one simulation per ``(G, R)``, order, split and
memory limit serves every scheme that computes there, both FSLPP ownerships and both weight caches.
The V shape (``strategy=vshape``: worker ``w`` computes stages ``w`` and ``S - 1 - w``, ``W = S/2``)
is a placement of its own, simulated apart (:func:`vshape_fits`, :data:`VSHAPE_ORDERS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from ..schedule.order import ORDERS as ORDER_CLASSES
from ..schedule.placement import OWNERSHIPS
from ..schedule.schemes import SCHEMES
from ..schedule.settings import DEFAULT

#: (order, warmup) pairs on ``h(s, b)``: 1f1b with and without its warm-up, breadth_first, depth_first,
#: zb_h1 and zb_h2 (split backward only) and interleaved_1f1b (looped pipelines only: :func:`order_fits`)
ORDERS: tuple[tuple[str, str], ...] = (
    ("1f1b", "classic"), ("1f1b", "none"), ("breadth_first", "none"), ("depth_first", "none"), ("zb_h1", "classic"),
    ("zb_h2", "classic"), ("interleaved_1f1b", "classic"),
)
#: (order, warmup) pairs on the V shape: 1f1b with and without its warm-up, zbv and dualpipev (split
#: backward only; dualpipev with at least as many micro-batches as stages)
VSHAPE_ORDERS: tuple[tuple[str, str], ...] = (("1f1b", "classic"), ("1f1b", "none"), ("zbv", "classic"),
                                              ("dualpipev", "classic"))
#: ``order=auto``: searched per step (:mod:`launcher.schedule.auto_order`), so only at the placements
#: of the best candidates the named orders find (:func:`launcher.plan.search.search`'s ``auto_top``)
AUTO: tuple[str, str] = ("auto", "classic")
CACHES = ("step", "job")


@dataclass(frozen=True)
class Variant:
    """A named scheme (of :data:`launcher.schedule.SCHEMES`) with its ``ownership``, FSLPP's only
    choice; the planner tries each variant that computes at a ``(G, R)``."""

    name: str
    ownership: str = DEFAULT.ownership

    @property
    def label(self) -> str:
        return f"fslpp/{self.ownership}" if self.name == "fslpp" else self.name


def schemes_at(G: int, R: int, S: int, B: int) -> list[Variant]:
    """The named schemes (and FSLPP's ownerships) whose compute placement is ``h(s, b)`` with this
    ``(G, R)``, the looped schemes first."""
    found = [s for s in SCHEMES.values() if s.computes_at(G, R, S, B)]
    found.sort(key=lambda s: s.W_equals is not None)  # stable: the looped schemes, then the fixed ones
    return [Variant(s.name, own) for s in found for own in (OWNERSHIPS if s.name == "fslpp" else ("seed",))]


def order_fits(order: str, R: int, S: int, split: bool, vshape: bool = False, B: int | None = None) -> bool:
    """Whether a built-in order exists at this point: ZB-H1, ZB-H2, ZB-V, DualPipeV and auto schedule
    the split backward's weight gradients apart; the interleaved 1F1B needs a looped pipeline
    (``1 < R < S``, ``S`` a multiple of ``R``); ZB-V and DualPipeV are made for the V shape
    (``vshape``) and exist only there, DualPipeV with ``B >= S`` micro-batches (when ``B`` is given)."""
    o = ORDER_CLASSES[order]
    looped = 1 < R < S and S % R == 0 and not vshape
    return ((split or not o.split_only) and (not o.looped_only or looped)
            and o.scheme_only in (None, "vshape" if vshape else None)
            and (B is None or not o.at_least_stages or B >= S))


def placements(workers: int, S: int, B: int) -> Iterator[tuple[int, int]]:
    """Every valid ``(G, R)``: ``G <= B``, ``R <= S``, ``G R <= workers``."""
    for G in range(1, min(B, workers) + 1):
        for R in range(1, min(S, workers // G) + 1):
            yield G, R


def vshape_fits(workers: int, S: int, B: int) -> bool:
    """Whether the V shape exists here: an even number of stages on ``S / 2 <= workers`` workers."""
    return S % 2 == 0 and 0 < S // 2 <= workers and B >= 1


@dataclass(frozen=True)
class Point:
    """One point of the space: everything ``mode=simulate`` needs to reproduce it."""

    scheme: Variant
    G: int
    R: int
    stages: int
    microbatches: int
    order: str
    warmup: str
    split: bool
    memory_limit: int | tuple[int, ...] | None
    weight_cache: str
    durations: dict[str, float] = field(compare=False, hash=False)
    comm: float = DEFAULT.comm
    partition: str | None = None  # how self.stages are cut (searched when the profile has modules)
    recompute: str = DEFAULT.recompute  # type: ignore[assignment]  # none | full: every backward recomputes its forward (searched under a byte budget)
    step_overlap: str = DEFAULT.step_overlap  # the rule its step time was priced under (launcher.schedule.overlap)
    #: its activation units' graph share (launcher.schedule.activations), from the profile's bytes
    graph_share: float | tuple[float, ...] = DEFAULT.graph_share

    def settings(self) -> dict[str, Any]:
        """Dotted config keys and values (what :func:`overrides` spells out)."""
        ml = list(self.memory_limit) if isinstance(self.memory_limit, tuple) else self.memory_limit
        out: dict[str, Any] = {
            "strategy": self.scheme.name, "G": self.G, "R": self.R, "stages": self.stages,
            "microbatches": self.microbatches, "order": self.order, "warmup": self.warmup,
            "split_backward": self.split, "memory_limit": ml, "weight_cache": self.weight_cache,
        }
        if self.scheme.name == "fslpp":
            out["strategy.ownership"] = self.scheme.ownership
        out.update({f"durations.{k}": v for k, v in self.durations.items()})
        out["comm"] = self.comm
        if self.partition is not None:
            out["partition"] = self.partition
        if self.recompute != "none":
            out["recompute"] = self.recompute
        if self.step_overlap != DEFAULT.step_overlap:
            out["step_overlap"] = self.step_overlap
        if self.graph_share != DEFAULT.graph_share:
            out["graph_share"] = list(self.graph_share) if isinstance(self.graph_share, tuple) else self.graph_share
        return out

    def overrides(self) -> list[str]:
        """Hydra overrides that reproduce this point exactly (add ``mode=simulate``)."""
        return [f"{k}={spell(v)}" for k, v in self.settings().items()]


def spell(v: Any) -> str:
    """A value as a Hydra override spells it (floats by ``repr``, so they round-trip exactly)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ",".join(spell(x) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)
