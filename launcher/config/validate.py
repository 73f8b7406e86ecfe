"""Every rule a launcher config must meet, each failure one sentence naming the key, the value and
the rule. Checked before anything runs.

Two entry points:

- :func:`errors` / :func:`validate` check a composed config (one run, or one point of a sweep);
- :func:`check_overrides` checks the command line itself before Hydra composes anything: an unknown
  group option (``strategy=foo``) or a value of the wrong type (``G=2.5``) would otherwise stop
  Hydra with a multi-line message, and in a sweep would abort every later point.

The step's own rules (sizes, durations, the scheme's worker count, memory limits, the size bound,
...) and their sentences live in :mod:`launcher.schedule.rules`, shared with the Python API
(``make_schedule``); this module adds the config's rules (mode, a custom ``_target_``, keys outside
the schema, ``png``) and the command-line pre-check, which also refuses a run or sweep directory
that cannot be written (:mod:`launcher.config.paths`).

A schedule that cannot finish under its ``memory_limit`` is found by the simulator itself
(:class:`launcher.schedule.ScheduleError`); the CLI reports it the same way.
"""

from __future__ import annotations

import dataclasses
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

from omegaconf import BooleanNode, DictConfig, FloatNode, IntegerNode, ListConfig, OmegaConf, StringNode
from omegaconf.errors import OmegaConfBaseException

from ..schedule import rules
from ..schedule.order import SPLIT_ONLY
from ..schedule.placement import OWNERSHIPS
from ..schedule.rules import DURATION_KINDS, StepError
from ..schedule.settings import DEFAULT, Settings
from .paths import dir_error
from .schema import MODES, SETTING_KEYS, LauncherConf
from .sentences import one_line

GROUPS = ("strategy", "order", "model", "data", "trainer", "logger", "hparams_search")
#: strategies only the launcher has (no schedule of their own), and how the sentences name them
LAUNCHER_STRATEGIES = ("auto", "single")
LAUNCHER_STRATEGIES_TEXT = ("the launcher also takes strategy=auto (the planner chooses) and strategy=single "
                            "(Lightning's default strategy on one device)")
#: the directories Hydra creates for a run and a sweep
OUTPUT_DIRS = ("hydra.run.dir", "hydra.sweep.dir")
DEFAULT_RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"


