"""Sharded checkpoints: a directory in which every stage's first owner writes that stage with
``torch.distributed.checkpoint`` (DCP), in parallel, and no process gathers the model.

Layout of ``last.ckpt/`` (a directory):

- ``.metadata`` and ``__<rank>_0.distcp``: DCP's files. Keys are single-device names:
  ``state_dict.<name>`` for every parameter (a tied one once, under its first name) and every stage
  buffer, ``optimizer_states.<k>.<name>.<key>`` for the optimizer state of parameter ``<name>``.
  Each tensor is whole: a stage is never split below its parameters, so no resharding is needed.
- ``lightning.pt``: everything else Lightning saves (step, epoch, loops, callbacks, schedulers,
  hyperparameters, the module's entries outside the stages, the optimizers' parameter groups in the
  single-device numbering), written by rank 0, small.

Loading anywhere is carried by this stage layout, not by DCP's resharding: a worker asks DCP for
the keys of the stages it will own, each a whole tensor under its single-device name, whatever
scheme, worker count, stage count or partition wrote it (a stage cut differently is only a
different set of names). A checkpoint is written under a hidden temporary name and swapped in whole
(:func:`launcher.atomic.replace_dir`) once every worker's shard and the metadata are on disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

#: the file holding everything but the stages' tensors
META = "lightning.pt"
#: the key of ``lightning.pt`` that marks a sharded checkpoint and holds the module's names
MARK = "launcher_sharded"
SD, OPT = "state_dict.", "optimizer_states."
FORMATS = ("sharded", "single")


def is_sharded(path: str | os.PathLike) -> bool:
    return os.path.isdir(path)


def tmp_dir(path: str | os.PathLike) -> Path:
    """Where a checkpoint is written before it is swapped in: hidden, and not ending in ``.ckpt``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def optimizer_entries(optimizer: torch.optim.Optimizer, names: dict[int, str],
                      writes: set[str]) -> dict[str, Any]:
    """This worker's optimizer state by parameter name: ``state`` of the parameters it writes,
    ``groups``: every parameter group's hyperparameters, ``members``: per group, the names of the
    parameters it writes in it (every parameter is written by one worker, so each is in one group)."""
    local = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[str, dict[str, Any]] = {}
    members: list[list[str]] = []
    for g in local["param_groups"]:
        members.append([])
        for i in g["params"]:
            n = names.get(id(params[i]))
            if n is None or n not in writes:
                continue
            # each parameter's group as its writer has it: a tied parameter seen by another stage
            # under its other name may sit in another group there (weight decay chosen by name)
            members[-1].append(n)
            if local["state"].get(i):
                state[n] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in local["state"][i].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in local["param_groups"]]
    return {"state": state, "groups": groups, "members": members}


