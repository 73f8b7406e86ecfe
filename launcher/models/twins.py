"""Twins: a stage that runs a model's own ``forward`` code on only the modules it holds.

A twin of a module is another object of its class that shares its attributes and submodules,
except those given, which replace the module's own of the same name (stand-ins, or stops). Calling
a method of the twin runs the library's code unchanged, with the stand-ins where the stage does not
hold the real module; a stop raises :class:`Reached` to end the forward where the stage ends.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from torch import nn


class Reached(Exception):
    """Raised inside a model's forward where a stage ends, carrying the value it ends with."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def twin(module: nn.Module, children: Mapping[str, nn.Module | None]) -> nn.Module:
    """An object of ``module``'s class that shares its attributes (config, flags) and its
    submodules, except ``children``, which replace those of the same name. Its own hooks are
    copies, so registering on one does not touch the other."""
    twin = object.__new__(type(module))
    state = dict(vars(module))
    for key, value in state.items():
        if key.startswith("_") and key.endswith("hooks") and isinstance(value, dict):
            state[key] = OrderedDict(value)
    state["_modules"] = OrderedDict(module._modules)
    state["_modules"].update(children)
    state["_parameters"] = OrderedDict(module._parameters)
    state["_buffers"] = OrderedDict(module._buffers)
    twin.__dict__.update(state)
    return twin
