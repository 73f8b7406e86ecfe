"""Check the engine against plain single-process training, many schedules in one process group.

Call :func:`run_cases` on every rank of a group (e.g. through :func:`~launcher.runtime.launch`):
for each :class:`Case` it trains the staged MLP with the engine and, beside it on every rank, the
oracle (one process, gradient accumulation over the same micro-batches), and compares the stages
each rank owns: the reduced gradient of every step and the parameters after every step. Ranks at
or above a case's ``W`` sit it out. Cases share the group because starting one is expensive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from launcher.schedule.settings import DEFAULT, make_step

from .model import flat_params, mlp_batches, reference_step, staged_mlp
from .worker import Engine


@dataclass(frozen=True)
class Case:
    """One schedule to check; ``placement`` (a callable) overrides ``strategy`` when given."""

    strategy: str
    G: int
    R: int
    S: int
    B: int
    order: str = DEFAULT.order_name
    optimizer: str = "sgd"
    split: bool = False
    weight_cache: str = DEFAULT.weight_cache
    prefetch: int = DEFAULT.prefetch
    steps: int = 3
    placement: Callable | None = field(default=None, compare=False)
    W: int | None = None  # with a custom placement
    bucket_bytes: int | None = None  # the replicas' all-reduce buckets (None: the engine's default)

    @property
    def name(self) -> str:
        extra = "".join([
            "-split" if self.split else "", f"-cache_{self.weight_cache}" if self.weight_cache != "step" else "",
            f"-prefetch{self.prefetch}" if self.prefetch != 1 else "",
            f"-bucket{self.bucket_bytes}" if self.bucket_bytes is not None else "",
        ])
        return f"{self.strategy}-G{self.G}R{self.R}-S{self.S}B{self.B}-{self.order}-{self.optimizer}{extra}"

    def make_optimizer(self, params: list) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    def schedule(self):
        if self.placement is None:
            return make_step(self.strategy, self.S, self.B, G=self.G, R=self.R, order=self.order,
                             split_backward=self.split)
        assert self.W is not None  # a custom placement comes with its worker count
        step = make_step(self.placement, self.S, self.B, order=self.order, split_backward=self.split)
        step.workers = self.W
        step.name = self.strategy
        return step


def run_case(case: Case, seed: int = 0) -> dict[str, Any]:
    """This rank's result for one case: max errors against the oracle and its per-step records."""
    extra: dict[str, Any] = {} if case.bucket_bytes is None else {"bucket_bytes": case.bucket_bytes}
    engine = Engine(staged_mlp(case.S, seed=seed), case.schedule(), case.make_optimizer,
                    prefetch=case.prefetch, weight_cache=case.weight_cache, **extra)
    ref = staged_mlp(case.S, seed=seed)
    ref_opt = case.make_optimizer([p for m in ref.stages for p in m.parameters()])
    grad_err = param_err = 0.0
    records = []
    for i in range(case.steps):
        mbs = mlp_batches(case.B, seed=seed * 1000 + i)
        records.append(engine.train_step(mbs))
        grads, _ = reference_step(ref, ref_opt, mbs)
        for s in engine.owned:
            grad_err = max(grad_err, (engine.last_grads[s] - grads[s]).abs().max().item())
            param_err = max(param_err, (flat_params(engine.modules[s]) - flat_params(ref.stages[s])).abs().max().item())
    return {"case": case.name, "grad_err": grad_err, "param_err": param_err, "owned": list(engine.owned),
            "records": records}


def run_cases(cases: list[Case], seed: int = 0) -> list[dict[str, Any]]:
    """:func:`run_case` for every case, in order (every rank must pass the same list)."""
    return [run_case(c, seed) for c in cases]
