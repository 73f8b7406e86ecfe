"""Hyperparameter search through Hydra's Optuna sweeper: ``hparams_search=optuna`` (the group
``conf/hparams_search/optuna.yaml``), or any multirun with ``hydra/sweeper=optuna``.

- Each run (a trial) returns the value of ``optimized_metric`` to the sweeper (:func:`objective`):
  one of :data:`NAMED`, or a key of the W&B summary of the run's ``metrics.json``
  (:data:`SUMMARY`); a list of them for a multi-objective search, with one
  ``hydra.sweeper.direction`` per metric. :func:`config_errors` refuses a bad value once, before
  any trial starts.
- A trial with no value (an invalid config, a worker that raised, a metric the run did not
  report, a NaN) returns :class:`NoValue`: ``float()`` of it raises, so the sweeper tells Optuna
  the trial FAILED and the study goes on. A NaN would not do: optuna 2.10 refuses it in
  ``study.tell`` and hydra-optuna-sweeper 1.3 then tells FAIL *with* the value, which raises out
  of the sweep.
- When no trial completed, the sweeper's ``study.best_trial`` raises (Optuna's traceback); the
  sweep is wrapped (:func:`_guard`) so that the command says it in one sentence instead, and the
  sweeper's log lines about failed trials say why they failed (:class:`_PluginLines`).
- At the end :func:`summarize` prints the best trial (its params, value, run directory and the
  command that reproduces it), or the Pareto front of a multi-objective search.
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

#: the metrics a run reports by name, and what each is
NAMED = {
    "val_loss": "the last validation loss",
    "train_loss": "the last training step's loss",
    "step_s": "the measured step time in seconds (metrics.json latency_s.measured)",
    "samples_per_s": "the measured throughput (throughput_samples_per_s.measured)",
    "peak_memory": "the largest process peak memory over the workers, in bytes",
    "bubble_fraction": "the measured bubble fraction",
}
#: the keys of a run's summary (:func:`launcher.report.wandb_log.summary_of` of its metrics.json)
SUMMARY = (*(f"{k}/{side}" for k in ("latency_s", "throughput_samples_per_s", "bubble_fraction")
             for side in ("predicted", "measured")), "loss/first", "loss/last", "val_loss/last")
METRICS = (*NAMED, *SUMMARY)
DIRECTIONS = ("minimize", "maximize")
RESULTS = "optimization_results.yaml"  #: what the sweeper writes in the sweep directory



@dataclass(frozen=True)
class StudyInfo:
    """An Optuna study, as its multirun started: where the sweeper writes and what it optimizes."""

    dir: str  #: the sweep directory, where the sweeper writes :data:`RESULTS`
    names: list[str]  #: the metrics of ``optimized_metric``
    directions: list[str]  #: one ``minimize`` or ``maximize`` per metric


def _plain(v: Any) -> Any:
    return OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v


def _shown(v: Any) -> str:
    v = _plain(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    return "null" if v is None else (v.name if isinstance(v, Enum) else str(v))


def names_of(value: Any) -> list[str] | None:
    """``optimized_metric`` as a list of names; ``None`` when it is neither a name nor a list of them."""
    value = _plain(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        return list(value)
    return None


def directions_of(direction: Any) -> list[str]:
    """``hydra.sweeper.direction`` as a list of names (the plugin's default is an enum)."""
    direction = _plain(direction)
    items = direction if isinstance(direction, (list, tuple)) else [direction]
    return [d.name if isinstance(d, Enum) else str(d) for d in items]


def is_optuna(sweeper: Any) -> bool:
    if isinstance(sweeper, DictConfig):
        target = OmegaConf.select(sweeper, "_target_")
    else:
        target = (sweeper or {}).get("_target_")
    return "optuna" in str(target or "").lower()


def metric_errors(value: Any) -> list[str]:
    """The sentence for an ``optimized_metric`` that names no metric a run reports."""
    choices = (f"one of {', '.join(NAMED)}, or a key of metrics.json's summary ({', '.join(SUMMARY)}), "
               f"or a list of them for a multi-objective search")
    names = names_of(value)
    if not names:
        return [f"optimized_metric={_shown(value)} is invalid: it must name the metric the sweeper optimizes: "
                f"{choices}."]
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], METRICS, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return [f"optimized_metric={_shown(value)} is invalid: a run does not report {unknown[0]}{hint}; "
                f"use {choices}."]
    if len(set(names)) < len(names):
        return [f"optimized_metric={_shown(value)} is invalid: each metric may be optimized once."]
    return []


