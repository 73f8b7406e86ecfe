"""Any Hugging Face ``transformers`` causal LM, by name or from a local directory, cut into stages
made of the model's own submodules: ``stages = [embeddings, decoder layer x L (the last with the
final norm), lm_head]``, found in the model's module tree and run by the library's own forward code
(:mod:`.hf_stages`), with no per-family code.

The model is built from a config with random weights (no download), or loaded from a local
directory written by ``save_pretrained``. The Hugging Face model stays whole as ``self.hf``: its own
``forward`` is the single-device path, the oracle the stages must match. It is kept out of the module
tree, so every parameter and buffer is named once, under ``stages.``, and ``.to()`` on this module
reaches all of them. A tied embedding (GPT-2, and Qwen2 / Gemma / OPT when tied) stays one
``Parameter``, held by the first and the last stage.

What a stage takes and returns (the engine unpacks a tuple into positional arguments):

- stage 0: ``input_ids`` (and ``attention_mask``, ``position_ids`` when the batch has them)
  -> ``(hidden, input_ids, attention_mask, position_ids)``;
- decoder layer: that tuple -> the same tuple with the layer's hidden state; the model's forward
  builds the layer's masks, positions, ALiBi and rotary ``(cos, sin)`` from the integer inputs, so
  only they travel between stages; the last layer returns its normed hidden state alone;
- last stage: the hidden state -> ``logits``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..torch_support.init import real_init
from . import hf_stages
from .base import adamw_cosine
from .data import VOCAB

if TYPE_CHECKING:  # transformers is imported where a model is built (it takes seconds)
    from transformers import PreTrainedConfig, PreTrainedModel

#: a small model from scratch, for every key the family's config has; ``config`` overrides any of
#: them. Dropout stays the architecture's own (GPT-2: 0.1): every scheme draws the same masks
#: (:mod:`launcher.torch_support.streams`). LayerDrop stays off: its forward skips whole layers, refused.
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "layerdrop": 0.0,
}
#: the architecture built from scratch when neither ``arch`` nor ``pretrained`` says one
DEFAULT_ARCH = "llama"
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _plain(config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, DictConfig):
        return cast(dict[str, Any], OmegaConf.to_container(config, resolve=True))  # a DictConfig's container is a dict
    return dict(config)


@functools.lru_cache(maxsize=128)  # one default instance per config class a run builds
def _default(cls: type) -> Any:
    return cls()


def _fields(cls: type[PreTrainedConfig]) -> set[str]:
    """The keys a config class has: its fields, their aliases, and what its default instance sets."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    # mypy checks a config class against Hashable with the instances' __hash__ (a false error)
    return names | set(cls.attribute_map) | set(vars(_default(cls)))  # type: ignore[arg-type]


def _overrides(arch: str, cls: type[PreTrainedConfig], config: Mapping[str, Any],
               siblings: bool = False) -> dict[str, Any]:
    """``config`` with unset (null) keys dropped and aliases (GPT-2's ``num_hidden_layers`` for
    ``n_layer``) turned into the family's own names; one sentence for a key the family does not have
    or a field given twice. With ``siblings``, a common key of :data:`SIBLINGS` the family has only
    under other names (T5's ``d_ff`` for ``intermediate_size``) is kept, for :func:`_small`."""
    known = _fields(cls)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in config.items():
        if value is None:
            continue
        if siblings and key not in known and any(o in known for o in SIBLINGS.get(key, ())):
            out[key] = given[key] = value
            continue
        if key not in known:
            raise ValueError(f"model.config.{key}={value} is invalid: {arch}'s {cls.__name__} has no field {key}.")
        name = cls.attribute_map.get(key, key)
        if name in out and out[name] != value:
            raise ValueError(f"model.config.{given[name]}={out[name]} and model.config.{key}={value} set the same "
                             f"field of {arch}'s {cls.__name__}; give one of them.")
        out[name], given[name] = value, key
    return out


#: fields that size a second stack or a wider layer under another name (an encoder-decoder's
#: decoder, T5's and BART's feed-forward width): from scratch they follow the common key's value
SIBLINGS = {"intermediate_size": ("d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim", "n_inner"),
            "num_hidden_layers": ("encoder_layers", "decoder_layers", "num_decoder_layers"),
            "num_attention_heads": ("encoder_attention_heads", "decoder_attention_heads")}


