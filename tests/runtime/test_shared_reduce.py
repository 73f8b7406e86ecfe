"""The replicas' gradient all-reduce through shared memory (``transport="shm"``, and ``auto`` on one
host's CPUs): several buckets, every owner bit-identical, bit-equal to gloo's where the sum has one
order (two owners), equal to one process, and a peer killed inside the reduce is a lost peer."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from launcher.runtime import Engine, WorkerFailed, launch, mlp_batches, reference_step, staged_mlp
from launcher.runtime.shared_reduce import chunks
from launcher.schedule import make_schedule

# (scheme, G, R): ddp on 2 and 3 workers, lpp with two replicas of each of two pipelines
CASES = [("ddp", 2, 1), ("ddp", 3, 1), ("lpp", 2, 2)]
BUCKET_BYTES = 200  # a stage of staged_mlp(4) holds 216 to 576 bytes: a bucket per stage


def _train(scheme: str, G: int, R: int, transport: str) -> tuple[dict[int, torch.Tensor], int, bool]:
    B = G if scheme == "ddp" else 4
    engine = Engine(staged_mlp(4), make_schedule(scheme, 4, B, G=G, R=R), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    transport=transport, bucket_bytes=BUCKET_BYTES)
    for seed in (1, 2):  # two steps: the buffers are reused
        engine.train_step(mlp_batches(B, seed=seed))
    params = {s: torch.cat([p.detach().reshape(-1) for p in engine.modules[s].parameters()]) for s in engine.owned}
    return params, len(engine.replicas.buckets), engine.replicas.shm is not None


def _oracle(B: int) -> list[torch.Tensor]:
    oracle = staged_mlp(4)
    opt = torch.optim.SGD([p for m in oracle.stages for p in m.parameters()], lr=0.1)
    for seed in (1, 2):
        reference_step(oracle, opt, mlp_batches(B, seed=seed))
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in oracle.stages]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheme,G,R", CASES)
def test_shared_reduce_equals_gloo_and_one_process(scheme, G, R):
    W = G * R
    runs = {t: launch(_train, W, scheme, G, R, t, timeout=60) for t in ("gloo", "shm")}
    assert all(shm for _, _, shm in runs["shm"]) and not any(shm for _, _, shm in runs["gloo"])
    assert all(n >= 2 for _, n, _ in runs["shm"]), "the test wants several buckets per worker"
    want = _oracle(G if scheme == "ddp" else 4)
    for t, ranks in runs.items():
        for s, ref in enumerate(want):
            copies = [params[s] for params, _, _ in ranks if s in params]
            assert len(copies) == (W if scheme == "ddp" else G)
            for c in copies[1:]:  # every owner the same bits
                assert torch.equal(c, copies[0]), f"{t}: the owners of stage {s} differ"
            torch.testing.assert_close(copies[0], ref, rtol=0, atol=1e-12, msg=f"{t}: stage {s}")
    if G == 2:  # two owners: a + b either way, so the same bits as gloo's ring
        for (a, _, _), (b, _, _) in zip(runs["gloo"], runs["shm"]):
            for s in a:
                assert torch.equal(a[s], b[s]), f"stage {s} differs between the transports"


def test_chunks_cover_the_bucket():
    assert chunks(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunks(2, 3) == [(0, 1), (1, 2), (2, 2)]


def _killed_inside_the_reduce(tmp: str) -> None:
    """Worker 2 of a ddp group of 3 dies inside its shared reduce of step 2, once it has said its
    first bucket's share is complete; the others wait for its sum there."""
    import torch.distributed as dist

    from launcher.runtime import shared_reduce

    Path(tmp, f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
    engine = Engine(staged_mlp(4), make_schedule("ddp", 4, 3, G=3, R=1), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    transport="shm", bucket_bytes=BUCKET_BYTES)
    engine.train_step(mlp_batches(3, seed=1))
    if dist.get_rank() == 2:
        share = shared_reduce.SharedReduce.share

        def share_then_die(self: shared_reduce.SharedReduce, k: int) -> None:
            share(self, k)
            os.kill(os.getpid(), signal.SIGKILL)

        shared_reduce.SharedReduce.share = share_then_die  # type: ignore[method-assign]
    engine.train_step(mlp_batches(3, seed=2))


@pytest.mark.timeout(120)
def test_a_worker_killed_inside_the_shared_reduce_is_a_lost_peer(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        launch(_killed_inside_the_reduce, 3, str(tmp_path), timeout=4.0, deadline=60)
    err = info.value
    assert "rank 2 failed" in str(err) and "SIGKILL" in str(err), str(err)
    for r in (0, 1):  # the survivors name it too: their waits ended on the lost peer
        assert "rank 2 failed" in err.errors.get(r, ""), f"rank {r} reported {err.errors.get(r)!r}"
    for r in range(3):  # nothing left behind
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid-{r}").read_text()), 0)
