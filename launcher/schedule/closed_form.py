"""The reference closed forms (docs/design.md, "Closed forms"), as data, beside the simulated
quantities they approximate.

Units as in docs/design.md, "Traffic and memory": a forward plus a backward of one stage takes 1
(``latency_fb``); a stage's weights and one activation each count 1. The two tables, ``000`` and
``001``, disagree (``000`` gives LPP's latency as ``S + B/G - 1``, ``001`` as ``B + S/G - 1``); both
are approximations, each stated for a regime. The simulator is the source of truth;
``docs/closed-forms.md`` says where each formula holds.

Simulated counterparts, per worker and then the worst worker (the tables are "per worker"):

- ``latency_fb``: the simulated latency over ``F + B``;
- ``act_xmit``: activations and gradients received, ``act_recv + grad_recv``;
- ``weight_xmit``: distinct stages fetched per step, ``weight_fetch_stages``;
- ``act_storage``: ``peak_activations``;
- ``weight_storage``: stages owned (source of truth), ``weights_owned``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

METRICS = ("latency_fb", "act_xmit", "weight_xmit", "act_storage", "weight_storage")
SEEDS = ("000", "001")

Formula = Callable[[int, int, int, int], float]  # (S, B, G, R) -> value


@dataclass(frozen=True)
class Row:
    """One row of a reference table: the regime it claims, and a formula per metric."""

    regime: str
    applies: Callable[[int, int, int, int], bool]
    formulas: dict[str, Formula]


def _always(S: int, B: int, G: int, R: int) -> bool:
    return True


def _row(regime: str, applies: Callable[[int, int, int, int], bool], *fs: Formula) -> Row:
    return Row(regime, applies, dict(zip(METRICS, fs)))


# table 000 (its GPipe row is empty)
_T000: dict[str, list[Row]] = {
    "ddp": [_row("W = B", _always,
                 lambda S, B, G, R: S, lambda S, B, G, R: 0, lambda S, B, G, R: 0,
                 lambda S, B, G, R: S, lambda S, B, G, R: S)],
    "fsdp": [_row("W = B", _always,
                  lambda S, B, G, R: S, lambda S, B, G, R: 0, lambda S, B, G, R: S - 1,
                  lambda S, B, G, R: S, lambda S, B, G, R: 1)],
    "gpipe": [],
    "lpp": [_row("W = G R", _always,
                 lambda S, B, G, R: S + B / G - 1, lambda S, B, G, R: B, lambda S, B, G, R: 0,
                 lambda S, B, G, R: S / R * min(S, B / G), lambda S, B, G, R: S / R)],
    "fslpp": [_row("W = G R", _always,
                   lambda S, B, G, R: S + B / G - 1, lambda S, B, G, R: B, lambda S, B, G, R: S - 1,
                   lambda S, B, G, R: S / R * min(S, B / G), lambda S, B, G, R: 1)],
}

# table 001 (big-O in the text, compared here as exact values); DDP and FSDP as in 000
_T001: dict[str, list[Row]] = {
    "ddp": _T000["ddp"],
    "fsdp": _T000["fsdp"],
    "gpipe": [_row("W = S", _always,
                   lambda S, B, G, R: B + S - 1, lambda S, B, G, R: 2 * B, lambda S, B, G, R: 0,
                   lambda S, B, G, R: S, lambda S, B, G, R: 1)],
    "lpp": [
        _row("B >= S >= W = G R", lambda S, B, G, R: B >= S >= G * R,
             lambda S, B, G, R: B + S / G - 1, lambda S, B, G, R: 2 * B, lambda S, B, G, R: 0,
             lambda S, B, G, R: S, lambda S, B, G, R: S / R),
        _row("S >= W = G R >= B", lambda S, B, G, R: S >= G * R >= B,
             lambda S, B, G, R: S, lambda S, B, G, R: 2 * B, lambda S, B, G, R: 0,
             lambda S, B, G, R: S, lambda S, B, G, R: S / R),
    ],
    "fslpp": [
        _row("B >= S >= W = G^2", lambda S, B, G, R: B >= S >= G * R and G == R,
             lambda S, B, G, R: B + S / G - 1, lambda S, B, G, R: 2 * B, lambda S, B, G, R: S / G - 1,
             lambda S, B, G, R: S, lambda S, B, G, R: 1),
        _row("S >= W = G R >= B", lambda S, B, G, R: S >= G * R >= B,
             lambda S, B, G, R: S, lambda S, B, G, R: 2 * B, lambda S, B, G, R: S / G - 1,
             lambda S, B, G, R: S, lambda S, B, G, R: 1),
    ],
}

TABLES: dict[str, dict[str, list[Row]]] = {"000": _T000, "001": _T001}


def row_for(seed: str, scheme: str, S: int, B: int, G: int, R: int) -> Row | None:
    """The first row of ``seed``'s table for ``scheme`` whose regime covers ``(S, B, G, R)``."""
    for row in TABLES[seed].get(scheme, []):
        if row.applies(S, B, G, R):
            return row
    return None


def closed_forms(scheme: str, S: int, B: int, G: int, R: int) -> dict[str, dict[str, Any]]:
    """Each reference table's closed forms for this configuration; ``None`` where the table gives none.

    ``regime`` names the row used (``None`` when no row of that seed covers the configuration).
    """
    out: dict[str, dict[str, Any]] = {}
    for seed in SEEDS:
        row = row_for(seed, scheme, S, B, G, R)
        vals: dict[str, Any] = {m: (float(row.formulas[m](S, B, G, R)) if row else None) for m in METRICS}
        vals["regime"] = row.regime if row else None
        out[seed] = vals
    return out


def simulated_counterparts(summary: dict[str, Any]) -> dict[str, float]:
    """The simulated value of each closed-form metric, from :func:`metrics.summarize`."""
    pw = summary["per_worker"]
    return {
        "latency_fb": float(summary["latency_fb"]),
        "act_xmit": float(max(a + g for a, g in zip(pw["act_recv"], pw["grad_recv"]))),
        "weight_xmit": float(max(pw["weight_fetch_stages"])),
        "act_storage": float(max(pw["peak_activations"])),
        "weight_storage": float(max(pw["weights_owned"])),
    }
