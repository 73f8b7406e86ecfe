"""The built-in models and data: ordinary LightningModules and LightningDataModules that need no
download, no account and no server. Each model exposes ``self.stages`` (an ``nn.ModuleList``) and
``self.loss(output, target)``, so it trains under any scheme of :class:`~launcher.lightning.UnifiedStrategy`
and, unchanged, under Lightning's default strategy."""

from .data import CharCorpus, stdlib_text
from .gpt import GPT
from .hf import HFCausalLM
from .mlp import CharMLP
from .vision import ShapesImages, TimmClassifier

__all__ = ["CharCorpus", "stdlib_text", "GPT", "CharMLP", "HFCausalLM", "TimmClassifier", "ShapesImages"]
