"""Random streams that belong to the job, not to the worker that runs it.

Every forward of unit ``i`` on micro-batch ``b`` at global step ``t`` draws its random numbers
(dropout masks, stochastic depth, anything drawn from torch's default generator inside the
module) from torch's generator seeded by a hash of ``(seed, t, b, i)``, set when the unit starts.
Which worker runs the job, in what order, on fetched weights or not, as a recomputation or not,
and whether the run was resumed then change nothing: a scheme moves jobs, never masks.

A *unit* does not depend on the number of stages or the scheme:

- a model with ``self.stages``: each module of that list (a stage runs one or several of them);
- a traced model: each segment of its traced forward from one submodule's first operation to the
  next one's (:mod:`launcher.split.cut` cuts stages only at such points, so no stage splits a unit);
  the graph of a stage seeds the segment before its first random operation, and on one device a
  forward pre-hook on the submodule that begins the segment does the same.

A job is :func:`job` (the engine's forward and recomputing backward of ``(stage, b)``, one
device's forward of micro-batch ``b``); outside a job the hooks do nothing, so evaluation,
tracing and checks draw from the user's generator as before (eval mode draws nothing anyway).
Each unit is seeded once per job: one generator state set, no work per tensor. On a GPU the
current device's generator is seeded too. A module that draws from a ``torch.Generator`` it
owns is not covered: its draws follow that generator, whichever job runs it.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

_MASK = (1 << 64) - 1


def _splitmix(x: int) -> int:
    """SplitMix64's finaliser: a 64-bit word whose every bit depends on every bit of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix(*words: int) -> int:
    """A 64-bit seed from ``words`` (in order); ``mix(seed, t, b, i)`` seeds unit ``i``'s job."""
    h = 0
    for w in words:
        h = _splitmix(h ^ (w & _MASK))
    return h


class _Job:
    __slots__ = ("key", "cuda", "seeded")

    def __init__(self, key: int, cuda: torch.Generator | None) -> None:
        self.key, self.cuda = key, cuda
        self.seeded: set[int] = set()  # the units seeded so far in this job


#: the running job (a context variable, not a global: a job set in one thread or task is not another's)
_current: contextvars.ContextVar[_Job | None] = contextvars.ContextVar("launcher_stream_job", default=None)


def seed_unit(unit: int) -> None:
    """Seed torch's generator (and the current GPU's) for ``unit`` in the running job, once per
    job; nothing outside a job. A traced stage's graph calls this before a unit's first random op."""
    job = _current.get()
    if job is None or unit in job.seeded:
        return
    job.seeded.add(unit)
    s = _splitmix(job.key ^ unit)
    torch.default_generator.manual_seed(s)
    if job.cuda is not None:
        job.cuda.manual_seed(s)


def _cuda_generator(device: torch.device | None) -> torch.Generator | None:
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def job(seed: int, step: int, microbatch: int, device: torch.device | None = None) -> Iterator[None]:
    """Run one job's forward: unit ``i`` starting inside draws from ``mix(seed, step, microbatch, i)``."""
    token = _current.set(_Job(mix(seed, step, microbatch), _cuda_generator(device)))
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def kept_generators(device: torch.device | None = None) -> Iterator[None]:
    """Put torch's generator (and ``device``'s on a GPU) back as it was after the block: the
    streams reseed it, and the user's draws outside the step (a shuffled loader's next epoch)
    must go on from where one device without streams would have them."""
    cpu = torch.default_generator.get_state()
    gpu = _cuda_generator(device)
    gstate = gpu.get_state() if gpu is not None else None
    try:
        yield
    finally:
        torch.default_generator.set_state(cpu)
        if gpu is not None and gstate is not None:  # both or neither
            gpu.set_state(gstate)


class UnitHook:
    """A forward pre-hook that seeds unit ``unit`` (a deep copy of the module keeps it: the
    engine's skeletons for fetched weights draw as the module does)."""

    __slots__ = ("unit",)

    def __init__(self, unit: int) -> None:
        self.unit = unit

    def __call__(self, module: nn.Module, args: tuple) -> None:
        seed_unit(self.unit)


# each module's hook, keyed weakly by the module it is installed on: an entry lives and dies with its
# module (what a hook is installed on is the module's state, not the run's; install() replaces it)
_installed: weakref.WeakKeyDictionary[nn.Module, tuple[int, torch.utils.hooks.RemovableHandle]] = \
    weakref.WeakKeyDictionary()


def install(units: Sequence[tuple[nn.Module, int]]) -> None:
    """Give each module its unit's hook (replacing one it has from an earlier call)."""
    for module, unit in units:
        had = _installed.get(module)
        if had is not None:
            if had[0] == unit:
                continue
            had[1].remove()
        _installed[module] = (unit, module.register_forward_pre_hook(UnitHook(unit)))


def install_stages(stages: Iterable[nn.Module]) -> None:
    """Units of a model with ``self.stages``: module ``i`` of the list is unit ``i``."""
    install([(m, i) for i, m in enumerate(stages)])

