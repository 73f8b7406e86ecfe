"""The runtime's edges: a hung worker is named within the timeout, ranks given different
micro-batches are refused, a bad model is one sentence per problem before any worker starts, and
the engine computes with the caller's own stage modules without touching the caller's list."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launcher.runtime import Engine, WorkerFailed, launch, mlp_batches, staged_mlp
from launcher.runtime.failure import hang_message
from launcher.schedule import make_schedule
from launcher.torch_support.checks import ModelError, model_errors
from launcher.torch_support.staged import StagedModel

TIMEOUT = 3.0
#: the watchdog's timeout, its grace and the launcher's second, plus start-up and a loaded machine
BOUND = TIMEOUT + 0.75 + 1.0 + 8.0


def _hang(where: str) -> None:
    rank = dist.get_rank()
    engine = Engine(staged_mlp(4), make_schedule("gpipe", 4, 4, G=1, R=4), lambda ps: torch.optim.SGD(ps, lr=0.1))
    if where == "job" and rank == 1:
        stage, inner = engine.modules[1], engine.modules[1].forward

        def forward(x):
            if engine.steps == 2:
                time.sleep(600)  # neither raises nor dies
            return inner(x)

        stage.forward = forward
    for i in range(3):
        if where == "data" and rank == 2 and i == 1:
            time.sleep(600)  # a data function stuck on one rank, between steps
        engine.train_step(mlp_batches(4, seed=i))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where, rank, job", [("job", 1, "F(1,"), ("data", 2, "no job (between steps)")])
def test_a_hung_worker_is_named_within_the_timeout(where, rank, job):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        launch(_hang, 4, where, timeout=TIMEOUT)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert msg.startswith(f"rank {rank} failed while running {job}"), msg
    assert "it hung: no progress for 3 s while ranks" in msg, msg
    assert took < BOUND + 4.0, took  # + the first step and start-up


def test_the_hang_rule_needs_a_waiter_and_names_the_one_that_does_not_wait():
    # nobody waits (every rank busy outside the engine, however long): not a hang
    assert hang_message({0: (5, False, ""), 1: (7, False, "")}, 3.0) is None
    assert hang_message({0: (5, True, "F(0,1) of step 2"), 1: (7, False, "F(1,0) of step 2"),
                         2: (1, True, "B(2,0) of step 2")}, 3.0) == (
        "rank 1 failed while running F(1,0) of step 2: it hung: no progress for 3 s while ranks 0, 2 waited for it")


def _different_batches() -> None:
    engine = Engine(staged_mlp(4), make_schedule("lpp", 4, 4, G=2, R=2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    rank = dist.get_rank()
    engine.train_step(mlp_batches(4, seed=0 if rank in (0, 2) else rank))


@pytest.mark.timeout(120)
def test_ranks_given_different_microbatches_are_refused():
    with pytest.raises(WorkerFailed) as e:
        launch(_different_batches, 4, timeout=10.0)
    assert "BatchMismatch: every rank must be given the same micro-batches, but the input of micro-batch 0 " \
           "on ranks 1, 3 differs from rank 0's (values)" in str(e.value)


def _different_on_step_2(every: int) -> int:
    engine = Engine(staged_mlp(4), make_schedule("lpp", 4, 4, G=2, R=2), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    check_batches=every)
    engine.train_step(mlp_batches(4, seed=0))
    engine.train_step(mlp_batches(4, seed=0 if dist.get_rank() in (0, 2) else 1))
    return engine.steps


@pytest.mark.timeout(120)
def test_the_batch_check_runs_on_step_1_then_every_n_steps():
    # every 2 steps: step 2's different batches are found
    with pytest.raises(WorkerFailed, match="differs from rank 0's"):
        launch(_different_on_step_2, 4, 2, timeout=10.0)
    # every 3 steps: step 2 is not checked (the default checks step 1, then every CHECK_EVERY)
    assert launch(_different_on_step_2, 4, 3, timeout=10.0) == [2, 2, 2, 2]


def _keeps_the_callers_modules() -> dict:
    model = staged_mlp(4)
    mine = list(model.stages)
    engine = Engine(model, make_schedule("lpp", 4, 4, G=1, R=2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    engine.train_step(mlp_batches(4))
    stepped = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    return {
        "same_list": all(a is b for a, b in zip(model.stages, mine)),
        "none_meta": all(not p.is_meta for m in model.stages for p in m.parameters()),
        "owned_by_reference": all(engine.modules[s] is mine[s] for s in engine.owned),
        "optimizer_steps_them": stepped == {id(p) for s in engine.owned for p in mine[s].parameters()},
    }


@pytest.mark.timeout(120)
def test_the_engine_computes_with_the_callers_modules_and_leaves_the_list_alone():
    for r in launch(_keeps_the_callers_modules, 2, timeout=10.0):
        assert r == {"same_list": True, "none_meta": True, "owned_by_reference": True, "optimizer_steps_them": True}


class _Tuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x), x


class _Object(_Tuple):
    """Returns something no stage can pass on."""

    def forward(self, x):
        return self.lin(x), object()


def test_model_problems_are_one_sentence_each_naming_the_stage():
    good = staged_mlp(4)
    assert model_errors(good, 4, torch.zeros(2, 6, dtype=torch.float64)) == []
    assert model_errors(nn.Linear(2, 2), 4) == [
        "the model is a Linear, not a StagedModel; build one with StagedModel(stages, loss), stages being a list "
        "of torch.nn.Module."]
    assert model_errors(good, 3) == [
        "the model has 4 stages but the step has stages=3; cut the model into 3 stages or set stages=4."]
    with pytest.raises(ModelError) as e:  # buffers (BatchNorm) are fine
        StagedModel([nn.BatchNorm1d(3), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, dtype=torch.float64)), "x"],
                    nn.functional.mse_loss)
    assert e.value.sentences == [
        "stage 1 (Sequential) mixes parameter dtypes ['torch.float32', 'torch.float64']; use one dtype per stage.",
        "stage 2 is a str, not a torch.nn.Module.",
    ]
    # a tuple passes on (into the next stage's arguments); an object does not
    tupled = StagedModel([_Tuple(), *staged_mlp(2, d_in=8).stages], nn.functional.mse_loss)
    assert model_errors(tupled, 3, torch.zeros(2, 6, dtype=torch.float64)) == [
        "stage 1 (Block) raised TypeError on an input of shape (2, 6): Block.forward() takes 2 positional arguments "
        "but 3 were given."]
    objected = StagedModel([_Object(), *staged_mlp(2, d_in=8).stages], nn.functional.mse_loss)
    assert model_errors(objected, 3, torch.zeros(2, 6, dtype=torch.float64)) == [
        "stage 0 (_Object) returned a tuple of 2 holding a object on an input of shape (2, 6); a stage returns "
        "tensors, or tuples, lists and dicts of tensors and constants."]
    # the engine re-checks what StagedModel checked: stages changed after construction
    good.stages[2] = nn.Linear(8, 8)
    good.stages[2].bias.data = good.stages[2].bias.data.double()
    assert model_errors(good, 4)[0].startswith("stage 2 (Linear) mixes parameter dtypes")
