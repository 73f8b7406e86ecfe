"""Any Hugging Face ``transformers`` causal LM of a supported family, cut into stages made of the
model's own submodules: ``stages = [embeddings, decoder layer x L, final norm + lm_head]``.

The model is built from a config with random weights (no download), or loaded from a local
directory written by ``save_pretrained``. The Hugging Face model stays whole as ``self.hf``: its own
``forward`` is the single-device path, the oracle the stages must match. It is kept out of the module
tree, so every parameter and buffer is named once, under ``stages.``, and ``.to()`` on this module
reaches all of them. A tied embedding (GPT-2, and Qwen2 / Gemma when tied) stays one ``Parameter``,
held by the first and the last stage.

What a stage takes and returns (the engine unpacks a tuple into positional arguments):

- stage 0: ``input_ids`` (and ``attention_mask``, ``position_ids`` when the batch has them)
  -> ``(hidden, position_ids, attention_mask)``;
- decoder layer: ``(hidden, position_ids, attention_mask)`` -> the same triple; each layer builds its
  4-D mask and its rotary ``(cos, sin)`` from those with the library's own functions, as the model's
  forward does, so only the 2-D mask and the integer positions travel between stages;
- last stage: the triple -> ``logits``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..runtime.init import real_init
from .base import adamw_cosine
from .data import VOCAB

#: families whose model forward is ``embed_tokens``, then every decoder layer called as
#: ``layer(hidden, attention_mask=mask, position_ids=..., position_embeddings=(cos, sin))``, then
#: ``norm`` and ``lm_head``, with nothing computed outside those modules (Gemma's embedding scale is
#: inside its embedding; no logit scaling or soft-capping): each is checked against the model's own
#: forward in tests/test_hf_models.py
ROTARY = ("llama", "mistral", "qwen2", "qwen3", "gemma")
FAMILIES = ("gpt2", *ROTARY)

#: a small model from scratch, for every key the family's config has (and no dropout, so a scheme
#: and the single-device run compute the same function); ``config`` overrides any of them
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attention_dropout": 0.0,
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


class Embeddings(nn.Module):
    """Token embedding (GPT-2: plus learned positions, then dropout); passes the positions and the
    2-D mask on to the decoder layers."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None = None,
                 drop: nn.Module | None = None) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.drop = drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        hidden = self.tokens(input_ids)
        if position_ids is None:
            # what the model's forward uses, one row per sample: a tensor of the micro-batch
            B, T = input_ids.shape
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T).contiguous()
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids)
        if self.drop is not None:
            hidden = self.drop(hidden)
        return hidden, position_ids, attention_mask


class _MaskedLayer(nn.Module):
    """A decoder layer that builds, from the 2-D mask and positions it is passed, the 4-D mask
    the model's forward would give it (with the library's own mask function)."""

    def __init__(self, make_mask: Callable[..., Any], config: Any) -> None:
        super().__init__()
        self.make_mask = make_mask
        self.config = config

    def mask(self, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
        return self.make_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                              past_key_values=None, position_ids=position_ids)


class RotaryLayer(_MaskedLayer):
    """One decoder layer of a rotary family, with the model's rotary embedding (shared by every
    layer: a constant buffer) and the mask its layer type calls for."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, make_mask: Callable[..., Any], config: Any) -> None:
        super().__init__(make_mask, config)
        self.layer = layer
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        mask = self.mask(hidden, position_ids, attention_mask)
        cos_sin = self.rotary(hidden, position_ids)
        hidden = self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
        return hidden, position_ids, attention_mask


class GPT2Layer(_MaskedLayer):
    """One GPT-2 block with the causal mask the model's forward builds."""

    def __init__(self, block: nn.Module, make_mask: Callable[..., Any], config: Any) -> None:
        super().__init__(make_mask, config)
        self.block = block

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        hidden = self.block(hidden, None, self.mask(hidden, position_ids, attention_mask), position_ids=position_ids)
        return hidden, position_ids, attention_mask


class Head(nn.Module):
    """Final norm and ``lm_head``: the logits at every position."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _plain(config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    return dict(OmegaConf.to_container(config, resolve=True)) if isinstance(config, DictConfig) else dict(config)


@functools.cache
def _default(cls: type) -> Any:
    return cls()


def _fields(cls: type) -> set[str]:
    """The keys a config class has: its fields, their aliases, and what its default instance sets."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(cls.attribute_map) | set(vars(_default(cls)))


