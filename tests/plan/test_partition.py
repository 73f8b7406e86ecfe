"""Cutting a chain of modules into stages: by parameters, by measured time within a memory cap, by
memory. The solvers against brute force, a real profile, the config key, and the planner."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from launcher.plan.partition import PartitionError, balanced_groups, memory_groups, scaled, stage_durations, time_groups


def cuts(n: int, S: int):
    """Every cut of ``range(n)`` into ``S`` consecutive non-empty groups."""
    for bounds in itertools.combinations(range(1, n), S - 1):
        edges = (0, *bounds, n)
        yield [list(range(a, b)) for a, b in zip(edges, edges[1:])]


def worst(xs, groups) -> float:
    return max(sum(xs[i] for i in g) for g in groups)


def is_cut(groups, n: int, S: int) -> bool:
    return len(groups) == S and all(groups) and [i for g in groups for i in g] == list(range(n))


costs = st.lists(st.integers(0, 50), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(costs, st.data())
def test_balanced_and_memory_groups_are_optimal(sizes, data):
    S = data.draw(st.integers(1, len(sizes)))
    best = min(worst(sizes, g) for g in cuts(len(sizes), S))
    for groups in (balanced_groups(sizes, S), memory_groups(sizes, S)):
        assert is_cut(groups, len(sizes), S)
        assert worst(sizes, groups) == best


@settings(max_examples=200, deadline=None)
@given(costs, st.data())
def test_time_groups_is_optimal_within_the_cap(seconds, data):
    n = len(seconds)
    S = data.draw(st.integers(1, n))
    memory = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    cap = data.draw(st.one_of(st.none(), st.integers(0, 150)))
    fits = [g for g in cuts(n, S) if cap is None or worst(memory, g) <= cap]
    if not fits:
        with pytest.raises(PartitionError, match="cannot fit every stage within the memory cap"):
            time_groups(seconds, S, memory, cap)
        return
    groups = time_groups(seconds, S, memory, cap)
    assert is_cut(groups, n, S)
    assert cap is None or worst(memory, groups) <= cap
    assert worst(seconds, groups) == min(worst(seconds, g) for g in fits)


def test_one_heavy_module_stands_alone():
    seconds = [1.0, 1.0, 1.0, 1.0, 1.0, 10.0]  # a vocabulary head ten times a block
    groups = time_groups(seconds, 3)
    assert groups[-1] == [5]
    assert worst(seconds, groups) == min(worst(seconds, g) for g in cuts(6, 3)) == 10.0
    # by parameter count (the head as big as the rest together) the head shares its stage
    assert balanced_groups([1, 1, 1, 1, 1, 5], 2) == [[0, 1, 2, 3, 4], [5]]


def test_the_cap_moves_the_cut_and_an_impossible_cap_is_one_sentence():
    seconds, memory = [1.0, 1.0, 1.0, 6.0], [1.0, 1.0, 1.0, 1.0]
    assert time_groups(seconds, 2) == [[0, 1, 2], [3]]
    assert time_groups(seconds, 2, [5.0, 1.0, 1.0, 1.0], cap=5.5) == [[0], [1, 2, 3]]  # the only cut that fits
    with pytest.raises(PartitionError) as e:
        time_groups(seconds, 2, memory, cap=1.5)
    assert str(e.value).count(".") <= 2 and "raise plan.memory" in str(e.value)


def test_stage_durations_sum_the_modules_and_scale_to_config_units():
    per = stage_durations([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [[0, 1], [2]])
    assert per == [{"F": 3.0, "B": 6.0, "I": 3.0, "W": 3.0}, {"F": 3.0, "B": 6.0, "I": 3.0, "W": 3.0}]
    units = scaled(per, {"F": 1.0, "B": 1.0})
    assert units[0]["F"] + units[0]["B"] == pytest.approx(2.0)
    assert units[0]["B"] == pytest.approx(2 * units[0]["F"])


def test_lightning_partition_keeps_balanced_groups():
    from launcher.lightning import stage_groups as partition

    assert partition.balanced_groups is balanced_groups
    mods = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 40)]
    stages, groups = partition.group_modules(mods, 2)
    assert groups == [[0, 1], [2]]
    with pytest.raises(ValueError, match="is not a cut of 3 modules into 2"):
        partition.group_modules(mods, 2, [[0], [2]])


# ---- a real profile --------------------------------------------------------------------------
class Heavy(nn.Module):
    """Five cheap layers and one wide one: the wide layer costs more than the rest together."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Linear(32, 32) for _ in range(5)]
                                    + [nn.Sequential(nn.Linear(32, 8192), nn.Tanh(), nn.Linear(8192, 32))])

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()


def test_a_real_profile_puts_the_heavy_module_alone():
    from launcher.lightning.staging import profiled_partition, stage_module

    torch.manual_seed(0)
    m = Heavy()
    batch = (torch.randn(1024, 32), torch.randn(1024, 32))
    groups, costs = profiled_partition(m, 2, "time", batch, microbatches=2)
    assert groups == [[0, 1, 2, 3, 4], [5]]
    assert costs[5].seconds > sum(c.seconds for c in costs[:5])
    assert costs[5].params == (32 * 8192 + 8192 + 8192 * 32 + 32) * 4 and costs[5].optimizer == 2 * costs[5].params
    assert costs[0].activation >= 512 * 32 * 4  # its input, one micro-batch
    assert all(p.grad is None for p in m.parameters())  # the profile leaves the model as it was
    staging = stage_module(m, 2, groups=groups, costs=costs)
    assert staging.groups == groups
    per = staging.stage_durations
    assert per is not None and per[1]["F"] == costs[5].forward_s


