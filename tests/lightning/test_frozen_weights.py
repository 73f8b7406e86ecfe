"""Frozen weights (``requires_grad=False``) and peft LoRA adapters under every scheme, against the
same LightningModule under ``strategy=single`` (Lightning's single-device strategy, each batch as
the same micro-batches through the random streams, so dropout draws the same masks).

At the launcher's defaults (gradient clipping at ``conf/trainer/default.yaml``'s value, the models'
own dropout: GPT-2's 0.1, a shuffling loader), float64, 2 steps: the trainable parameters equal one
device's within 1e-10, the frozen ones stay bit-equal to their initial values, and a step's weight
gradient messages and replica all-reduces carry the trainable parameters' bytes only, as predicted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from helpers.training import Keep, char_data, quiet_trainer, tiny_gpt
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import HFCausalLM

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.filterwarnings("ignore:.*fan_in_fan_out.*"),
              pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")]

TOL = 1e-10
STEPS = 2
B = 4
#: the gradient clipping a user of the launcher gets
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)
SCHEMES = [("ddp", None, None, {}), ("fsdp", None, None, {}), ("gpipe", None, None, {}), ("lpp", 2, 2, {}),
           ("fslpp", 2, 2, {}),
           # the split backward (W takes each parameter's gradient of a fetched copy) on copies freed after each job
           ("fslpp", 2, 2, {"split_backward": True, "weight_cache": "job", "prefetch": 2})]


def lora_gpt2(lora: dict | None = None) -> L.LightningModule:
    """A tiny GPT-2 (tied embedding, dropout 0.1) with peft LoRA adapters on ``c_attn``, by name.
    ``alpha`` 256 (scale 64) puts the adapters' gradient norm (1.7) above the clipping threshold, so
    the clipping is active (:func:`test_clipping_is_active`); peft's default 8 gives 0.05."""
    torch.manual_seed(0)
    return HFCausalLM("gpt2", config={"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 2},
                      lora={"r": 4, "alpha": 256} if lora is None else lora, max_steps=STEPS).double()


def frozen_gpt() -> L.LightningModule:
    """The built-in GPT with its whole embedding stage and the first block's attention frozen."""
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=2, max_steps=STEPS).double()
    for p in model.stages[0].parameters():
        p.requires_grad_(False)
    for p in [*model.stages[1].qkv.parameters(), *model.stages[1].proj.parameters()]:
        p.requires_grad_(False)
    return model


MODELS = {"lora": lora_gpt2, "frozen": frozen_gpt}


def fit(model: L.LightningModule, strategy, devices: int, callbacks: list | None = None) -> L.Trainer:
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP,
                       limit_val_batches=0, callbacks=callbacks or [])
    tr.fit(model, datamodule=char_data())
    return tr


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[L.LightningModule, L.LightningModule]]:
    """Per model: its initial copy and the same model trained under ``strategy=single``."""
    out = {}
    for name, make in MODELS.items():
        model = make()
        start = copy.deepcopy(model)
        fit(model, StreamedSingleDevice(microbatches=B), 1)
        out[name] = (start, model)
    return out


def check_against_single(start: L.LightningModule, want: L.LightningModule, got: L.LightningModule) -> float:
    """The largest difference of a trainable parameter from one device's; every frozen parameter
    bit-equal to its initial value (and to one device's)."""
    initial = dict(start.named_parameters())
    single = dict(want.named_parameters())
    trained = dict(got.named_parameters())
    assert trained.keys() == single.keys()
    frozen = [n for n, p in initial.items() if not p.requires_grad]
    assert frozen and len(frozen) < len(initial)
    for n in frozen:
        assert torch.equal(trained[n], initial[n]), n
        assert torch.equal(single[n], initial[n]), n
    moved = max((single[n] - initial[n]).abs().max().item() for n in initial if n not in frozen)
    assert moved > 1e-4  # the trainable parameters did train
    return max((trained[n] - single[n]).abs().max().item() for n in initial if n not in frozen)


