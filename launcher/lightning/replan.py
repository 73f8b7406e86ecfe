"""The scheme for the workers that remain after a loss (:func:`replan`), used by both recoveries
(in place, :mod:`.recovery`; by re-entering ``fit``, :mod:`.replacement`), and how a scheme is named
in a recovery's record (:func:`scheme_label`)."""

from __future__ import annotations

from ..schedule.run_settings import survives_a_loss
from ..schedule.schemes import SCHEMES
from ..schedule.settings import SCHEME_DEFAULT, Settings


def scheme_label(s: Settings) -> str:
    """A scheme as a recovery's record and console line name it."""
    return f"{s.name} G={s.G} R={s.R} (W={s.workers})"


def replan(settings: Settings, workers: int) -> tuple[Settings, str]:
    """The step for ``workers`` survivors, and how it was chosen: the same scheme when its layout
    fits them (LPP keeps ``R`` when it divides them), else the planner's fastest layout that would
    survive another loss (:func:`~launcher.schedule.run_settings.survives_a_loss`)."""
    S, B = settings.stages, settings.microbatches
    registered = SCHEMES.get(settings.name)
    fixed = registered.sizes(S, B) if registered is not None else None
    if fixed is not None and fixed[0] * fixed[1] == workers:
        return settings.replace(G=fixed[0], R=fixed[1]), "the same scheme"
    if fixed is None and settings.name == "lpp" and workers % settings.R == 0 \
            and survives_a_loss("lpp", workers // settings.R, settings.R):
        return settings.replace(G=workers // settings.R), "the same scheme"
    from ..plan.profile import unit
    from ..plan.search import Budget, search

    ranking = search(S, [B], workers, unit(settings.durations, settings.comm), Budget(), top=50)
    for c in ranking.candidates:  # the fastest that can itself survive another loss
        p = c.point
        if p.G * p.R == workers and survives_a_loss(p.scheme.name, p.G, p.R):
            return settings.replace(scheme=p.scheme.name, G=p.G, R=p.R, order=SCHEME_DEFAULT), "the planner's choice"
    return settings.replace(scheme="lpp", G=workers, R=1, order=SCHEME_DEFAULT), "the data-parallel layout"
