"""Torch's own schedules as CSV, written by ``torch.distributed.pipelining`` itself without a process
group: a schedule class's ``pipeline_order`` (its ``_calculate_single_rank_operations``), and, for
the full CSV, that order lowered by torch's own passes, as ``_prepare_schedule_with_comms`` does."""

from __future__ import annotations

import types
from pathlib import Path

from torch.distributed.pipelining import schedules as pipelining

KINDS = ("bfs", "interleaved", "zbv")  # looped breadth-first (GPipe at one stage per rank), interleaved 1F1B, ZB-V


def stage_to_rank(kind: str, ranks: int, S: int) -> dict[int, int]:
    """Torch's stage-to-rank map: looped, or V-shaped for ZB-V."""
    return {s: (s if s < ranks else S - 1 - s) if kind == "zbv" else s % ranks for s in range(S)}


def torch_order(kind: str, ranks: int, per_rank: int, B: int) -> dict[int, list]:
    """``pipeline_order`` of torch's own schedule class for ``kind``."""
    S = ranks * per_rank
    order = {}
    for rank in range(ranks):
        if kind == "interleaved":
            rounds = max(1, B // ranks)
            sched = types.SimpleNamespace(n_local_stages=per_rank, microbatches_per_round=B // rounds,
                                          pp_group_size=ranks, _n_microbatches=B)
            order[rank] = pipelining.ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, rank)
        elif kind == "zbv":
            sched = types.SimpleNamespace(pp_group_size=ranks, num_stages=S, _n_microbatches=B)
            order[rank] = pipelining.ScheduleZBVZeroBubble._calculate_single_rank_operations(sched, rank)
        else:
            sched = types.SimpleNamespace(_stages=[None] * per_rank, pp_group_size=ranks, _n_microbatches=B,
                                          stage_index_to_group_rank=stage_to_rank(kind, ranks, S))
            order[rank] = pipelining.ScheduleLoopedBFS._calculate_single_rank_operations(sched, rank)
    return order


def torch_full_order(kind: str, ranks: int, per_rank: int, B: int) -> dict[int, list]:
    """``pipeline_order_with_comms``: torch's order lowered by torch's passes (UNSHARD/RESHARD,
    REDUCE_GRAD, then SEND/RECV), in the order ``_prepare_schedule_with_comms`` runs them."""
    order, to_rank = torch_order(kind, ranks, per_rank, B), stage_to_rank(kind, ranks, ranks * per_rank)
    full = {r: pipelining._add_reduce_grad(pipelining._add_unshard_reshard(order[r]), B) for r in order}
    return pipelining._add_send_recv(full, stage_to_rank=to_rank.__getitem__, num_stages=ranks * per_rank)


def dump_torch_csv(path: Path, kind: str, ranks: int, per_rank: int, B: int, comms: bool = False) -> Path:
    """Torch's ``_dump_csv`` of its schedule ``kind``: ``compute_only``, or with ``comms`` the full
    (``compute_comms``) CSV of its lowered schedule."""
    if comms:
        fake = types.SimpleNamespace(pipeline_order_with_comms=torch_full_order(kind, ranks, per_rank, B))
        pipelining._PipelineScheduleRuntime._dump_csv(fake, str(path), format="compute_comms")
    else:
        fake = types.SimpleNamespace(pipeline_order=torch_order(kind, ranks, per_rank, B))
        pipelining.PipelineScheduleMulti._dump_csv(fake, str(path))
    return path
