"""One module per mode of ``python -m launcher``; each takes the composed config of one run (one
point of a sweep), validates it, runs it and returns ``{"point", "ok", ...}`` for the sweep table.
An unknown mode is reported by validation (:func:`launcher.config.validate.errors`), so any entry
is a safe default for it."""

from __future__ import annotations

from typing import Any, Callable

from omegaconf import DictConfig

from . import planning, simulation, train

MODES: dict[str, Callable[[DictConfig], dict[str, Any]]] = {
    "train": train.run, "simulate": simulation.run, "plan": planning.run,
}
