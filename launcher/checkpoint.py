"""Checkpoints outside training: read, consolidate, export.

    python -m launcher.checkpoint consolidate RUN/checkpoints/last.ckpt OUT.ckpt
    python -m launcher.checkpoint export RUN/checkpoints/last.ckpt OUT_DIR     # model=hf: save_pretrained

``consolidate`` writes a sharded checkpoint (a directory, :mod:`launcher.lightning.sharded`) as one
file in the single-device layout, the file ``checkpoint.format=single`` writes. ``export`` writes a
``model=hf`` checkpoint (either format) as ``save_pretrained`` output that ``transformers`` loads.

In Python, :func:`load` reads either format as the single-device checkpoint dict, and Lightning's
``load_from_checkpoint`` takes a sharded checkpoint through :func:`as_file`, in one line::

    model = GPT.load_from_checkpoint(launcher.checkpoint.as_file("run/checkpoints/last.ckpt"))
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Any

from .lightning.sharded import (
    assemble,
    is_sharded,
    load,
    param_of,
    problems,
    read_into,
    read_meta,
    requests,
)

__all__ = ["as_file", "consolidate", "export_pretrained", "load"]


def as_file(path: str | os.PathLike) -> Any:
    """What ``LightningModule.load_from_checkpoint`` takes for ``path``: a single file as it is, a
    sharded checkpoint as that file's bytes in memory."""
    import torch

    if not is_sharded(path):
        return path
    buffer = io.BytesIO()
    torch.save(load(path), buffer)
    buffer.seek(0)
    return buffer


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the checkpoint at ``path`` as one single-device file ``out`` (written whole or not at all).

    A sharded checkpoint is streamed stage by stage: the file's layout (``torch.save``'s zip, every
    tensor's record, no tensor bytes) is written first from tensors that are allocated but never
    touched, then each stage's parameters, buffers and optimizer state are read from the shards and
    written at their records' offsets, one stage at a time. So the process holds at most one stage
    and its optimizer state, and the file is the one ``torch.save`` of the whole dict writes."""
    import torch

    from .atomic import replacing

    if not is_sharded(path):
        ckpt = load(path)
        with replacing(out, "wb") as f:
            torch.save(ckpt, f)
        return
    meta = read_meta(path)
    request = requests(path, meta)
    ckpt = assemble(meta, request)
    with replacing(out, "wb") as f:
        with torch.serialization.skip_data():
            torch.save(ckpt, f)
        f.flush()
        offsets = _record_offsets(f.name, ckpt)
        crcs: dict[int, int] = {}  # record's data offset -> CRC-32 of the bytes written there
        small = {id(t) for t in request.values()}
        for t in _tensors(ckpt):  # the entries of lightning.pt: small, held already
            if id(t) not in small:
                crcs[offsets[id(t)]] = _write(f, offsets[id(t)], t)
        for keys in _by_stage(request).values():
            part = {k: torch.empty_like(request[k]) for k in keys if torch.is_tensor(request[k])}
            read_into(path, part)
            for k, v in part.items():
                crcs[offsets[id(request[k])]] = _write(f, offsets[id(request[k])], v)
            del part
        _write_crcs(f, crcs)
        f.seek(0, os.SEEK_END)


def _write(f: Any, offset: int, t: Any) -> int:
    """``t``'s whole storage at ``offset`` of ``f``; the CRC-32 of its bytes."""
    import zlib

    import torch

    data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().data
    if len(data):
        f.seek(offset)
        f.write(data)
    return zlib.crc32(data)


