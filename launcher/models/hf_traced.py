"""Any Hugging Face ``transformers`` causal LM or encoder-decoder LM (T5, BART, mBART), built by
name as :mod:`.hf` builds it, kept whole and trained as a traced model: with no ``self.stages``,
its ``training_step`` is traced and cut at module boundaries (``split=auto``, or the module paths
``split=[...]`` names, :mod:`launcher.split`), so no per-family code is needed and any forward
``torch.export`` can trace fits, where :class:`~.hf.HFCausalLM`'s cut at the decoder layers does
not (RWKV's layers return their recurrent state with the hidden state; an encoder-decoder runs two
stacks of layers).

Batches are the character corpus's ``(x, y)`` or dicts of ``input_ids`` (``attention_mask``) and
optional ``labels``. A causal LM predicts ``y`` (the next token at each position) from ``x``; an
encoder-decoder reads ``x`` and writes ``y``, its decoder fed ``y`` shifted right by the model's
own rule (``prepare_decoder_input_ids_from_labels``: T5's ``decoder_start_token_id``, mBART's wrap
of the last token). A dict's ``labels`` are the Hugging Face kind: a causal LM shifts them, an
encoder-decoder takes them as they are. The loss is the cross-entropy over the positions with a
target (-100: none) in the logits' own precision (the library's loss casts float64 logits to
float32), and :meth:`HFTraced.loss_items` counts those positions, so a scheme weighs its
micro-batches as one device's mean over the batch does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from .base import adamw_cosine
from .hf import HEADS, build

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFTraced(LightningModule):
    """A ``transformers`` LM built by name (``arch``, ``config``, ``pretrained``, ``dtype``,
    ``attn_implementation`` as for :class:`~.hf.HFCausalLM`) as ``self.model``, traced and cut.
    From scratch, a second stack and a family's own width fields (BART's ``decoder_layers``, T5's
    ``d_ff``) follow the common keys (``num_hidden_layers``, ``intermediate_size``).

    ``head``: ``causal_lm`` (``AutoModelForCausalLM``) or ``seq2seq_lm``
    (``AutoModelForSeq2SeqLM``); null: the encoder-decoder where the family has one (``t5``,
    ``bart``, ``mbart``), else the causal LM (``rwkv``, ``llama``, ...). AdamW with a cosine
    learning-rate schedule over ``max_steps``, as the other built-in models."""

    model: PreTrainedModel

    def __init__(self, arch: str | None = None, config: Mapping[str, Any] | None = None, pretrained: str | None = None,
                 head: str | None = None, lr: float = 3e-3, weight_decay: float = 0.0, max_steps: int = 0,
                 dtype: str | None = None, attn_implementation: str | None = None) -> None:
        super().__init__()
        if head is not None and head not in HEADS:
            raise ValueError(f"head={head} is invalid: use {' or '.join(HEADS)}, or null (the encoder-decoder LM where "
                             f"the family has one, else the causal LM).")
        self.save_hyperparameters()
        self.model = build(arch, config, pretrained, dtype, attn_implementation, head=head, siblings=True)
        cfg = self.model.config
        self.seq2seq = bool(cfg.is_encoder_decoder)
        if self.seq2seq and getattr(cfg, "decoder_start_token_id", None) is None:
            # T5's config leaves it to the generation config (the padding token, as T5 trained)
            cfg.decoder_start_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    def split_batch(self, batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(inputs, target)``: the model's keyword inputs (``input_ids``, an ``attention_mask``
        where given) and the token each output position must predict (-100: none)."""
        if isinstance(batch, (tuple, list)):
            x, y = batch
            return {"input_ids": x}, y
        if not isinstance(batch, Mapping):  # BatchEncoding is a UserDict
            batch = dict(batch)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask") if batch.get(k) is not None}
        labels = batch.get("labels")
        if labels is None:
            labels = inputs["input_ids"]
            if "attention_mask" in inputs:
                labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
        if self.seq2seq:
            return inputs, labels
        return inputs, F.pad(labels, (0, 1), value=-100)[..., 1:]  # a causal LM's shift: t predicts t + 1

    def loss_items(self, batch: Any) -> torch.Tensor:
        """The positions with a target in ``batch``: what the loss averages over."""
        return (self.split_batch(batch)[1] != -100).sum()

    def forward(self, inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The logits; an encoder-decoder's decoder reads ``target`` shifted right."""
        if self.seq2seq:
            shift = self.model.prepare_decoder_input_ids_from_labels  # the family's own rule
            decoder_ids = shift(labels=target)  # type: ignore[operator]  # typed as a module attribute
            return self.model(**inputs, decoder_input_ids=decoder_ids, use_cache=False).logits
        return self.model(**inputs, use_cache=False).logits

    def _loss(self, batch: Any) -> torch.Tensor:
        inputs, target = self.split_batch(batch)
        logits = self(inputs, target)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's union of return types
        hp = self.hparams
        return adamw_cosine(self.parameters(), hp["lr"], hp["weight_decay"], hp["max_steps"])
