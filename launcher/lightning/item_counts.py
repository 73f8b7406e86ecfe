"""How many items each micro-batch's loss averages over, so that the engine weighs it by its share
of the step's items (:mod:`launcher.runtime.items`) and a step equals one device's on the whole batch.

The rule, first that applies:

1. the module's own hook, ``loss_items(batch) -> int | Tensor``, called with each micro-batch (a
   slice of the batch the DataLoader produced, in the same form);
2. a dict batch (or ``BatchEncoding``) with ``labels``, for a module that holds a Hugging Face
   model: the labels the model's loss counts, by its ``loss_type`` (:func:`hf_items`);
3. otherwise the rows of each micro-batch (the engine's default): right for a loss that is a mean
   over samples, also when the last batch does not cut into equal micro-batches.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ..torch_support.values import as_tree, chunk
from .staging import _mapping_type

#: the LightningModule method that says how many items a micro-batch's loss averages over
HOOK = "loss_items"
#: Hugging Face's "ignore this position" label (``ignore_index`` of its cross-entropy losses)
IGNORE = -100
#: loss types whose labels are shifted by one position inside the loss (position t predicts t + 1)
SHIFTED = ("ForCausalLM", "ForConditionalGeneration")
#: loss types that average over every label that is not IGNORE, unshifted
UNSHIFTED = ("ForMaskedLM", "ForTokenClassification")

# each module's label-counting rule, found once: keyed weakly by the module, so an entry lives and dies
# with it (no run's modules are kept alive, and the table does not grow across runs)
_rules: weakref.WeakKeyDictionary[nn.Module, Callable[[torch.Tensor], torch.Tensor] | None] = \
    weakref.WeakKeyDictionary()


def hf_model(module: nn.Module) -> Any:
    """The first Hugging Face ``PreTrainedModel`` in ``module`` (itself included), or None."""
    utils = sys.modules.get("transformers.modeling_utils")  # not imported: no such model can exist
    if utils is None:
        return None
    return next((m for m in module.modules() if isinstance(m, utils.PreTrainedModel)), None)


def _label_rule(model: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How ``model``'s loss counts its labels: causal LMs shift them (``ForCausalLMLoss`` pads the
    labels with IGNORE and drops the first position), masked LMs and token classifiers do not;
    None for a loss that averages over samples (sequence classification, ...)."""
    config = getattr(model, "config", None)
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None and callable(getattr(model, "can_generate", None)) and model.can_generate():
        loss_type = "ForCausalLM"  # what PreTrainedModel.loss_function falls back to (GPT-2's LM head)
    if loss_type in SHIFTED and not getattr(config, "is_encoder_decoder", False):
        return lambda labels: (labels[..., 1:] != IGNORE).sum()
    if loss_type in UNSHIFTED or (loss_type in SHIFTED and getattr(config, "is_encoder_decoder", False)):
        return lambda labels: (labels != IGNORE).sum()  # an encoder-decoder's labels are the decoder's own
    return None


def hf_items(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The count of a micro-batch's ``labels`` for a module that holds a Hugging Face model
    (found once per module), or None."""
    if module not in _rules:
        model = hf_model(module)
        _rules[module] = _label_rule(model) if model is not None else None
    return _rules[module]


def loss_items(module: nn.Module, batch: Any, pieces: int) -> list[Any] | None:
    """The item count of each of the ``pieces`` micro-batches ``batch`` is cut into (numbers or
    0-d tensors), by the rule in the module doc; None where the rows are the count."""
    hook = getattr(module, HOOK, None)
    if callable(hook):
        kind = _mapping_type(batch)  # a BatchEncoding's slices are BatchEncodings too
        return [hook(kind(part) if kind is not None else part) for part in chunk(batch, pieces, equal=False)]
    if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), torch.Tensor):
        return None
    count = hf_items(module)
    if count is None:
        return None
    return [count(part["labels"]) for part in chunk(as_tree(batch), pieces, equal=False)]
