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
