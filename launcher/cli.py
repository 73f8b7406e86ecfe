"""``python -m launcher`` / ``launcher``: the Hydra front end.

Thin by design: Hydra composes the config (``conf/``, typed by :mod:`launcher.config.schema`) and
this module hands it to one module per mode (:mod:`launcher.modes`), each of which validates it
(:mod:`launcher.config.validate`) before it runs anything.

Exit codes:

- ``0``: every run (every point of a sweep) ran;
- ``2``: an invalid config. The command line itself (an unknown ``strategy``/``order`` option, a
  key the schema lacks, a value of the wrong type, e.g. ``G=2.5``) is checked before Hydra starts.
  In a single run nothing runs. In a multirun (``-m``) each value of a sweep is checked on its
  own: an invalid one is reported, taken out of the sweep and the other points still run; nothing
  runs when a plain override, a key, or every value of a sweep is invalid. A config that composes
  but breaks a rule (``W != G*R``, ``R > stages``, a memory limit the step cannot finish under,
  ...) stops a single run; in a sweep that point is reported and skipped, the other points still
  run. Either way the exit code is ``2`` once all of them have run. A single training run is
  checked whole (model, data and Trainer built, one batch of the data checked against the model)
  before Hydra makes its run directory; a config file under ``--config-dir`` that is not valid
  YAML, and a run directory another live run holds (``.launcher.lock``, naming its PID), are
  refused the same way;
- ``1``: a training run (a point) failed: a worker raised or died (the others still ran), a file
  could not be written (a full disk: one line naming it), or anything else (Hydra's own errors, a
  crash);
- ``130`` / ``143``: stopped by SIGINT (Ctrl-C) / SIGTERM; every worker was stopped first, and a
  training run left ``metrics.json`` with ``"status": "interrupted"`` (what it measured so far).

A hyperparameter search (``hparams_search=optuna``, or a multirun with ``hydra/sweeper=optuna``)
is a sweep whose points are Optuna's trials, and ends with the same codes: each run returns its
``optimized_metric`` (:mod:`launcher.hparams`); an invalid trial (``2``) or a failed one (``1``) is
reported to Optuna as a failed trial and the study goes on, as does a trial that ran but has no
value (the metric is missing or NaN: failed for Optuna, ``0`` here). The study ends with its best
trial (or Pareto front) and the command that reproduces it; when no trial completed, one sentence
(``all N trials failed``) and ``2`` if every trial was invalid, ``1`` otherwise. A bad
``optimized_metric``, a direction per metric missing, or a search parameter that is not a key,
is an invalid config: ``2`` before any trial runs.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Any, Callable

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .config import check_overrides
from .config.validate import SweepCheck, check_sweep_overrides, sweeps_without_multirun
from .modes import MODES, common

EXIT_INVALID = 2
EXIT_FAILED = 1

#: the points this process ran (one for a run, one per point of a sweep on the in-process launcher)
POINTS: list[dict[str, Any]] = []

#: the run directory a single training run will write, as the command-line check composed it
RUN_DIR: dict[str, Any] = {}


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run (one point of a sweep) in the mode the config names; records its outcome."""
    mode: Callable[[DictConfig], dict[str, Any]] = MODES.get(cfg.get("mode"), MODES["simulate"])
    try:
        result = mode(cfg)
    except OSError as e:  # a file the run could not write (a full disk): one sentence naming it
        from .atomic import WriteError, is_disk_full, write_sentence

        if not (isinstance(e, WriteError) or is_disk_full(e)):
            raise
        said = write_sentence(e.filename or "a file of the run", e)
        print(f"error: {said}", file=sys.stderr, flush=True)
        result = {"point": common.point(), "ok": False, "failed": True, "errors": [said]}
    POINTS.append(result)
    return result


