"""The split backward (launcher.runtime.backward): ``I`` then ``W`` give exactly the gradients of
one backward, and ``W`` does not go over the input side of the graph again."""

from __future__ import annotations

import torch
from torch import nn

from launcher.models.gpt import Block
from launcher.runtime.backward import input_grads, stage_grads

F64 = torch.float64


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        Counted.calls += 1
        return g


def _both(f, x: torch.Tensor, weights: list[torch.Tensor], g: torch.Tensor | None = None):
    """(one backward's gradients, I's then W's, whether W started from the junctions)."""
    x1 = x.detach().clone().requires_grad_()
    out = f(x1)
    roots, grads = [out], (None if g is None else [g])
    want = stage_grads(roots, [x1, *weights], grads)
    x2 = x.detach().clone().requires_grad_()
    out = f(x2)
    gx, deferred = input_grads([out], None if g is None else [g], [x2], weights)
    junctions = deferred.found is not None
    return want, (*gx, *deferred.weight_grads()), junctions


def _equal(a, b, tol: float = 0.0) -> bool:
    """Equal gradients: bit for bit, or within ``tol`` where a weight's uses may add in another order."""
    return all((u is None and v is None)
               or (u is not None and v is not None and (torch.equal(u, v) if tol == 0.0
                                                        else torch.allclose(u, v, rtol=tol, atol=tol)))
               for u, v in zip(a, b, strict=True))


def test_a_transformer_block_gets_one_backwards_gradients_from_its_junctions():
    torch.manual_seed(0)
    block = Block(32, 2).to(F64)
    x, g = torch.randn(2, 8, 32, dtype=F64), torch.randn(2, 8, 32, dtype=F64)
    want, got, junctions = _both(block, x, list(block.parameters()), g)
    assert junctions and _equal(want, got)


def test_w_does_not_go_over_the_input_side_again():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4, dtype=F64), nn.Linear(4, 1, dtype=F64)

    def f(x: torch.Tensor) -> torch.Tensor:
        return b(Counted.apply(torch.tanh(a(x)))).sum()

    x = torch.randn(3, 4, dtype=F64)
    weights = [*a.parameters(), *b.parameters()]
    Counted.calls = 0
    x1 = x.clone().requires_grad_()
    gx, deferred = input_grads([f(x1)], None, [x1], weights)
    assert Counted.calls == 1 and deferred.found is not None
    wg = deferred.weight_grads()
    assert Counted.calls == 1  # taking the weights' gradient from the outputs would pass it again
    x2 = x.clone().requires_grad_()
    assert _equal(stage_grads([f(x2)], [x2, *weights], None), (*gx, *wg))


def test_a_weight_used_twice_and_one_off_the_input_side():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, dtype=F64)
    extra = nn.Parameter(torch.randn(4, dtype=F64))

    def f(x: torch.Tensor) -> torch.Tensor:  # lin twice (its junctions chained), extra joins at the output
        return (lin(torch.tanh(lin(x))) * 2 + extra.square()).sum()

    want, got, junctions = _both(f, torch.randn(3, 4, dtype=F64), [*lin.parameters(), extra])
    assert junctions and _equal(want, got, tol=1e-12)


def test_views_of_a_fetched_copy_and_the_fallbacks():
    torch.manual_seed(0)
    flat = torch.randn(20, dtype=F64, requires_grad=True)  # a fetched copy: weight 4x4 and bias 4
    w, bias = flat[:16].view(4, 4), flat[16:]
    want, got, junctions = _both(lambda x: torch.tanh(x @ w.t() + bias).sum(), torch.randn(3, 4, dtype=F64), [w, bias])
    assert junctions and _equal(want, got)
    # the output does not depend on the input: W goes from the outputs
    p = nn.Parameter(torch.randn(4, dtype=F64))
    want, got, junctions = _both(lambda x: (p * 2).sum() + 0 * x.detach().sum(), torch.randn(4, dtype=F64), [p])
    assert not junctions and _equal(want, got)
