"""HFCausalLM's stages against the Hugging Face model's own forward, for every family tried (cut with
no per-family code): the stages, run in order the way the engine runs them, give the same logits
(float64, exactly, with left and right padding), the same loss and the same gradients; every
parameter and buffer is under ``stages``, a tied embedding stays one Parameter, a saved model loads
back offline with its architecture read from its config.json, and a model that cannot be cut, or a
config the data cannot use, is one sentence."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from helpers.training import run_stages
from launcher.models import HFCausalLM
from launcher.torch_support.staged import skeleton

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
    "gpt_neox": {},  # parallel attention and MLP, partial rotary
    "opt": {"ffn_dim": 64},  # tied, learned positions offset by 2 and taken from the mask's cumulative sum
    "phi3": {"num_key_value_heads": 2},  # fused qkv, partial rotary
    "stablelm": {"num_key_value_heads": 2, "qk_layernorm": True},
    "falcon": {},  # tied, rotary, parallel attention, multi-query
    "mixtral": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},  # mixture of experts
}
#: the families' other shapes: (family, what changes)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "falcon-alibi": ("falcon", {"alibi": True}),  # ALiBi folded into the mask the model's forward builds
    "falcon-alibi-sequential": ("falcon", {"alibi": True, "parallel_attn": False, "multi_query": False}),
    "falcon-new-architecture": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "opt-projected": ("opt", {"ffn_dim": 64, "word_embed_proj_dim": 16}),  # project_in / project_out
    "opt-post-norm": ("opt", {"ffn_dim": 64, "do_layer_norm_before": False}),  # no final norm
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "stablelm-parallel": ("stablelm", {"use_parallel_residual": True}),
}
FAMILIES = list(EXTRA)
B, T = 3, 12


def tiny(arch: str, extra: dict[str, Any] | None = None, **kw: Any) -> HFCausalLM:
    torch.manual_seed(0)
    if arch == "mixtral":  # float64: the default grouped_mm experts take float32 and bf16 only
        kw.setdefault("experts_implementation", "batched_mm")
    return HFCausalLM(arch, config={**TINY, **(EXTRA[arch] if extra is None else extra)}, **kw).double()


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
    equal_forward(model)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_equal_the_models_forward(name: str) -> None:
    arch, extra = VARIANTS[name]
    model = tiny(arch, {**TINY, **extra})
    equal_forward(model)
    model.train()  # and the gradients, through every stage
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 128, (B, T), generator=g), torch.randint(0, 128, (B, T), generator=g)
    inp, target = model.split_batch((x, y))
    torch.manual_seed(3)  # the family's dropout on: both passes draw the same masks, in the same order
    model.loss(run_stages(model.stages, inp), target).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(3)
    model.training_step((x, y), 0).backward()
    for n, p in model.named_parameters():
        assert torch.equal(ours[n], p.grad), n


def equal_forward(model: HFCausalLM) -> None:
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
    torch.manual_seed(3)  # the family's dropout on: both passes draw the same masks, in the same order
    staged = model.loss(run_stages(model.stages, inp), target)
    staged.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(3)
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


def test_a_stages_skeleton_copies_no_weight(model: HFCausalLM) -> None:
    """The engine computes on fetched weights through a skeleton of each stage (a deep copy, its own
    parameters on the meta device). Nothing a stage keeps may reach the rest of the model: a
    skeleton that copied the model along (through a bound method of the cut's plan, once) held a
    copy of every real weight per stage, 1.3 GB more per worker of a 0.17 B Llama under fsdp W=4."""
    before = {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor) and not t.is_meta}
    skeletons = [skeleton(stage) for stage in model.stages]
    new = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and not t.is_meta and id(t) not in before]
    buffers = sum(b.numel() for stage in model.stages for b in stage.buffers())
    assert sum(t.numel() for t in new) <= buffers, [tuple(t.shape) for t in new][:10]
    assert len(skeletons) == len(model.stages)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "gemma", "opt", "falcon"])
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
    # the final norm runs in the last layer's stage, with the rest of the model's forward after the layers
    assert model.stages[2].norm is model.hf.model.norm and model.stages[-1].lm_head is model.hf.lm_head


def test_pretrained_round_trip(tmp_path) -> None:
    for arch in ("gpt2", "llama", "opt"):
        built = tiny(arch)
        built.hf.save_pretrained(tmp_path / arch)
        # the architecture comes from the directory's config.json: model.arch may be left out
        loaded = HFCausalLM(pretrained=str(tmp_path / arch))
        assert loaded.hf.config.model_type == arch
        a, b = built.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys()
        assert all(a[k].dtype == b[k].dtype == torch.float64 and torch.equal(a[k], b[k]) for k in a)
        assert (loaded.stages[0].tokens.weight is loaded.stages[-1].lm_head.weight) == (arch != "llama")
    assert HFCausalLM("gpt2", pretrained=str(tmp_path / "gpt2")).hf.config.model_type == "gpt2"
    with pytest.raises(ValueError, match=r"^model.arch=llama does not match model.pretrained=.*a gpt2 model; "):
        HFCausalLM("llama", pretrained=str(tmp_path / "gpt2"))
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError) as e:
        HFCausalLM(pretrained=str(missing))
    assert str(e.value) == f"model.pretrained={missing} is invalid: there is no such directory."
    with pytest.raises(ValueError, match=r"^model.pretrained=.* is invalid: the directory has no config.json "):
        HFCausalLM(pretrained=str(tmp_path))


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
    with pytest.raises(ValueError, match=r"^model.arch=t5 is not supported by model=hf: t5 is an encoder-decoder"):
        HFCausalLM("t5")
    with pytest.raises(ValueError, match=r"^model.arch=vit is not supported: transformers has no causal LM of type"):
        HFCausalLM("vit")
    with pytest.raises(ValueError, match=r"^model.arch=nonesuch is invalid: transformers has no model type nonesuch"):
        HFCausalLM("nonesuch")
    with pytest.raises(ValueError, match=r"rope_type dynamic is not supported: "):
        HFCausalLM("llama", config={**TINY, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    # the small defaults under what is given, the common names working for GPT-2 too
    model = HFCausalLM("gpt2", config={"num_hidden_layers": 1, "n_embd": 16})
    assert (model.hf.config.n_layer, model.hf.config.n_embd, model.hf.config.vocab_size) == (1, 16, 128)
    from transformers import GPT2Config

    assert model.hf.config.resid_pdrop == GPT2Config().resid_pdrop  # dropout: the architecture's own


@pytest.mark.parametrize("arch, why", [
    # BERT's decoder: its embeddings are outside the module that runs the layers
    ("bert", "its input embedding is not a child of BertEncoder, the module that runs the layers"),
    # GPT-BigCode keeps a causal-mask tensor on the module that runs the layers
    ("gpt_bigcode", "GPTBigCodeModel holds tensors of its own, outside its submodules"),
])
def test_a_model_that_cannot_be_cut_names_the_traced_route(arch: str, why: str) -> None:
    with pytest.raises(ValueError) as e:
        HFCausalLM(arch, config={**TINY, "is_decoder": True} if arch == "bert" else TINY)
    assert str(e.value) == (f"model.arch={arch} cannot be cut into stages at its decoder layers: {why}; train it "
                            f"with model=hf_traced and the same model.* keys (traced and cut at any module).")


def test_state_a_stage_cannot_keep_is_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"^model.config.output_router_logits=true is not supported: "):
        tiny("mixtral", {**TINY, **EXTRA["mixtral"], "output_router_logits": True})
    with pytest.raises(ValueError, match=r"^model.config.layerdrop=0.5 is not supported: "):
        tiny("opt", {**TINY, **EXTRA["opt"], "layerdrop": 0.5})


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
