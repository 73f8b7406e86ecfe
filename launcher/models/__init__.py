"""The built-in models and data: ordinary LightningModules and LightningDataModules that need no
download, no account and no server. Each model but one exposes ``self.stages`` (an ``nn.ModuleList``)
and ``self.loss(output, target)``, so it trains under any scheme of :class:`~launcher.lightning.UnifiedStrategy`
and, unchanged, under Lightning's default strategy; :class:`HFTraced` has none and is traced and cut."""

from .data import CharCorpus, stdlib_text
from .gpt import GPT
from .hf import HFCausalLM
from .hf_traced import HFTraced
from .mlp import CharMLP
from .vision import ShapesImages, TimmClassifier

__all__ = ["CharCorpus", "stdlib_text", "GPT", "CharMLP", "HFCausalLM", "HFTraced", "TimmClassifier", "ShapesImages"]
