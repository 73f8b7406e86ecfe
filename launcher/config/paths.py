"""Whether an output path can be written, checked before anything runs (one sentence if not).

Every mode writes into a directory (``hydra.run.dir``, a sweep's ``hydra.sweep.dir``, a records
file): finding out only when the results are ready to be written loses them, so the entry points
check first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _existing_ancestor(p: Path) -> Path:
    """The nearest ancestor of ``p`` (or ``p`` itself) that exists: where mkdir would start."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _problem(p: Path, target: Path) -> str | None:
    """Why directory ``p`` cannot be created or written into, as the end of a sentence about
    ``target`` (``p`` itself, or the file to write in it)."""
    base = _existing_ancestor(p.absolute())
    if not base.is_dir():
        return f"{base} is a file, not a directory"
    if not _writable(base):
        what = "it" if base == target.absolute() else f"its existing parent {base}"
        return f"{what} is not writable, so the run could not save its results"
    return None


def dir_error(key: str, path: str | os.PathLike) -> str | None:
    """The sentence saying why directory ``path`` (given as ``key``) cannot be created or written
    into; ``None`` when it can. Only the part before a ``${...}`` interpolation is checked."""
    text = str(path)
    static = text.split("${", 1)[0]
    p = Path(static or ".").expanduser()
    if "${" in text and not static.endswith(("/", os.sep)):
        p = p.parent  # the interpolation completes the last component
    why = _problem(p, p)
    return f"{key}={text} is invalid: {why}." if why else None


def file_error(key: str, path: str | os.PathLike) -> str | None:
    """The sentence saying why file ``path`` (given as ``key``) cannot be written; ``None`` if it can."""
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{key}={path} is invalid: it is a directory; give a file name."
    if p.exists():
        ok = os.access(p, os.W_OK)
        return None if ok else (f"{key}={path} is invalid: the file is not writable, so the run could not save its "
                                f"results.")
    why = _problem(p.parent, p)
    return f"{key}={path} is invalid: {why}." if why else None


def _writable(d: Path) -> bool:
    """Whether a directory can be created in ``d``: tried, since permission bits say nothing for
    root or for special file systems (/proc, a read-only mount)."""
    if not os.access(d, os.W_OK | os.X_OK):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".launcher-probe-", dir=d))
    except OSError:
        return False
    return True
