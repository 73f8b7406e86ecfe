"""What the planner predicts with: job durations, the message delay, and the model's bytes.

A profile is a JSON object (the lead's training mode writes it into each run's ``metrics.json``
under ``"profile"``; a bare profile file works too)::

    {"durations_s": {"F": float, "B": float, "I": float | null, "W": float | null},  # B null: I + W
     "comm_s": float,                       # seconds added when a dependency crosses workers
     "message_cpu_s": float | null,         # optional: CPU a message costs its two workers (CPU workers)
     "link": {"latency_s": float, "bytes_per_s": float} | null,   # optional: message costs
     "cores": int | null,                   # optional: cores the workers share (null: one each)
     "shared_reduce": bool,                 # optional: replicas all-reduce through shared memory (one host's CPUs)
     "outside_s": float,                    # optional: per worker, a step's seconds outside the engine
     "bytes": {"params": [per stage], "grads": [per stage], "optimizer": [per stage],
               "activation": [per stage: bytes of x_s^b for one micro-batch],
               "saved": [per stage: bytes its forward's autograd graph holds, one micro-batch]},  # optional
     "stage_durations_s": [{"F": float, "B": float, ...} per stage] | null,   # optional: uneven stages
     "modules": [{"forward_s", "backward_s", "params", "grads", "optimizer", "activation"} per module
                 of the model's self.stages] | null}   # optional: lets the planner search the cut too

Without a profile the planner uses the config's unit-cost model (``durations``, ``comm``) and has
no bytes, so ``plan.memory`` needs a profile. With a ``link`` and bytes, a candidate's step time
also counts the gradient exchange after the compute (:mod:`launcher.schedule.link`). With
``cores``, a candidate of more workers than that shares them (:mod:`launcher.schedule.cores`):
on a CPU machine, more workers are not faster once the cores are busy, and each message a
placement moves costs its two workers ``message_cpu_s`` of a core. ``outside_s`` is added to
every candidate, so its step time compares with a measured training step. With
``stage_durations_s`` (one per stage of the planned ``stages``) every stage takes its own time;
with ``modules`` the planner also searches how the modules are cut into stages
(:mod:`launcher.plan.partition`). With ``shared_reduce`` (the workers ran on one host's CPUs under
``transport`` auto or shm) a replicated stage's all-reduce costs two rounds of notices and no bytes
over the link (:func:`~launcher.schedule.link.exchanges`), as it did on the workers measured.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..schedule.link import Link

BYTE_KINDS = ("params", "grads", "optimizer", "activation")
#: byte kinds a profile may leave out (older profiles): taken as 0
OPTIONAL_BYTE_KINDS = ("saved",)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ProfileError(ValueError):
    """A profile that cannot be read or lacks what the planner needs (one sentence)."""


@dataclass(frozen=True)
class Profile:
    """Durations (seconds, or units without a profile), the message delay, and bytes per stage
    (``None`` when unknown). ``I``/``W`` are ``None`` when the split backward was not measured."""

    durations: Mapping[str, float | None]
    comm: float
    bytes: Mapping[str, tuple[float, ...]] | None = None
    seconds: bool = True  # False: the config's unit-cost model
    link: Link | None = None  # message costs between workers, when measured
    cores: int | None = None  # cores the workers share (None: a processor each)
    outside: float = 0.0  # seconds of a step outside the engine
    message_cpu: float | None = None  # CPU seconds per message sent or received (CPU workers)
    shared_reduce: bool = False  # replicas all-reduce through shared memory (launcher.runtime.shared_reduce)
    #: per stage, its own seconds per job kind (a kind left out takes ``durations``'s)
    stage_durations: tuple[Mapping[str, float], ...] | None = None
    #: per module of the model's ``self.stages``, its profiled cost (see the module docstring)
    modules: tuple[Mapping[str, float], ...] | None = None

    def stage_table(self, S: int) -> tuple[Mapping[str, float], ...] | None:
        """The per-stage durations when they describe ``S`` stages, else ``None`` (uniform)."""
        return self.stage_durations if self.stage_durations is not None and len(self.stage_durations) == S else None

    @property
    def can_split(self) -> bool:
        return self.durations.get("I") is not None and self.durations.get("W") is not None

    def stage_bytes(self, kind: str, s: int) -> float:
        """Bytes of ``kind`` for stage ``s``; a list shorter than the stages repeats its max."""
        xs = self.bytes.get(kind, ()) if self.bytes else ()
        return float(xs[s]) if s < len(xs) else float(max(xs, default=0.0))


def parse_bytes(text: Any) -> int:
    """``2GB`` -> 2e9, ``512MiB`` -> 512 * 2**20, a plain number -> bytes; :class:`ValueError`."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text > 0 and math.isfinite(text):
            return int(text)
        raise ValueError(f"{text!r} is not a positive number of bytes")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size such as 2GB, 512MiB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _whole_backward(dur: Any) -> Any:
    """``dur`` with ``B = I + W`` where a run on the split backward measured ``I`` and ``W`` but
    no whole ``B`` (the same gradients, computed in two jobs), so its profile plans both ways."""
    if isinstance(dur, Mapping) and dur.get("B") is None and _pos(dur.get("I")) and _pos(dur.get("W")):
        return {**dur, "B": float(dur["I"]) + float(dur["W"])}
    return dur


