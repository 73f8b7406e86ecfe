"""Sentences about a config: why a ``_target_`` names nothing (:func:`target_error`) and an
error's first line (:func:`one_line`). (Config -> :class:`launcher.schedule.Schedule` is
:func:`launcher.config.spec.to_schedule`, through :class:`~launcher.schedule.settings.Settings`.)"""

from __future__ import annotations

from typing import Any


def target_error(target: str) -> str | None:
    """Why the dotted path ``target`` names nothing, said as a user would look for it (``module
    mymodule has no attribute nope``, not Python's "'mymodule' is not a package"; a module that is
    nowhere to import: where Python looked, the working directory and ``PYTHONPATH``); ``None``
    when it resolves, or when importing fails inside the module (Hydra's own error says more then)."""
    import importlib
    import os

    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name != e.name and not name.startswith(e.name + "."):
                return None  # the module exists but one of its own imports is missing
            continue
        except Exception:
            return None
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:j])
                kind = "module" if j == i else "object"
                return f"{kind} {owner} has no attribute {attr}"
            obj = getattr(obj, attr)
        return None
    # not even the first name imports: the module is neither where the command runs nor on the path
    top = parts[0]
    return (f"there is no module {top} in the working directory ({os.getcwd()}) or on PYTHONPATH; run from the "
            f"directory that holds {top}.py (or the package {top}/), or add that directory to PYTHONPATH")


def one_line(e: BaseException, limit: int = 300) -> str:
    """The root cause of an exception as ``Type: message`` on one line, without a final period."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return (text if len(text) <= limit else text[: limit - 3] + "...").rstrip(".")
