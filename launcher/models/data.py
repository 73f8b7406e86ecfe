"""A character-level corpus every machine has: the Python standard library's own source files.

Text is read from the ``.py`` files at the top of the standard library (sorted by name, so every
machine with the same Python reads the same text), encoded as ASCII bytes (anything else becomes
``?``), and cut into windows of ``seq_len + 1`` characters: input = the first ``seq_len``, target
= the last ``seq_len`` (the next character at every position).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 128  # ASCII


def stdlib_text(chars: int) -> str:
    """The first ``chars`` characters of the standard library's top-level ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    n = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= chars:
            break
    text = "".join(parts)[:chars]
    if len(text) < chars:
        raise ValueError(f"data.chars={chars} is more than the {len(text)} characters of {root}'s top-level .py files")
    return text


class CharCorpus(LightningDataModule):
    """Next-character prediction on standard-library source; ``batch_size`` windows per batch.

    Shuffling uses its own generator seeded by ``seed``, so every worker of a scheme and the
    single-device reference see the same batches in the same order.
    """

    vocab_size = VOCAB

    def __init__(self, batch_size: int = 32, seq_len: int = 64, chars: int = 300_000, val_fraction: float = 0.05,
                 shuffle: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.seq_len, self.chars = batch_size, seq_len, chars
        self.val_fraction, self.shuffle, self.seed = val_fraction, shuffle, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(stdlib_text(self.chars).encode("ascii", "replace")), dtype=torch.uint8)
        n = (len(data) - 1) // (self.seq_len + 1)
        windows = data[: n * (self.seq_len + 1)].view(n, self.seq_len + 1).long()
        n_val = max(1, int(n * self.val_fraction))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True, generator=gen)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        # whole batches only: a scheme cuts every batch into the same number of micro-batches
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
