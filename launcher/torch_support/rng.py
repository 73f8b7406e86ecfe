"""The user's random state, kept through anything the launcher runs before training.

Drawing an example batch, tracing a module or checking its stages must not change what training
computes afterwards: one device would not have run them. Two things are consumed by such a
preflight and must be given back:

- the generators: Python's, numpy's and torch's (the CPU's, and each CUDA device's that has been
  started), which :func:`lightning.pytorch.seed_everything` seeds. A ``DataLoader`` draws from
  torch's when an iterator is created (its workers' base seed, and ``shuffle=True``'s
  permutation); a loader, sampler or batch sampler given its own ``generator`` draws from that;
- the loader itself: only a fresh iterator is read (:func:`peek`), never the trainer's.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import Generator, Tensor

from .torch_private import drop_persistent_iterator, persistent_iterator


@dataclass
class RandomState:
    """Python's, numpy's and torch's generators at one moment (see :func:`random_state`)."""

    python: Any
    numpy: Any
    # the field ``torch`` hides the module in the class body: the names below are imported apart
    torch: Tensor
    cuda: list[Tensor] | None  # every CUDA device's, where CUDA was started; else untouched
    own: list[tuple[Generator, Tensor]] = field(default_factory=list)  # generators of loaders


def random_state(*generators: torch.Generator) -> RandomState:
    """The process's generators now, and those of ``generators`` (a loader's own)."""
    import numpy as np

    # Asking CUDA for its state would start it, and a process that forks workers must not start CUDA.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return RandomState(random.getstate(), np.random.get_state(), torch.random.get_rng_state(), cuda,
                       [(g, g.get_state()) for g in generators])


def set_random_state(state: RandomState) -> None:
    """Put every generator of ``state`` back as it was. A CUDA device started since ``state`` was
    taken is put back to its seed as it was started (its generator was only seeded before)."""
    import numpy as np

    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.random.set_rng_state(state.torch)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)
    elif torch.cuda.is_initialized():
        for g in torch.cuda.default_generators:
            g.manual_seed(g.initial_seed())
    for g, s in state.own:
        g.set_state(s)


@contextlib.contextmanager
def kept_random_state(*generators: torch.Generator) -> Iterator[None]:
    """Run the block, then put every generator (the process's and ``generators``) back as it was."""
    state = random_state(*generators)
    try:
        yield
    finally:
        set_random_state(state)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators a loader draws from besides torch's global one: its own, its sampler's and
    its batch sampler's (and that one's sampler's), each once."""
    found: list[torch.Generator] = []
    parts = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    parts.append(getattr(parts[2], "sampler", None))
    for part in parts:
        g = getattr(part, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def peek(iterable: Iterable[Any], loaders: Sequence[Any] | None = None) -> Any:
    """The first item of a fresh iterator over ``iterable``, with every random state kept: the next
    iterator (the trainer's) yields what it would have yielded without this call. ``loaders``: the
    loaders ``iterable`` reads (default: itself), whose own generators are kept too. Raises
    ``StopIteration`` for an empty loader."""
    loaders = [iterable] if loaders is None else list(loaders)
    kept = [persistent_iterator(dl) for dl in loaders]
    with kept_random_state(*[g for dl in loaders for g in loader_generators(dl)]):
        it = iter(iterable)
        try:
            return next(it)
        finally:
            del it  # a DataLoader's worker processes stop with their iterator
            for dl, k in zip(loaders, kept):  # unless the loader keeps it: then here
                drop_persistent_iterator(dl, k)
