"""Losses that average over a data-dependent count (labelled tokens, masked positions, rows of a
last batch that does not divide): a step under a scheme equals one device's step on the whole
batch (float64, within 1e-10), not a mean of the micro-batches' means.

- the engine (Python API) with counts it is given, counts of rows, and a micro-batch with none;
- ``model=hf`` on right-padded batches (labels -100 on the padding) through the command line;
- a BERT masked LM in a user's LightningModule, traced (``split=auto``), on dict batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from launcher.runtime import Engine, StagedModel, launch
from launcher.runtime.items import shares
from launcher.runtime.model import flat_params, staged_mlp
from launcher.schedule import make_step

ATOL = 1e-10


# ---- the engine -----------------------------------------------------------------------------


def masked_mse(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean squared error over the rows ``mask`` keeps: a mean over a count the data decides."""
    y, mask = target
    return (((out - y) ** 2).sum(-1) * mask).sum() / mask.sum()


def _batch(rows: int, step: int, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=gen, dtype=torch.float64)
    mask = torch.zeros(rows, dtype=torch.float64)
    mask[keep] = 1.0
    return x, y, mask


def _forward(model: StagedModel, x: torch.Tensor) -> torch.Tensor:
    for m in model.stages:
        x = m(x)
    return x


def _one_device(model: StagedModel, opt: torch.optim.Optimizer, x: torch.Tensor, target: object,
                loss_fn) -> tuple[list[torch.Tensor], float]:
    """The oracle: one forward and backward over the whole batch, then the optimizer step."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(_forward(model, x), target)
    loss.backward()
    grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in model.stages]
    opt.step()
    return grads, float(loss.detach())


#: (scheme, G, R, options): every path a loss stage's loss takes (a kept graph, a forward
#: recomputed on freshly fetched weights under weight_cache=job, the split backward's I and W)
CASES = [("ddp", 4, 1, {}), ("fsdp", 4, 1, {"weight_cache": "job"}), ("gpipe", 1, 4, {"split_backward": True}),
         ("lpp", 2, 2, {}), ("fslpp", 2, 2, {"split_backward": True})]
#: per step: the batch's rows, the rows the mask keeps (micro-batches of 4, 4, 3, 3 rows hold
#: 3, 1, 2 and 0 kept rows in step 0: one has nothing to average over, so its mean is NaN)
STEPS = [(14, [0, 1, 3, 6, 9, 10]), (14, [0, 2, 4, 5, 7, 8, 9, 11, 12, 13]), (13, [1, 2, 3, 4, 5, 6, 7, 8, 12])]


def _weighted_case(scheme: str, G: int, R: int, options: dict) -> dict[str, float]:
    """This rank's largest differences from one device, per kind of count."""
    S = B = 4
    step = make_step(scheme, S, B, G=G, R=R, split_backward=options.get("split_backward", False))
    errors: dict[str, float] = {}
    for kind in ("mask", "rows"):
        loss_fn = masked_mse if kind == "mask" else nn.functional.mse_loss
        model = StagedModel(staged_mlp(S, seed=3).stages, loss_fn)
        ref = copy.deepcopy(model)
        engine = Engine(model, step, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                        weight_cache=options.get("weight_cache", "step"))
        ref_opt = torch.optim.SGD([p for m in ref.stages for p in m.parameters()], lr=0.1, momentum=0.9)
        diffs = [0.0]
        for i, (rows, keep) in enumerate(STEPS):
            x, y, mask = _batch(rows, i, keep)
            xs, ys, ms = x.tensor_split(B), y.tensor_split(B), mask.tensor_split(B)
            if kind == "mask":  # the counts given; the mean over kept rows, each micro-batch's by its own
                mbs = [(a, (b, m)) for a, b, m in zip(xs, ys, ms)]
                items = [m.sum() for m in ms]
                target = (y, mask)
            else:  # no counts: the engine counts rows (13 rows: 4, 3, 3, 3)
                mbs, items, target = list(zip(xs, ys)), None, y
            record = engine.train_step(mbs, items)
            grads, loss = _one_device(ref, ref_opt, x, target, loss_fn)
            if engine.worker is None:
                continue
            for s in engine.owned:
                diffs += [(engine.last_grads[s] - grads[s]).abs().max().item(),
                          (flat_params(engine.modules[s]) - flat_params(ref.stages[s])).abs().max().item()]
            errors[f"{kind}-loss-share-{i}"] = record["measured_only"]["loss"]
            errors[f"{kind}-loss-{i}"] = loss
            # evaluation weighs micro-batches alike: on the updated weights, against one device's loss
            errors[f"{kind}-eval-share-{i}"], _ = engine.evaluate(mbs, items)
            with torch.no_grad():
                errors[f"{kind}-eval-{i}"] = float(loss_fn(_forward(ref, x), target))
        errors[f"{kind}-err"] = torch.tensor(diffs).max().item()  # NaN if any is
    return errors


def _all_cases() -> list[dict[str, float]]:
    return [_weighted_case(*case) for case in CASES]


@pytest.fixture(scope="module")
def engine_results() -> list[list[dict[str, float]]]:
    return launch(_all_cases, 4, timeout=30, deadline=240)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_engine_weighs_microbatches_by_their_items(engine_results, case: int) -> None:
    per_rank = [r[case] for r in engine_results]
    for kind in ("mask", "rows"):
        assert max(r[f"{kind}-err"] for r in per_rank) < ATOL
        for i in range(len(STEPS)):
            want = per_rank[0][f"{kind}-loss-{i}"]
            # the step's loss: each worker's share of it (its loss stages' weighted losses), summed
            assert abs(sum(r[f"{kind}-loss-share-{i}"] for r in per_rank) - want) < ATOL
            # evaluation after the step: the same weighting, on the updated weights
            want = per_rank[0][f"{kind}-eval-{i}"]
            assert abs(sum(r[f"{kind}-eval-share-{i}"] for r in per_rank) - want) < ATOL


def test_equal_counts_keep_the_plain_mean() -> None:
    """Equal counts (or rows) weigh each micro-batch 1 / B exactly: the engine divides by B as it
    always did, so runs on equal micro-batches stay bit for bit."""
    mbs = [(torch.zeros(3, 2), None)] * 4
    assert shares(mbs) is None
    assert shares(mbs, [5, 5, 5, 5]) is None
    assert shares(mbs, [torch.tensor(2), 2, 2.0, torch.tensor(2.0)]) is None
    assert shares(mbs, [1, 3, 0, 4]) == [1 / 8, 3 / 8, 0.0, 4 / 8]
    assert shares([(torch.zeros(n, 2), None) for n in (4, 4, 3, 3)]) == [4 / 14, 4 / 14, 3 / 14, 3 / 14]
    with pytest.raises(ValueError, match="count is -1.0; counts must be finite and >= 0"):
        shares(mbs, [1, -1, 2, 2])
    with pytest.raises(ValueError, match="items has 3 counts for 4 micro-batches"):
        shares(mbs, [1, 2, 2])
