"""Read a W&B run file (``run-<id>.wandb``) back from disk, with no server and no account.

An offline run keeps everything in one file: a 7-byte header, then W&B's protobuf ``Record``
messages framed as LevelDB's log format (32 KiB blocks; each chunk has a 7-byte header of
checksum, length and type; a record may span chunks). This reads the records the comparison
dashboard and the tests need: the run (group, tags, name, config), history rows, the summary and
the media files logged.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32768
HEADER = 7  # the file's own header (":W&B", magic, version) and each chunk's (crc, length, type)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[bytes]:
    """The raw records of a ``.wandb`` file, in order."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # the block's tail is padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero padding / preallocated space
            pos += room
            continue
        chunk = data[pos + HEADER: pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            parts.append(chunk)
            yield b"".join(parts)
            parts = []


@dataclass
class Run:
    """What one offline run recorded."""

    id: str = ""
    name: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    dir: str = ""


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str | Path) -> Run:
    """Parse a ``run-<id>.wandb`` file (or an ``offline-run-*`` directory holding one)."""
    from wandb.proto import wandb_internal_pb2 as pb

    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("run-*.wandb"))
        if not found:
            raise FileNotFoundError(f"no run-*.wandb file in {p}")
        p = found[0]
    run = Run(dir=str(p.parent))
    for raw in records(p):
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run.id, run.name, run.group = r.run.run_id, r.run.display_name, r.run.run_group
            run.tags = list(r.run.tags)
            for item in r.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in r.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            for item in r.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "files":
            run.files += [f.path for f in r.files.files]
    return run


def find_runs(directory: str | Path) -> list[str]:
    """Every offline run file under ``directory`` (a run directory or a sweep)."""
    return sorted(glob.glob(os.path.join(str(directory), "**", "offline-run-*", "run-*.wandb"), recursive=True))