class SweepDir(Callback):
    """Remembers the sweep directory in the launching process, so the end-of-sweep table can read
    back the points that a remote launcher (Slurm) ran in other processes."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SWEEP["dir"] = str(config.hydra.sweep.dir)


SWEEP: dict[str, str] = {}


def _points_on_disk() -> list[dict[str, Any]]:
    """Each point of the sweep, from its directory (numbered as Hydra numbers them); a point that
    left nothing (its job died before writing) is recorded as failed with where to look."""
    from pathlib import Path

    root = Path(SWEEP["dir"])
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    points = []
    for d in dirs:
        rec = common.outcome_of(d)
        logs = sorted(root.glob(f".submitit/*_{d.name}/*_{d.name}_*log.err"))
        where = logs[-1] if logs else root / ".submitit"
        points.append(dict(rec, dir=str(d)) if rec is not None else {
            "point": d.name, "ok": False, "failed": True, "dir": str(d),
            "errors": [f"the job of point {d.name} ended without a result; its log: {where}"]})
    return points


@hydra.main(config_path="pkg://launcher.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Any:
    """One run; returns its ``optimized_metric`` to the sweeper (Optuna's value of the trial, or
    :class:`launcher.hparams.NoValue`, which the sweeper records as a failed trial)."""
    from . import hparams

    result = run(cfg)
    result.setdefault("dir", str(common.output_dir()))
    return hparams.objective(cfg, result)


def _preflight(argv: list[str]) -> tuple[list[str], SweepCheck]:
    """Check the command line's own typos (see the module doc) before Hydra starts; returns the
    argv to hand Hydra and the check. In a multirun each value of a sweep is checked on its own
    and an invalid one is taken out of the argv (:func:`check_sweep_overrides`). Nothing is
    checked when Hydra is only asked to show something (``--help``, ``--cfg``, ``--info``)."""
    from .config.hydra_private import args_parser

    nothing = SweepCheck([], [], [])
    try:
        args, _ = args_parser().parse_known_args(argv)
    except SystemExit:
        return argv, nothing  # argparse has printed its usage error; Hydra will repeat it
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return argv, nothing
    dirs = [args.config_dir] if args.config_dir else []
    multirun = args.multirun or any(o.replace(" ", "") in ("hydra.mode=MULTIRUN", "hydra.mode=multirun")
                                    for o in args.overrides)
    multirun = multirun or _multirun_by_config(args.config_name or "config", list(args.overrides), dirs)
    if not multirun:  # a sweep without -m first: alone, it is the one thing to fix
        found = sweeps_without_multirun(args.overrides) or check_overrides(args.overrides, dirs)
        if not found:
            found = _check_training(args.config_name or "config", list(args.overrides), dirs)
        return argv, SweepCheck(list(args.overrides), found, [])
    if dirs:  # a broken YAML file of the user's: one sentence, not the parser's traceback from Hydra
        broken = _yaml_error_of_sweep(args.config_name or "config", list(args.overrides), dirs)
        if broken:
            return argv, SweepCheck(list(args.overrides), [broken], [])
    found = check_sweep_overrides(args.overrides, dirs)
    if not found.fatal:  # optimized_metric and the Optuna sweeper's directions and parameters
        found.fatal.extend(_search_errors(args.config_name or "config", found.overrides, dirs))
    if found.fatal or not found.skipped:
        return argv, found
    # the overrides are argv's positional arguments, in order: swap each for its filtered form
    new, pending = list(argv), list(zip(args.overrides, found.overrides))
    for i, token in enumerate(new):
        if pending and token == pending[0][0]:
            new[i] = pending.pop(0)[1]
    return new, found


def _config_args(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """The options of ``argv`` that choose the config (for a command that reproduces a run of
    it), the primary config's name and the ``--config-dir``."""
    from .config.hydra_private import args_parser

    try:
        args, _ = args_parser().parse_known_args(argv)
    except SystemExit:
        return [], "config", []
    given = [f"--config-dir={args.config_dir}"] if args.config_dir else []
    given += [f"--config-path={args.config_path}"] if args.config_path else []
    given += [f"--config-name={args.config_name}"] if args.config_name else []
    return given, args.config_name or "config", [args.config_dir] if args.config_dir else []


