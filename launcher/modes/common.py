"""What every mode of ``python -m launcher`` shares: the console, the point being run, its run
directory, and how an invalid point is reported (one sentence per rule, ``invalid.json``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


def console():
    from rich.console import Console

    # not a terminal (a pipe, a log file): wide enough that the tables never wrap
    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def point() -> str:
    try:
        return " ".join(HydraConfig.get().overrides.task) or "(defaults)"
    except ValueError:  # not inside Hydra (tests calling run_config directly)
        return "(config)"


def output_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def reject(sentences: list[str], point: str, sweep: bool) -> dict[str, Any]:
    for s in sentences:
        print(f"error: {s}", file=sys.stderr)
    if sweep:
        print(f"skipped: {point} (invalid config; the other points still run)", file=sys.stderr)
    return {"point": point, "ok": False, "errors": sentences}


def write_invalid(cfg: DictConfig, sentences: list[str]) -> None:
    """``invalid.json`` in the run directory: why this run (sweep point) did not run."""
    import json

    try:
        out = output_dir()
    except ValueError:
        return
    try:
        config: Any = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that cannot resolve: keep it as written
        config = OmegaConf.to_container(cfg, resolve=False)
    (out / "invalid.json").write_text(json.dumps({"config": config, "errors": sentences}, indent=2, default=str) + "\n")


def in_sweep() -> bool:
    """Whether this run is one point of a Hydra multirun."""
    try:
        return HydraConfig.get().mode.name == "MULTIRUN"
    except ValueError:
        return False
