"""The dashboard's figures (matplotlib, Agg): each run's predicted beside measured step time,
throughput, bubble, peak activation memory, resident weights and traffic per kind; the loss curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from .runs import Run

KINDS = ("act", "grad", "weights", "wgrad", "reduce", "bcast")  # the last two: runs from before replicas all-reduced
#: (title, unit, value(metrics, side) -> number or None)
PANELS: list[tuple[str, str, Callable[[dict, str], Any]]] = [
    ("step time", "ms", lambda m, s: m["latency_s"][s] and m["latency_s"][s] * 1e3),
    ("throughput", "samples/s", lambda m, s: m["throughput_samples_per_s"][s]),
    ("bubble fraction", "", lambda m, s: m["bubble_fraction"][s]),
    ("peak activations (max worker)", "MiB", lambda m, s: _max(m["per_worker"]["peak_activation_bytes"][s], 2**20)),
    ("resident weights (max worker)", "stages", lambda m, s: _max(m["per_worker"]["weights_peak_resident"][s])),
    ("traffic received (all workers)", "MiB", lambda m, s: _sum_kinds(m, s) / 2**20),
]


def _max(xs: Sequence[Any] | None, scale: float = 1.0) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return max(xs) / scale if xs else None


def _sum_kinds(m: dict, side: str) -> float:
    tb = m["per_worker"]["traffic_bytes"]
    return float(sum(sum(v for v in tb[k][side] if v is not None) for k in tb))


def _plt():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Write the figure whole or not at all (:mod:`launcher.atomic`), then free it."""
    from ..atomic import replacing_path

    path = Path(path)
    try:
        with replacing_path(path) as tmp:
            fig.savefig(tmp, dpi=90, format=path.suffix.lstrip(".") or "png")
    finally:
        _plt().close(fig)
    return path


def comparison(runs: list[Run], path: Path) -> Path:
    """A grid of bar charts, one per metric, one pair of bars (predicted, measured) per run."""
    plt = _plt()
    labels = [r.name for r in runs]
    fig, axes = plt.subplots(2, 3, figsize=(max(10.0, 1.2 * len(runs) + 6), 7.5), constrained_layout=True)
    x = range(len(runs))
    for ax, (title, unit, value) in zip(axes.flat, PANELS):
        for k, (side, colour) in enumerate((("predicted", "#9ecae1"), ("measured", "#3182bd"))):
            ys = [value(r.metrics, side) if r.metrics else None for r in runs]
            ax.bar([i + (k - 0.5) * 0.38 for i in x], [y or 0 for y in ys], 0.38, label=side, color=colour)
        ax.set_title(f"{title}{f' ({unit})' if unit else ''}", fontsize=10)
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    return _save(fig, path)


def traffic(runs: list[Run], path: Path) -> Path:
    """Bytes received per message kind, predicted beside measured, one group per run."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(runs), figsize=(max(6.0, 3.2 * len(runs)), 3.4), constrained_layout=True,
                             squeeze=False)
    for ax, r in zip(axes[0], runs):
        tb = r.metrics["per_worker"]["traffic_bytes"]
        kinds = [k for k in KINDS if k in tb]
        for j, (side, colour) in enumerate((("predicted", "#fdae6b"), ("measured", "#e6550d"))):
            ys = [sum(v for v in tb[k][side] if v is not None) / 2**20 for k in kinds]
            ax.bar([i + (j - 0.5) * 0.38 for i in range(len(kinds))], ys, 0.38, label=side, color=colour)
        ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
        ax.set_title(r.name, fontsize=9)
        ax.set_ylabel("MiB", fontsize=8)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def losses(runs: list[Run], path: Path) -> Path:
    """Training loss per step (lines) and validation loss (markers), one colour per run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4), constrained_layout=True)
    for i, r in enumerate(runs):
        colour = f"C{i % 10}"
        steps = r.metrics.get("steps") or []
        ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], color=colour, label=r.name, lw=1.4)
        val = r.metrics.get("val") or []
        if val:
            ax.plot([v["step"] for v in val], [v["val_loss"] for v in val], "o", color=colour, ms=5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (lines: train, dots: validation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)