def config_errors(cfg: DictConfig) -> list[str]:
    """The rules of ``optimized_metric`` on a composed config (with its ``hydra`` node when there
    is one): a metric a run reports, and under the Optuna sweeper one direction (minimize or
    maximize) per metric and a training run to measure it."""
    value = OmegaConf.select(cfg, "optimized_metric", default="val_loss")
    found = metric_errors(value)
    sweeper = OmegaConf.select(cfg, "hydra.sweeper", default=None)
    if found or sweeper is None or not is_optuna(sweeper):
        return found
    names = names_of(value) or []
    raw = OmegaConf.select(sweeper, "direction", default="minimize")
    dirs = directions_of(raw)
    bad = [d for d in dirs if d not in DIRECTIONS]
    if bad or not dirs:
        return [f"hydra.sweeper.direction={_shown(raw)} is invalid: use minimize or maximize, or a list of them "
                f"(one per metric of optimized_metric)."]
    if len(dirs) != len(names):
        example = ",".join(["minimize"] * len(names))
        return [f"optimized_metric={_shown(value)} is invalid with hydra.sweeper.direction={_shown(raw)}: the search "
                f"needs one direction per metric ({len(names)} metric{'s' if len(names) > 1 else ''}, {len(dirs)} "
                f"direction{'s' if len(dirs) > 1 else ''}), e.g. hydra.sweeper.direction=[{example}]."]
    mode = OmegaConf.select(cfg, "mode", default="train")
    if mode != "train":
        return [f"mode={mode} is invalid with the Optuna sweeper: a trial returns optimized_metric={_shown(value)}, "
                f"which only a training run measures; search with mode=train."]
    return _validation_errors(cfg, value, names)


def _validation_errors(cfg: DictConfig, value: Any, names: list[str]) -> list[str]:
    """A search on ``val_loss`` whose runs never validate: every trial would fail for want of it."""
    if not any(n.startswith("val_loss") for n in names):
        return []
    t = lambda k: OmegaConf.select(cfg, f"trainer.{k}", default=None)  # noqa: E731
    steps, every, limit = t("max_steps"), t("val_check_interval"), t("limit_val_batches")
    if limit == 0 or limit == 0.0:
        return [f"optimized_metric={_shown(value)} is invalid with trainer.limit_val_batches={limit}: no validation "
                f"runs, so no trial would have a val_loss; validate, or optimize train_loss."]
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (steps, every))
    if ints and steps > 0 and every > steps and t("check_val_every_n_epoch") is None:
        return [f"optimized_metric={_shown(value)} is invalid with trainer.max_steps={steps} and "
                f"trainer.val_check_interval={every}: no validation runs before training ends, so no trial would "
                f"have a val_loss; set trainer.val_check_interval to at most {steps}, or optimize train_loss."]
    return []


def params_overrides(cfg: DictConfig) -> list[str]:
    """``hydra.sweeper.params`` (set in YAML, e.g. by ``hparams_search=optuna``) as the overrides
    the sweeper makes of them, for the command-line check."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    if not isinstance(params, DictConfig):
        return []
    return [f"{k!s}={v}" for k, v in params.items()]


# --- what a trial returns -------------------------------------------------------------------


class NoValue:
    """What a trial with no value returns: the sweeper cannot take ``float()`` of it (nor iterate
    it, for several metrics), so it tells Optuna the trial FAILED and the study goes on; ``str()``
    is why (the sweeper logs it)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __float__(self) -> float:
        raise ValueError(self.why)

    def __iter__(self) -> Any:
        raise TypeError(self.why)

    def __str__(self) -> str:
        return self.why

    __repr__ = __str__


