"""UnifiedStrategy against the oracle: the same LightningModule, unchanged, under Lightning's
default single-device strategy. Equal parameters after several steps (float64), for every scheme
and order, with AdamW, a learning-rate schedule stepped every step and gradient clipping by norm;
equal validation loss and predictions through the forward-only path."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from helpers.training import char_data, max_diff, quiet_trainer, tiny_gpt
from launcher.lightning import UnifiedStrategy
from launcher.models import GPT

pytestmark = pytest.mark.timeout(240)

STEPS = 3
TOL = 1e-10


def trainer(strategy, devices: int, **kw) -> L.Trainer:
    args = dict(precision="64-true", max_steps=STEPS, limit_val_batches=2, val_check_interval=STEPS,
                gradient_clip_val=0.05)
    return quiet_trainer(strategy, devices, **{**args, **kw})


@pytest.fixture(scope="module")
def base() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(n_layer=4, max_steps=STEPS)  # 6 modules


@pytest.fixture(scope="module")
def reference(base):
    model = copy.deepcopy(base)
    tr = trainer("auto", 1)
    tr.fit(model, datamodule=char_data())
    return model, float(tr.callback_metrics["val_loss"]), float(tr.callback_metrics["train_loss"])


CASES = [
    # (scheme, G, R, stages, microbatches, order, extra)
    *[(s, G, R, 4, 4, o, {}) for s, G, R in (("ddp", None, None), ("fsdp", None, None), ("gpipe", None, None),
                                             ("lpp", 2, 2), ("fslpp", 2, 2))
      for o in ("1f1b", "breadth_first", "depth_first") if s != "ddp" or o == "1f1b"],  # DDP has no order to choose
    # the ddp and lpp G=2 cases above reduce their gradients through shared memory (transport auto
    # on one host's CPUs); over gloo's collectives too
    ("ddp", None, None, 4, 4, "1f1b", {"transport": "gloo"}),
    ("gpipe", None, None, 4, 2, "1f1b", {}),  # fewer micro-batches than stages
    ("lpp", 1, 2, 2, 4, "1f1b", {}),  # 6 modules grouped into 2 stages by parameter count
    ("lpp", 1, 2, 4, 8, "interleaved_1f1b", {}),  # Megatron's interleaved order, two stages per worker
    ("fslpp", 2, 2, 4, 4, "1f1b", {"split_backward": True, "weight_cache": "job", "prefetch": 2}),
    # the zero-bubble family: each worker's job sequence given (seed 004), W jobs deferred
    ("gpipe", None, None, 4, 4, "zb_h2", {"split_backward": True}),
    ("vshape", None, None, 4, 4, "zbv", {"split_backward": True}),  # 2 workers, stages 0+3 and 1+2
    ("vshape", None, None, 4, 4, "dualpipev", {"split_backward": True}),
    ("lpp", 1, 2, 4, 4, "auto", {"split_backward": True, "memory_limit": 4}),  # the searched schedule
]


@pytest.mark.parametrize("scheme,G,R,S,B,order,extra", CASES,
                         ids=[f"{c[0]}-S{c[3]}B{c[4]}-{c[5]}{'-' + '-'.join(c[6]) if c[6] else ''}" for c in CASES])
def test_equals_default_strategy(base, reference, scheme, G, R, S, B, order, extra):
    ref, ref_val, ref_train = reference
    model = copy.deepcopy(base)
    st = UnifiedStrategy(scheme, G=G, R=R, stages=S, microbatches=B, order=order, **extra)
    tr = trainer(st, st.workers)
    tr.fit(model, datamodule=char_data())
    assert max_diff(ref, model) < TOL  # the launching process holds the trained weights
    assert abs(float(tr.callback_metrics["val_loss"]) - ref_val) < TOL
    assert abs(float(tr.callback_metrics["train_loss"]) - ref_train) < TOL  # the last step's loss, as logged


def test_clipping_is_active_and_global(base, reference):
    """Without clipping the result differs, so the equality above really tests the global norm."""
    ref = reference[0]
    model = copy.deepcopy(base)
    st = UnifiedStrategy("fslpp", G=2, R=2, stages=4, microbatches=4)
    trainer(st, st.workers, gradient_clip_val=None).fit(model, datamodule=char_data())
    assert max_diff(ref, model) > 1e-6


def test_custom_placement_callable(base, reference):
    ref = reference[0]

    def two_groups(s: int, b: int, d: str) -> tuple[int, int]:  # stages 0,1 on worker b%2, 2,3 on 2+b%2
        w = 2 * (s // 2) + b % 2
        return (w, w)

    model = copy.deepcopy(base)
    st = UnifiedStrategy(two_groups, G=2, R=2, stages=4, microbatches=4)
    trainer(st, st.workers).fit(model, datamodule=char_data())
    assert max_diff(ref, model) < TOL


def test_predict_and_test_match(base, reference):
    ref = reference[0]
    st = UnifiedStrategy("lpp", G=2, R=2, stages=4, microbatches=4)
    tr = trainer(st, st.workers)
    preds = tr.predict(copy.deepcopy(ref), datamodule=char_data())
    single = trainer("auto", 1).predict(copy.deepcopy(ref), datamodule=char_data())
    assert len(preds) == len(single) > 0
    assert max((a - b).abs().max().item() for a, b in zip(preds, single)) < TOL
    got = trainer(UnifiedStrategy("gpipe", stages=4, microbatches=4), 4).test(copy.deepcopy(ref),
                                                                               datamodule=char_data(), verbose=False)
    want = trainer("auto", 1).test(copy.deepcopy(ref), datamodule=char_data(), verbose=False)
    assert abs(got[0]["test_loss"] - want[0]["test_loss"]) < TOL


def test_batch_that_does_not_divide_is_one_clear_error(base):
    from launcher.torch_support.checks import ModelError

    st = UnifiedStrategy("lpp", G=2, R=2, stages=4, microbatches=4)
    # found on the first batch before any worker starts
    with pytest.raises(ModelError, match="cannot be cut into microbatches=4 equal micro-batches"):
        trainer(st, st.workers).fit(copy.deepcopy(base), datamodule=char_data(batch_size=6))


def test_bad_keywords_are_one_sentence():
    from launcher.config import ConfigError

    with pytest.raises(ConfigError, match="W must equal|needs W = microbatches"):
        UnifiedStrategy("ddp", G=2, R=2, stages=4, microbatches=8)
    with pytest.raises(ConfigError, match="R=8 is invalid"):
        UnifiedStrategy("lpp", G=1, R=8, stages=4, microbatches=4)


#: keywords UnifiedStrategy does not take, and its one sentence for each (key, value, rule, a close match)
UNKNOWN = [
    (dict(memory_limt=3), "memory_limt=3 is invalid: memory_limt is not a keyword of UnifiedStrategy; did you "
                          "mean memory_limit?"),
    (dict(stage=4), "stage=4 is invalid: stage is not a keyword of UnifiedStrategy; did you mean stages?"),
    (dict(seed=3), "seed=3 is invalid: seed is not a keyword of UnifiedStrategy; seed is a key of the command "
                   "line's config that the strategy does not read (give it to the Trainer, the module or the data)."),
    (dict(strategy="gpipe"), "strategy=gpipe is invalid: strategy is not a keyword of UnifiedStrategy; its keyword "
                             "for the scheme is scheme."),
    (dict(plan={"top": 3}), "plan.top=3 is invalid: plan.top is not a keyword of UnifiedStrategy's plan; did you "
                            "mean plan.memory?"),
]


@pytest.mark.parametrize("stages", [4, None], ids=["stages", "stages-from-module"])
@pytest.mark.parametrize("keywords,sentence", UNKNOWN, ids=[next(iter(k)) for k, _ in UNKNOWN])
def test_an_unknown_keyword_is_refused_at_once(keywords, sentence, stages):
    from launcher.config import ConfigError

    # refused in the constructor, also when the stage count waits for the module (stages=None)
    with pytest.raises(ConfigError) as e:
        UnifiedStrategy("lpp", G=1, R=2, stages=stages, microbatches=4, **keywords)
    assert isinstance(e.value, ValueError) and e.value.sentences == [sentence]
    # the keywords it does take are not refused (plan.memory is the one key of plan a run reads)
    st = UnifiedStrategy("lpp", G=1, R=2, stages=4, microbatches=4, weight_cache="job", plan={"memory": "1GB"},
                         partition="time")
    assert st.settings.weight_cache == "job" and st.settings.plan_memory == "1GB"


def test_registered_with_lightning():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "unified" in StrategyRegistry
