"""A small GPT-style transformer, cut into blocks: the embedding is the first module of
``self.stages``, each transformer block one module, the final norm and head the last.

An ordinary LightningModule: ``training_step`` is the single-device one. No buffers (the causal
mask comes from ``is_causal``), so every stage's state is its parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_support.checks import non_negative_ints, positive_ints, positive_number
from .base import StagedLM, adamw_cosine


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and the projection to the vocabulary."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(StagedLM):
    """Character-level GPT: ``stages = [Embedding, Block x n_layer, Head]``; AdamW with a cosine
    learning-rate schedule over ``max_steps`` (stepped every optimizer step)."""

    def __init__(self, vocab_size: int = 128, seq_len: int = 64, d_model: int = 64, n_head: int = 4, n_layer: int = 6,
                 lr: float = 3e-3, weight_decay: float = 0.0, max_steps: int = 0) -> None:
        super().__init__()
        positive_ints(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_head=n_head)
        non_negative_ints(n_layer=n_layer)
        if d_model % n_head:
            raise ValueError(f"n_head={n_head} is invalid: it must divide d_model={d_model} (each attention head "
                             f"takes d_model / n_head features).")
        positive_number("lr", lr, "the learning rate")
        self.save_hyperparameters()
        self.stages = nn.ModuleList(
            [Embedding(vocab_size, seq_len, d_model), *(Block(d_model, n_head) for _ in range(n_layer)),
             Head(d_model, vocab_size)]
        )

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's union of return types
        hp = self.hparams
        return adamw_cosine(self.parameters(), hp["lr"], hp["weight_decay"], hp["max_steps"])
