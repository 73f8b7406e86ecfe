"""The pipeline diagram as a picture: rows = workers, x = time, one rectangle per job from its
start to its finish, colour = micro-batch, label = f/b/i/w + stage.

matplotlib is imported inside :func:`save_png` (Agg backend), so importing this module is cheap
and :mod:`launcher.schedule` never pulls matplotlib in.
"""

from __future__ import annotations

from pathlib import Path

from ..schedule.simulate import Timeline

#: beyond this many jobs the labels would not fit; only colours are drawn
MAX_LABELS = 2000
#: ``png=auto`` draws the picture up to this many jobs: beyond, drawing takes most of the run
#: (20 of 21 s at 262,144 jobs, about 2 s at 10,000) and no single job can be seen in it
AUTO_MAX_JOBS = 10_000


def want_png(png: object, jobs: int) -> bool:
    """``png``: true, false, or auto (drawn up to :data:`AUTO_MAX_JOBS` jobs: past that the
    picture takes most of the run and shows no single job)."""
    return png is True or (png == "auto" and jobs <= AUTO_MAX_JOBS)


def save_png(tl: Timeline, path: str | Path, title: str | None = None, dpi: int = 100,
             unit: str = "duration units") -> Path:
    """Draw ``tl`` into ``path`` (PNG) and return the path; ``unit`` labels the time axis."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    space = tl.schedule.space
    W, B = tl.schedule.workers, space.microbatches
    latency = tl.latency or 1.0
    width = min(max(6.0, 0.35 * latency + 1.5), 40.0)
    height = min(max(2.0, 0.4 * W + 1.2), 30.0)
    plt.rcParams["hatch.linewidth"] = 0.4  # backward hatching stays behind the label
    fig, ax = plt.subplots(figsize=(width, height))
    cmap = plt.get_cmap("tab20" if B > 10 else "tab10")
    colour = lambda b: cmap(b % cmap.N)  # noqa: E731
    label = space.N <= MAX_LABELS
    for w, prog in enumerate(tl.sequences):
        # one collection per worker and direction (fast for thousands of jobs): forwards solid,
        # backwards hatched, so the same colour reads as the same micro-batch both ways
        for forward in (True, False):
            jobs = [j for j in prog if (space.job(j).kind == "F") == forward]
            if not jobs:
                continue
            ax.broken_barh([(tl.start[j], tl.finish[j] - tl.start[j]) for j in jobs], (w - 0.4, 0.8),
                           facecolors=[colour(space.job(j).microbatch) for j in jobs], edgecolors="black",
                           linewidth=0.5, hatch=None if forward else "//")
        if label:
            for j in prog:
                s, b, k = space.job(j)
                ax.text((tl.start[j] + tl.finish[j]) / 2, w, f"{k.lower()}{s}", ha="center", va="center", fontsize=7)
    ax.set_ylim(W - 0.5, -0.5)  # worker 0 on top, as in the text diagram
    ax.set_yticks(range(W))
    ax.set_yticklabels([f"w{w}" for w in range(W)])
    ax.set_xlim(0, latency)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"{tl.schedule.name}: S={space.S} B={B} W={W}, latency {tl.latency:g}")
    if B <= 20:
        handles = [Patch(facecolor=colour(b), edgecolor="black", label=f"mb {b}") for b in range(B)]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    path = Path(path)
    from ..atomic import replacing_path

    try:
        with replacing_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path