def _write_crcs(f: Any, crcs: dict[int, int]) -> None:
    """Each record's CRC-32 (by its data's offset) where ``torch.save`` keeps it, the record's data
    descriptor and its central directory entry: ``skip_data`` wrote 0, before the bytes were there."""
    import struct
    import zipfile

    f.flush()
    with open(f.name, "rb") as r:
        z = zipfile.ZipFile(r)
        by_name = {}
        for info in z.infolist():
            r.seek(info.header_offset)
            n, m = struct.unpack("<HH", r.read(30)[26:30])
            start = info.header_offset + 30 + n + m
            if start in crcs:
                by_name[info.filename] = (start + info.file_size, crcs[start])
        pos = z.start_dir
        central = []
        while True:
            r.seek(pos)
            head = r.read(46)
            if len(head) < 46 or head[:4] != b"PK\x01\x02":
                break
            n, m, k = struct.unpack("<HHH", head[28:34])
            central.append((pos, r.read(n).decode()))
            pos += 46 + n + m + k
        signed = {}  # whether each data descriptor starts with its optional signature
        for end, _ in by_name.values():
            r.seek(end)
            signed[end] = r.read(4) == b"PK\x07\x08"
    for name, (end, crc) in by_name.items():
        f.seek(end + 4 * signed[end])  # the data descriptor's CRC-32, after its optional signature
        f.write(struct.pack("<I", crc))
    for pos, name in central:
        if name in by_name:
            f.seek(pos + 16)
            f.write(struct.pack("<I", by_name[name][1]))


def _tensors(obj: Any) -> list[Any]:
    """Every tensor in a nested dict, list or tuple, in order."""
    import torch

    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _by_stage(request: dict[str, Any]) -> dict[str, list[str]]:
    """DCP's keys grouped by the stage (``stages.<i>``, else the first name component) they belong to."""
    groups: dict[str, list[str]] = {}
    for key in request:
        parts = param_of(key).split(".")
        groups.setdefault(".".join(parts[:2]) if parts[0] == "stages" else parts[0], []).append(key)
    return groups


def _record_offsets(file: str, ckpt: dict[str, Any]) -> dict[int, int]:
    """Where in ``torch.save``'s file of ``ckpt`` each tensor's storage goes (by the tensor's id):
    the file memory-mapped (no page read), every storage's address less the map's start."""
    import torch

    mapped = _tensors(torch.load(file, mmap=True, weights_only=True, map_location="cpu"))
    ours = _tensors(ckpt)
    if len(mapped) != len(ours):
        raise RuntimeError(f"{file} does not hold the checkpoint's {len(ours)} tensors")
    reader: Any = torch._C.PyTorchFileReader(file)  # its stubs lack get_record_offset
    starts = sorted(reader.get_record_offset(r) for r in reader.get_all_records()
                    if r.startswith("data/") and r[5:].isdigit())
    ptrs = {id(t): m.untyped_storage().data_ptr() for t, m in zip(ours, mapped) if m.untyped_storage().nbytes()}
    if not ptrs:
        return {}
    first = min(ptrs.values())
    record = set(starts)
    for start in starts:  # the map's start: the one that puts every storage at a record's start
        base = first - start
        if all(p - base in record for p in ptrs.values()):
            return {k: p - base for k, p in ptrs.items()}
    raise RuntimeError(f"cannot place the tensors in {file}'s records")


def export_pretrained(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write a ``model=hf`` checkpoint as ``save_pretrained`` output in the directory ``out``."""
    import torch

    from .models.hf import HFCausalLM

    ckpt = load(path)
    model = HFCausalLM(**ckpt["hyper_parameters"])
    dtypes = {v.dtype for v in ckpt["state_dict"].values() if torch.is_tensor(v) and v.is_floating_point()}
    if len(dtypes) == 1:  # the weights' own precision (a float64 run exports float64, not the default float32)
        model.to(dtypes.pop())
    model.load_state_dict(ckpt["state_dict"])
    hf: Any = model.hf  # the transformers model the stages are made of
    hf.save_pretrained(str(out))


def _refusal(path: str) -> str | None:
    if not os.path.exists(path):
        return f"{path} does not exist: give a checkpoint file or a sharded checkpoint's directory."
    if is_sharded(path):
        why = problems(path)
        if why is not None:
            return f"{path} {why}: give a whole checkpoint."
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="a sharded checkpoint as one single-device .ckpt file")
    c.add_argument("checkpoint")
    c.add_argument("out")
    e = sub.add_parser("export", help="a model=hf checkpoint as save_pretrained output")
    e.add_argument("checkpoint")
    e.add_argument("out")
    args = parser.parse_args(argv)
    refused = _refusal(args.checkpoint)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    import launcher  # noqa: F401 - before lightning and transformers, as every entry point

    if args.command == "consolidate":
        consolidate(args.checkpoint, args.out)
    else:
        export_pretrained(args.checkpoint, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
