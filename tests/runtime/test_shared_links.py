"""Activations and gradients through shared memory (``transport="shm"``) train exactly as over
gloo, when the step's shapes change from step to step (each direction's buffer is laid out per step
and grows), and a bad transport is one sentence before any worker links."""

from __future__ import annotations

import pytest
import torch

from launcher.models.gpt import GPT
from launcher.runtime import Engine, launch
from launcher.schedule import make_schedule
from launcher.torch_support.staged import StagedModel

LENGTHS = [8, 16, 8, 12]  # the sequence length of each step's micro-batches: buffers grow, then suffice


def _train(transport: str) -> dict[int, torch.Tensor]:
    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, seq_len=16, d_model=32, n_head=2, n_layer=2).to(torch.float64)
    engine = Engine(StagedModel(list(gpt.stages), gpt.loss),
                    make_schedule("lpp", 4, 4, G=1, R=2, order="interleaved_1f1b"),
                    lambda ps: torch.optim.SGD(ps, lr=0.1), transport=transport)
    for step, T in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(32, (4, T + 1), generator=g)
        engine.train_step([(t[None, :-1], t[None, 1:]) for t in tokens])
    return {s: torch.cat([p.detach().reshape(-1) for p in engine.modules[s].parameters()]) for s in engine.owned}


@pytest.mark.timeout(120)
def test_shared_memory_trains_as_gloo_with_shapes_changing_between_steps():
    over = {t: {s: p for rank in launch(_train, 2, t) for s, p in rank.items()} for t in ("gloo", "shm")}
    assert sorted(over["shm"]) == [0, 1, 2, 3]
    for s, p in over["gloo"].items():
        assert torch.equal(over["shm"][s], p), f"stage {s} differs between the transports"


def _refused() -> str:
    try:
        Engine(StagedModel([torch.nn.Linear(2, 2)], torch.nn.functional.mse_loss), make_schedule("ddp", 1, 1, G=1, R=1),
               transport="tcp")
    except ValueError as e:
        return str(e)
    return ""


def test_an_unknown_transport_is_one_sentence():
    assert launch(_refused, 1)[0] == "transport='tcp' is invalid: use one of auto, gloo, shm"


def _came() -> list:
    """Worker 1 sends message 0 at once and message 1 after 0.3 s; worker 0 asks for message 0
    after 0.15 s (it came long before) and then for message 1 (it waits about 0.15 s for it)."""
    import time

    import torch.distributed as dist

    from launcher.runtime.shared_links import SharedLinks, new_token

    token = [new_token()]
    dist.broadcast_object_list(token, src=0)
    me = dist.get_rank()
    links = SharedLinks(token[0], me, [1 - me], None)
    links.begin_step([(0, 1, 0, 8 * 64), (1, 1, 0, 8 * 64)])
    dist.barrier()
    if me == 1:
        sends = [links.send(0, 0, torch.arange(64, dtype=torch.float64))]
        time.sleep(0.3)
        sends.append(links.send(1, 0, torch.arange(64, dtype=torch.float64) + 1))
        for s in sends:
            s.wait()
        return []
    time.sleep(0.15)
    out = []
    for mid in (0, 1):
        into = torch.empty(64, dtype=torch.float64)
        recv = links.recv(mid, 1, into)
        asked = time.perf_counter()
        recv.wait()
        out.append((None if recv.came is None else recv.came - asked, float(into[0])))
    return out


@pytest.mark.timeout(120)
def test_a_message_read_after_it_came_was_not_waited_for():
    # the copy out of the shared buffer is the receiver's work: timed as a wait, a message that
    # sat in its slot while its receiver computed counted as a slow message (metrics.json's comm_s
    # took the time it sat there, 3.7 ms where a waiting receiver had its data after 0.15 ms)
    (early, e0), (late, l0) = launch(_came, 2)[0]
    assert early is None and e0 == 0.0  # there before it was asked for: no wait
    assert late is not None and 0.05 < late < 0.3 and l0 == 1.0  # waited for until it came