class ConfigError(StepError):
    """An invalid config; ``sentences`` holds one sentence per failed rule."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=default)
    node = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _plain(v: Any) -> Any:
    return OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v


def _has_target(node: Any) -> bool:
    target = _get(node, "_target_") if node is not None else None
    return isinstance(target, str) and target not in ("", "???")


def _target(node: Any) -> str:
    t = _get(node, "_target_") if isinstance(node, (Mapping, DictConfig)) else None
    return "(not set)" if t in (None, "", "???") else str(t)


def errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """One sentence per rule ``cfg`` breaks; empty when the config is valid."""
    out: list[str] = []
    mode = _get(cfg, "mode")
    if mode not in MODES:
        out.append(f"mode={mode} is not a known mode; use {' or '.join('mode=' + m for m in MODES)}.")
    out += png_errors(cfg)
    if mode == "plan" or _get(cfg, "strategy.name") == "auto":
        out += plan_errors(cfg)
    return out + step_errors(cfg)


def png_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """``png`` (``pipeline.png`` of ``mode=simulate`` and ``mode=train``): true, false or auto."""
    png = _get(cfg, "png", "auto")
    if not (isinstance(png, bool) or png == "auto"):  # not `in (True, False)`: 0 == False
        return [f"png={rules.shown(png)} is invalid: use true, false or auto."]
    return []


def plan_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """The ``plan.*`` keys of ``mode=plan`` and ``strategy=auto``."""
    from ..plan.profile import ProfileError, load, parse_bytes

    out: list[str] = []
    for k in ("workers", "max_activations", "top"):
        v = _get(cfg, f"plan.{k}")
        if not (v is None and k != "top") and not rules.is_size(v):
            out.append(f"plan.{k}={v} is invalid: it must be a positive integer{'' if k == 'top' else ' or null'}.")
    mb = _plain(_get(cfg, "plan.microbatches"))
    if mb is not None and not (rules.is_size(mb)
                               or (isinstance(mb, list) and mb and all(rules.is_size(x) for x in mb))):
        out.append(f"plan.microbatches={mb} is invalid: use null (microbatches), a positive integer or a list of them.")
    memory, path = _get(cfg, "plan.memory"), _get(cfg, "plan.profile")
    if memory is not None:
        try:
            parse_bytes(memory)
        except ValueError:
            out.append(f"plan.memory={memory} is invalid: give a size such as 2GB, 512MiB or a number of bytes.")
    prof = None
    if path is not None:
        try:
            prof = load(path)
        except ProfileError as e:
            out.append(f"{e}.")
    trials = _get(cfg, "plan.trials")  # a key left out (a config built in code) takes the schema's default
    if trials is not None and not (trials == 0 or rules.is_size(trials)):
        out.append(f"plan.trials={trials} is invalid: it must be 0 (choose by prediction) or a positive integer.")
    elif trials and _get(cfg, "mode") != "plan":
        out.append(f"plan.trials={trials} is invalid with mode={_get(cfg, 'mode')}: trials run under mode=plan only "
                   f"(strategy=auto takes the predicted best; train mode=plan's best by its overrides).")
    steps = _get(cfg, "plan.trial_steps")
    if steps is not None and not (rules.is_size(steps) and steps >= 2):
        out.append(f"plan.trial_steps={steps} is invalid: it must be an integer of at least 2 (the first step "
                   f"warms up and is not measured).")
    rounds = _get(cfg, "plan.trial_rounds")
    if rounds is not None and not rules.is_size(rounds):
        out.append(f"plan.trial_rounds={rounds} is invalid: it must be a positive integer.")
    if memory is not None and (path is None or (prof is not None and not prof.bytes)):
        out.append(f"plan.memory={memory} needs plan.profile with bytes (params, grads, optimizer, activation per "
                   f"stage).")
    return out


def step_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """One sentence per rule the step ``cfg`` describes breaks (every key but ``mode``): the
    schedule's own rules (:mod:`launcher.schedule.rules`, shared with the Python API) plus the
    config's (a custom callable must name its ``_target_``; no key outside the schema)."""
    out: list[str] = unknown_keys(cfg)
    given: dict[str, Any] = {}  # a custom callable, checked as the user's own
    placement = _get(cfg, "strategy.placement")
    if placement is not None:
        if not _has_target(placement):
            out.append(
                f"strategy.placement._target_={_target(placement)} is invalid: a custom placement needs "
                f"it to name a callable (s, b, d) -> (w_owner, w_compute), e.g. mymodule.my_placement."
            )
        given["scheme"] = _custom
    elif _get(cfg, "strategy.name") == "auto":  # the planner picks the scheme (plan_errors)
        given["scheme"] = _custom
    strategy = _get(cfg, "strategy.name")
    ownership = _get(cfg, "strategy.ownership", DEFAULT.ownership)
    if ownership not in OWNERSHIPS:
        out.append(f"strategy.ownership={ownership} is invalid: use {' or '.join(OWNERSHIPS)} (FSLPP's owner h(s, s) "
                   f"or h(s, floor(s/R))).")
    elif ownership != DEFAULT.ownership and (placement is not None or strategy != "fslpp"):
        out.append(f"strategy.ownership={ownership} is invalid for strategy={strategy}: only strategy=fslpp has a "
                   f"choice of owner; leave it at seed.")
    out += partition_errors(cfg)
    n = _get(cfg, "order.n")
    if n is not None:
        if not _has_target(n):
            out.append(
                f"order.n._target_={_target(n)} is invalid: a custom order needs it to name a "
                f"callable n(s, b, d) -> comparable, e.g. mymodule.my_order."
            )
        given["order"] = _custom
    out += _order_file_errors(cfg, given)
    settings = raw_settings(cfg, **given)
    if settings.order in SPLIT_ONLY and settings.split_backward is False:
        out.append(f"split_backward=false is invalid with order={settings.order}: it runs the weight-gradient "
                   f"jobs W apart, which exist only when the backward is split; leave split_backward at true.")
    W = _get(cfg, "W", _ABSENT)
    return out + settings.errors(**({} if W is _ABSENT else {"W": W}))