def save(checkpoint: dict[str, Any], path: str | os.PathLike, staged: set[str], names: list[str],
         aliases: dict[str, str], rank: int, async_save: bool = False, group: Any = None) -> Any:
    """Write this worker's part of ``checkpoint`` into the directory ``path`` (collective: every rank
    calls it). ``checkpoint["state_dict"]``: the tensors this worker writes (and, on rank 0, the
    module's entries outside the stages); ``checkpoint["optimizer_states"]``: per optimizer, this
    worker's :func:`optimizer_entries`. ``staged``: every key that belongs to a stage; ``names``:
    the full module's parameter names in order; ``aliases``: other name -> first name of a tied
    parameter. With ``async_save`` the shards are written in the background from a host copy, and
    the returned callable finishes the save (waits, then swaps the directory in); ``group``: the
    process group of its collectives under a process group (the caller's, apart from training's)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    path = Path(path)
    tmp = tmp_dir(path)
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # a save that was interrupted
    if distributed:
        dist.barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    shards: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for k, v in checkpoint["state_dict"].items():
        if k in staged:
            shards[SD + k] = v.detach().cpu()
        else:
            rest[k] = v
    members: list[list[list[str]]] = []
    for k, entry in enumerate(checkpoint.get("optimizer_states", [])):
        for n, st in entry["state"].items():
            for key, v in st.items():
                shards[f"{OPT}{k}.{n}.{key}"] = v
        members.append(entry["members"])
    every: list[Any] | None = [None] * dist.get_world_size() if distributed and rank == 0 else None
    if distributed:
        dist.gather_object(members, every, dst=0)  # names only: which group each parameter is in
    else:
        every = [members]
    meta: dict[str, Any] | None = None
    if rank == 0:
        assert every is not None
        index = {n: i for i, n in enumerate(names)}
        optimizers = []
        for k, entry in enumerate(checkpoint.get("optimizer_states", [])):
            groups = [dict(h, params=set()) for h in entry["groups"]]
            for part in every:
                for gi, in_group in enumerate(part[k]):  # not ``group``: that is the save's process group
                    groups[gi]["params"].update(index[n] for n in in_group if n in index)
            optimizers.append({"param_groups": [dict(g, params=sorted(g["params"])) for g in groups]})
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta.update(state_dict=rest, optimizer_states=optimizers, **{MARK: {"names": names, "aliases": aliases}})
    writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
    if not async_save:
        with _said(path, tmp, rank):
            dcp.save(shards, storage_writer=writer, no_dist=not distributed)
            _finish(meta, tmp, path, started, None)
        return None
    with _said(path, tmp, rank):
        future: Any = dcp.async_save(shards, storage_writer=writer, no_dist=not distributed,
                                     process_group=group if distributed else None)
    blocked = time.perf_counter() - started

    def finish() -> None:
        with _said(path, tmp, rank):
            future.result()
            _finish(meta, tmp, path, started, blocked)

    return finish


def _finish(meta: dict[str, Any] | None, tmp: Path, path: Path, started: float, blocked: float | None) -> None:
    """Rank 0, once every shard and DCP's metadata are written: the rest, then the swap. The save's
    timing goes with it: ``blocking_s``, how long rank 0's training waited for the save (a
    synchronous one: all of it; an asynchronous one: the copy to host memory), ``write_s`` until now."""
    if meta is None:
        return
    from ..atomic import replace_dir, replacing

    took = time.perf_counter() - started
    meta[MARK]["save"] = {"blocking_s": took if blocked is None else blocked, "write_s": took,
                          "async": blocked is not None}
    with replacing(tmp / META, "wb") as f:
        torch.save(meta, f)
    replace_dir(tmp, path)


def _os_error(e: BaseException | None, seen: int = 0) -> OSError | None:
    """The ``OSError`` behind a failed save: DCP wraps each rank's failure (``CheckpointException``)."""
    if e is None or seen > 8:
        return None
    if isinstance(e, OSError):
        return e
    for inner in (getattr(e, "failures", None) or {}).values():
        # DCP keeps each rank's failure as (exception, traceback), or an object holding it in .exc
        inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exc", inner)
        found = _os_error(inner if isinstance(inner, BaseException) else None, seen + 1)
        if found is not None:
            return found
    return _os_error(e.__cause__ or e.__context__, seen + 1)


@contextlib.contextmanager
def _said(path: Path, tmp: Path, rank: int) -> Iterator[None]:
    """A failed write (a full disk) raised as :class:`launcher.atomic.WriteError`, one sentence naming
    the checkpoint; the temporary directory removed; the previous checkpoint of that name kept."""
    from ..atomic import WriteError, write_sentence

    try:
        yield
    except BaseException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        found = _os_error(e)
        if found is not None and not isinstance(e, WriteError):
            raise WriteError(found.errno, write_sentence(path, found), str(path)) from e
        raise


# ---- reading --------------------------------------------------------------------------------
def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``lightning.pt`` of a sharded checkpoint (tensors and plain values only)."""
    return torch.load(Path(path) / META, map_location="cpu", weights_only=True)


def read_index(path: str | os.PathLike) -> Any:
    """DCP's metadata: every key's size and dtype, and where its bytes lie."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def shapes(path: str | os.PathLike, meta: dict[str, Any] | None = None) -> dict[str, list[int] | None]:
    """Every entry of the module's state dict the checkpoint holds, with its shape (``None``: not a tensor)."""
    meta = meta if meta is not None else read_meta(path)
    out: dict[str, list[int] | None] = {k: list(v.shape) if torch.is_tensor(v) else None
                                        for k, v in meta["state_dict"].items()}
    for key, md in read_index(path).state_dict_metadata.items():
        if key.startswith(SD):
            out[key[len(SD):]] = list(md.size) if hasattr(md, "size") else None
    for alias, name in meta[MARK]["aliases"].items():
        if name in out:
            out[alias] = out[name]
    return out


