"""HFCausalLM's stages against the Hugging Face model's own forward: the stages, run in order the way
the engine runs them, give the same logits (float64, exactly), the same loss and the same gradients;
every parameter and buffer is under ``stages``, a tied embedding stays one Parameter, a saved model
loads back offline, and a config the data cannot use is one sentence."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.training import run_stages
from launcher.models import HFCausalLM
from launcher.models.hf import FAMILIES

pytestmark = [pytest.mark.timeout(60),
              # the steps are called without a Trainer: self.log() has nowhere to log
              pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")]

TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
#: per family: what makes the tiny model cover the family's variants
EXTRA: dict[str, dict[str, Any]] = {
    "gpt2": {},  # tied, learned positions
    "llama": {"num_key_value_heads": 2},  # grouped-query attention
    "mistral": {"num_key_value_heads": 2, "sliding_window": 5},  # a window shorter than the sequence
    "qwen2": {"num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen3": {"num_key_value_heads": 2},
    "gemma": {"num_key_value_heads": 1},  # tied, scaled embedding
}
B, T = 3, 12


def tiny(arch: str, **kw: Any) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(arch, config={**TINY, **EXTRA[arch]}, **kw).double()


def masks() -> list[torch.Tensor | None]:
    left = torch.ones(B, T, dtype=torch.long)
    left[0, :4] = 0
    left[2, :1] = 0
    right = torch.ones(B, T, dtype=torch.long)
    right[1, 7:] = 0
    return [None, left, right]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> HFCausalLM:
    return tiny(request.param)


def test_stages_equal_the_models_forward(model: HFCausalLM) -> None:
    model.eval()
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(1))
    for mask in masks():
        inp = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
        ours = run_stages(model.stages, inp)
        theirs = model.hf(**inp).logits
        assert ours.dtype == torch.float64
        assert (ours - theirs).abs().max().item() <= 1e-12
    # the character corpus's input: a bare tensor
    assert torch.equal(run_stages(model.stages, ids), model.hf(input_ids=ids).logits)


def test_loss_and_gradients_equal_the_single_device_step(model: HFCausalLM) -> None:
    model.train()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 128, (B, T), generator=g), torch.randint(0, 128, (B, T), generator=g)
    inp, target = model.split_batch((x, y))
    staged = model.loss(run_stages(model.stages, inp), target)
    staged.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    single = model.training_step((x, y), 0)
    single.backward()
    assert abs(staged.item() - single.item()) <= 1e-12
    for n, p in model.named_parameters():
        assert torch.equal(ours[n], p.grad), n
    model.zero_grad()


def dict_batches() -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    from transformers import BatchEncoding

    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(3))
    mask = masks()[2]
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, [{"input_ids": ids, "attention_mask": mask, "labels": labels},
                       BatchEncoding({"input_ids": ids, "attention_mask": mask}),  # labels: the tokens, less padding
                       {"input_ids": ids, "attention_mask": mask}]


def test_dict_batches(model: HFCausalLM) -> None:
    model.eval()
    ids, mask, batches = dict_batches()
    # the model's own loss computes in float32; ours keeps float64 (and equals it to float32's precision)
    reference = model.hf(input_ids=ids, attention_mask=mask, labels=batches[0]["labels"]).loss
    single = model.validation_step(batches[0], 0)
    assert abs(single.item() - reference.item()) <= 1e-6
    for batch in batches:
        inp, target = model.split_batch(batch)
        assert type(inp) is dict and set(inp) == {"input_ids", "attention_mask"}
        assert abs(model.loss(run_stages(model.stages, inp), target).item() - single.item()) <= 1e-12
        assert abs(model.validation_step(batch, 0).item() - single.item()) <= 1e-12


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_in_float32_the_loss_is_the_models_own(arch: str) -> None:
    torch.manual_seed(0)
    model = HFCausalLM(arch, config={**TINY, **EXTRA[arch]}).eval()
    ids, mask, batches = dict_batches()
    reference = model.hf(input_ids=ids, attention_mask=mask, labels=batches[0]["labels"]).loss
    for batch in batches:
        assert torch.equal(model.validation_step(batch, 0), reference)


def test_every_parameter_and_buffer_is_under_stages(model: HFCausalLM) -> None:
    assert all(n.startswith("stages.") for n, _ in model.named_parameters())
    assert all(n.startswith("stages.") for n, _ in model.named_buffers())
    assert {id(p) for p in model.hf.parameters()} == {id(p) for p in model.parameters()}
    assert {id(b) for b in model.hf.buffers()} == {id(b) for b in model.buffers()}
    # the stages are the model's own modules: .double() above converted the model itself
    assert all(t.dtype == torch.float64 for t in [*model.hf.parameters(), *model.hf.buffers()] if t.is_floating_point())
    model.train(False)
    assert not model.hf.training and not model.hf.base_model.training


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "gemma"])
def test_a_tied_embedding_stays_one_parameter(arch: str) -> None:
    model = tiny(arch)
    assert model.hf.config.tie_word_embeddings
    first, last = model.stages[0].tokens.weight, model.stages[-1].lm_head.weight
    assert first is last and first is model.hf.get_input_embeddings().weight
    assert sum(p is first for p in model.parameters()) == 1  # one Parameter, optimized once


def test_llama_untied_and_grouped_query() -> None:
    model = tiny("llama")
    assert model.stages[0].tokens.weight is not model.stages[-1].lm_head.weight
    attn = model.stages[1].layer.self_attn
    assert attn.k_proj.out_features * 2 == attn.q_proj.out_features  # 2 key/value heads for 4 query heads
    assert len(model.stages) == 4


def test_pretrained_round_trip(tmp_path) -> None:
    for arch in ("gpt2", "llama"):
        built = tiny(arch)
        built.hf.save_pretrained(tmp_path / arch)
        loaded = HFCausalLM(arch, pretrained=str(tmp_path / arch))
        a, b = built.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys()
        assert all(a[k].dtype == b[k].dtype == torch.float64 and torch.equal(a[k], b[k]) for k in a)
        assert (loaded.stages[0].tokens.weight is loaded.stages[-1].lm_head.weight) == (arch == "gpt2")
    with pytest.raises(ValueError, match=r"^model.arch=llama does not match model.pretrained=.*a gpt2 model; "):
        HFCausalLM("llama", pretrained=str(tmp_path / "gpt2"))


def test_a_vocabulary_smaller_than_the_datas_is_one_sentence(tmp_path) -> None:
    with pytest.raises(ValueError) as e:
        HFCausalLM("llama", config={**TINY, "vocab_size": 64})
    assert str(e.value) == ("model.config.vocab_size=64 is invalid: the vocabulary must hold the data's 128 symbols, "
                            "so it must be at least 128.")
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2, vocab_size=50)
                                     ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^model.config.vocab_size=50 \(from model.pretrained=.*\) is invalid: "):
        HFCausalLM("gpt2", pretrained=str(tmp_path))


def test_config_keys_are_checked() -> None:
    with pytest.raises(ValueError,
                       match=r"^model.config.n_layer=2 is invalid: llama's LlamaConfig has no field n_layer\.$"):
        HFCausalLM("llama", config={"n_layer": 2})
    with pytest.raises(ValueError, match=r"set the same field of gpt2's GPT2Config; give one of them\.$"):
        HFCausalLM("gpt2", config={"num_hidden_layers": 3, "n_layer": 2})
    with pytest.raises(ValueError, match=r"^model.arch=bert is not supported: "):
        HFCausalLM("bert")
    with pytest.raises(ValueError, match=r"rope_type dynamic is not supported: "):
        HFCausalLM("llama", config={**TINY, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    # the small defaults under what is given, the common names working for GPT-2 too
    model = HFCausalLM("gpt2", config={"num_hidden_layers": 1, "n_embd": 16})
    assert (model.hf.config.n_layer, model.hf.config.n_embd, model.hf.config.vocab_size) == (1, 16, 128)
    assert model.hf.config.resid_pdrop == 0.0


def test_the_hf_config_group() -> None:
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    import launcher.config.schema  # noqa: F401 - registers the schema

    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = compose("config", overrides=["model=hf", "model.arch=gpt2", "model.config.n_layer=2",
                                           "model.config.n_embd=32", "trainer.max_steps=5"])
    model = instantiate(cfg.model)
    assert isinstance(model, HFCausalLM) and len(model.stages) == 4 and model.hparams.max_steps == 5
    assert model.hf.config.n_embd == 32