#: a key the config does not have (its setting keeps the default)
_ABSENT = object()


def raw_settings(cfg: DictConfig | Mapping[str, Any], **given: Any) -> Settings:
    """The :class:`Settings` the config's keys hold, unchecked (the rules read them); a key the
    config lacks keeps the setting's default. ``given``: fields built elsewhere (a custom callable)."""
    found: dict[str, Any] = {}
    for name, key in SETTING_KEYS.items():
        if name not in given and (v := _get(cfg, key, _ABSENT)) is not _ABSENT:
            found[name] = _plain(v)
    d = found.get("durations")
    if "durations" in found and not isinstance(d, Mapping):  # each kind then reads as missing
        found["durations"] = {k: None for k in DURATION_KINDS}
    return Settings(**found, **given)


def partition_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """``partition``: how the model's ``self.stages`` are cut (:mod:`launcher.plan.partition`)."""
    from ..plan.partition import PARTITIONS

    by, split = _get(cfg, "partition", DEFAULT.partition), _plain(_get(cfg, "split"))
    if by not in PARTITIONS:
        return [f"partition={rules.shown(by)} is invalid: use params (balanced parameter counts), time (balanced "
                f"profiled forward and backward seconds) or memory (balanced profiled bytes)."]
    if by != "params" and split is not None:
        return [f"partition={by} is invalid with split={split}: a traced model is cut at its split points, and "
                f"partition applies to a model's self.stages only; leave partition at params or split at null."]
    return []


def _order_file_errors(cfg: DictConfig | Mapping[str, Any], given: dict[str, Any]) -> list[str]:
    """``order=file`` needs a readable schedule file in ``order.path`` (the file's order goes in
    ``given``), and ``order.path`` and ``order.export`` only mean something where they apply."""
    from ..schedule.order_file import FileOrder, read_jobs

    name, path = _get(cfg, "order.name"), _get(cfg, "order.path")
    path = None if path in ("", "???") else path
    if name != "file":
        if path is not None:
            return [f"order.path={path} is invalid with order={name}: only order=file reads a schedule file; "
                    f"drop order.path or set order=file."]
        return []
    warmup = _get(cfg, "warmup")
    given["order"] = FileOrder(path=str(path or ""), **({"warmup": warmup} if warmup is not None else {}))
    if path is None:
        return ["order.path is missing: order=file reads each worker's job sequence from a file, so give "
                "order.path=PATH (our action text, or torch's compute_only CSV for a .csv)."]
    try:
        read_jobs(str(path))
    except OSError as e:
        return [f"order.path={path} cannot be read: {e.strerror or one_line(e)}."]
    except ValueError as e:
        return [f"order.path={path} is not a schedule file: {str(e).rstrip('.')}."]
    return []


def _custom(*args: Any) -> Any:
    """Stands for a custom callable that only :func:`launcher.config.to_schedule` builds."""


def schema_keys(prefix: str = "", cls: Any = None) -> list[str]:
    """Every dotted key of the schema (a key under an untyped node, such as a custom placement's
    arguments, is not listed: anything goes there)."""
    cls = cls or LauncherConf
    out: list[str] = []
    for f in dataclasses.fields(cls):
        t = typing.get_type_hints(cls)[f.name]
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(t):
            out += schema_keys(f"{prefix}{f.name}.", t)
    return out


