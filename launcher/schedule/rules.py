"""The rules a step must meet, one sentence per broken rule naming the key, the value and the rule.

They check the fields of :class:`launcher.schedule.settings.Settings` (:meth:`~.Settings.errors`),
which every entry point builds: the Python API (:func:`launcher.schedule.make_schedule`) raises
:class:`StepError` with these sentences, and the command line (:mod:`launcher.config.validate`)
reports the same ones, so a bad value reads the same wherever it is given. Pure Python: no torch,
no omegaconf (the config layer depends on the schedule, never the reverse).

:func:`step_errors` takes the values by key name (the command line's keys: ``strategy`` for the
scheme); a key that is absent is not checked (``W`` is the config's own key).
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping, TypeGuard

from .order import BUILTIN as ORDERS
from .order import ORDERS as ORDER_CLASSES
from .order import SCHEME_DEFAULT, WARMUPS, too_few_microbatches
from .order_file import FileOrder
from .schemes import SCHEMES

#: the sizes of a step; each must be a positive integer
SIZES = ("G", "R", "stages", "microbatches")
STRATEGIES = tuple(sorted(SCHEMES))
DURATION_KINDS = ("F", "B", "I", "W")
WEIGHT_CACHES = ("step", "job")
#: how one step's end meets the next's start (:mod:`launcher.schedule.overlap`)
STEP_OVERLAPS = ("none", "post_validation", "post_validation_paper")
#: ``recompute``: which stages' backward recomputes their forward (activation checkpointing)
RECOMPUTE = ("none", "full")


#: the schemes whose training runs ``step_overlap=post_validation`` (:mod:`launcher.lightning.step_overlap`):
#: those whose every stage has one owner (lpp with G = 1) and whose loss stage is on the pipeline's last worker
OVERLAP_TRAINING_SCHEMES = ("gpipe", "lpp")


def overlap_training_errors(overlap: object, scheme: object = None, G: object = None, R: object = None,
                            stages: object = None) -> list[str]:
    """The sentence for a valid ``step_overlap`` other than ``none`` when training (the command line's
    check and ``UnifiedStrategy``'s) under a scheme whose runtime does not overlap steps: only
    :data:`OVERLAP_TRAINING_SCHEMES`, one owner per stage and the loss stage on the last worker (a
    size None: not known yet), train with post-validation. An unknown value is not this check's to
    name (the step's own checks say why)."""
    if overlap == "none" or overlap not in STEP_OVERLAPS:
        return []
    if overlap == "post_validation_paper":
        return ["step_overlap=post_validation_paper is invalid with mode=train: the paper's chain runs the next "
                "step's forwards on weights not yet validated, which a rollback would invalidate; train with "
                "step_overlap=post_validation, or price it with mode=simulate or mode=plan."]
    if scheme == "lpp" and G not in (None, 1):
        return [f"step_overlap={overlap} is invalid with mode=train and strategy=lpp G={G}: the runtime overlaps "
                f"steps only where each stage has one owner (lpp with G=1); price the overlap with mode=simulate "
                f"or mode=plan."]
    if scheme == "lpp" and isinstance(R, int) and isinstance(stages, int) and R > 0 and stages % R:
        return [f"step_overlap={overlap} is invalid with mode=train and strategy=lpp stages={stages} R={R}: the loss "
                f"stage must be on the pipeline's last worker (stages a multiple of R); price the overlap with "
                f"mode=simulate or mode=plan."]
    if scheme in OVERLAP_TRAINING_SCHEMES:
        return []
    return [f"step_overlap={overlap} is invalid with mode=train and strategy={scheme}: the runtime overlaps steps "
            f"only under strategy=gpipe or lpp with G=1 (one owner per stage); price the overlap with "
            f"mode=simulate or mode=plan."]


RECOMPUTE_RULE = "use none, full (every stage) or a list of stage indices"
#: the most jobs (stages * microbatches * kinds) a step may have. The simulator holds about
#: 250 bytes per job and the reports several times that (the 1,048,576-job step of the README
#: peaks near 1 GB), so beyond this a step would not fit in a workstation's memory.
MAX_JOBS = 1 << 23  # 8,388,608
BYTES_PER_JOB = 1000  # peak memory of planning and reporting one job, rounded up (measured)


class StepError(ValueError):
    """A step that breaks a rule; ``sentences`` holds one sentence per broken rule."""

    def __init__(self, sentences: Iterable[str]):
        self.sentences = list(sentences)
        super().__init__("\n".join(self.sentences))


def is_size(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shown(v: Any) -> str:
    """A value as the sentences show it (``null`` as the config writes it)."""
    return "null" if v is None else str(v)


def unknown_key(key: str, value: Any, known: Iterable[str], what: str = "a known key", otherwise: str = "") -> str:
    """The sentence for a key that does not exist (``what``: what it is not), with the closest
    existing one when there is one, else ``otherwise`` (a clause, when given)."""
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"; did you mean {by_lower[close[0]]}?" if close else f"; {otherwise}." if otherwise else "."
    return f"{key}={shown(value)} is invalid: {key} is not {what}{hint}"


#: what a custom strategy or order is, on the command line and from Python
_CUSTOM = {
    "strategy": "a placement callable (strategy=custom with strategy.placement._target_)",
    "order": "an order callable (order=custom with order.n._target_)",
}


def unknown_option(key: str, value: object, extra: Iterable[str] = ()) -> str:
    """The sentence for an unknown ``strategy`` or ``order`` name; ``extra``: options a user's own
    config directory adds to the built-in ones."""
    # order=file is a name of the config's (it needs order.path), not a built-in order object
    names = sorted(set(STRATEGIES if key == "strategy" else (*ORDERS, FileOrder.name, SCHEME_DEFAULT)) | set(extra))
    return f"{key}={shown(value)} is not a known {key}; choose one of {', '.join(names)}, or {_CUSTOM[key]}."


def value_error(key: str, v: Any) -> str | None:
    """The rule one key's value breaks on its own (no other key involved); ``None`` if it is fine
    or the key has no rule of its own."""
    if key in SIZES:
        if not is_size(v):
            return f"{key}={shown(v)} is invalid: the sizes G, R, stages and microbatches must be positive integers."
    elif key.startswith(("durations.", "stage_durations.")) and key.rsplit(".", 1)[-1] in DURATION_KINDS:
        # inf or nan would leave the step unfinished (or its times undefined): refuse them here
        if not (is_number(v) and v > 0 and math.isfinite(v)):
            return f"{key}={shown(v)} is invalid: job durations must be positive finite numbers."
    elif key == "comm":
        if not (is_number(v) and v >= 0 and math.isfinite(v)):
            return f"comm={shown(v)} is invalid: the communication delay must be a finite number >= 0."
    elif key == "warmup":
        if v is not None and v not in WARMUPS:
            return f"warmup={shown(v)} is invalid: use null (the order's default), {' or '.join(WARMUPS)}."
    elif key == "weight_cache":
        if v not in WEIGHT_CACHES:
            return f"weight_cache={shown(v)} is invalid: use {' or '.join(WEIGHT_CACHES)}."
    elif key == "graph_share":
        rule = ("it is the part of a stage's micro-batch activations that its graph holds until W: a number from 0 "
                "to 1, or a list of such numbers, one per stage")
        if isinstance(v, (list, tuple)):
            if not v or any(not (is_number(x) and 0 <= x <= 1) for x in v):
                return f"graph_share={list(v)} is invalid: {rule}."
        elif not (is_number(v) and 0 <= v <= 1):
            return f"graph_share={shown(v)} is invalid: {rule}."
    elif key == "step_overlap":
        if v not in STEP_OVERLAPS:
            return (f"step_overlap={shown(v)} is invalid: use none (every step ends on every worker before the next "
                    f"begins), post_validation (each stage steps as soon as its own gradients are final) or "
                    f"post_validation_paper (priced only: the paper's speculative chain).")
    elif key == "prefetch":
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return f"prefetch={shown(v)} is invalid: the prefetch lookahead must be an integer >= 0."
    elif key == "split_backward":
        if not isinstance(v, bool):
            return f"split_backward={shown(v)} is invalid: it must be true or false."
    elif key == "recompute":
        if isinstance(v, (list, tuple)):
            bad = next((x for x in v if not (isinstance(x, int) and not isinstance(x, bool) and x >= 0)), None)
            if bad is not None or len(set(v)) != len(v):
                why = f"{shown(bad)} is not a stage index" if bad is not None else "it names a stage twice"
                return f"recompute={list(v)} is invalid: {why}; {RECOMPUTE_RULE}."
        elif v not in RECOMPUTE:
            return f"recompute={shown(v)} is invalid: {RECOMPUTE_RULE}."
    elif key == "memory_limit":
        rule = "memory_limit must be null, a positive integer, or a list of positive integers, one per worker"
        if isinstance(v, (list, tuple)):
            if any(not is_size(x) for x in v):
                return f"memory_limit={list(v)} is invalid: {rule}."
        elif v is not None and not is_size(v):
            return f"memory_limit={shown(v)} is invalid: {rule}."
    return None


def step_errors(values: Mapping[str, Any]) -> list[str]:
    """One sentence per rule the step described by ``values`` breaks; empty when it is valid.

    Keys (each optional): ``G``, ``R``, ``W``, ``stages``, ``microbatches``, ``strategy`` (a name,
    or a callable placement), ``order`` (a name or a callable), ``warmup``, ``durations`` (a
    mapping of kind to time), ``comm``, ``memory_limit``, ``split_backward``, ``weight_cache``,
    ``prefetch``, ``recompute``.
    """
    out = _own_errors(values, SIZES)
    out += _option_errors(values)
    G, R, S, B = (values.get(k) for k in SIZES)
    workers: int | None = None  # G * R, once every size is valid
    if is_size(G) and is_size(R) and is_size(S) and is_size(B):
        workers = G * R
        out += _size_errors(values, G, R, S, B)
    out += _duration_errors(values)
    out += _own_errors(values, ("comm", "memory_limit", "graph_share"))
    if e := _memory_limit_length_error(values.get("memory_limit"), workers):
        out.append(e)
    g = values.get("graph_share")
    if isinstance(g, (list, tuple)) and is_size(S) and not value_error("graph_share", g) and len(g) != S:
        out.append(f"graph_share={list(g)} is invalid: it has {len(g)} entries but there are stages={S} stages "
                   f"(one number for all, or one per stage).")
    out += _own_errors(values, ("warmup", "weight_cache", "prefetch", "split_backward", "step_overlap"))
    out += _recompute_errors(values, S)
    return out


def _own_errors(values: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """The rules the values of ``keys`` (those present) break on their own, in the order of ``keys``."""
    return [e for k in keys if k in values and (e := value_error(k, values[k]))]


def _option_errors(values: Mapping[str, Any]) -> list[str]:
    """An unknown ``strategy`` or ``order`` name (a callable is the user's own)."""
    out: list[str] = []
    strategy = values.get("strategy")
    if "strategy" in values and not callable(strategy) and strategy not in SCHEMES:
        out.append(unknown_option("strategy", strategy))
    order = values.get("order")
    if "order" in values and not callable(order) and order not in (*ORDERS, SCHEME_DEFAULT):
        out.append(unknown_option("order", order))
    return out


def _size_errors(values: Mapping[str, Any], G: int, R: int, S: int, B: int) -> list[str]:
    """The rules that tie the (valid) sizes together: ``W``, a stage for every worker of a group,
    a micro-batch for every group, the named scheme's own ``W``, and the most jobs a step may have."""
    out: list[str] = []
    if "W" in values and values["W"] != G * R:
        out.append(f"W={shown(values['W'])} is invalid: W must equal G*R = {G}*{R} = {G * R}.")
    if R > S:
        out.append(f"R={R} is invalid: R must not exceed stages={S}, or some of a group's workers get no stage.")
    if G > B:
        out.append(f"G={G} is invalid: G must not exceed microbatches={B}, or some groups get no micro-batch.")
    if e := _scheme_workers_error(values.get("strategy"), G, R, S, B):
        out.append(e)
    if e := _scheme_order_error(values.get("strategy"), values.get("order")):
        out.append(e)
    if e := looped_order_error(values.get("strategy"), values.get("order"), R, S):
        out.append(e)
    if e := _order_microbatches_error(values.get("order"), S, B):
        out.append(e)
    kinds = 3 if values.get("split_backward") is True else 2
    jobs = S * B * kinds
    if jobs > MAX_JOBS:
        out.append(
            f"stages*microbatches={S}*{B}={S * B} is too large: the step would have {jobs:,} jobs "
            f"(about {jobs * BYTES_PER_JOB / 1e9:,.0f} GB to plan) and the limit is {MAX_JOBS:,} jobs."
        )
    return out


def _scheme_workers_error(strategy: Any, G: int, R: int, S: int, B: int) -> str | None:
    """The sentence for a named scheme whose layout fixes ``W`` (``W = stages``, say) that
    ``G * R`` does not meet."""
    named = SCHEMES.get(strategy) if isinstance(strategy, str) else None
    if named is not None and named.W_equals == "half_stages" and (S != 2 * G * R or G != 1):
        return (f"strategy={strategy} with G={G} R={R} stages={S} is invalid: it is one pipeline of W = R workers "
                f"that each hold two stages, so it needs G=1 and stages = 2W = 2R "
                + (f"(set G=1 R={S // 2})." if S % 2 == 0 else "(give it an even number of stages)."))
    fixed = named.sizes(S, B) if named is not None else None
    if named is None or named.W_equals is None or fixed is None or G * R == fixed[0] * fixed[1]:
        return None
    key, want = named.W_equals, fixed[0] * fixed[1]
    return (
        f"strategy={strategy} needs W = {key}, but W=G*R={G * R} and {key}={want}; "
        f"set G={fixed[0]} R={fixed[1]} (the {strategy} layout) or {key}={G * R}."
    )


def _scheme_order_error(strategy: Any, order: Any) -> str | None:
    """The sentence for an order made for one named scheme (``zbv`` for ``vshape``) under another."""
    cls = ORDER_CLASSES.get(order) if isinstance(order, str) else None
    if cls is None or cls.scheme_only is None or strategy == cls.scheme_only:
        return None
    shown_strategy = strategy if isinstance(strategy, str) else "custom"
    return (f"order={order} is invalid with strategy={shown_strategy}: its sequences are made for the placement "
            f"of strategy={cls.scheme_only}, and only that scheme may use it.")


def _order_microbatches_error(order: Any, S: int, B: int) -> str | None:
    """:func:`~launcher.schedule.order.too_few_microbatches` for a built-in order's name."""
    cls = ORDER_CLASSES.get(order) if isinstance(order, str) else None
    return None if cls is None else too_few_microbatches(cls, S, B)


def looped_order_error(strategy: Any, order: Any, R: int, S: int) -> str | None:
    """The sentence for an order made for looped pipelines (``interleaved_1f1b``) on a named scheme
    that is not one: each worker of a pipeline of ``1 < R < stages`` workers holds ``stages / R``
    stages (Megatron's warm-up counts them, so every worker holds as many)."""
    cls = ORDER_CLASSES.get(order) if isinstance(order, str) else None
    if cls is None or not cls.looped_only or not isinstance(strategy, str) or strategy not in SCHEMES:
        return None
    if not SCHEMES[strategy].has_order:
        return None  # the order has no effect there (a warning says so), nothing to refuse
    if SCHEMES[strategy].W_equals is None and 1 < R < S and S % R == 0:
        return None
    return (f"order={order} is invalid with strategy={strategy} R={R} stages={S}: it interleaves the stages each "
            f"worker of a pipeline holds, so it needs a looped pipeline whose workers hold equally many "
            f"(strategy=lpp or fslpp with 1 < R < stages and stages a multiple of R).")


def _duration_errors(values: Mapping[str, Any]) -> list[str]:
    """``durations``: a mapping of known job kinds to valid times."""
    if "durations" not in values:
        return []
    durations = values["durations"]
    if not isinstance(durations, Mapping):
        return [f"durations={shown(durations)} is invalid: give a mapping of job kind (F, B, I, W) to time."]
    known = [f"durations.{k}" for k in DURATION_KINDS]
    out: list[str] = []
    for k, v in durations.items():
        dkey = f"durations.{k}"
        if e := (value_error(dkey, v) if dkey in known else unknown_key(dkey, v, known)):
            out.append(e)
    return out


def _memory_limit_length_error(ml: Any, workers: int | None) -> str | None:
    """A (valid) per-worker ``memory_limit`` list whose length is not the worker count, once that is known."""
    if (
        isinstance(ml, (list, tuple)) and workers is not None
        and not value_error("memory_limit", ml) and len(ml) != workers
    ):
        return (
            f"memory_limit={list(ml)} is invalid: it has {len(ml)} entries but there are W={workers} workers "
            f"(memory_limit must be null, a positive integer, or a list of positive integers, one per worker)."
        )
    return None


def _recompute_errors(values: Mapping[str, Any], S: Any) -> list[str]:
    """``recompute``: a valid value on its own, and stage indices that exist (when ``stages`` is valid)."""
    if "recompute" not in values:
        return []
    rc = values["recompute"]
    if e := value_error("recompute", rc):
        return [e]
    if isinstance(rc, (list, tuple)) and is_size(S) and (over := [x for x in rc if x >= S]):
        return [f"recompute={list(rc)} is invalid: stage {over[0]} does not exist with stages={S}; "
                f"{RECOMPUTE_RULE} in [0, {S})."]
    return []


def recompute_stages(value: Any, stages: int) -> frozenset[int]:
    """The stages a (valid) ``recompute`` value names: ``none``/``None`` -> none, ``full`` -> all."""
    if value is None or value == "none":
        return frozenset()
    if value == "full":
        return frozenset(range(stages))
    return frozenset(int(x) for x in value)