def _import_from_cwd() -> None:
    """``python -m launcher`` imports from the working directory; the ``launcher`` console script
    must too, or a ``_target_=mymodule.fn`` that works one way fails the other."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _check_training(config_name: str, overrides: list[str], dirs: list[str]) -> list[str]:
    """A single training run is checked whole before Hydra starts (composed here with Hydra's
    compose API, then built by :func:`launcher.modes.train.check` without starting anything; the run
    takes over what it built), so
    an invalid one leaves no run directory behind. Simulations keep reporting from their run."""
    from pathlib import Path

    from omegaconf import open_dict

    from .config import ConfigError
    from .config.validate import errors as config_errors
    from .modes import train

    try:
        cfg = _compose(config_name, overrides, dirs)
    except Exception as e:  # noqa: BLE001 - Hydra's composition error, e.g. a key not in the config: one sentence
        broken = _yaml_error(e, dirs)
        if broken:
            return [broken]
        if dirs or config_name != "config":
            return []  # a config of the user's own: Hydra reports its problems itself
        added = _not_in_config(e, config_name, overrides, dirs)
        if added:
            return added
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()][:2]
        return [" ".join(lines).rstrip(".") + "."]
    searched = _search_check(cfg, dirs)
    if searched:
        return searched
    if str(cfg.hydra.mode) == "RunMode.MULTIRUN" or cfg.hydra.mode == "MULTIRUN":
        return []  # a sweep set up in the config file: each point is checked when it runs
    try:
        run_dir: str | None = str(cfg.hydra.run.dir)
    except Exception:  # noqa: BLE001 - an interpolation only Hydra's run can resolve: held when the run starts
        run_dir = None
    with open_dict(cfg):
        del cfg["hydra"]
    if cfg.get("mode") != "train":
        return [s for s in config_errors(cfg) if s.startswith("mode=")]
    busy = common.in_use(Path(run_dir)) if run_dir is not None and common.joined_rank() == 0 else None
    if busy:  # another run holds the directory: say so at once, before building anything
        return [busy]
    earlier = train.previous_checkpoint(cfg, Path(run_dir)) if run_dir is not None else None
    if earlier:  # before Hydra writes this run's config into the earlier run's directory
        return [earlier]
    try:
        train.check(cfg)
    except ConfigError as e:
        return e.sentences
    RUN_DIR["dir"] = Path(run_dir) if run_dir is not None else None  # held by _main before Hydra starts
    return []


def _not_in_config(e: BaseException, config_name: str, overrides: list[str], dirs: list[str]) -> list[str]:
    """A key the config lacks (``trainer.max_step=10``): Hydra advises ``+trainer.max_step=10``,
    whose answer is then another error ("did you mean trainer.max_steps?"). The run is checked as
    that advice would have it and its answer said at once; only when the key may be added does the
    sentence say to add it with ``+``. Empty when ``e`` is not about such a key."""
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser

    m = re.match(r"Could not override '([^']+)'", str(e))
    if m is None:
        return []
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - Hydra's syntax error: Hydra's own sentence
        return []
    at = [i for i, o in enumerate(parsed) if o.key_or_group == m.group(1) and not o.is_add() and not o.is_force_add()]
    if not at:
        return []
    given = overrides[at[0]]
    found = _check_training(config_name, [*overrides[:at[0]], "+" + given, *overrides[at[0] + 1:]], dirs)
    RUN_DIR.clear()  # not this command's run: it still stops here
    parent, _, leaf = m.group(1).rpartition(".")
    return found or [f"{given} is not in the config{f': {parent} has no key {leaf}' if parent else ''}; to add "
                     f"it, write +{given}."]


def _multirun_by_config(config_name: str, overrides: list[str], dirs: list[str]) -> bool:
    """Whether a command line with a sweep and no ``-m`` is a multirun because its config sets
    ``hydra.mode: MULTIRUN`` (``hparams_search=optuna 'model.d_model=choice(32,64)'``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        if not any(o.is_sweep_override() for o in parsed):
            return False
        cfg = _compose(config_name, [t for t, o in zip(overrides, parsed) if not o.is_sweep_override()], dirs)
    except Exception:  # noqa: BLE001 - a syntax or composition error: the single run's check says it
        return False
    return "MULTIRUN" in str(cfg.hydra.mode)


def _search_check(cfg: DictConfig, dirs: list[str]) -> list[str]:
    """``optimized_metric`` (and under the Optuna sweeper its directions, and each search parameter
    its config sets, e.g. ``hparams_search=optuna``'s, as a command-line sweep is checked) on the
    composed config, with its ``hydra`` node: once, before any run or trial starts."""
    from . import hparams

    found = hparams.config_errors(cfg)
    if not found and hparams.is_optuna(cfg.hydra.get("sweeper")):
        found = [f"hydra.sweeper.params: {s}" for s in check_sweep_overrides(hparams.params_overrides(cfg), dirs).fatal]
    return found


def _search_errors(config_name: str, overrides: list[str], dirs: list[str]) -> list[str]:
    """:func:`_search_check` of a multirun's config, composed with its plain overrides (a sweep's
    values are checked by :func:`check_sweep_overrides`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        plain = [text for text, o in zip(overrides, parsed) if not o.is_sweep_override()
                 and o.key_or_group not in ("hydra.mode",)]
        cfg = _compose(config_name, plain, dirs)
    except Exception as e:  # noqa: BLE001 - a config Hydra cannot compose: Hydra's own report when it runs
        # except a key the config lacks: the single run's answer (did you mean ...), not Hydra's
        # "Key ... is not in struct" from every point
        given = re.match(r"Could not override '([^']+)'", str(e))
        said = _not_in_config(e, config_name, plain, dirs) if given else []
        return [s for s in said if s.startswith(given.group(1) + "=")] if given else []
    return _search_check(cfg, dirs)


def _compose(config_name: str, overrides: list[str], dirs: list[str]) -> DictConfig:
    """The config as Hydra will compose it (with its ``hydra`` node), through Hydra's compose API."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    # --config-dir adds a directory to the search path after the package's configs, as the
    # command does (hydra/_internal/utils.py: prepended before the structured configs); the
    # compose API looks for the primary config before it reads hydra.searchpath, so a primary
    # config of the user's own is composed from their directory, with the package's after it
    extra = [f"hydra.searchpath=['file://{os.path.abspath(dirs[0])}']"] if dirs else []
    try:
        try:
            with initialize_config_module("launcher.conf", version_base="1.3"):
                return compose(config_name, overrides + extra, return_hydra_config=True)
        except MissingConfigException:
            if not dirs:
                raise
            GlobalHydra.instance().clear()
            with initialize_config_dir(os.path.abspath(dirs[0]), version_base="1.3"):
                return compose(config_name, overrides + ["hydra.searchpath=[pkg://launcher.conf]"],
                               return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def _yaml_error(e: BaseException, dirs: list[str]) -> str | None:
    """One sentence for a config file that is not valid YAML (Hydra raises the parser's error):
    the file, the line and column, and what the parser expected."""
    import yaml

    seen: BaseException | None = e
    while seen is not None and not isinstance(seen, yaml.YAMLError):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    mark = getattr(seen, "problem_mark", None) or getattr(seen, "context_mark", None)
    name = getattr(mark, "name", None) or "a config file"
    if dirs and isinstance(name, str) and os.path.isabs(name):
        base = os.path.abspath(dirs[0])
        name = os.path.relpath(name, base) if name.startswith(base + os.sep) else name
    problem = " ".join(str(getattr(seen, "problem", None) or seen).split()).rstrip(".")
    context = getattr(seen, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    how = f" ({' '.join(str(context).split())})" if context else ""
    key = f"--config-dir={dirs[0]}: " if dirs else ""
    return f"{key}{name} is not valid YAML: {problem}{where}{how}."


def _yaml_error_of_sweep(config_name: str, overrides: list[str], dirs: list[str]) -> str | None:
    """A multirun's config composed once with its plain overrides (a sweep's values are checked by
    each point): its YAML error, if any."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        plain = [text for text, o in zip(overrides, parsed) if not o.is_sweep_override()
                 and o.key_or_group not in ("hydra.mode",)]
        _compose(config_name, plain, dirs)
    except Exception as e:  # noqa: BLE001 - anything but YAML: Hydra's own report when it runs
        return _yaml_error(e, dirs)
    return None


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    from .runtime import Interrupted

    raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} before any worker started")


def main() -> None:
    import logging

    _import_from_cwd()
    from .logs import show

    show()  # warnings and progress notes as plain lines on stderr
    # a log file that cannot be written (a full disk) must not print a traceback per record: the
    # run reports the file it could not write, once
    logging.raiseExceptions = False
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        _main()
    except (SystemExit, Exception):
        raise
    except BaseException as e:  # a stop: the runtime (and torch) imported only now, so --help stays quick
        from .runtime import Interrupted

        if isinstance(e, Interrupted):
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        if isinstance(e, KeyboardInterrupt):
            print("error: stopped by SIGINT before any worker started", file=sys.stderr, flush=True)
            sys.exit(128 + signal.SIGINT)
        raise


def _main() -> None:
    RUN_DIR.clear()
    argv, found = _preflight(sys.argv[1:])
    if not found.fatal and RUN_DIR.get("dir") is not None and common.joined_rank() == 0:
        # held from here to the run's end (the run holds the directory Hydra makes: the same one,
        # unless a clock's second passed in between): a second run in it stops here, before Hydra
        # writes its config into the first one's directory
        try:
            common.hold(RUN_DIR["dir"])
        except common.DirInUse as e:
            found.fatal.append(str(e))
        except OSError:
            pass  # an unwritable directory: Hydra's own check says so
    if found.fatal:
        for s in found.fatal:
            print(f"error: {s}", file=sys.stderr)
        sys.exit(EXIT_INVALID)
    for point, s in found.skipped:
        print(f"error: {s}", file=sys.stderr)
        print(f"skipped: {point} (invalid config; the other points still run)", file=sys.stderr)
    sys.argv[1:] = argv
    POINTS.clear()
    SWEEP.clear()
    from . import hparams

    hparams.STUDY.clear()
    try:
        _hydra_main()
    except SystemExit:
        # Hydra reported its own error and exits 1; when a remote job died without a result
        # (killed, out of memory) the sweep still ends with the table of what each point left
        if not SWEEP or POINTS:
            raise
    finally:
        common.let_go()  # the directory held since the check (the run has let go of its own)
    if SWEEP and not POINTS:  # the points ran in other processes (a Slurm job array)
        POINTS.extend(_points_on_disk())
    study = bool(hparams.STUDY) and bool(POINTS)  # an Optuna search: its points are trials
    noun = "trials" if study else "points"
    if len(POINTS) > 1:
        from .report import sweep_table

        common.console().print(sweep_table(POINTS, title=f"{'study' if study else 'sweep'}: {len(POINTS)} {noun}"))
    failed = [p for p in POINTS if p.get("failed")]
    bad = [p for p in POINTS if not p["ok"] and not p.get("failed")]
    if study and not hparams.summarize(POINTS, *_config_args(argv)):  # no trial completed: said in one sentence
        sys.exit(EXIT_INVALID if len(bad) == len(POINTS) else EXIT_FAILED)
    told = " (reported to Optuna as failed trials)" if study else ""
    if bad and len(POINTS) > 1:
        print(f"error: {len(bad)} of {len(POINTS)} {noun} were invalid and skipped{told}", file=sys.stderr)
    if failed and len(POINTS) > 1:
        print(f"error: {len(failed)} of {len(POINTS)} {noun} failed while training{told}", file=sys.stderr)
    if failed:
        sys.exit(EXIT_FAILED)
    if found.skipped:
        values = ", ".join(point for point, _ in found.skipped)
        print(f"error: {len(found.skipped)} invalid sweep value{'s were' if len(found.skipped) > 1 else ' was'} "
              f"skipped before the sweep started: {values}", file=sys.stderr)
    if bad or found.skipped:
        sys.exit(EXIT_INVALID)


if __name__ == "__main__":
    main()
