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

from .lightning.sharded import is_sharded, load, problems

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
    """Write the checkpoint at ``path`` as one single-device file ``out`` (written whole or not at all)."""
    import torch

    from .atomic import replacing

    ckpt = load(path)
    with replacing(out, "wb") as f:
        torch.save(ckpt, f)


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
