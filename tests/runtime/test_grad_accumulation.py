"""Gradient accumulation over micro-batches: after a stage's first micro-batch, autograd adds each
weight's gradient into the stage's total during the backward (``stage_grads_into``), and the
totals are those of plain PyTorch's accumulation, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from launcher.models.gpt import GPT, Block
from launcher.runtime import Engine, launch
from launcher.runtime.backward import stage_grads, stage_grads_into
from launcher.runtime.oracle import reference_step
from launcher.schedule import make_schedule
from launcher.torch_support.staged import StagedModel


def test_a_blocks_weight_gradients_are_added_into_the_given_tensors():
    torch.manual_seed(0)
    block = Block(32, 2)
    weights = list(block.parameters())
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    x1 = x.clone().requires_grad_()
    want = stage_grads([block(x1)], [x1, *weights], [g])
    prior = [torch.randn_like(w) for w in weights]
    into = [p.clone() for p in prior]
    x2 = x.clone().requires_grad_()
    (gx,) = stage_grads_into([block(x2)], [x2], weights, into, [g])
    assert torch.equal(gx, want[0])
    assert all(torch.equal(t, p + w) for t, p, w in zip(into, prior, want[1:], strict=True))
    assert all(w.grad is None for w in weights) and x2.grad is None  # nothing left behind


def _gpt() -> tuple[StagedModel, list]:
    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, seq_len=8, d_model=32, n_head=2, n_layer=2).to(torch.float64)
    model = StagedModel(list(gpt.stages), gpt.loss)
    torch.manual_seed(1)
    tokens = torch.randint(32, (3, 9))
    return model, [(t[None, :-1], t[None, 1:]) for t in tokens]


def _totals(S: int, hooked: bool) -> tuple[list[torch.Tensor], int]:
    model, mbs = _gpt()
    calls = []
    if hooked:
        next(model.stages[1].parameters()).register_post_accumulate_grad_hook(calls.append)
    engine = Engine(model, make_schedule("lpp", S, len(mbs), G=1, R=1), lambda ps: torch.optim.SGD(ps, lr=0.1))
    params = [p for m in model.stages for p in m.parameters()]
    mark = params[0].grad = torch.ones_like(params[0])  # a user's .grad from before the step
    engine.compute_step(mbs)
    # the backwards pointed the weights' .grad at the stages' totals only while the step ran
    assert params[0].grad is mark and all(p.grad is None for p in params[1:])
    return [engine.last_grads[s].clone() for s in range(S)], len(calls)


@pytest.mark.parametrize("hooked", [False, True])
def test_the_engines_totals_are_plain_accumulation(hooked):
    """One worker runs every micro-batch of every stage: the first micro-batch's gradients start
    the totals, the others are added during their backward. A weight with a hook on its
    accumulation keeps the separate add (the hook is not run mid-step: the user's ``.grad`` is the
    step's total, set after the reduction)."""
    model, mbs = _gpt()
    plain = copy.deepcopy(model)
    want, _ = reference_step(plain, torch.optim.SGD([p for m in plain.stages for p in m.parameters()], lr=0.1), mbs)
    (got, calls), = launch(_totals, 1, len(model.stages), hooked)
    assert calls == 0
    assert all(torch.allclose(g, w, rtol=1e-12, atol=1e-12) for g, w in zip(got, want, strict=True))
