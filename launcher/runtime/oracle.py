"""The oracle: plain single-process training of a staged model (gradient accumulation over the same
micro-batches), the small staged MLP the engine is checked on, and the engine checked against them.

Call :func:`run_cases` on every rank of a group (e.g. through :func:`~launcher.runtime.launch`):
for each :class:`Case` it trains the staged MLP with the engine and, beside it on every rank, the
oracle, and compares the stages each rank owns: the reduced gradient of every step and the
parameters after every step. Ranks at or above a case's ``W`` sit it out. Cases share the group
because starting one is expensive.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from launcher.schedule.order import Order
from launcher.schedule.run_settings import DEFAULT_RUN
from launcher.schedule.settings import DEFAULT, SCHEME_DEFAULT, make_schedule

from ..torch_support.staged import Batch, StagedModel, run_stage
from .engine import Engine

# ---- a small staged MLP, for tests and examples -------------------------------------------------


class Block(nn.Module):
    """``tanh(x W + b)``: one stage of the test MLP."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def staged_mlp(
    stages: int, width: int = 8, d_in: int = 6, d_out: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0
) -> StagedModel:
    """A chain of ``stages`` tanh layers (the last one linear) with an MSE loss; deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    mods: list[nn.Module] = []
    for s in range(stages):
        a = d_in if s == 0 else width
        z = d_out if s == stages - 1 else width
        m: nn.Module = nn.Linear(a, z) if s == stages - 1 else Block(a, z)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
        mods.append(m.to(dtype))
    return StagedModel(mods, nn.functional.mse_loss)


def mlp_batches(
    microbatches: int, size: int = 4, d_in: int = 6, d_out: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0
) -> list[Batch]:
    """``microbatches`` random (input, target) pairs of ``size`` rows each."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [
        (torch.randn(size, d_in, generator=gen, dtype=dtype), torch.randn(size, d_out, generator=gen, dtype=dtype))
        for _ in range(microbatches)
    ]


# ---- the oracle ---------------------------------------------------------------------------------


def forward_all(model: StagedModel, x: Any) -> list[Any]:
    """Outputs of every stage for one micro-batch, through the stage graph."""
    outs: list[Any] = []
    for s, m in enumerate(model.stages):
        outs.append(run_stage(m, None, model.received(s, outs, x)))
    return outs


def reference_loss(model: StagedModel, batch: Batch, microbatches: int) -> torch.Tensor:
    """One micro-batch's contribution to the step loss: the sum of its sinks' losses over ``B``."""
    x, y = batch
    outs = forward_all(model, x)
    return functools.reduce(operator.add, [model.loss(outs[s], y) for s in model.graph.sinks]) / microbatches


def reference_step(
    model: StagedModel, optimizer: torch.optim.Optimizer, microbatches: Sequence[Batch]
) -> tuple[list[torch.Tensor], float]:
    """Plain single-process training with gradient accumulation; returns per-stage flat grads and the loss."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch in microbatches:
        loss = reference_loss(model, batch, len(microbatches))
        loss.backward()
        total += float(loss.detach())
    grads = [
        torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in m.parameters()])
        if list(m.parameters())
        else torch.zeros(0)
        for m in model.stages
    ]
    optimizer.step()
    return grads, total


def flat_params(module: nn.Module) -> torch.Tensor:
    ps = [p.detach().reshape(-1) for p in module.parameters()]
    return torch.cat(ps) if ps else torch.zeros(0)


# ---- the engine against the oracle ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One schedule to check; ``placement`` (a callable) overrides ``strategy`` when given."""

    strategy: str
    G: int
    R: int
    S: int
    B: int
    order: str | Order = SCHEME_DEFAULT  # a name, or an order object (a schedule file's)
    optimizer: str = "sgd"
    split: bool = False
    weight_cache: str = DEFAULT.weight_cache
    prefetch: int = DEFAULT.prefetch
    steps: int = 3
    placement: Callable | None = field(default=None, compare=False)
    W: int | None = None  # with a custom placement
    bucket_bytes: int | None = None  # the replicas' all-reduce buckets (None: the engine's default)
    transport: str = DEFAULT_RUN.transport  # how activations and their gradients travel (the engine's ``transport``)

    @property
    def name(self) -> str:
        extra = "".join([
            "-split" if self.split else "", f"-cache_{self.weight_cache}" if self.weight_cache != "step" else "",
            f"-prefetch{self.prefetch}" if self.prefetch != 1 else "",
            f"-bucket{self.bucket_bytes}" if self.bucket_bytes is not None else "",
            f"-{self.transport}" if self.transport != DEFAULT_RUN.transport else "",
        ])
        order = self.order if isinstance(self.order, str) else self.order.name
        return f"{self.strategy}-G{self.G}R{self.R}-S{self.S}B{self.B}-{order}-{self.optimizer}{extra}"

    def make_optimizer(self, params: list) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    def schedule(self):
        if self.placement is None:
            return make_schedule(self.strategy, self.S, self.B, G=self.G, R=self.R, order=self.order,
                             split_backward=self.split)
        assert self.W is not None  # a custom placement comes with its worker count
        step = make_schedule(self.placement, self.S, self.B, order=self.order, split_backward=self.split)
        step.workers = self.W
        step.name = self.strategy
        return step


def run_case(case: Case, seed: int = 0, device: torch.device | None = None) -> dict[str, Any]:
    """This rank's result for one case: max errors against the oracle and its per-step records.
    ``device``: where the engine and the oracle compute (default: the engine's, the CPU on gloo)."""
    extra: dict[str, Any] = {} if case.bucket_bytes is None else {"bucket_bytes": case.bucket_bytes}
    if device is not None:
        extra["device"] = device
    engine = Engine(staged_mlp(case.S, seed=seed), case.schedule(), case.make_optimizer,
                    prefetch=case.prefetch, weight_cache=case.weight_cache, transport=case.transport, **extra)
    ref = staged_mlp(case.S, seed=seed)
    for m in ref.stages:
        m.to(engine.device)  # in place: the optimizer below takes these parameters
    ref_opt = case.make_optimizer([p for m in ref.stages for p in m.parameters()])
    grad_err = param_err = 0.0
    records = []
    for i in range(case.steps):
        mbs = [(x.to(engine.device), y.to(engine.device)) for x, y in mlp_batches(case.B, seed=seed * 1000 + i)]
        records.append(engine.train_step(mbs))
        grads, _ = reference_step(ref, ref_opt, mbs)
        for s in engine.owned:
            grad_err = max(grad_err, (engine.last_grads[s] - grads[s]).abs().max().item())
            param_err = max(param_err, (flat_params(engine.modules[s]) - flat_params(ref.stages[s])).abs().max().item())
    return {"case": case.name, "grad_err": grad_err, "param_err": param_err, "owned": list(engine.owned),
            "records": records}


def run_cases(cases: list[Case], seed: int = 0, device: torch.device | None = None) -> list[dict[str, Any]]:
    """:func:`run_case` for every case, in order (every rank must pass the same list)."""
    return [run_case(c, seed, device) for c in cases]
