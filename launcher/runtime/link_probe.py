"""Measure the link between two workers (a ping-pong), for the simulator's message costs.

Ranks ``a`` and ``b`` bounce a small and a large message back and forth; half a round trip of
the small one is the latency, and the large one's extra time over it gives the bandwidth. Each is
the fastest of the round trips: on shared cores a round trip can only be slowed (a peer not yet
scheduled), never sped up, so the minimum is the link and the median partly the machine's load.
Only the two ranks take part (point-to-point), so the others return at once.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from launcher.schedule.link import Link

from .comm import irecv, isend

SMALL, LARGE = 8, 1 << 20  # bytes


def measure(group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu", *, a: int = 0, b: int = 1,
            reps: int = 7, tag: int = 0) -> Link | None:
    """The link between ranks ``a`` and ``b`` of ``group`` (``None`` on other ranks, or with one rank)."""
    rank = dist.get_rank(group)
    if dist.get_world_size(group) < 2 or rank not in (a, b):
        return None
    peer = dist.get_global_rank(group, b if rank == a else a) if group is not None else (b if rank == a else a)

    def one_way(nbytes: int) -> float:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(reps + 1):  # the first round trip sets up the pair: not timed
            t = time.perf_counter()
            if rank == a:
                isend(buf, peer, tag=tag).wait()
                irecv(buf, peer, tag=tag).wait()
            else:
                irecv(buf, peer, tag=tag).wait()
                isend(buf, peer, tag=tag).wait()
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
            if i:
                times.append((time.perf_counter() - t) / 2)
        return min(times)

    small, large = one_way(SMALL), one_way(LARGE)
    latency = max(small, 1e-7)
    # the large message's extra time; should noise leave none, its whole time bounds the bandwidth
    extra = large - small if large > small else large
    return Link(latency, (LARGE - SMALL) / max(extra, 1e-9))