def _overrides(arch: str, cls: type, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with unset (null) keys dropped and aliases (GPT-2's ``num_hidden_layers`` for
    ``n_layer``) turned into the family's own names; one sentence for a key the family does not have
    or a field given twice."""
    known = _fields(cls)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in config.items():
        if value is None:
            continue
        if key not in known:
            raise ValueError(f"model.config.{key}={value} is invalid: {arch}'s {cls.__name__} has no field {key}.")
        name = cls.attribute_map.get(key, key)
        if name in out and out[name] != value:
            raise ValueError(f"model.config.{given[name]}={out[name]} and model.config.{key}={value} set the same "
                             f"field of {arch}'s {cls.__name__}; give one of them.")
        out[name], given[name] = value, key
    return out


def _small(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """:data:`SMALL` under ``given``, for the keys ``cls`` has; ``head_dim`` follows the width, and a
    default token id beyond the vocabulary is dropped (an embedding cannot pad with it)."""
    known = _fields(cls)
    out = {cls.attribute_map.get(k, k): v for k, v in SMALL.items() if k in known}
    out.update(given)
    if "head_dim" in known and "head_dim" not in given:
        width = out.get(cls.attribute_map.get("hidden_size", "hidden_size"))
        heads = out.get(cls.attribute_map.get("num_attention_heads", "num_attention_heads"))
        out["head_dim"] = width // heads
    default = _default(cls)
    for key in TOKEN_IDS:
        value = getattr(default, key, None)
        if key not in given and isinstance(value, int) and value >= out["vocab_size"]:
            out[key] = None
    return out


def build(arch: str, config: Mapping[str, Any] | None, pretrained: str | None, dtype: str | None,
          attn_implementation: str) -> nn.Module:
    """The Hugging Face model: from ``arch``'s config with :data:`SMALL` under ``config`` and random
    weights, or, with ``pretrained``, config and weights from that local directory, ``config`` over
    the saved config. One sentence (``ValueError``) for what cannot be built."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    if arch not in FAMILIES:
        raise ValueError(f"model.arch={arch} is not supported: HFCausalLM cuts {', '.join(FAMILIES)} into stages.")
    cls = CONFIG_MAPPING[arch]
    given = _overrides(arch, cls, _plain(config))
    kw: dict[str, Any] = {"attn_implementation": attn_implementation}
    if dtype is not None:
        kw["dtype"] = getattr(torch, dtype)
    if pretrained is None:
        cfg = AutoConfig.for_model(arch, **_small(cls, given))
    else:
        try:
            cfg = AutoConfig.from_pretrained(pretrained, local_files_only=True, **given)
        except OSError as e:
            raise ValueError(f"model.pretrained={pretrained} is invalid: no model config there ({e}).") from e
        if cfg.model_type != arch:
            raise ValueError(f"model.arch={arch} does not match model.pretrained={pretrained}, a {cfg.model_type} "
                             f"model; set model.arch={cfg.model_type}.")
    if cfg.vocab_size < VOCAB:
        where = "" if pretrained is None or "vocab_size" in given else f" (from model.pretrained={pretrained})"
        raise ValueError(f"model.config.vocab_size={cfg.vocab_size}{where} is invalid: the vocabulary must hold the "
                         f"data's {VOCAB} symbols, so it must be at least {VOCAB}.")
    if pretrained is None:
        return AutoModelForCausalLM.from_config(cfg, **kw)
    with real_init():  # loaded weights are real even where the model is built on the meta device
        return AutoModelForCausalLM.from_pretrained(pretrained, config=cfg, local_files_only=True, **kw)


def _layer_mask(config: Any, i: int) -> Callable[..., Any]:
    """The mask function the model's forward uses for layer ``i``: ``layer_types`` where the config
    has them, else a sliding window where it sets one (Mistral), else the causal mask."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    types = getattr(config, "layer_types", None)
    if types is not None:
        sliding = types[i] == "sliding_attention"
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    return create_sliding_window_causal_mask if sliding else create_causal_mask


def cut(model: nn.Module) -> list[nn.Module]:
    """``model``'s own submodules as stages (no copies): embeddings, one stage per decoder layer,
    final norm + ``lm_head``."""
    from transformers.masking_utils import create_causal_mask

    config = model.config
    head = model.get_output_embeddings()
    if config.model_type == "gpt2":
        t = model.transformer
        return [Embeddings(t.wte, t.wpe, t.drop), *(GPT2Layer(b, create_causal_mask, config) for b in t.h),
                Head(t.ln_f, head)]
    m = model.model
    rope = str(getattr(m.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope or "longrope" in rope:
        raise ValueError(f"model.config.rope_parameters with rope_type {rope} is not supported: it recomputes the "
                         f"rotary frequencies from the positions it sees, so a stage's state would change with its "
                         f"data; use a static rope_type (default, linear, llama3, yarn).")
    return [Embeddings(m.embed_tokens),
            *(RotaryLayer(layer, m.rotary_emb, _layer_mask(config, i), config) for i, layer in enumerate(m.layers)),
            Head(m.norm, head)]


class HFCausalLM(LightningModule):
    """A ``transformers`` causal LM (``arch``: one of :data:`FAMILIES`) as ``self.stages``.

    ``config`` sets fields of the family's config (null: unset); from scratch they go over
    :data:`SMALL`, with ``pretrained`` (a local ``save_pretrained`` directory, read offline) over the
    saved config. ``attn_implementation`` is ``sdpa`` or ``eager``; ``dtype`` (``float32``,
    ``bfloat16``, ...) the parameters' dtype, else float32 from scratch and the saved one when
    loaded. Batches are the character corpus's ``(x, y)`` or dicts with ``input_ids`` and optional
    ``attention_mask`` and ``labels`` (:meth:`split_batch`); the loss is the model's own shifted
    cross-entropy. AdamW with a cosine learning-rate schedule over ``max_steps``, like :class:`GPT`.
    """

    def __init__(self, arch: str = "llama", config: Mapping[str, Any] | None = None, pretrained: str | None = None,
                 lr: float = 3e-3, weight_decay: float = 0.0, max_steps: int = 0, dtype: str | None = None,
                 attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.save_hyperparameters()
        model = build(arch, config, pretrained, dtype, attn_implementation)
        model.loss_type = "ForCausalLM"  # what GPT2LMHeadModel falls back to anyway, with a warning
        # a plain attribute, not a child module: its parameters are named once, under stages
        object.__setattr__(self, "hf", model)
        self.stages = nn.ModuleList(cut(model))

    def reset_stage(self, module: nn.Module) -> None:
        """Initialise one module of ``self.stages`` with the library's own ``_init_weights`` (the
        rule a model built on the meta device follows, :mod:`launcher.runtime.init`)."""
        for m in module.modules():
            self.hf._init_weights(m)

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
        return adamw_cosine(self.parameters(), self.hparams.lr, self.hparams.weight_decay, self.hparams.max_steps)
