"""Every file a run writes appears whole or not at all: written to a temporary name in the same
directory, flushed to disk, then renamed over the final name (``os.replace``, atomic on POSIX).

A reader (a resumed run, ``mode=plan`` reading a profile, the comparison page, a person) never sees a
half-written ``metrics.json`` or checkpoint, and a failed write (a full disk) leaves the previous
version of the file intact. A failed write raises :class:`WriteError`, whose text is one sentence
naming the file and why; its temporary file is removed. Standard library only: every layer (the
report writers, the Lightning checkpoint plugin, the workers) uses it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator

#: errors that mean "the disk (or the quota, or the file-size limit) is full"
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class WriteError(OSError):
    """Writing ``path`` failed; ``str()`` is one sentence naming it (no ``[Errno n]`` prefix)."""

    def __init__(self, err: int | None, sentence: str, path: str) -> None:
        super().__init__(err, sentence, path)
        self.sentence = sentence

    def __str__(self) -> str:
        return self.sentence

    def __reduce__(self) -> Any:  # crosses process boundaries intact (a worker's error)
        return (type(self), (self.errno, self.sentence, self.filename))


def reason(e: BaseException) -> str:
    """Why a write failed, in words: a full disk is said plainly."""
    err = getattr(e, "errno", None)
    if err == errno.ENOSPC:
        return "no space left on the device"
    if err == errno.EDQUOT:
        return "the disk quota is exceeded"
    if err == errno.EFBIG:
        return "the file is larger than this process may write (the file-size limit, ulimit -f)"
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return " ".join(str(text).split()).rstrip(".")


def write_sentence(path: str | os.PathLike, e: BaseException) -> str:
    """The one sentence saying that ``path`` could not be written, and why."""
    if isinstance(e, WriteError):
        return e.sentence
    return f"could not write {path}: {reason(e)}."


def is_disk_full(e: BaseException) -> bool:
    return getattr(e, "errno", None) in DISK_FULL


def _tmp_name(path: Path) -> Path:
    # hidden, and not ending in the final suffix: globs such as *.ckpt or *.json never match it
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_leftovers(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that writers of ``path`` killed mid-write left beside it (any
    process's :func:`replacing`); call only where no other process is writing ``path``. Returns them."""
    path = Path(path)
    found = [p for p in path.parent.glob(f".{glob.escape(path.name)}.*.tmp") if p.is_file()]
    for p in found:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return found


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _renamed(path: Path, tmp: Path) -> Iterator[None]:
    """Rename ``tmp`` over ``path`` if the block succeeds; otherwise remove it, and raise an
    ``OSError`` again as :class:`WriteError` (one sentence naming ``path``)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(e.errno, write_sentence(path, e), str(path)) from e
        raise


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb", *, sync: bool = True) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; when the block ends without error it is
    flushed and renamed to ``path``. On any error the temporary file is removed, ``path`` keeps its
    previous content, and an ``OSError`` is raised again as :class:`WriteError`."""
    path = Path(path)
    tmp = _tmp_name(path)
    with _renamed(path, tmp):
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
    if sync:
        _fsync_dir(path.parent)


@contextlib.contextmanager
def replacing_path(path: str | os.PathLike) -> Iterator[Path]:
    """Like :func:`replacing`, for a writer that takes a file name (``savefig``): yields the
    temporary path to write (it keeps ``path``'s suffix as its format's hint), renamed on success."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    with _renamed(path, tmp):
        yield tmp


def write_bytes(path: str | os.PathLike, data: bytes, *, sync: bool = True) -> Path:
    with replacing(path, "wb", sync=sync) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, *, sync: bool = True) -> Path:
    with replacing(path, "w", sync=sync) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sync: bool = True) -> Path:
    """``obj`` as JSON (anything JSON cannot hold is written as its ``str``), with a final newline."""
    return write_text(path, json.dumps(obj, indent=indent, default=str) + "\n", sync=sync)


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or file system cannot."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    return renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the finished directory ``tmp`` in place of ``path`` (a directory or a file, or nothing):
    a reader sees the old one or the new one, never a mix. Where the two cannot be swapped in one
    step (not Linux), the old one is renamed aside first, so a crash in between leaves both whole."""
    import shutil

    tmp, path = Path(tmp), Path(path)
    _fsync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):  # tmp now holds the previous checkpoint
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    else:
        old = path.with_name(f".{path.name}.{os.getpid()}.old")
        os.rename(path, old)
        os.rename(tmp, path)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    _fsync_dir(path.parent)
