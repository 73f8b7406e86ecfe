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
from torch.utils.data import DataLoader, Sampler, TensorDataset

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


class EpochSampler(Sampler[int]):
    """A permutation per epoch, seeded by ``seed + epoch`` (so it does not depend on what ran
    before), that can start part-way into an epoch: how a resumed run sees the batches an
    uninterrupted one would have seen."""

    def __init__(self, n: int, shuffle: bool, seed: int) -> None:
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.epoch, self.skip = 0, 0

    def __iter__(self):  # noqa: ANN204
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.n)
        start, self.skip = self.skip, 0
        self.epoch += 1
        return iter(order[start:].tolist())

    def __len__(self) -> int:
        return self.n


class SeededData(LightningDataModule):
    """A training and a validation set (``train_set``, ``val_set``, made by the subclass's
    ``setup``), read in batches of ``batch_size``.

    Shuffling uses its own generator seeded by ``seed`` and the epoch, so every worker of a scheme
    and the single-device reference see the same batches in the same order; the position in the
    epoch is saved in checkpoints, so a resumed run continues with the next batch.
    """

    def __init__(self, batch_size: int, shuffle: bool, seed: int) -> None:
        super().__init__()
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.sampler: EpochSampler | None = None
        self._resume: dict[str, int] | None = None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        self.sampler = EpochSampler(len(self.train_set), self.shuffle, self.seed)
        if self._resume is not None:
            self.sampler.epoch, self.sampler.skip = self._resume["epoch"], self._resume["samples"]
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=self.sampler, drop_last=True)

    def state_dict(self) -> dict[str, int]:
        """Where training stands in the data: the epoch and the samples of it already trained on."""
        loop = self.trainer.fit_loop if self.trainer is not None else None
        if loop is None:
            return {}
        done = loop.epoch_loop.batch_progress.current.processed
        return {"epoch": self.trainer.current_epoch, "samples": done * self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state) if state else None

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        # whole batches only: a scheme cuts every batch into the same number of micro-batches
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class CharCorpus(SeededData):
    """Next-character prediction on standard-library source; ``batch_size`` windows per batch,
    shuffled and resumed as :class:`SeededData` says."""

    vocab_size = VOCAB

    def __init__(self, batch_size: int = 32, seq_len: int = 64, chars: int = 300_000, val_fraction: float = 0.05,
                 shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(batch_size, shuffle, seed)
        self.seq_len, self.chars, self.val_fraction = seq_len, chars, val_fraction

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
