"""A character-level corpus every machine has: the Python standard library's own source files.

Text is read from the ``.py`` files at the top of the standard library (sorted by name, so every
machine with the same Python reads the same text), encoded as ASCII bytes (anything else becomes
``?``), and cut into windows of ``seq_len + 1`` characters: input = the first ``seq_len``, target
= the last ``seq_len`` (the next character at every position).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ..torch_support.checks import fraction, positive_ints

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
    uninterrupted one would have seen.

    ``position``: called as each iteration begins, gives ``(epoch, first sample)`` to iterate
    from (where training stands); without it, ``epoch`` and ``skip`` are used and move on."""

    def __init__(self, n: int, shuffle: bool, seed: int, position: Callable[[], tuple[int, int]] | None = None) -> None:
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.epoch, self.skip = 0, 0
        self.position = position

    def __iter__(self):  # noqa: ANN204
        if self.position is not None:
            self.epoch, self.skip = self.position()
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
    and the single-device reference see the same batches in the same order.

    Where training stands in the data is a function of the batches trained so far (Lightning's
    count, which a checkpoint restores): every epoch of data has the same number of batches, so
    ``T`` batches after a known position ``(epoch, samples)`` the next batch is determined. Each
    iteration over the training set starts there (:meth:`position`), and a checkpoint saves it
    with ``T``. Lightning's own epoch counter is not used: a run that stops at ``max_steps`` ends
    Lightning's epoch early (its count moves on, the data does not), and a run resumed from such a
    checkpoint may end its first epoch where the data's does not; either way the next iteration
    starts at the right batch, so a resumed run reads exactly the batches an uninterrupted one does.
    """

    def __init__(self, batch_size: int, shuffle: bool, seed: int) -> None:
        super().__init__()
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.sampler: EpochSampler | None = None
        #: a known position: (epoch, samples of it trained on, batches trained then; None: when first read)
        self._resume: tuple[int, int, int | None] | None = None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        self.sampler = EpochSampler(len(self.train_set), self.shuffle, self.seed, self.position)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=self.sampler, drop_last=True)

    def _trained(self) -> int:
        """Batches the training loop has consumed so far, across epochs and resumes (0 outside ``fit``)."""
        trainer = self.trainer
        if trainer is None:
            return 0
        # Lightning types ``total`` as the base tracker; the training loop's batch progress is a _ProcessedTracker
        return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)  # type: ignore[attr-defined]

    def _epoch_samples(self) -> int:
        """Samples an epoch trains on: its whole batches, or ``limit_train_batches`` of them."""
        per_epoch = len(self.train_set) // self.batch_size if self.train_set is not None else 0
        limit = getattr(self.trainer, "num_training_batches", None) if self.trainer is not None else None
        if isinstance(limit, int) and limit > 0:
            per_epoch = min(per_epoch, limit)
        return per_epoch * self.batch_size

    def position(self) -> tuple[int, int]:
        """``(epoch, samples of it trained on)`` now: the next training batch starts there."""
        epoch, samples, at = self._resume or (0, 0, 0)
        trained = self._trained()
        if at is None:  # a data state without a ``batches`` count: it holds where training resumes
            at = trained
            self._resume = (epoch, samples, at)
        done = samples + max(0, trained - at) * self.batch_size
        per_epoch = self._epoch_samples()
        return (epoch + done // per_epoch, done % per_epoch) if per_epoch else (epoch, done)

    def state_dict(self) -> dict[str, int]:
        """Where training stands in the data: the epoch, the samples of it already trained on, and
        the batches trained so far."""
        if self.trainer is None:
            return {}
        epoch, samples = self.position()
        return {"epoch": epoch, "samples": samples, "batches": self._trained()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = ((int(state["epoch"]), int(state["samples"]), state.get("batches")) if state else None)

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
        positive_ints(batch_size=batch_size, seq_len=seq_len, chars=chars)
        fraction("val_fraction", val_fraction)
        self.seq_len, self.chars, self.val_fraction = seq_len, chars, val_fraction

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(stdlib_text(self.chars).encode("ascii", "replace")), dtype=torch.uint8)
        n = (len(data) - 1) // (self.seq_len + 1)
        windows = data[: n * (self.seq_len + 1)].view(n, self.seq_len + 1).long()
        n_val = max(1, int(n * self.val_fraction))
        if n - n_val < self.batch_size:  # not one training batch: say which key to change
            if n - 1 >= self.batch_size:
                raise ValueError(f"val_fraction={self.val_fraction} is invalid here: it holds out {n_val} of the {n} "
                                 f"windows of seq_len+1={self.seq_len + 1} characters, leaving fewer than one batch "
                                 f"(batch_size={self.batch_size}) to train on; lower val_fraction.")
            raise ValueError(f"chars={self.chars} is invalid here: it makes {n} windows of "
                             f"seq_len+1={self.seq_len + 1} characters, fewer than one batch "
                             f"(batch_size={self.batch_size}) plus one held out for validation; raise chars or lower "
                             f"seq_len or batch_size.")
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])
