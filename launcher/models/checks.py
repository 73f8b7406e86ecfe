"""The built-in models' and data's own checks of their arguments, before anything is built.

Each failure is a ``ValueError`` whose text starts with ``name=value is invalid:``; the launcher
turns it into the sentence about the config key (``model.n_head=5 is invalid: ...``, see
:func:`launcher.modes.train.keyed`), and a Python caller reads the same sentence.
"""

from __future__ import annotations

import math
from typing import Any


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_ints(**values: Any) -> None:
    """Each of ``values`` must be a positive integer."""
    for name, v in values.items():
        if not (_is_int(v) and v > 0):
            raise ValueError(f"{name}={v} is invalid: it must be a positive integer.")


def non_negative_ints(**values: Any) -> None:
    for name, v in values.items():
        if not (_is_int(v) and v >= 0):
            raise ValueError(f"{name}={v} is invalid: it must be an integer of at least 0.")


def positive_number(name: str, v: Any, what: str = "it") -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={v} is invalid: {what} must be a positive number.")


def fraction(name: str, v: Any) -> None:
    """``v`` in ``[0, 1)``: a share of something that leaves some of it."""
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1):
        raise ValueError(f"{name}={v} is invalid: it is the share of the windows held out for validation, from 0 "
                         f"up to (not including) 1.")