def _small(cls: type[PreTrainedConfig], given: dict[str, Any], siblings: bool = False) -> dict[str, Any]:
    """:data:`SMALL` under ``given``, for the keys ``cls`` has; ``head_dim`` follows the width, and a
    default token id beyond the vocabulary is dropped (an embedding cannot pad with it). With
    ``siblings``, the fields of :data:`SIBLINGS` (and T5's ``d_kv``) follow their common key too."""
    known = _fields(cls)
    out = {cls.attribute_map.get(k, k): v for k, v in SMALL.items() if k in known}
    out.update(given)
    if siblings:
        for key, others in SIBLINGS.items():
            own = cls.attribute_map.get(key, key)
            value = out.get(own, SMALL[key]) if own in known else out.pop(key, SMALL[key])
            out.update({o: value for o in others if o in known and o not in given and o != own})
        if "d_kv" in known and "d_kv" not in given:
            out["d_kv"] = out[cls.attribute_map.get("hidden_size", "hidden_size")] // out[
                cls.attribute_map.get("num_attention_heads", "num_attention_heads")]
    if "head_dim" in known and "head_dim" not in given:
        width = out[cls.attribute_map.get("hidden_size", "hidden_size")]
        heads = out[cls.attribute_map.get("num_attention_heads", "num_attention_heads")]
        out["head_dim"] = width // heads
    default = _default(cls)  # type: ignore[arg-type]  # a config class is hashable (see _fields)
    for key in TOKEN_IDS:
        value = getattr(default, key, None)
        if key not in given and isinstance(value, int) and value >= out["vocab_size"]:
            out[key] = None
    return out


def _saved_config(pretrained: str) -> Any:
    """The config a ``save_pretrained`` directory holds; one sentence for a missing directory or one
    without ``config.json``."""
    from transformers import AutoConfig

    if not os.path.isdir(pretrained):
        raise ValueError(f"model.pretrained={pretrained} is invalid: there is no such directory.")
    if not os.path.isfile(os.path.join(pretrained, "config.json")):
        raise ValueError(f"model.pretrained={pretrained} is invalid: the directory has no config.json "
                         f"(write one with save_pretrained).")
    try:
        return AutoConfig.from_pretrained(pretrained, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model.pretrained={pretrained} is invalid: its config.json cannot be read "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__}).") from e


#: the heads a model is built with: ``transformers``' auto class, and the mapping of config classes it has
HEADS = {"causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING", "causal LM"),
         "seq2seq_lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING", "encoder-decoder LM")}