def value_of(metrics: Mapping[str, Any], name: str) -> tuple[float | None, str | None]:
    """The value of metric ``name`` in a run's ``metrics.json``, or ``None`` and why it has none."""
    steps, val = metrics.get("steps") or [], metrics.get("val") or []
    try:
        if name == "val_loss":
            v = val[-1]["val_loss"] if val else None
            why = None if val else ("the run logged no val_loss (no validation ran: trainer.val_check_interval > "
                                    "trainer.max_steps?)")
        elif name == "train_loss":
            v, why = (steps[-1]["loss"], None) if steps else (None, "the run trained no step")
        elif name == "step_s":
            v, why = metrics["latency_s"]["measured"], "the run measured no step time"
        elif name == "samples_per_s":
            v, why = metrics["throughput_samples_per_s"]["measured"], "the run measured no throughput"
        elif name == "bubble_fraction":
            v, why = metrics["bubble_fraction"]["measured"], "the run measured no bubble fraction"
        elif name == "peak_memory":
            mem = [m for m in metrics["per_worker"]["peak_memory_bytes"]["measured"] or [] if m is not None]
            v, why = (max(mem) if mem else None), "the run measured no peak memory"
        else:
            from .report.wandb_log import summary_of

            v, why = summary_of(metrics).get(name), f"the run's summary has no {name}"
    except (KeyError, IndexError, TypeError):
        return None, f"the run's metrics.json has no {name}"
    if v is None:
        return None, why
    v = float(v)
    if math.isnan(v):
        return None, f"{name}=nan"
    return v, None


def trial_values(point: Mapping[str, Any], names: Sequence[str]) -> tuple[list[float] | None, str]:
    """The values of ``names`` a point (a trial's outcome record) gives, or ``None`` and why not."""
    if not point.get("ok"):
        errors = point.get("errors") or ["?"]
        return None, f"{'failed while training' if point.get('failed') else 'invalid config'}: {errors[0]}"
    metrics = point.get("metrics")
    if not isinstance(metrics, Mapping):
        return None, f"no {names[0]}: only mode=train runs measure it"
    values = []
    for n in names:
        v, why = value_of(metrics, n)
        if v is None:
            return None, str(why)
        values.append(v)
    return values, ""


def objective(cfg: DictConfig, result: Mapping[str, Any]) -> Any:
    """What the task function returns to the sweeper: the value of ``optimized_metric`` (a list for
    several metrics), or :class:`NoValue` (the sweeper then marks the trial FAILED)."""
    names = names_of(cfg.get("optimized_metric", "val_loss")) or ["val_loss"]
    values, why = trial_values(result, names)
    if values is None:
        return NoValue(why)
    return values[0] if len(values) == 1 else values


# --- the sweep ------------------------------------------------------------------------------


def study_of(config: DictConfig) -> StudyInfo | None:
    """The study a multirun runs (its config with the ``hydra`` node), under the Optuna sweeper;
    else ``None``."""
    sweeper = OmegaConf.select(config, "hydra.sweeper", default=None)
    if sweeper is None or not is_optuna(sweeper):
        return None
    names = names_of(OmegaConf.select(config, "optimized_metric", default="val_loss")) or ["val_loss"]
    return StudyInfo(dir=str(config.hydra.sweep.dir), names=names,
                     directions=directions_of(OmegaConf.select(sweeper, "direction", default="minimize")))


class Study(Callback):
    """When a multirun with the Optuna sweeper starts: an earlier study's results in its directory
    are removed, and its sweep is guarded (:func:`_guard`). (The command records the study itself:
    :class:`launcher.command.SweepDir`.)"""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        study = study_of(config)
        if study is None:
            return
        (Path(study.dir) / RESULTS).unlink(missing_ok=True)  # an earlier study's best is not this one's
        _guard()


class _PluginLines(logging.Filter):
    """The sweeper's line for a failed trial says why it failed (not that its return value was not
    a float), and its line about the failure rate, which stops nothing here, is left out."""

    CAST = re.compile(r"^Failed experiment: Return value must be (?:float-castable|a list or tuple of float-castable "
                      r"values)\. Got '(.*)'\.?$", re.S)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg.startswith("Failed ") and " times out of " in msg and "max_failure_rate" in msg:
            return False
        m = self.CAST.match(msg)
        if m:
            record.msg, record.args = f"Failed experiment: {m.group(1)}", ()
        return True


