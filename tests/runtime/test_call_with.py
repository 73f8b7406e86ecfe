"""A stage called on fetched weights (launcher.torch_support.staged.call_with) computes what
torch.func.functional_call computes, and leaves the module as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from launcher.torch_support.staged import call_with


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # one parameter under two names
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)) * self.scale + shift)


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _other(module: nn.Module, drop: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {n: torch.randn_like(p, requires_grad=True) for n, p in module.named_parameters() if n != drop}


@pytest.mark.parametrize("drop", [None, "block.0.bias"])
def test_the_same_outputs_and_gradients_as_functional_call(drop):
    torch.manual_seed(0)
    m, ids = Tied(), torch.randint(0, 10, (3, 5))
    before = {n: id(p) for n, p in m.named_parameters(remove_duplicate=False)}
    ours, theirs = _other(m, drop), _other(m, drop)
    a = call_with(m, ours, (ids,), {"shift": 0.5})
    b = functional_call(m, theirs, (ids,), {"shift": 0.5})
    assert torch.equal(a, b)
    a.square().sum().backward()
    b.square().sum().backward()
    for n in ours:
        assert torch.equal(ours[n].grad, theirs[n].grad), n
    # the module's own parameters are back, the tie included, and got no gradient
    assert {n: id(p) for n, p in m.named_parameters(remove_duplicate=False)} == before
    assert m.head.weight is m.emb.weight
    assert (m.block[0].bias.grad is not None) == (drop is not None)  # a name left out keeps the module's own


def test_a_parametrized_module_and_an_error_leave_the_module_as_it_was():
    torch.manual_seed(0)
    m = nn.Linear(3, 3)
    parametrize.register_parametrization(m, "weight", Symmetric())
    x, w = torch.randn(2, 3), _other(m)
    assert torch.equal(call_with(m, w, (x,), {}), functional_call(m, w, (x,)))
    before = {n: id(p) for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError):
        call_with(m, w, (torch.randn(2, 5),), {})  # the wrong width fails inside the forward
    assert {n: id(p) for n, p in m.named_parameters()} == before