@pytest.mark.parametrize("scheme,G,R,extra", SCHEMES, ids=[s + ("-split-job" if e else "") for s, _, _, e in SCHEMES])
def test_frozen_weights_train_as_on_one_device(references, scheme: str, G, R, extra: dict) -> None:
    """Both models under one scheme: trainable parameters equal one device's, frozen ones untouched."""
    for name in MODELS:
        start, want = references[name]
        got = copy.deepcopy(start)
        st = UnifiedStrategy(scheme, G=G, R=R, stages=4, microbatches=B, **extra)
        fit(got, st, st.workers)
        diff = check_against_single(start, want, got)
        print(f"{name} under {scheme}: trainable parameters within {diff:.1e} of strategy=single")
        assert diff < TOL, (name, diff)


class PeftLM(L.LightningModule):
    """A user's own module: a Llama wrapped by ``peft.get_peft_model`` (LoRA on ``q_proj``/``v_proj``),
    no ``self.stages``: traced and cut (``split=auto``)."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("llama", vocab_size=128, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                   num_attention_heads=2, num_key_value_heads=1)
        self.model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                                    LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("scheme,G,R", [("gpipe", None, None), ("fslpp", 2, 2)], ids=["gpipe", "fslpp"])
def test_a_users_peft_model_traced(scheme: str, G, R) -> None:
    """A LightningModule around ``get_peft_model(...)``, traced and cut: adapters equal one device's,
    the base model untouched."""
    torch.manual_seed(0)
    start = PeftLM().double()
    want, got = copy.deepcopy(start), copy.deepcopy(start)
    fit(want, StreamedSingleDevice(microbatches=B, split="auto"), 1)
    st = UnifiedStrategy(scheme, G=G, R=R, stages=4, microbatches=B, split="auto")
    fit(got, st, st.workers)
    diff = check_against_single(start, want, got)
    print(f"peft user module under {scheme}: adapters within {diff:.1e} of strategy=single")
    assert diff < TOL


def trainable_bytes(model: L.LightningModule) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("scheme,G,R", [("fsdp", None, None), ("lpp", 2, 2)])
def test_gradient_traffic_is_the_adapters_only(tmp_path: Path, scheme: str, G, R) -> None:
    """The LoRA model's weight-gradient sums (FSDP: every worker sends its sum of the stages it does
    not own) and replica all-reduces (LPP, G=2: each stage's 2 owners) carry its adapters' bytes
    only: far fewer than the same model fully trained, and what the engine predicts. Its embedding
    and head stages have nothing to train: they send no sum and all-reduce nothing at all."""
    from launcher.runtime.measure import mismatches

    got = {}
    for name, lora in (("lora", None), ("full", {})):
        model = lora_gpt2(lora)
        out = tmp_path / name
        out.mkdir()
        st = UnifiedStrategy(scheme, G=G, R=R, stages=4, microbatches=B)
        fit(model, st, st.workers, [Keep(out)])
        ranks = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))]
        measured = sum(rec["measured_only"]["sent_bytes"].get("wgrad", 0) for r in ranks for rec in r["records"])
        predicted = sum(n * STEPS for r in ranks for kind, dst, n in r["predicted"]
                        if kind == "wgrad" and dst == r["worker"])
        assert measured == predicted, (name, measured, predicted)
        records = [rec for r in ranks for rec in r["records"] if rec]
        assert not any(mismatches(rec) for rec in records)  # message and all-reduce counts as predicted
        sums = sum(rec["measured_only"]["sent_count"].get("wgrad", 0) for rec in records)
        reduces = sum(rec["per_worker"]["weight_allreduce"]["measured"] for rec in records)
        got[name] = (measured, sum(r["allreduce_bytes"] for r in ranks), trainable_bytes(model), sums, reduces)
    lora_sent, lora_reduced, adapters, lora_sums, lora_reduces = got["lora"]
    full_sent, full_reduced, _, full_sums, full_reduces = got["full"]
    # stage s is owned by worker s % 4 (FSDP) or by workers s % 2 and 2 + s % 2 (LPP); LoRA trains stages 1 and 2
    if scheme == "fsdp":
        assert (lora_sums, full_sums) == (6 * STEPS, 12 * STEPS)
    else:
        assert (lora_reduces, full_reduces) == (4 * STEPS, 8 * STEPS)
    print(f"{scheme}: weight-gradient bytes sent over {STEPS} steps {lora_sent} (LoRA) vs {full_sent} (full); "
          f"all-reduced per step {lora_reduced} vs {full_reduced}; adapters {adapters} bytes")
    if scheme == "fsdp":
        assert lora_sent == 3 * adapters * STEPS and full_sent > 20 * lora_sent
    else:  # every stage has 2 owners, and each all-reduces its stages' gradients
        assert lora_reduced == 2 * adapters and full_reduced > 20 * lora_reduced


#: the command line's tiny GPT-2 with LoRA adapters, at the launcher's defaults otherwise
LORA_CLI = ["stages=4", "microbatches=4", "trainer.max_steps=2", "trainer.precision=64-true", "logger=none",
            "model=hf", "model.arch=gpt2", "model.config.n_layer=2", "model.config.n_embd=16", "model.config.n_head=2",
            "model.lora.r=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000"]


@pytest.mark.slow
def test_lora_by_name_through_the_command_line(tmp_path: Path) -> None:
    """``model=hf model.lora.r=4`` under FSLPP: ``last.ckpt`` holds the adapters within 1e-10 of
    ``strategy=single`` and every frozen weight exactly as one device leaves it (its initial value);
    resumed for one more step under FSDP it equals the same checkpoint resumed under
    ``strategy=single``, optimizer state (the adapters' only) included."""
    from helpers.cli import run_launcher
    from helpers.oracle import single_device
    from helpers.training import last_state, load_checkpoint

    run = tmp_path / "run"
    p = run_launcher("strategy=fslpp", "G=2", "R=2", *LORA_CLI, f"hydra.run.dir={run}", cwd=tmp_path, timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = last_state(run), single_device(LORA_CLI)
    assert got.keys() == want.keys()
    adapters = [k for k in want if ".lora_" in k]
    assert adapters and len(adapters) < len(want)
    for k in want:
        if k in adapters:
            assert (got[k] - want[k]).abs().max().item() < TOL, k
        else:
            assert torch.equal(got[k], want[k]), k
    # the run's report (the planner's profile, the memory meter's prediction) counts the adapters'
    # gradients and optimizer state only, and its gradient traffic as measured
    metrics = json.loads((run / "metrics.json").read_text())
    by, adapter_bytes = metrics["profile"]["bytes"], sum(want[k].numel() * want[k].element_size() for k in adapters)
    assert sum(by["grads"]) == adapter_bytes and sum(by["params"]) > 10 * adapter_bytes
    # AdamW: two moments of each adapter, and a step count
    assert 2 * adapter_bytes <= sum(by["optimizer"]) <= 2 * adapter_bytes + 8 * len(adapters)
    wgrad = metrics["per_worker"]["traffic_bytes"]["wgrad"]
    assert wgrad["predicted"] == wgrad["measured"] and 0 < sum(wgrad["measured"]) <= adapter_bytes
    # resume: one more step on the schedule the checkpoint was trained with (model.max_steps=2)
    resumed = {}
    for scheme in ("fsdp", "single"):
        out = tmp_path / f"resumed-{scheme}"
        p = run_launcher(f"strategy={scheme}", *LORA_CLI, "trainer.max_steps=3", "model.max_steps=2",
                         f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={out}", cwd=tmp_path,
                         timeout=380)
        assert p.returncode == 0, p.stderr[-3000:]
        resumed[scheme] = load_checkpoint(out / "checkpoints" / "last.ckpt")
    a, b = resumed["fsdp"], resumed["single"]
    assert a["global_step"] == b["global_step"] == 3
    assert max((a["state_dict"][k] - b["state_dict"][k]).abs().max().item() for k in want) < TOL
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sorted(sa) == sorted(sb) and len(sb) == len(adapters)
    assert max((sa[i]["exp_avg_sq"] - sb[i]["exp_avg_sq"]).abs().max().item() for i in sb) < TOL


@pytest.mark.parametrize("lora,sentence", [
    ({"r": 0}, "model.lora.r=0 is invalid: the adapters' rank must be a positive integer (e.g. 8)."),
    ({"alpha": 16}, "model.lora.alpha=16 needs model.lora.r: set the adapters' rank (e.g. model.lora.r=8) "
                    "to train with LoRA."),
    ({"r": 4, "rank": 4}, "model.lora.rank=4 is invalid: model.lora takes r, alpha, dropout, target_modules."),
    ({"r": 4, "dropout": 1.0}, "model.lora.dropout=1.0 is invalid: a dropout probability must be at least 0 "
                               "and below 1."),
    ({"r": 4, "target_modules": ["q_proj"]},
     "model.lora.target_modules=[q_proj] is invalid for model.arch=gpt2: no module of the model has that name "
     "(peft's default for gpt2: [c_attn])."),
], ids=["rank-0", "alpha-without-rank", "unknown-key", "dropout-1", "no-such-module"])
def test_bad_lora_options_are_one_sentence(lora: dict, sentence: str) -> None:
    with pytest.raises(ValueError) as e:
        HFCausalLM("gpt2", config={"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2}, lora=lora)
    assert str(e.value) == sentence


def test_bad_lora_option_exits_2_before_any_worker(tmp_path: Path) -> None:
    from helpers.cli import run_launcher

    run = tmp_path / "run"
    p = run_launcher("strategy=fsdp", *LORA_CLI[:-4], "model.lora.r=-1", f"hydra.run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "model.lora.r=-1 is invalid: the adapters' rank must be a positive integer (e.g. 8)." in p.stderr
    assert "Traceback" not in p.stderr and not (run / "checkpoints").exists()


def test_clipping_is_active(references) -> None:
    """The references clip (their global norm, over the trainable parameters only, exceeds the
    launcher's 1.0): without clipping a scheme lands elsewhere, so the equality above tests the norm."""
    for name in MODELS:
        start, want = references[name]
        got = copy.deepcopy(start)
        st = UnifiedStrategy("fslpp", G=2, R=2, stages=4, microbatches=B)
        quiet_trainer(st, st.workers, precision="64-true", max_steps=STEPS, gradient_clip_val=None,
                      limit_val_batches=0).fit(got, datamodule=char_data())
        assert check_against_single(start, want, got) > 1e-6, name


def test_a_tied_weight_after_frozen_ones_is_clipped_once() -> None:
    """GPT-2 fully trained, its head stage holding a frozen parameter listed before the head tied to
    the embedding (as a frozen final norm would be where a cut puts it there): the clipping norm
    (taken in the step's one all-reduce under ddp) counts the tied weight's gradient once, found by
    the parameter and not by its place among the trainable ones; and the norm binds (it exceeds
    the launcher's 1.0, checked by running without clipping)."""
    def make() -> L.LightningModule:
        model = lora_gpt2(lora={})
        head = model.stages[-1]
        head.register_parameter("frozen", torch.nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False))
        assert next(head.parameters()) is head.frozen  # listed before the tied lm_head.weight
        return model

    start = make()
    want = copy.deepcopy(start)
    fit(want, StreamedSingleDevice(microbatches=B), 1)
    got, unclipped = copy.deepcopy(start), copy.deepcopy(start)
    fit(got, UnifiedStrategy("ddp", stages=4, microbatches=B), B)
    assert check_against_single(start, want, got) < TOL
    quiet_trainer(UnifiedStrategy("ddp", stages=4, microbatches=B), B, precision="64-true", max_steps=STEPS,
                  gradient_clip_val=None, limit_val_batches=0).fit(unclipped, datamodule=char_data())
    assert check_against_single(start, want, unclipped) > 1e-6


def test_lora_on_a_loaded_model_keeps_its_weights(tmp_path: Path) -> None:
    """``model.pretrained`` with ``model.lora``, built on the meta device as the command builds it:
    the loaded weights stay as saved (nothing is initialised again), the adapters start as peft
    starts them (``lora_B`` zero: the model's output is the loaded model's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from launcher.torch_support.init import empty_init, has_meta

    torch.manual_seed(1)
    cfg = AutoConfig.for_model("gpt2", vocab_size=128, n_layer=1, n_embd=16, n_head=2, bos_token_id=0, eos_token_id=0)
    saved = AutoModelForCausalLM.from_config(cfg)
    saved.save_pretrained(tmp_path)
    with empty_init():
        model = HFCausalLM(pretrained=str(tmp_path), lora={"r": 4})
    assert not has_meta(model)
    layer = model.hf.transformer.h[0].attn.c_attn
    assert torch.equal(layer.base_layer.weight, saved.transformer.h[0].attn.c_attn.weight)
    assert not layer.lora_B["default"].weight.any() and layer.lora_A["default"].weight.any()
    x = torch.randint(0, 128, (2, 8))
    assert torch.equal(model.eval()(x), saved.eval()(x).logits)
