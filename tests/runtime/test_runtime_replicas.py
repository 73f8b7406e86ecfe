"""Replicas of a stage start equal even when ranks build their models apart (torchrun, per-rank seeds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launcher.runtime import Engine, launch, mlp_batches, reference_step, staged_mlp
from launcher.schedule import make_schedule
from launcher.torch_support.staged import StagedModel


def _train_with_per_rank_seeds() -> list[dict[str, torch.Tensor]] | None:
    # every rank draws its own initial weights; the engine must start every replica from the root's
    model = staged_mlp(4, seed=dist.get_rank())
    engine = Engine(model, make_schedule("lpp", 4, 4, G=2, R=2, order="1f1b"), lambda ps: torch.optim.SGD(ps, lr=0.1))
    engine.train_step(mlp_batches(4, seed=1))
    return engine.gather_state(0)  # tensors travel back to the launcher by value


@pytest.mark.timeout(120)
def test_replicas_start_from_the_root_owners_weights():
    state = launch(_train_with_per_rank_seeds, 4, timeout=20)[0]
    # LPP G=2 R=2: stages 0 and 2 are rooted at worker 0 (seed 0), stages 1 and 3 at worker 1 (seed 1)
    ref0, ref1 = staged_mlp(4, seed=0), staged_mlp(4, seed=1)
    stages = [ref0.stages[0], ref1.stages[1], ref0.stages[2], ref1.stages[3]]
    oracle = StagedModel(stages, ref0.loss)
    params = [p for m in oracle.stages for p in m.parameters()]
    reference_step(oracle, torch.optim.SGD(params, lr=0.1), mlp_batches(4, seed=1))
    for s, got in enumerate(state):
        for (name, want), (_, have) in zip(oracle.stages[s].named_parameters(), got.items()):
            torch.testing.assert_close(have, want.detach(), rtol=0, atol=1e-12, msg=f"stage {s} {name}")


def _ddp_with_the_end_bucket_on_gloos_ring(root_bytes: int | None) -> tuple[list[dict[str, torch.Tensor]] | None, str]:
    from launcher.runtime import groups

    if root_bytes is not None:  # 0: no bucket is small, so the one reduced at the end goes to gloo's ring
        groups.ROOT_BYTES = root_bytes
    # gloo's algorithms (on one host's CPUs "auto" reduces through shared memory: test_shared_reduce.py)
    engine = Engine(staged_mlp(4), make_schedule("ddp", 4, 4, G=4, R=1), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    transport="gloo")
    last = engine.replicas.buckets[-1]
    how = "root" if engine.replicas._by_root(last) else "ring" if last.at_end else "overlapped"
    for seed in (1, 2):  # two steps
        engine.train_step(mlp_batches(4, seed=seed))
    return engine.gather_state(0), how


@pytest.mark.timeout(120)
@pytest.mark.parametrize("root_bytes,how", [(None, "root"), (0, "ring")])
def test_ddps_end_bucket_through_a_root_or_gloos_ring_equals_one_process(root_bytes, how):
    """The bucket every owner completes only with its last job: a small one through one root, a large
    one (here: every one, ROOT_BYTES=0) on gloo's own all-reduce; both train as one process does."""
    state, used = launch(_ddp_with_the_end_bucket_on_gloos_ring, 4, root_bytes, timeout=20)[0]
    assert used == how
    oracle = staged_mlp(4)
    params = [p for m in oracle.stages for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    for seed in (1, 2):
        reference_step(oracle, opt, mlp_batches(4, seed=seed))  # steps the optimizer
    for s, got in enumerate(state):
        for (name, want), (_, have) in zip(oracle.stages[s].named_parameters(), got.items()):
            torch.testing.assert_close(have, want.detach(), rtol=0, atol=1e-12, msg=f"stage {s} {name}")
