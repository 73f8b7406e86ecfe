""":class:`RunSettings`: how a training run behaves around its steps (checkpoints, non-finite
values, the failure timeout, the transport between workers), typed and frozen, each default written
here once.

Both entry points build one and nothing else checks these values: the command line
(:func:`launcher.config.training.run_settings_of`, from the keys ``checkpoint.format``,
``checkpoint.async_mode``, ``nonfinite``, ``timeout``, ``runtime.transport``, ``fault.restarts``,
``fault.copies`` and ``fault.replace``, whose schema takes its defaults from :data:`DEFAULT_RUN`)
and ``UnifiedStrategy``'s keywords. Its constructor raises :class:`~launcher.schedule.rules.StepError`
with one sentence per broken rule, the same sentences on both paths. It lives at the bottom layer so
that the config, the runtime and the Lightning strategy all read it without an upward import. Pure
Python: no torch, no omegaconf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping, get_args

from .rules import StepError, is_number, shown, unknown_key
from .schemes import SCHEMES

#: ``checkpoint.format``: each stage's owner writes its share (a directory) | one file at rank 0
CheckpointFormat = Literal["sharded", "single"]
#: ``checkpoint.async_mode``: shards written before training goes on | in the background
AsyncMode = Literal["disabled", "async"]
#: ``nonfinite``: a NaN or infinite loss or gradient stops the run | drops that step
Nonfinite = Literal["stop", "skip"]
#: ``runtime.transport`` (the engine's ``transport``): how activations, their gradients and the
#: replicas' gradient all-reduce travel between workers: gloo's point-to-point and collectives,
#: shared memory between workers on one host (:mod:`launcher.runtime.shared_links`,
#: :mod:`launcher.runtime.shared_reduce`), or "auto" (shared memory where every worker computes on
#: the CPU of one host, else the backend's)
Transport = Literal["auto", "gloo", "shm"]

FORMATS: tuple[str, ...] = get_args(CheckpointFormat)
ASYNC_MODES: tuple[str, ...] = get_args(AsyncMode)
NONFINITE_MODES: tuple[str, ...] = get_args(Nonfinite)
TRANSPORTS: tuple[str, ...] = get_args(Transport)


def _or(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def _node_of(cls: Any, value: Any, node: str) -> Any:
    """``value`` as the settings ``cls`` of the config node ``node``: itself, the defaults for
    ``None``, or a mapping whose keys must be fields (a misspelt key gets the command line's
    sentence)."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    names = tuple(f.name for f in fields(cls))
    if not isinstance(value, Mapping):
        keys = f"the key {names[0]}" if len(names) == 1 else f"the keys {_or(names)}"
        raise StepError([f"{node}={value!r} is invalid: use a mapping with {keys}."])
    known = [f"{node}.{n}" for n in names]
    unknown = [k for k in value if f"{node}.{k}" not in known]
    if unknown:
        raise StepError([unknown_key(f"{node}.{k}", value[k], known) for k in unknown])
    return cls(**value)


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``checkpoint`` node: ``format`` (``None``: the scheme's, :meth:`format_for`) and
    ``async_mode``. Raises :class:`StepError` on a value outside its choices."""

    format: CheckpointFormat | None = None
    async_mode: AsyncMode = "disabled"

    def __post_init__(self) -> None:
        found = self.errors()
        if found:
            raise StepError(found)

    def errors(self) -> list[str]:
        out: list[str] = []
        if self.format is not None and self.format not in FORMATS:
            out.append(f"checkpoint.format={shown(self.format)} is invalid: use sharded (each stage's owner writes "
                       f"it), single (one file) or null (the scheme's default).")
        if self.async_mode not in ASYNC_MODES:
            out.append(f"checkpoint.async_mode={shown(self.async_mode)} is invalid: use {_or(ASYNC_MODES)}.")
        return out

    @classmethod
    def of(cls, value: CheckpointSettings | Mapping[str, Any] | None) -> CheckpointSettings:
        """``value`` as checkpoint settings: a mapping's keys must be fields (a typo is refused)."""
        return _node_of(cls, value, "checkpoint")

    def format_for(self, scheme: Any) -> str:
        """The format a run of ``scheme`` (a name, or a placement callable) writes: ``format``, else
        the scheme's default (:attr:`launcher.schedule.schemes.Scheme.checkpoint`), else single."""
        if self.format is not None:
            return self.format
        registered = SCHEMES.get(scheme) if isinstance(scheme, str) else None
        return registered.checkpoint if registered is not None else "single"


def survives_a_loss(scheme: str, G: int, R: int) -> bool:
    """Whether every stage's state stays whole in memory when any one worker is lost: every worker
    holds every stage (DDP; LPP with ``R = 1``), or each stage has ``G >= 2`` replicas (LPP with
    ``G > 1``). The schemes ``fault.restarts`` recovers."""
    return scheme == "ddp" or (scheme == "lpp" and (R == 1 or G > 1))


def survives_losses(scheme: str, G: int, R: int, n: int) -> bool:
    """Whether every stage's state stays whole in memory when any ``n`` workers are lost at once (a
    second loss during a recovery): it survives one (:func:`survives_a_loss`) and each stage has more
    than ``n`` holders (``G`` under LPP, each of the ``W = G * R`` workers under DDP)."""
    return survives_a_loss(scheme, G, R) and (G if scheme == "lpp" else G * R) > n


def one_holds_every_stage(scheme: str, G: int, R: int) -> bool:
    """Whether every worker holds every stage's state (DDP; LPP with ``R = 1``): any survivor then
    holds the whole training state, which ``fault.replace`` hands to a replacement process from memory."""
    return scheme == "ddp" or (scheme == "lpp" and R == 1)


@dataclass(frozen=True)
class FaultSettings:
    """The ``fault`` node: ``restarts``, how many lost workers (killed, or hung and then killed) a
    run recovers from inside the job, training on in the same processes with the survivors
    (:mod:`launcher.runtime.recovery`); 0 (the default) ends the run at the first failure. Raises
    :class:`StepError` on a value that is not a non-negative integer."""

    restarts: int = 0
    #: 1: after each optimizer step, every stage held by a single worker is copied (its parameters,
    #: buffers and optimizer state) into the CPU memory of the next worker in a ring
    #: (:mod:`launcher.lightning.copies`), so that a loss of that worker is recovered from memory
    copies: int = 0
    #: true: a lost worker is replaced by a fresh process the launcher forks for its rank, and the run
    #: goes on under the user's scheme at the same W (:mod:`launcher.lightning.replacement`); false:
    #: the survivors train on without it, the step re-planned for them
    replace: bool = False

    def __post_init__(self) -> None:
        found: list[str] = []
        r = self.restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            found.append(f"fault.restarts={shown(r)} is invalid: the number of lost workers to recover from "
                         f"must be a non-negative integer (0: a failure ends the run).")
        c = self.copies
        if isinstance(c, bool) or c not in (0, 1):
            found.append(f"fault.copies={shown(c)} is invalid: use 0 (no copies) or 1 (each stage held by one "
                         f"worker copied to the next worker after every step).")
        elif c and not found and r == 0:
            # the copies serve only a recovery inside the job: without one they cost memory and traffic for nothing
            found.append("fault.copies=1 is invalid with fault.restarts=0: the copies are what a recovery inside the "
                         "job takes lost stages from, so set fault.restarts to 1 or more, or fault.copies=0.")
        if not isinstance(self.replace, bool):
            found.append(f"fault.replace={shown(self.replace)} is invalid: use true (a fresh process replaces a lost "
                         f"worker) or false (the survivors train on without it).")
        elif self.replace and not found and r == 0:
            found.append("fault.replace=true is invalid with fault.restarts=0: a replacement process is forked for a "
                         "lost worker only while a restart is left, so set fault.restarts to 1 or more, or "
                         "fault.replace=false.")
        if found:
            raise StepError(found)

    def scheme_errors(self, scheme: str, G: int, R: int, checkpoint: CheckpointSettings) -> list[str]:
        """One sentence when ``restarts`` asks to recover a scheme this version cannot: one where a
        stage's state may be lost with one worker (:func:`survives_a_loss`) and the run keeps no
        sharded checkpoint written in the foreground to take it from (and no ``copies``)."""
        foreground_sharded = checkpoint.format_for(scheme) == "sharded" and checkpoint.async_mode == "disabled"
        if self.replace and not one_holds_every_stage(scheme, G, R) and not foreground_sharded:
            # the replacement enters training with the others from one state: a survivor's whole state,
            # or the last sharded checkpoint (a copy of fault.copies holds a stage, not the whole state)
            return [f"fault.replace=true is invalid with strategy={scheme} G={G} R={R} and "
                    f"checkpoint.format={checkpoint.format_for(scheme)} checkpoint.async_mode={checkpoint.async_mode}: "
                    f"a replacement process starts from a survivor's whole state (strategy=ddp, or strategy=lpp with "
                    f"R=1) or from the last sharded checkpoint, so set checkpoint.format=sharded and "
                    f"checkpoint.async_mode=disabled, or fault.replace=false."]
        if self.restarts == 0 or self.copies or survives_a_loss(scheme, G, R) or foreground_sharded:
            return []
        return [f"fault.restarts={self.restarts} is invalid with strategy={scheme} G={G} R={R} and "
                f"checkpoint.format={checkpoint.format_for(scheme)} checkpoint.async_mode={checkpoint.async_mode}: "
                f"a stage held by one worker is recovered from the last sharded checkpoint, so set "
                f"checkpoint.format=sharded and checkpoint.async_mode=disabled (or use strategy=ddp, or strategy=lpp "
                f"with G>1 or R=1, recovered from memory), or fault.copies=1, or fault.restarts=0."]

    @classmethod
    def of(cls, value: FaultSettings | Mapping[str, Any] | None) -> FaultSettings:
        """``value`` as fault settings: a mapping's keys must be fields (a typo is refused)."""
        return _node_of(cls, value, "fault")


@dataclass(frozen=True)
class RunSettings:
    """The run's settings beside the step's (:class:`~launcher.schedule.settings.Settings`).

    ``checkpoint`` and ``fault`` may be given as mappings (``{"format": "sharded"}``), converted here once.
    ``timeout``: seconds a worker may go without progress while its peers wait before it is named
    as hung, and within which every worker stops after one fails. Raises :class:`StepError` with
    one sentence per broken rule.
    """

    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    nonfinite: Nonfinite = "stop"
    timeout: float = 30.0
    transport: Transport = "auto"
    fault: FaultSettings = field(default_factory=FaultSettings)

    def __post_init__(self) -> None:
        found: list[str] = []
        try:
            object.__setattr__(self, "checkpoint", CheckpointSettings.of(self.checkpoint))
        except StepError as e:
            found += e.sentences
        if self.nonfinite not in NONFINITE_MODES:
            found.append(f"nonfinite={shown(self.nonfinite)} is invalid: use stop (a NaN or infinite loss or gradient "
                         f"stops the run) or skip (that step is dropped).")
        t = self.timeout
        if not (is_number(t) and math.isfinite(t) and t > 0):
            # 0, not Hydra's 0.0: the value as the user typed it, on the command line and in Python
            found.append(f"timeout={f'{t:g}' if is_number(t) else shown(t)} is invalid: the failure timeout must be "
                         f"a positive number of seconds.")
        else:
            object.__setattr__(self, "timeout", float(t))
        if self.transport not in TRANSPORTS:
            found.append(f"runtime.transport={shown(self.transport)} is invalid: use auto (shared memory between "
                         f"workers on one host's CPUs, else the backend's), gloo (the backend's point-to-point) or "
                         f"shm (shared memory).")
        try:
            object.__setattr__(self, "fault", FaultSettings.of(self.fault))
        except StepError as e:
            found += e.sentences
        if found:
            raise StepError(found)


#: every default, once: the config's schema, the runtime and ``UnifiedStrategy`` read them from here
DEFAULT_RUN = RunSettings()
