"""The one registry of named schemes: placement, worker-count rule, default ``(G, R)``, description,
and the settings that have no effect under a scheme (what it fetches, passes, orders).

Everything that lists schemes reads it: the rules (:mod:`launcher.schedule.rules`), the settings
(:class:`launcher.schedule.settings.Settings`: what a scheme ignores, the ``G``/``R`` it fixes),
the planner's space, the closed-form report, and the YAML of ``conf/strategy/`` (through the
``scheme_size`` resolver of :mod:`launcher.config.schema`). Adding a scheme is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from .placement import DDP, FSDP, FSLPP, LPP, GPipe, Placement, VShape

#: which size fixes a scheme's worker count, when one does
Fixed = Literal["microbatches", "stages", "half_stages"]


@dataclass(frozen=True)
class Scheme:
    """A named scheme; ``description`` is its line of ``python -m launcher --help`` (a test holds
    them equal). ``W_equals``: the size its worker count must equal (DDP and FSDP put one worker per
    micro-batch, GPipe one per stage, the V shape one per two stages), or ``None`` when any ``G * R``
    works."""

    name: str
    description: str
    build: Callable[[int, int, str], Placement]  # (G, R, ownership) -> placement
    W_equals: Fixed | None = None
    #: whether some worker fetches weights it does not own (then ``weight_cache`` matters)
    fetches: bool = False
    #: whether activations pass between workers (then, or when it fetches, ``prefetch`` matters)
    passes: bool = True
    #: why a tie-break order has no effect, when it has none (``order`` is then ignored)
    why_no_order: str | None = None
    #: the default ``checkpoint.format``: ``sharded`` where each stage's weights have one owner (no
    #: worker holds the whole model, so none should gather it), ``single`` where they are replicated
    checkpoint: str = "single"
    #: whether its compute placement is the looped hash ``h(s, b)`` at its ``(G, R)`` (the planner
    #: searches those only); the V shape's ``min(s, S - 1 - s)`` is not
    hashed: bool = True

    @property
    def has_order(self) -> bool:
        """Whether the tie-break order changes the schedule."""
        return self.why_no_order is None

    def sizes(self, stages: int, microbatches: int) -> tuple[int, int] | None:
        """The ``(G, R)`` the scheme fixes, or ``None`` when ``G`` and ``R`` are free."""
        if self.W_equals == "microbatches":
            return microbatches, 1
        if self.W_equals == "stages":
            return 1, stages
        if self.W_equals == "half_stages":  # one pipeline of S / 2 workers (odd S: the rules refuse it)
            return 1, max(1, stages // 2)
        return None

    def sizes_or(self, G: int, R: int, stages: int, microbatches: int) -> tuple[int, int]:
        """``(G, R)`` as the scheme uses them: its fixed sizes, else the given ones."""
        return self.sizes(stages, microbatches) or (G, R)

    def computes_at(self, G: int, R: int, stages: int, microbatches: int) -> bool:
        """Whether the scheme's compute placement is the looped hash ``h(s, b)`` with this ``(G, R)``."""
        return self.hashed and self.sizes_or(G, R, stages, microbatches) == (G, R)


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("ddp", "one worker per micro-batch, every stage's weights on every worker (G = B, R = 1)",
               lambda G, R, own: DDP(), "microbatches", passes=False,
               why_no_order="each DDP worker takes its one micro-batch through every stage alone, with no "
                            "pipeline bubble for an order to fill"),
        Scheme("fsdp", "one worker per micro-batch, each stage's weights sharded and fetched (G = B, R = 1)",
               lambda G, R, own: FSDP(G * R), "microbatches", fetches=True, passes=False, checkpoint="sharded"),
        Scheme("gpipe", "one worker per stage, activations sent along the pipeline (G = 1, R = S)",
               lambda G, R, own: GPipe(), "stages", checkpoint="sharded"),
        Scheme("lpp", "looped pipeline: G pipelines of R workers that loop over the S stages",
               lambda G, R, own: LPP(G, R)),
        Scheme("fslpp", "fully sharded looped pipeline: lpp with each stage's weights owned by one worker",
               lambda G, R, own: FSLPP(G, R, own), fetches=True, checkpoint="sharded"),
        Scheme("vshape", "V-shaped pipeline: worker w holds stages w and S-1-w (G = 1, R = S/2), as ZBV and DualPipeV",
               lambda G, R, own: VShape(G * R), "half_stages", checkpoint="sharded", hashed=False),
    )
}


def scheme(name: str) -> Scheme:
    """The registered scheme ``name``; a ``ValueError`` naming the choices otherwise."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"strategy={name!r} is not a known scheme; choose one of {sorted(SCHEMES)}") from None


def named(name: str, G: int, R: int, ownership: str = "seed") -> Placement:
    """The named placement ``name`` for ``G`` groups of ``R`` workers; ``ownership`` picks FSLPP's
    owner formula (only FSLPP has a choice: every other scheme's owner is fixed)."""
    return scheme(name).build(G, R, ownership)
