"""``fault.copies=1``: each stage held by one worker also kept in the memory of another, so that a
lost worker's stages are recovered from memory (no disk read, no replay) under ``fsdp``, ``gpipe``,
``fslpp`` and ``lpp`` with ``G=1``, as ``ddp``'s are from its replicas.

After every optimizer step (and before a step when no copy of the current state was sent yet: the
first step, the step after a resume or a recovery), each worker sends the state of the stages it
alone owns (parameters, buffers, optimizer state by parameter name) to the next worker in a ring
(``rank + 1 mod W``), which keeps it in CPU memory, tagged with the number of completed steps it
reflects, in place of the previous one. Why every step rather than every checkpoint interval: a copy
of the state after the last completed step is what makes a recovery lose 0 steps; a copy from the
last checkpoint would still need the batches since and their replay, which the sharded checkpoint
already gives. The cost is one stage-state message per worker and step (measured in
``docs/faults.md``).

A single loss leaves every such stage on a survivor: the lost worker's own stages at its successor,
and the stages whose copy it held at their (surviving) owner. :func:`launcher.lightning.recovery.recover`
takes a lost stage from the copy whose tag equals the survivors' completed steps; a stale copy (the
loss came during the exchange itself) is not used, and the run falls back to the last sharded
checkpoint when it has one. Stages with several owners are not copied: a replica holds them.

A loss during the exchange: each worker posts both its sends before it waits for its receive, and
waits for the sends whatever the receive does, so the successor of the worker whose predecessor
was lost still gets its copy; every survivor then leaves the exchange (:func:`after_step`) and
meets the loss in the next training step, where it is recovered.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .strategy import UnifiedStrategy

#: the point-to-point tag of the copies' messages, apart from the engine's
TAG = 7_311


def lone_stages(owners: list[list[int]]) -> list[int]:
    """The stages held by a single worker: those a loss could take with it, so those copied."""
    return [s for s, o in enumerate(owners) if len(o) == 1]


def _nbytes(payload: Any) -> int:
    """Bytes of the tensors in a stage payload (parameters and buffers, optimizer state)."""
    tensors, opt = payload
    return sum(t.numel() * t.element_size() for t in [*tensors.values(), *(v for st in opt.values()
                                                                            for v in st.values())]
               if torch.is_tensor(t))


@dataclass
class StageCopies:
    """The copies this worker keeps for the previous worker in the ring, and what keeping them costs."""

    #: completed training steps the copies reflect (-1: none kept, or not of the current group)
    step: int = -1
    #: stage -> (parameters and buffers, optimizer state by parameter name), on the CPU
    stages: dict[int, Any] = field(default_factory=dict)
    #: the step whose state this worker last sent (so a step does not send it twice)
    sent_step: int = -1
    held_bytes: int = 0
    peak_held_bytes: int = 0
    #: exchanges made, the most bytes this worker sent in one, and their wall seconds in all
    #: (serialise, send, receive, load): running figures, so a long run keeps no per-step list
    exchanges: int = 0
    sent_bytes_max: int = 0
    seconds_total: float = 0.0

    def tags(self) -> dict[int, int]:
        """Per stage copied here, the completed steps its copy reflects."""
        return {s: self.step for s in self.stages}

    def reset(self) -> None:
        """Drop the copies (after a recovery the ring is another; the next exchange refills them)."""
        self.step, self.sent_step, self.stages, self.held_bytes = -1, -1, {}, 0

    def summary(self) -> dict[str, Any]:
        """This worker's costs, as ``metrics.json``'s ``copies`` lists them."""
        n = self.exchanges
        return {"exchanges": n, "held_bytes": self.held_bytes, "peak_held_bytes": self.peak_held_bytes,
                "sent_bytes_per_step": self.sent_bytes_max,
                "seconds_per_step": round(self.seconds_total / n, 6) if n else 0.0}


def _both(*reqs: Any) -> None:
    """Wait for each request; every one is waited for even when one fails, and the first failure
    is raised after (a send to a live worker must not be dropped because a receive failed)."""
    failed: Exception | None = None
    for req in reqs:  # None only for a rank outside the group, which a member of the ring never is
        try:
            req.wait()
        except Exception as e:  # noqa: BLE001 - raised below, after the other requests
            failed = failed or e
    if failed is not None:
        raise failed


def exchange(strategy: UnifiedStrategy, step: int) -> None:
    """Send this worker's lone stages, as they are after ``step`` completed steps, to the next
    worker, and keep the previous worker's; collective over the group (every worker derives the
    same layout, so all take part, an empty message where a worker owns no lone stage)."""
    from .recovery import _stage_payload

    copies, engine = strategy.copies, strategy.engine
    assert copies is not None and engine is not None
    copies.sent_step = step
    world = dist.get_world_size()
    lone = lone_stages(engine.lowered.owners)
    if world < 2 or not lone:  # every stage has a replica (or there is no one to copy to)
        copies.reset()
        copies.sent_step = step
        return
    start = time.monotonic()
    rank = dist.get_rank()
    mine = {s: _stage_payload(strategy, s) for s in lone if engine.lowered.owners[s][0] == rank}
    buf = io.BytesIO()
    torch.save({"step": step, "stages": mine}, buf)
    # NCCL sends device tensors only; the copy itself stays on the CPU
    device = strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
    out = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8).to(device)
    to, frm = (rank + 1) % world, (rank - 1) % world
    n_in = torch.zeros(1, dtype=torch.int64, device=device)
    # both sends posted before any receive is waited for, and waited for whatever the receives do:
    # a ring of blocking sends could wait on each other, and a worker whose predecessor was lost
    # must still send its successor its copy, which a survivor would otherwise wait for in vain
    # while this one went on to the next collective (a deadlock of two survivors)
    sends = [dist.isend(torch.tensor([out.numel()], device=device), to, tag=TAG), dist.isend(out, to, tag=TAG + 1)]
    try:
        _both(dist.irecv(n_in, frm, tag=TAG))
        got = torch.empty(int(n_in.item()), dtype=torch.uint8, device=device)
        _both(dist.irecv(got, frm, tag=TAG + 1))
    finally:
        _both(*sends)
    kept = torch.load(io.BytesIO(got.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
    copies.step, copies.stages = int(kept["step"]), kept["stages"]
    copies.held_bytes = sum(_nbytes(p) for p in copies.stages.values())
    copies.peak_held_bytes = max(copies.peak_held_bytes, copies.held_bytes)
    copies.exchanges += 1
    copies.sent_bytes_max = max(copies.sent_bytes_max, sum(_nbytes(p) for p in mine.values()))
    copies.seconds_total += time.monotonic() - start


def after_step(strategy: UnifiedStrategy, step: int) -> None:
    """:func:`exchange` after the optimizer step that completed ``step`` steps. A loss met here
    (outside the training step, where recovery happens) leaves the copies as they are: every
    survivor leaves the exchange (no survivor waits for another's copy: :func:`exchange`), the next
    step fails on the lost peer and recovers there, taking no copy that is not of its state
    (``tests/lightning/test_copies.py``, a loss as the exchange sends)."""
    from .recovery import recoverable

    try:
        exchange(strategy, step)
    except Exception as e:  # what is kept stays tagged with the step it is of
        if not recoverable(strategy, e):
            raise
