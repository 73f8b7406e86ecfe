"""``AtomicCheckpointIO``: Lightning's checkpoint writer, but every checkpoint appears whole or not at
all (:mod:`launcher.atomic`).

Lightning's own ``TorchCheckpointIO`` writes through fsspec, whose local "transaction" writes to
the system's temporary directory and then copies across file systems onto the final name: a full
disk leaves a truncated ``last.ckpt`` under its final name. This one serialises the checkpoint in
memory, writes it beside its final name, flushes it and renames it. A failed write raises
:class:`launcher.atomic.WriteError` (one sentence naming the checkpoint) and the previous
checkpoint of that name stays as it was.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from ..atomic import replacing


class AtomicCheckpointIO(TorchCheckpointIO):
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        with replacing(path, "wb") as f:
            f.write(buffer.getbuffer())