def from_dict(d: Mapping[str, Any], where: str = "profile") -> Profile:
    """A :class:`Profile` from the JSON contract above (checked, one sentence per problem)."""
    if "profile" in d and isinstance(d["profile"], Mapping):
        d = d["profile"]  # a run's metrics.json
    dur = _whole_backward(d.get("durations_s"))
    if not isinstance(dur, Mapping) or not all(_pos(dur.get(k)) for k in ("F", "B")):
        raise ProfileError(f"{where} needs durations_s with positive F and B in seconds")
    for k in ("I", "W"):
        if dur.get(k) is not None and not _pos(dur.get(k)):
            raise ProfileError(f"{where} has durations_s.{k}={dur.get(k)!r}; it must be a positive number or null")
    comm = d.get("comm_s", 0.0)
    if not (isinstance(comm, (int, float)) and not isinstance(comm, bool) and comm >= 0):
        raise ProfileError(f"{where} has comm_s={comm!r}; it must be a number >= 0")
    by = d.get("bytes")
    table = None
    if by is not None:
        if not isinstance(by, Mapping) or not all(_sizes(by.get(k)) for k in BYTE_KINDS):
            raise ProfileError(f"{where} has bytes without lists of sizes >= 0 for each of {', '.join(BYTE_KINDS)}")
        table = {k: tuple(float(x) for x in by[k]) for k in BYTE_KINDS}
        for k in OPTIONAL_BYTE_KINDS:
            if by.get(k) is not None:
                if not _sizes(by[k]):
                    raise ProfileError(f"{where} has bytes.{k}={by[k]!r}; it must be a list of sizes >= 0 per stage")
                table[k] = tuple(float(x) for x in by[k])
    link = d.get("link")
    if link is not None:
        if not (isinstance(link, Mapping) and _pos(link.get("latency_s")) and _pos(link.get("bytes_per_s"))):
            raise ProfileError(f"{where} has link={link!r}; it must be null or hold positive latency_s and bytes_per_s")
        link = Link(float(link["latency_s"]), float(link["bytes_per_s"]))
    cores = d.get("cores")
    if cores is not None and not (isinstance(cores, int) and not isinstance(cores, bool) and cores > 0):
        raise ProfileError(f"{where} has cores={cores!r}; it must be null or a positive int")
    outside = d.get("outside_s", 0.0)
    if not _nonneg(outside):
        raise ProfileError(f"{where} has outside_s={outside!r}; it must be a number >= 0")
    shared = d.get("shared_reduce", False)
    if not isinstance(shared, bool):
        raise ProfileError(f"{where} has shared_reduce={shared!r}; it must be true or false")
    msg = d.get("message_cpu_s")
    if msg is not None and not _nonneg(msg):
        raise ProfileError(f"{where} has message_cpu_s={msg!r}; it must be null or a number >= 0")
    per = d.get("stage_durations_s")
    if isinstance(per, Sequence):
        per = [_whole_backward(x) for x in per]
    if per is not None and not (isinstance(per, Sequence) and per and all(
            isinstance(x, Mapping) and _pos(x.get("F")) and _pos(x.get("B"))
            and all(x.get(k) is None or _pos(x.get(k)) for k in ("I", "W")) for x in per)):
        raise ProfileError(f"{where} has stage_durations_s that is not a list of {{F, B}} positive seconds per stage")
    mods = d.get("modules")
    keys = ("forward_s", "backward_s", "params", "grads", "optimizer", "activation")
    if mods is not None and not (isinstance(mods, Sequence) and mods and all(
            isinstance(m, Mapping) and all(_nonneg(m.get(k)) for k in keys) for m in mods)):
        raise ProfileError(f"{where} has modules that is not a list of {{{', '.join(keys)}}} numbers >= 0 per module")
    return Profile({k: (float(dur[k]) if dur.get(k) is not None else None) for k in ("F", "B", "I", "W")},
                   float(comm), table, seconds=True, link=link, cores=cores, outside=float(outside),
                   message_cpu=float(msg) if msg is not None else None, shared_reduce=shared,
                   stage_durations=(tuple({k: float(v) for k, v in x.items() if v is not None} for x in per)
                                    if per else None),
                   modules=tuple({k: float(m[k]) for k in keys} for m in mods) if mods else None)


def load(path: str | Path) -> Profile:
    """Read a profile from a bare profile JSON or a run's ``metrics.json`` (key ``profile``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ProfileError(f"plan.profile={path} cannot be read: {e.strerror or e}") from e
    except ValueError as e:
        raise ProfileError(f"plan.profile={path} is not JSON: {e}") from e
    if not isinstance(data, Mapping):
        raise ProfileError(f"plan.profile={path} must hold a JSON object")
    return from_dict(data, f"plan.profile={path}")


def unit(durations: Mapping[str, float], comm: float) -> Profile:
    """The config's unit-cost model: its durations and comm, no bytes."""
    return Profile({k: float(durations[k]) for k in ("F", "B", "I", "W")}, float(comm), None, seconds=False)


def _pos(x: Any) -> bool:
    return _nonneg(x) and x > 0


def _nonneg(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 and math.isfinite(x)


def _sizes(xs: Any) -> bool:
    return isinstance(xs, Sequence) and not isinstance(xs, str) and len(xs) > 0 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in xs)