def build(arch: str | None, config: Mapping[str, Any] | None, pretrained: str | None, dtype: str | None,
          attn_implementation: str | None = None, experts_implementation: str | None = None,
          head: str | None = "causal_lm", siblings: bool = False) -> PreTrainedModel:
    """The Hugging Face model: from ``arch``'s config (default :data:`DEFAULT_ARCH`) with
    :data:`SMALL` under ``config`` and random weights, or, with ``pretrained``, config and weights
    from that local directory (its ``config.json`` says the architecture), ``config`` over the saved
    config. ``head``: a key of :data:`HEADS`; ``None``: the encoder-decoder LM where the family has
    one (T5, BART), else the causal LM; ``siblings``: see :func:`_small`. One sentence (``ValueError``)
    for what cannot be built."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    saved = None if pretrained is None else _saved_config(pretrained)
    if saved is not None:
        if arch is not None and saved.model_type != arch:
            raise ValueError(f"model.arch={arch} does not match model.pretrained={pretrained}, a {saved.model_type} "
                             f"model; set model.arch={saved.model_type} or leave it out.")
        arch = saved.model_type
    arch = DEFAULT_ARCH if arch is None else arch
    if arch not in CONFIG_MAPPING:
        raise ValueError(f"model.arch={arch} is invalid: transformers has no model type {arch}.")
    cls = CONFIG_MAPPING[arch]
    if head is None:
        head = "seq2seq_lm" if cls in transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING else "causal_lm"
    auto_name, mapping, what = HEADS[head]
    if cls not in getattr(transformers, mapping):
        if head == "causal_lm" and cls in transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
            raise ValueError(f"model.arch={arch} is not supported by model=hf: {arch} is an encoder-decoder "
                             f"(AutoModelForSeq2SeqLM), and model=hf cuts causal LMs at their decoder layers; "
                             f"{hf_stages.ROUTE}.")
        raise ValueError(f"model.arch={arch} is not supported: transformers has no {what} of type {arch} "
                         f"({auto_name}).")
    auto = getattr(transformers, auto_name)
    given = _overrides(arch, cls, _plain(config), siblings)
    kw: dict[str, Any] = {}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    if dtype is not None:
        kw["dtype"] = getattr(torch, dtype)
    if pretrained is None:
        cfg = AutoConfig.for_model(arch, **_small(cls, given, siblings))
    else:
        cfg = AutoConfig.from_pretrained(pretrained, local_files_only=True, **given)
    if cfg.vocab_size < VOCAB:
        where = "" if pretrained is None or "vocab_size" in given else f" (from model.pretrained={pretrained})"
        raise ValueError(f"model.config.vocab_size={cfg.vocab_size}{where} is invalid: the vocabulary must hold the "
                         f"data's {VOCAB} symbols, so it must be at least {VOCAB}.")
    if pretrained is None:
        return auto.from_config(cfg, **kw)
    with real_init():  # loaded weights are real even where the model is built on the meta device
        return auto.from_pretrained(pretrained, config=cfg, local_files_only=True, **kw)


#: the keys of ``model.lora`` (peft's ``LoraConfig`` names: ``alpha`` is ``lora_alpha``, ``dropout`` ``lora_dropout``)
LORA_KEYS = ("r", "alpha", "dropout", "target_modules")


def _lora_error(lora: Mapping[str, Any], arch: str) -> str | None:
    """One sentence for a ``model.lora`` that cannot be used, else None."""
    for key, value in lora.items():
        if key not in LORA_KEYS:
            return f"model.lora.{key}={value} is invalid: model.lora takes {', '.join(LORA_KEYS)}."
    r = lora.get("r")
    if r is None:
        given = next(((k, v) for k, v in lora.items() if v is not None), None)
        return None if given is None else (f"model.lora.{given[0]}={given[1]} needs model.lora.r: set the adapters' "
                                           f"rank (e.g. model.lora.r=8) to train with LoRA.")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        return f"model.lora.r={r} is invalid: the adapters' rank must be a positive integer (e.g. 8)."
    alpha = lora.get("alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        return f"model.lora.alpha={alpha} is invalid: the adapters' scale (alpha / r) needs a positive number."
    p = lora.get("dropout")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1):
        return f"model.lora.dropout={p} is invalid: a dropout probability must be at least 0 and below 1."
    targets = lora.get("target_modules")
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        if arch not in DEFAULTS:
            return (f"model.lora.target_modules=null is invalid for model.arch={arch}: peft has no default adapter "
                    f"targets for it; name the modules (e.g. model.lora.target_modules=[q_proj,v_proj]).")
    elif isinstance(targets, str) or not (isinstance(targets, (list, tuple)) and targets
                                          and all(isinstance(t, str) and t for t in targets)):
        return (f"model.lora.target_modules={targets} is invalid: it must be a non-empty list of module names "
                f"(e.g. [q_proj,v_proj]), or null for peft's default for the family.")
    return None


def add_lora(model: PreTrainedModel, lora: Mapping[str, Any]) -> None:
    """Low-rank adapters (peft's LoRA) on ``model``'s target modules, in place: the adapters train,
    every other parameter is frozen (``requires_grad=False``). One sentence (``ValueError``) for a
    ``model.lora`` that cannot be used."""
    arch = str(model.config.model_type)
    found = _lora_error(lora, arch)
    if found:
        raise ValueError(found)
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    targets = lora.get("target_modules")
    targets = list(DEFAULTS[arch]) if targets is None else list(targets)
    kw: dict[str, Any] = {"r": lora["r"], "target_modules": targets}
    if lora.get("alpha") is not None:
        kw["lora_alpha"] = lora["alpha"]
    if lora.get("dropout") is not None:
        kw["lora_dropout"] = float(lora["dropout"])
    if arch == "gpt2":  # GPT-2's Conv1D keeps its weight transposed
        kw["fan_in_fan_out"] = True
    try:
        inject_adapter_in_model(LoraConfig(**kw), model)
    except ValueError as e:
        hint = f" (peft's default for {arch}: [{','.join(DEFAULTS[arch])}])" if arch in DEFAULTS else ""
        why = ("no module of the model has that name" + hint if "not found" in str(e)
               else " ".join(str(e).split()).rstrip("."))
        raise ValueError(f"model.lora.target_modules=[{','.join(targets)}] is invalid for model.arch={arch}: "
                         f"{why}.") from None


def reset_lora(module: nn.Module) -> None:
    """peft's own start for every adapter in ``module`` (``lora_A`` Kaiming-uniform, ``lora_B``
    zero: the adapted model starts as the base model)."""
    from peft.tuners.lora import LoraLayer

    for m in module.modules():
        if isinstance(m, LoraLayer):
            for name in m.lora_A:
                m.reset_lora_parameters(name, True)


def cut(model: PreTrainedModel) -> list[nn.Module]:
    """``model``'s own submodules as stages (no copies): the embeddings, one stage per decoder
    layer (the last with the final norm), ``lm_head`` (:mod:`.hf_stages`). One sentence
    (``ValueError``) for a model that cannot be cut so, or whose state a stage could not keep."""
    config = model.config
    if getattr(config, "output_router_logits", False):
        raise ValueError("model.config.output_router_logits=true is not supported: the load-balancing loss "
                         "couples the router logits of every layer; set it to false.")
    layerdrop = getattr(config, "layerdrop", 0) or 0
    if layerdrop:
        raise ValueError(f"model.config.layerdrop={layerdrop} is not supported: the model's forward skips "
                         f"layers at random, which no stage sees; set it to 0.")
    for module in model.modules():
        rope = str(getattr(module, "rope_type", "default"))
        if "dynamic" in rope or "longrope" in rope:
            raise ValueError(f"model.config.rope_parameters with rope_type {rope} is not supported: it recomputes the "
                             f"rotary frequencies from the positions it sees, so a stage's state would change with its "
                             f"data; use a static rope_type (default, linear, llama3, yarn).")
    try:
        return hf_stages.cut(model)
    except hf_stages.CutError as e:
        raise ValueError(str(e)) from None


class HFCausalLM(LightningModule):
    """A ``transformers`` causal LM (``arch``: any model type with an ``AutoModelForCausalLM``; with
    ``pretrained``, the directory's ``config.json`` says it) as ``self.stages``.

    ``config`` sets fields of the family's config (null: unset); from scratch they go over
    :data:`SMALL`, with ``pretrained`` (a local ``save_pretrained`` directory, read offline) over the
    saved config. ``attn_implementation`` is ``sdpa``, ``eager``, ... (null: the library's default,
    sdpa where the family has it); ``dtype`` (``float32``,
    ``bfloat16``, ...) the parameters' dtype, else float32 from scratch and the saved one when
    loaded. Batches are the character corpus's ``(x, y)`` or dicts with ``input_ids`` and optional
    ``attention_mask`` and ``labels`` (:meth:`split_batch`); the loss is the model's own shifted
    cross-entropy. AdamW with a cosine learning-rate schedule over ``max_steps``, like :class:`GPT`.
    ``experts_implementation`` picks the mixture-of-experts kernel (null: the library's default,
    ``grouped_mm``, which takes float32 and bf16 only; ``batched_mm`` computes in any dtype and
    runs on the meta device, which the engine's memory estimate needs; ``eager`` routes by value).
    ``lora`` (``r``, ``alpha``, ``dropout``, ``target_modules``; ``r`` null: off) trains peft's LoRA
    adapters only, every other weight frozen (:func:`add_lora`; ``target_modules`` null: peft's
    default for the family, e.g. ``q_proj``/``v_proj`` for Llama, ``c_attn`` for GPT-2).
    """

    stages: nn.ModuleList
    hf: PreTrainedModel  # a plain attribute (see __init__)

    def __init__(self, arch: str | None = None, config: Mapping[str, Any] | None = None, pretrained: str | None = None,
                 lr: float = 3e-3, weight_decay: float = 0.0, max_steps: int = 0, dtype: str | None = None,
                 attn_implementation: str | None = None, experts_implementation: str | None = None,
                 lora: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        model = build(arch, config, pretrained, dtype, attn_implementation, experts_implementation)
        model.loss_type = "ForCausalLM"  # what GPT2LMHeadModel falls back to anyway, with a warning
        lora = _plain(lora)
        self.lora = lora.get("r") is not None
        if self.lora or any(v is not None for v in lora.values()):  # the latter: one sentence on what lacks r
            # adapters take their device from the layer they wrap: real on loaded weights (started by
            # peft here; no stage of a loaded model is initialised again), meta on a meta-built model
            with real_init():
                add_lora(model, lora)
        # a plain attribute, not a child module: its parameters are named once, under stages
        object.__setattr__(self, "hf", model)
        self.stages = nn.ModuleList(cut(model))

    def reset_stage(self, module: nn.Module) -> None:
        """Initialise one module of ``self.stages`` with the library's own ``_init_weights`` (the
        rule a model built on the meta device follows, :mod:`launcher.torch_support.init`)."""
        for m in module.modules():
            self.hf._init_weights(m)
        if self.lora:  # the library's rule reaches the adapters' layers too: peft's own start instead
            reset_lora(module)

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        if "hf" in self.__dict__:
            self.hf.train(mode)  # the outer modules, which the stages do not hold
        return self

    def split_batch(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """``(input, target)`` of a batch: ``input`` is the token ids (a tensor), or a dict of
        ``input_ids`` with ``attention_mask`` / ``position_ids`` where given; ``target`` the next token
        at every position (-100: no loss there). A dict's ``labels`` are the Hugging Face kind,
        unshifted; without labels the tokens themselves are the labels, padding excluded."""
        if isinstance(batch, (tuple, list)):
            x, y = batch
            return x, y
        if not isinstance(batch, Mapping):  # BatchEncoding is a UserDict
            batch = dict(batch)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if batch.get(k) is not None}
        labels = batch.get("labels")
        if labels is None:
            labels = inputs["input_ids"]
            if "attention_mask" in inputs:
                labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
        # the shift ForCausalLMLoss makes of labels: position t predicts token t + 1
        target = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return inputs, target

    def loss_items(self, batch: Any) -> torch.Tensor:
        """The positions with a target in ``batch`` (padding and -100 labels have none): what
        :meth:`loss` averages over, so a scheme weighs each micro-batch by its share of them."""
        return (self.split_batch(batch)[1] != -100).sum()

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The model's own causal-LM cross-entropy, mean over the positions with a target."""
        if logits.dtype == torch.float64:
            # ForCausalLMLoss casts the logits to float32 (meant as an upcast from half precision);
            # its cross-entropy without the cast keeps a float64 run, and its gradients, in float64
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
        return self.hf.loss_function(logits=logits, labels=None, vocab_size=self.hf.config.vocab_size,
                                     shift_labels=target)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits from the Hugging Face model's own forward."""
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits

    def _step(self, batch: Any, key: str, prog_bar: bool) -> torch.Tensor:
        inputs, target = self.split_batch(batch)
        logits = self(**inputs) if isinstance(inputs, Mapping) else self(inputs)
        loss = self.loss(logits, target)
        self.log(key, loss, prog_bar=prog_bar, batch_size=target.shape[0])
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train_loss", True)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val_loss", True)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test_loss", False)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, _ = self.split_batch(batch)
        return self(**inputs) if isinstance(inputs, Mapping) else self(inputs)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's union of return types
        hp = self.hparams
        # every parameter, as a user's module passes them: a frozen one (LoRA's base model) never has
        # a gradient, so AdamW keeps no state for it and never changes it
        return adamw_cosine(self.parameters(), hp["lr"], hp["weight_decay"], hp["max_steps"])