def unknown_keys(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """A sentence per key of ``cfg`` that the schema lacks (one added with ``+``, or by a recipe)."""
    known = schema_keys()
    out: list[str] = []

    def walk(node: Any, cls: Any, prefix: str) -> None:
        if not isinstance(node, (Mapping, DictConfig)):
            return
        fields = {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
        for k in node.keys():
            k = str(k)
            key = prefix + k
            if k == "hydra" and not prefix:
                continue
            if k not in fields:
                out.append(rules.unknown_key(key, _node_value(node, k), known))
            elif dataclasses.is_dataclass(fields[k]):
                walk(node[k] if isinstance(node, Mapping) else node.get(k), fields[k], key + ".")

    walk(cfg, LauncherConf, "")
    return out


def _node_value(node: Any, k: str) -> Any:
    try:
        return _plain(node[k]) if isinstance(node, Mapping) else _plain(node.get(k))
    except Exception:  # an interpolation that cannot resolve: show it as written
        if not isinstance(node, DictConfig):
            return None
        return cast(dict, OmegaConf.to_container(node, resolve=False)).get(k)  # a DictConfig's container is a dict


def validate(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` (all failures, one sentence each) unless ``cfg`` is valid."""
    found = errors(cfg)
    if found:
        raise ConfigError(found)


# --- the command line, before Hydra composes ------------------------------------------------

# concrete node classes (their common base, ValueNode, is abstract)
_NODES: dict[type, Callable[..., Any]] = {int: IntegerNode, float: FloatNode, bool: BooleanNode, str: StringNode}
_WHAT = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_ANY = object()
_UNKNOWN = object()


def _field_type(path: str) -> tuple[Any, bool]:
    """The schema type at dotted ``path`` and whether it may be null; ``_ANY`` under an untyped
    node, ``_UNKNOWN`` for a key the schema does not have."""
    cls: Any = LauncherConf
    parts = path.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return _UNKNOWN, False
        hints = typing.get_type_hints(cls)
        t = hints[part]
        optional = False
        if typing.get_origin(t) is typing.Union:
            args = [a for a in typing.get_args(t) if a is not type(None)]
            optional, t = True, args[0]
        if t is Any:
            return _ANY, True
        if dataclasses.is_dataclass(t):
            if i == len(parts) - 1:
                return _ANY, False  # a whole node: Hydra checks it
            cls = t
            continue
        return (t, optional) if i == len(parts) - 1 else (_UNKNOWN, False)
    return _ANY, False


def group_options(group: str, config_dirs: Iterable[str | Path] = ()) -> list[str]:
    """Options of a config group: the shipped ``conf/<group>/*.yaml`` plus any ``--config-dir``'s."""
    names: set[str] = set()
    root = resources.files("launcher.conf") / group
    if root.is_dir():
        names.update(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))
    for d in config_dirs:
        p = Path(d) / group
        if p.is_dir():
            names.update(q.stem for q in p.glob("*.yaml"))
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo.get(group, {})
    names.update(k[: -len(".yaml")] for k in repo if k.endswith(".yaml"))
    return sorted(names)


def _values(override: Any) -> list[tuple[Any, str]] | None:
    """The values an override takes (several for a sweep), each with its command-line spelling;
    ``None`` when they cannot be listed (interval and glob sweeps: left to Hydra)."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    from .hydra_private import element_value_and_text

    if not override.is_sweep_override():
        return [(override.value(), override.get_value_element_as_str())]
    raw = override.value()  # a sweep's value: the sweep as parsed
    if isinstance(raw, ChoiceSweep):
        return [element_value_and_text(x) for x in raw.list]
    if isinstance(raw, RangeSweep):
        return [(x, str(x)) for x in raw.range()]
    return None


def _value_error(key: str, v: Any, t: Any, optional: bool, options: list[str] | None) -> str | None:
    """The sentence for one value of a command-line override, ``None`` when Hydra can compose it."""
    if options is not None:  # a config group: the schedule's sentence, plus a user's own options
        if isinstance(v, str) and v not in options:
            if key == "strategy":  # the schedule's options (as the API says them), then the launcher's own
                said = rules.unknown_option(key, v, [o for o in options if o not in ("custom", *LAUNCHER_STRATEGIES)])
                return said[:-1] + "; " + LAUNCHER_STRATEGIES_TEXT + "."
            if key == "order":
                return rules.unknown_option(key, v, [o for o in options if o != "custom"])
            return f"{key}={rules.shown(v)} is not a known {key}; choose one of {', '.join(options)}."
        return None
    if t is _ANY or (isinstance(v, str) and v.startswith("${")):
        return None  # an untyped node, or an interpolation: resolved (and checked) later
    try:
        _NODES[t](value=v, is_optional=optional)
    except OmegaConfBaseException:
        # the schedule's own sentence when it has a rule for this key, so the API reads the same
        return rules.value_error(key, v) or (
            f"{key}={rules.shown(v)} is invalid: {key} must be {_WHAT[t]}{' or null' if optional else ''}.")
    return None


@dataclasses.dataclass
class _Checked:
    """One command-line override and what is wrong with it."""

    text: str  #: as given
    override: Any = None  #: Hydra's parse of it; ``None`` when it is not checked here
    key_error: str | None = None  #: a sentence about the key itself (it is not a config key)
    #: ``(spelling, shown, sentence or None)`` per value (``shown``: as the sentences show it);
    #: ``None`` when the values cannot be listed
    values: list[tuple[str, str, str | None]] | None = None

    @property
    def sentences(self) -> list[str]:
        if self.key_error:
            return [self.key_error]
        return [e for _, _, e in self.values or [] if e]


def _check_each(overrides: Sequence[str], config_dirs: Iterable[str | Path]) -> list[_Checked] | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(list(overrides))
    except Exception:
        return None  # Hydra reports its own syntax errors
    config_dirs = list(config_dirs)
    out: list[_Checked] = []
    for text, o in zip(overrides, parsed):
        key, given = o.key_or_group, o.value()
        if key in OUTPUT_DIRS and not o.is_sweep_override() and isinstance(given, str):
            # Hydra creates it before the run starts: an unwritable one is a traceback otherwise
            e = dir_error(key, given)
            out.append(_Checked(text, o, e) if e else _Checked(text))
            continue
        if key.startswith("hydra") or o.is_delete() or o.package is not None:
            out.append(_Checked(text))
            continue
        if key in GROUPS:
            t, optional, options = None, False, group_options(key, config_dirs)
        else:
            (t, optional), options = _field_type(key), None
            if t is _UNKNOWN:
                # refused with or without ``+``: an added key would land in the config unchecked
                # (keys under an untyped node, e.g. a custom placement's arguments, are _ANY)
                value = (o.input_line or "").partition("=")[2]  # parsed from text: always set
                out.append(_Checked(text, o, rules.unknown_key(key, value, schema_keys())))
                continue
        try:
            values = _values(o)
        except Exception:  # anything Hydra's parser accepts but we cannot enumerate: Hydra's call
            values = None
        checked = None if values is None else [
            (s, v if isinstance(v, str) else s, _value_error(key, v, t, optional, options)) for v, s in values]
        out.append(_Checked(text, o, None, checked))
    if not any(o.key_or_group in OUTPUT_DIRS for o in parsed):
        e = dir_error("hydra.run.dir", DEFAULT_RUN_DIR)  # Hydra's default, under the working directory
        if e:
            out.append(_Checked("hydra.run.dir", None, e))
    return out


def check_overrides(overrides: Sequence[str], config_dirs: Iterable[str | Path] = ()) -> list[str]:
    """One sentence per command-line value that Hydra could not compose: an unknown option of
    ``strategy``/``order``, a key the schema lacks, or a value of the wrong type (each value of a
    sweep on its own; a single run checks :func:`sweeps_without_multirun` first)."""
    return [s for c in _check_each(overrides, config_dirs) or [] for s in c.sentences]


def sweeps_without_multirun(overrides: Sequence[str]) -> list[str]:
    """One sentence per sweep (``a,b``, ``choice(...)``, ``range(...)``) on the command line of a
    single run: it runs only as a multirun (``-m``); Hydra would answer "Ambiguous value ... use
    key=[value1,value2]", the advice for a list. Where the key also takes a list (a key the
    schema leaves untyped: ``memory_limit``, ``recompute``, ``model.*``, ...), the sentence says how
    to write one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:
        return []  # Hydra reports its own syntax errors
    out: list[str] = []
    for o in parsed:
        key = o.key_or_group
        if not o.is_sweep_override() or key.startswith("hydra"):
            continue
        try:
            values = _values(o)
        except Exception:  # noqa: BLE001 - a sweep Hydra parses but this cannot list
            values = None
        text = o.input_line
        count = f" over {len(values)} value{'s' if len(values) != 1 else ''}" if values is not None else ""
        listed = isinstance(o.value(), ChoiceSweep) and key not in GROUPS and _field_type(key)[0] is _ANY
        as_list = f", or write {o.get_key_element()}=[{','.join(s for _, s in values or [])}] for one list value" \
            if listed and values else ""
        out.append(f"{text} is a sweep{count}: add -m (multirun) to run {'each' if count else 'it'}{as_list}.")
    return out


@dataclasses.dataclass
class SweepCheck:
    """:func:`check_sweep_overrides`'s answer."""

    #: the overrides to hand to Hydra: as given, but without the invalid values of each sweep
    overrides: list[str]
    #: the sentences that stop the command before any point runs (empty when the sweep may run)
    fatal: list[str]
    #: ``(key=value, sentence)`` of each sweep value taken out: reported and skipped
    skipped: list[tuple[str, str]]


def _sweep_text(o: Any, kept: list[str]) -> str:
    """The override ``o`` with only the values ``kept`` (their command-line spellings)."""
    sweep = o.value()  # a sweep as parsed (its choices, shuffle and tags)
    body = ",".join(kept)
    shuffle, tags = getattr(sweep, "shuffle", False), sorted(getattr(sweep, "tags", None) or ())
    if len(kept) > 1 and shuffle:
        body = f"shuffle({body})"
    if tags:
        body = f"tag({','.join(tags)},{body if body.startswith('shuffle(') else f'choice({body})'})"
    return f"{o.get_key_element()}={body}"


def check_sweep_overrides(overrides: Sequence[str], config_dirs: Iterable[str | Path] = ()) -> SweepCheck:
    """The multirun form of :func:`check_overrides`: each value of a sweep (``a,b``,
    ``choice(...)``, ``range(...)``) is checked on its own, and an invalid one is taken out of the
    sweep so that the other points still run. An invalid value of a plain override, a key the
    schema lacks, or a sweep none of whose values is valid is fatal: every sentence is then in
    ``fatal`` and nothing should run."""
    checked = _check_each(overrides, config_dirs)
    if checked is None:
        return SweepCheck(list(overrides), [], [])
    kept: list[str] = []
    skipped: list[tuple[str, str]] = []
    for c in checked:
        values = c.values or []
        bad = [(shown, e) for _, shown, e in values if e]
        if c.key_error or (bad and (not c.override.is_sweep_override() or len(bad) == len(values))):
            return SweepCheck(list(overrides), [s for c in checked for s in c.sentences], [])
        if bad:
            skipped.extend((f"{c.override.key_or_group}={shown}", e) for shown, e in bad)
            kept.append(_sweep_text(c.override, [s for s, _, e in values if not e]))
        else:
            kept.append(c.text)
    return SweepCheck(kept, [], skipped)