def problems(path: str | os.PathLike) -> str | None:
    """Why the directory ``path`` is not a whole sharded checkpoint, in words naming the file; None if it is."""
    path = Path(path)
    if not (path / META).is_file():
        return f"lacks {path / META}, which a save writes last, so it is not a whole checkpoint"
    if not (path / ".metadata").is_file():
        return f"lacks {path / '.metadata'}, so it is not a whole checkpoint"
    try:
        meta = read_meta(path)
    except Exception as e:  # noqa: BLE001 - a damaged file: one sentence
        return f"cannot read {path / META} ({' '.join(str(e).split())[:200]})"
    if not isinstance(meta, dict) or MARK not in meta:
        return f"holds {path / META}, which is not a launcher checkpoint's"
    try:
        index = read_index(path)
    except Exception as e:  # noqa: BLE001
        return f"cannot read {path / '.metadata'} ({' '.join(str(e).split())[:200]})"
    need: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        rel = info.relative_path
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            return f"lacks its shard {f}"
        have = f.stat().st_size
        if have < size:
            return f"has its shard {f} cut short ({have:,} of {size:,} bytes)"
    return None


def requests(path: str | os.PathLike, meta: dict[str, Any], names: Iterable[str] | None = None,
             optimizer: bool = True) -> dict[str, Any]:
    """DCP's keys to read for ``names`` (every parameter and stage buffer if None), each with an
    empty tensor of its size and dtype to read into (allocated, not yet touched)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_index(path).state_dict_metadata
    mark = meta[MARK]
    wanted = None if names is None else {mark["aliases"].get(n, n) for n in names}
    request: dict[str, Any] = {}
    for key, md in index.items():
        if key.startswith(SD):
            name = key[len(SD):]
        elif key.startswith(OPT) and optimizer:
            name = param_of(key)
        else:
            continue
        if wanted is not None and name not in wanted:
            continue
        request[key] = (torch.empty(list(md.size), dtype=md.properties.dtype)
                        if isinstance(md, TensorStorageMetadata) else None)
    return request


def param_of(key: str) -> str:
    """The parameter (or buffer) name a DCP key belongs to."""
    if key.startswith(SD):
        return key[len(SD):]
    return key[len(OPT):].split(".", 1)[1].rsplit(".", 1)[0]


def read_into(path: str | os.PathLike, request: dict[str, Any]) -> None:
    """Fill ``request`` (DCP key -> tensor) from the shards, without collectives."""
    import warnings

    import torch.distributed.checkpoint as dcp

    if not request:
        return
    with warnings.catch_warnings():  # each process reads its own keys, on purpose without collectives
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, checkpoint_id=str(path), no_dist=True)


def assemble(meta: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """Lightning's single-device checkpoint dict from ``lightning.pt`` and the read keys."""
    meta = dict(meta)
    mark = meta[MARK]
    state = dict(meta["state_dict"])
    opt_state: list[dict[int, dict[str, Any]]] = [{} for _ in meta["optimizer_states"]]
    position = {n: i for i, n in enumerate(mark["names"])}
    for key, v in request.items():
        if key.startswith(SD):
            state[key[len(SD):]] = v
        else:
            k, rest = key[len(OPT):].split(".", 1)
            name, entry = rest.rsplit(".", 1)
            opt_state[int(k)].setdefault(position[name], {})[entry] = v
    for alias, name in mark["aliases"].items():  # a tied parameter under each of its names, as one process saves it
        if name in state:
            state[alias] = state[name]
    meta["state_dict"] = state
    meta["optimizer_states"] = [{"state": st, "param_groups": o["param_groups"]}
                                for st, o in zip(opt_state, meta["optimizer_states"])]
    meta.pop(MARK)
    return meta


def read(path: str | os.PathLike, names: Iterable[str] | None = None, optimizer: bool = True,
         meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A sharded checkpoint as Lightning's single-device checkpoint dict; with ``names``, only
    those parameters and stage buffers (and the module's entries outside the stages) are read, with
    their optimizer state: what one worker needs. Reads nothing else from the shards."""
    meta = meta if meta is not None else read_meta(path)
    request = requests(path, meta, names, optimizer)
    read_into(path, request)
    return assemble(meta, request)


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Any launcher checkpoint, sharded directory or single file, as the single-device checkpoint dict."""
    if is_sharded(path):
        return read(path)
    return torch.load(path, map_location="cpu", weights_only=True)
