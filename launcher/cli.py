"""``python -m launcher`` / ``launcher``: the Hydra front end.

Thin by design: the command line is checked before Hydra starts (:mod:`launcher.preflight`), Hydra
composes the config (``conf/``, typed by :mod:`launcher.config.schema`) and runs each point through
the command's object (:class:`launcher.command.Command`, which carries the command's state from
the check to the exit code), which hands it to one module per mode (:mod:`launcher.modes`), each
of which validates it (:mod:`launcher.config.validate`) before it runs anything. Which process
gets which signal handler is :mod:`launcher.signals`.

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
import signal
import sys

from . import signals
from .command import Command, SweepDir  # noqa: F401 - SweepDir: conf/config.yaml's hydra.callbacks name it here
from .modes import common
from .preflight import preflight

EXIT_INVALID = 2
EXIT_FAILED = 1


def _import_from_cwd() -> None:
    """``python -m launcher`` imports from the working directory; the ``launcher`` console script
    must too, or a ``_target_=mymodule.fn`` that works one way fails the other."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main() -> None:
    import logging

    _import_from_cwd()
    from .logs import show

    show()  # warnings and progress notes as plain lines on stderr
    # a log file that cannot be written (a full disk) must not print a traceback per record: the
    # run reports the file it could not write, once
    logging.raiseExceptions = False
    signals.on_launch()
    try:
        _main(Command())
    except (SystemExit, Exception):
        raise
    except BaseException as e:  # a stop: the runtime (and torch) imported only now, so --help stays quick
        if isinstance(e, signals.Interrupted):
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        if isinstance(e, KeyboardInterrupt):
            print("error: stopped by SIGINT before any worker started", file=sys.stderr, flush=True)
            sys.exit(128 + signal.SIGINT)
        raise


def _main(command: Command) -> None:
    """The check, Hydra's run(s), then the end-of-sweep table and the exit code (see the module doc)."""
    argv, found = preflight(sys.argv[1:], command)
    if not found.fatal and command.run_dir is not None and common.joined_rank() == 0:
        # held from here to the run's end (the run holds the directory Hydra makes: the same one,
        # unless a clock's second passed in between): a second run in it stops here, before Hydra
        # writes its config into the first one's directory
        try:
            common.hold(command.run_dir)
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
    points = command.points
    try:
        command.hydra()
    except SystemExit:
        # Hydra reported its own error and exits 1; when a remote job died without a result
        # (killed, out of memory) the sweep still ends with the table of what each point left
        if command.sweep_dir is None or points:
            raise
    finally:
        common.let_go()  # the directory held since the check (the run has let go of its own)
    if command.sweep_dir is not None and not points:  # the points ran in other processes (a Slurm job array)
        points.extend(command.points_on_disk())
    study = command.study if points else None  # an Optuna search: its points are trials
    noun = "trials" if study else "points"
    if len(points) > 1:
        from .report import sweep_table

        common.console().print(sweep_table(points, title=f"{'study' if study else 'sweep'}: {len(points)} {noun}"))
    failed = [p for p in points if p.get("failed")]
    bad = [p for p in points if not p["ok"] and not p.get("failed")]
    if study is not None:
        from . import hparams
        from .config.compose import config_args

        if not hparams.summarize(points, study, *config_args(argv)):  # no trial completed: said in one sentence
            sys.exit(EXIT_INVALID if len(bad) == len(points) else EXIT_FAILED)
    told = " (reported to Optuna as failed trials)" if study else ""
    if bad and len(points) > 1:
        print(f"error: {len(bad)} of {len(points)} {noun} were invalid and skipped{told}", file=sys.stderr)
    if failed and len(points) > 1:
        print(f"error: {len(failed)} of {len(points)} {noun} failed while training{told}", file=sys.stderr)
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
