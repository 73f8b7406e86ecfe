"""The engine's point-to-point all-reduce (through a root) on real gloo workers: the exact sum of
every member's buffer, the same bits on every member, for member sets that are and are not powers
of two, on a subset of the ranks, and for buffers shorter than the member count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launcher.runtime import launch
from launcher.runtime.collectives import through_root

SIZES = [1, 2, 3, 7, 1000]
MEMBERS = [[0, 1], [0, 1, 2], [0, 1, 2, 3, 4], [0, 2, 3, 4]]


def _run(sizes: list[int], members_list: list[list[int]]) -> list[tuple]:
    """On every rank: for each member set, algorithm and size, the error against the sum and the bits."""
    rank, out = dist.get_rank(), []
    for m, members in enumerate(members_list):
        for a, algorithm in enumerate((through_root,)):
            for k, n in enumerate(sizes):
                torch.manual_seed(1000 * rank + 10 * k + m)
                x = torch.randn(n, dtype=torch.float64)
                every = [torch.empty_like(x) for _ in range(dist.get_world_size())]
                dist.all_gather(every, x)
                if rank in members:
                    algorithm(x, members, members.index(rank), lambda r, key=(m, a, k): hash(key) % 10_000 * 16 + r)
                    exact = torch.stack([every[i] for i in members]).sum(0)
                    out.append((m, a, k, float((x - exact).abs().max()), x.tolist()))
    return out


@pytest.mark.timeout(120)
def test_point_to_point_all_reduces_sum_exactly_and_agree_bit_for_bit():
    per_rank = launch(_run, 5, SIZES, MEMBERS, timeout=20, deadline=100)
    results: dict[tuple, list] = {}
    for rows in per_rank:
        for m, a, k, err, bits in rows:
            assert err < 1e-12, f"members {MEMBERS[m]} algorithm {a} size {SIZES[k]}: error {err}"
            results.setdefault((m, a, k), []).append(bits)
    assert len(results) == len(MEMBERS) * len(SIZES)
    for key, copies in results.items():
        assert len(copies) == len(MEMBERS[key[0]])
        assert all(c == copies[0] for c in copies), f"members disagree on {key}"
