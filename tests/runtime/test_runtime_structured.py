"""Stages that pass more than one tensor, on real workers, against single-process training.

The toy model has what third-party models bring: a dict micro-batch input with integer ids, a
tuple and a dict between stages, integer tensors travelling forward only, a skip connection that
goes straight from stage 0 to stage 3 (``picks``), a parameter shared by the first and last stage
(tied embeddings), BatchNorm running statistics and a constant buffer. Every scheme must give the
gradients, parameters and running statistics of one process running the same micro-batches in
order (float64).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from launcher.runtime import Engine, launch, merge
from launcher.runtime.oracle import flat_params, reference_step
from launcher.schedule import make_schedule
from launcher.schedule.graph import StageGraph
from launcher.torch_support.staged import StagedModel

ATOL = 1e-10
D, V = 6, 11
GRAPH = StageGraph(((), (0,), (1,), (2, 0)))  # stage 0's skip value goes straight to stage 3


class Embed(nn.Module):
    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table
        self.lin = nn.Linear(D, D)
        self.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64))  # a constant buffer

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        h = torch.tanh(self.lin(x)) + self.table[ids] * self.scale
        return h, ids, {"skip": h * 2}


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, ids: torch.Tensor):
        return torch.tanh(self.lin(self.bn(h))), (ids + 1) % V


class Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * (1.0 + ids.unsqueeze(-1).to(h.dtype) / V)


class Head(nn.Module):
    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table  # tied with the embedding's

    def forward(self, h: torch.Tensor, extra: dict) -> torch.Tensor:
        return (h + extra["skip"]) @ self.table.t()


def structured(seed: int = 0) -> StagedModel:
    torch.manual_seed(seed)
    table = nn.Parameter(torch.randn(V, D, dtype=torch.float64) / 3)
    stages = [Embed(table), Norm(), Mid(), Head(table)]
    for m in stages:
        m.double()
    return StagedModel(stages, lambda logits, y: nn.functional.cross_entropy(logits, y),
                       graph=GRAPH, picks={(0, 1): (0, 1), (0, 3): (2,)})


def batches(B: int, step: int, n: int = 3) -> list:
    g = torch.Generator().manual_seed(100 + step)
    return [({"x": torch.randn(n, D, generator=g, dtype=torch.float64), "ids": torch.randint(0, V, (n,), generator=g)},
             torch.randint(0, V, (n,), generator=g)) for _ in range(B)]


CASES = [("ddp", 4, 1, 4), ("fsdp", 4, 1, 4), ("gpipe", 1, 4, 4), ("lpp", 2, 2, 4), ("fslpp", 2, 2, 4)]


def run(scheme: str, G: int, R: int, B: int, cache: str) -> dict:
    model = structured()
    ref = copy.deepcopy(model)
    ref.stages[3].table = ref.stages[0].table  # deepcopy of the list keeps the tie; make sure
    engine = Engine(model, make_schedule(scheme, 4, B, G=G, R=R, graph=GRAPH), lambda ps: torch.optim.Adam(ps, lr=0.01),
                    weight_cache=cache)
    ref_opt = torch.optim.Adam([p for p in dict.fromkeys(p for m in ref.stages for p in m.parameters())], lr=0.01)
    grad_err = param_err = stat_err = 0.0
    records = []
    for step in range(3):
        mbs = batches(B, step)
        records.append(engine.train_step(mbs))
        grads, _ = reference_step(ref, ref_opt, mbs)
        for s in engine.owned:
            grad_err = max(grad_err, (engine.last_grads[s] - grads[s]).abs().max().item())
            param_err = max(param_err, (flat_params(engine.modules[s]) - flat_params(ref.stages[s])).abs().max().item())
        for s in range(4):  # every worker holds every stage's running statistics
            for a, b in zip(engine.stages[s].buffers(), ref.stages[s].buffers()):
                stat_err = max(stat_err, (a.double() - b.double()).abs().max().item())
    loss, _ = engine.evaluate(batches(B, 9))
    return {"grad_err": grad_err, "param_err": param_err, "stat_err": stat_err, "records": records, "eval": loss}


@pytest.mark.parametrize("cache", ["step", "job"])
@pytest.mark.parametrize("scheme,G,R,B", CASES, ids=[c[0] for c in CASES])
def test_structured_stages_equal_one_process(scheme: str, G: int, R: int, B: int, cache: str) -> None:
    out = launch(run, 4, scheme, G, R, B, cache)
    for r in out:
        assert r["grad_err"] < ATOL and r["param_err"] < ATOL and r["stat_err"] < ATOL, (scheme, r)
    # evaluation in eval mode (running statistics) matches one process
    ref = structured()
    ref_opt = torch.optim.Adam(list(dict.fromkeys(p for m in ref.stages for p in m.parameters())), lr=0.01)
    for step in range(3):
        reference_step(ref, ref_opt, batches(B, step))
    for m in ref.stages:
        m.eval()
    from launcher.runtime.oracle import reference_loss

    with torch.no_grad():
        want = sum(float(reference_loss(ref, mb, B)) for mb in batches(B, 9))
    assert abs(sum(r["eval"] for r in out) - want) < ATOL
    # measured message counts equal the plan's
    record = merge([r["records"][-1] for r in out])
    for key, v in record["per_worker"].items():
        if isinstance(v, dict) and "predicted" in v and key in ("act_recv", "grad_recv", "weights_recv"):
            assert v["predicted"] == v["measured"], key


class Frozen(nn.Module):
    """A stage whose dropout the user put in eval mode while the stage itself trains."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.drop = nn.Dropout(0.5).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x)))


def _frozen_parts() -> dict:
    torch.manual_seed(0)
    stages = [Frozen(), Frozen()]
    model = StagedModel(stages, lambda out, y: ((out - y) ** 2).mean())
    ref = copy.deepcopy(model)
    # fsdp: every worker computes both stages on fetched weights, with the engine's copies of them
    engine = Engine(model, make_schedule("fsdp", 2, 2, G=2, R=1), lambda ps: torch.optim.SGD(ps, lr=0.1))
    g = torch.Generator().manual_seed(5)
    mbs = [(torch.randn(3, D, generator=g, dtype=torch.float64), torch.randn(3, D, generator=g, dtype=torch.float64))
           for _ in range(2)]
    engine.train_step(mbs)
    grads, _ = reference_step(ref, torch.optim.SGD([p for m in ref.stages for p in m.parameters()], lr=0.1), mbs)
    err = max((engine.last_grads[s] - grads[s]).abs().max().item() for s in engine.owned)
    engine.evaluate(mbs)
    modes = [(m.training, m.drop.training) for m in model.stages]
    return {"err": err, "modes": modes}


def test_a_submodule_in_eval_mode_stays_so_on_every_copy() -> None:
    # the engine's copies of a stage follow the user's modules submodule by submodule (a dropout
    # in eval mode drops nothing: the gradients are one process's), and evaluate() puts every
    # submodule back as it was, not all to the stage's own mode
    for r in launch(_frozen_parts, 2):
        assert r["err"] < ATOL, r
        assert r["modes"] == [(True, False), (True, False)], r