def test_a_shared_parameter_counts_once_where_first_used():
    from launcher.split.cost import profile_chain

    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight  # tied
    costs = profile_chain([emb, head], torch.randint(0, 50, (4, 3)), repeat=1)
    assert costs[0].params == 50 * 8 * 4 and costs[1].params == 0


# ---- the config key --------------------------------------------------------------------------
def test_partition_key_is_validated_in_one_sentence():
    from omegaconf import OmegaConf

    from launcher.config import LauncherConf
    from launcher.config.validate import step_errors

    cfg = OmegaConf.structured(LauncherConf)
    cfg.partition = "speed"
    found = [e for e in step_errors(cfg) if e.startswith("partition")]
    assert found == ["partition=speed is invalid: use params (balanced parameter counts), time (balanced profiled "
                     "forward and backward seconds) or memory (balanced profiled bytes)."]
    cfg.partition, cfg.split = "time", "auto"
    assert any(e.startswith("partition=time is invalid with split=auto") for e in step_errors(cfg))


# ---- predictions and the planner -------------------------------------------------------------
def test_report_uses_each_stages_measured_time():
    from launcher.report.measured_costs import job_seconds, stage_job_seconds

    rec = {"records": [{"measured_only": {"jobs": [[0, 0, "F", 1.0], [1, 0, "F", 3.0], [0, 0, "B", 2.0],
                                                    [1, 0, "B", 6.0]], "device": "cuda"}}]}
    assert job_seconds([rec], "FB") == {"F": 2.0, "B": 4.0}
    assert stage_job_seconds([rec], "FB", 2) == [{"F": 1.0, "B": 2.0}, {"F": 3.0, "B": 6.0}]


def _module(f: float, params: float = 1e6) -> dict[str, float]:
    return {"forward_s": f, "backward_s": 2 * f, "params": params, "grads": params, "optimizer": 2 * params,
            "activation": 1e5}


def test_planner_searches_the_partition_and_picks_time_for_a_heavy_head():
    from launcher.plan.profile import from_dict
    from launcher.plan.search import Budget, search

    # embedding (big, cheap), four blocks, a head as slow as the blocks together
    mods = [_module(0.001, 8e6)] + [_module(0.01) for _ in range(4)] + [_module(0.04, 8e6)]
    prof = from_dict({"durations_s": {"F": 0.01, "B": 0.02}, "comm_s": 0.0,
                      "bytes": {k: [1.0] for k in ("params", "grads", "optimizer", "activation")},
                      "modules": mods})
    plan = search(3, [4], 3, prof, Budget(), top=10)
    best = plan.best
    assert best is not None and best.point.partition == "time"
    assert "partition=time" in best.overrides
    by = {c.point.partition for c in plan.candidates}
    assert "time" in by
    # its step: the slowest stage (the head, 0.12 s per micro-batch) bounds it
    assert best.step_time >= 4 * 0.12 - 1e-9


def test_planner_uses_stage_durations():
    from launcher.plan.profile import from_dict
    from launcher.plan.search import Budget, search

    base = {"durations_s": {"F": 1.0, "B": 2.0}, "comm_s": 0.0}
    even = search(2, [2], 2, from_dict(base), Budget()).best
    uneven = search(2, [2], 2, from_dict(base | {"stage_durations_s": [{"F": 1.0, "B": 2.0}, {"F": 3.0, "B": 6.0}]}),
                    Budget()).best
    assert even is not None and uneven is not None and uneven.step_time > even.step_time


def test_a_model_on_the_meta_device_is_profiled_one_materialised_module_at_a_time():
    from launcher.models.gpt import GPT
    from launcher.split.cost import profile_chain
    from launcher.torch_support.init import empty_init, has_meta

    with empty_init():
        m = GPT(vocab_size=2048, seq_len=16, d_model=32, n_head=2, n_layer=2)
    x = torch.randint(0, 128, (2, 16))
    costs = profile_chain(list(m.stages), x, m.loss, x, repeat=1, min_seconds=0.0)
    assert has_meta(m)  # the launching process still holds no weights
    assert len(costs) == 4 and all(c.forward_s > 0 and c.backward_s > 0 for c in costs)
    assert costs[-1].params == (32 * 2048 + 2048 + 2 * 32) * 4


def test_strategy_profiles_once_before_the_fork_and_its_step_has_uneven_stages():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from launcher.lightning import UnifiedStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.stages = Heavy().stages

        def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2).mean()

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(1024, 32), torch.randn(1024, 32)), batch_size=1024)

    strategy = UnifiedStrategy("gpipe", stages=2, microbatches=2, partition="time")
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    strategy.check_before_fork(Model(), Data())
    staging = strategy._staged[1]
    assert staging.groups == [[0, 1, 2, 3, 4], [5]] and len(staging.costs) == 6
    strategy.stage_durations_s = staging.stage_durations  # what setup takes from the inherited staging
    step = strategy.make_schedule()
    # the step carries the profile's own stage times (scaled to the config's units), not one time for
    # every stage; which stage is slower is the machine's (a cut by time makes them near equal)
    from launcher.plan.partition import scaled

    assert step.stage_durations == scaled(staging.stage_durations, step.durations)
    assert step.stage_durations[0] != step.stage_durations[1]
    with pytest.raises(Exception, match="partition=fast is invalid"):
        UnifiedStrategy("gpipe", stages=2, microbatches=2, partition="fast")