def _guard() -> None:
    """Wrap the Optuna sweeper's ``sweep`` (once): when no trial completed, ``study.best_trial``
    raises ``ValueError: No trials are completed yet``; the sweep then ends normally and the
    command says so in one sentence (:func:`summarize`)."""
    import functools

    from .config.hydra_private import optuna_sweeper_impl

    logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's storage imports it: a line per plugin
    impl = optuna_sweeper_impl()
    if impl is None:  # Hydra reports the missing plugin itself
        return
    cls = impl.OptunaSweeperImpl
    if getattr(cls.sweep, "_launcher_guard", False):
        return
    original = cls.sweep

    @functools.wraps(original)
    def sweep(self: Any, arguments: list[str]) -> Any:
        log, lines = logging.getLogger(impl.__name__), _PluginLines()
        log.addFilter(lines)
        try:
            return original(self, arguments)
        except ValueError as e:
            if "No trials are completed yet" not in str(e):
                raise
            return None
        finally:
            log.removeFilter(lines)

    sweep._launcher_guard = True  # type: ignore[attr-defined]
    cls.sweep = sweep


# --- the end of the study ---------------------------------------------------------------------


def _overrides_of(point: Mapping[str, Any]) -> list[str]:
    d = point.get("dir")
    path = Path(d) / ".hydra" / "overrides.yaml" if d else None
    if path is not None and path.exists():
        return [str(x) for x in OmegaConf.load(path)]
    return [] if point.get("point") in (None, "(defaults)") else str(point["point"]).split()


def _same(text: str, v: Any) -> bool:
    if text == str(v):
        return True
    try:
        return float(text) == float(v)
    except (TypeError, ValueError):
        return False


def _matches(point: Mapping[str, Any], params: Mapping[str, Any], values: Sequence[float] | None,
             mine: Sequence[float] | None) -> bool:
    given = dict(o.split("=", 1) for o in _overrides_of(point) if "=" in o)
    if not all(k in given and _same(given[k], v) for k, v in params.items()):
        return False
    return values is None or (mine is not None and all(math.isclose(a, float(b), rel_tol=1e-9, abs_tol=1e-12)
                                                     for a, b in zip(mine, values)))


def _dominates(a: Sequence[float], b: Sequence[float], dirs: Sequence[str]) -> bool:
    sa = [x if d == "minimize" else -x for x, d in zip(a, dirs)]
    sb = [x if d == "minimize" else -x for x, d in zip(b, dirs)]
    return all(x <= y for x, y in zip(sa, sb)) and any(x < y for x, y in zip(sa, sb))


def _best(done: list[tuple[int, list[float]]], dirs: list[str]) -> list[tuple[int, list[float]]]:
    """Optuna's answer for a fresh study: the first best trial, or the Pareto front."""
    if len(dirs) == 1:
        pick = min if dirs[0] == "minimize" else max
        v = pick(vals[0] for _, vals in done)
        return [next(t for t in done if t[1][0] == v)]
    return [t for t in done if not any(_dominates(o[1], t[1], dirs) for o in done if o is not t)]


def reproduce(point: Mapping[str, Any], config_args: Sequence[str], config_name: str,
              dirs: Sequence[str]) -> tuple[str, str | None]:
    """The command that runs the trial again as a single run, and a note when the config it
    composes is not the trial's. A config that sets ``hydra.mode: MULTIRUN`` (``hparams_search``)
    gets ``hydra.mode=RUN``, so the command runs once instead of searching again."""
    from .config.compose import compose

    overrides = _overrides_of(point)
    note = None
    try:
        cfg = compose(config_name, overrides, list(dirs))
        if "MULTIRUN" in str(cfg.hydra.mode):
            overrides = [*overrides, "hydra.mode=RUN"]
        saved = Path(str(point.get("dir"))) / ".hydra" / "config.yaml"
        if saved.exists():
            mine: Any = OmegaConf.to_container(cfg, resolve=False)
            mine.pop("hydra", None)
            theirs: Any = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if differ:
                note = f"this command composes a config that differs from the trial's in {', '.join(differ)}"
    except Exception as e:  # noqa: BLE001 - the command is still the trial's overrides
        note = f"could not compose this command's config to check it: {' '.join(str(e).split())[:200]}"
    return " ".join(["python -m launcher", *map(shlex.quote, [*config_args, *overrides])]), note


def _relative(path: str) -> str:
    """``path`` from the working directory when it is under it (as Hydra's own paths read)."""
    import os

    p = Path(path).absolute()
    try:
        return str(p.relative_to(Path(os.getcwd()).absolute()))
    except ValueError:
        return str(p)


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def summarize(points: Sequence[Mapping[str, Any]], study: StudyInfo, config_args: Sequence[str] = (),
              config_name: str = "config", dirs: Sequence[str] = ()) -> bool:
    """Print the study's outcome: how many trials completed and failed, then the best trial (or the
    Pareto front) with its params, value(s), run directory and the command that reproduces it.
    When no trial completed, one sentence on stderr and ``False``."""
    from .modes.common import console

    names, dirs_ = list(study.names or ["val_loss"]), list(study.directions or ["minimize"])
    done: list[tuple[int, list[float]]] = []
    why: dict[str, int] = {}
    for i, p in enumerate(points):
        values, _ = trial_values(p, names)
        if values is None:
            kind = ("failed while training" if p.get("failed") else "invalid") if not p.get("ok") else \
                f"without {names[0] if len(names) == 1 else ' or '.join(names)}"
            why[kind] = why.get(kind, 0) + 1
        else:
            done.append((i, values))
    n = len(points)
    counts = ", ".join(f"{v} {k}" for k, v in why.items())
    if not done:
        print(f"error: all {n} trials failed ({counts}): Optuna has no best trial; each trial's error is above.",
              file=sys.stderr, flush=True)
        return False
    con = console()
    said = ", ".join(f"{m} ({d})" for m, d in zip(names, dirs_))
    failed = n - len(done)
    con.print(f"study: {n} trials, {len(done)} completed, {failed} failed" + (f" ({counts})" if failed else "")
              + f"; optimized: {said}", highlight=False, soft_wrap=True)
    results = Path(study.dir) / RESULTS
    chosen: list[tuple[dict[str, Any], list[float]]] = []
    if results.exists():
        r: Any = OmegaConf.to_container(OmegaConf.load(results), resolve=True)
        if "solutions" in r:
            chosen = [(dict(s.get("params") or {}), list(s.get("values") or [])) for s in r["solutions"]]
        elif "best_params" in r:
            chosen = [(dict(r.get("best_params") or {}), [r["best_value"]])]
    picked: list[tuple[int | None, dict[str, Any], list[float]]] = []
    if chosen:
        for params, values in chosen:
            at = next((i for i, vals in done if _matches(points[i], params, values, vals)), None)
            picked.append((at, params, values))
    else:  # the sweeper wrote no results: its rule, from the trials' values
        picked = [(i, {}, vals) for i, vals in _best(done, dirs_)]
    if len(names) == 1:
        con.print(f"best trial: {_trial_line(picked[0], names)}", highlight=False, soft_wrap=True)
    else:
        con.print(f"Pareto front: {len(picked)} of {len(done)} completed trials", highlight=False, soft_wrap=True)
    pad = "  " if len(names) == 1 else "    "
    for at, params, values in picked:
        if len(names) > 1:
            con.print(f"  {_trial_line((at, params, values), names)}", highlight=False, soft_wrap=True)
        if params:
            con.print(f"{pad}params: " + " ".join(f"{p}={v}" for p, v in params.items()), highlight=False,
                      soft_wrap=True)
        if at is None:
            con.print(f"{pad}(a trial of an earlier run of this study: its run directory is not in this sweep)",
                      highlight=False, soft_wrap=True)
            continue
        cmd, note = reproduce(points[at], config_args, config_name, dirs)
        if points[at].get("dir"):
            con.print(f"{pad}run: {_relative(points[at]['dir'])}", highlight=False, soft_wrap=True)
        con.print(f"{pad}reproduce: {cmd}", highlight=False, soft_wrap=True)
        if note:
            con.print(f"{pad}note: {note}", highlight=False, soft_wrap=True)
    return True


def _trial_line(pick: tuple[int | None, dict[str, Any], list[float]], names: Sequence[str]) -> str:
    i, _, values = pick
    head = f"#{i}" if i is not None else "(earlier)"
    return head + " " + " ".join(f"{m}={_fmt(float(v))}" for m, v in zip(names, values))
