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
  checked whole (model, data and Trainer built) before Hydra makes its run directory;
- ``1``: a training run (a point) failed: a worker raised or died (the others still ran), or
  anything else (Hydra's own errors, a crash);
- ``130`` / ``143``: stopped by SIGINT (Ctrl-C) / SIGTERM; every worker was stopped first.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .config import check_overrides
from .config.validate import SweepCheck, check_sweep_overrides
from .modes import MODES, common

EXIT_INVALID = 2
EXIT_FAILED = 1

#: the points this process ran (one for a run, one per point of a sweep on the in-process launcher)
POINTS: list[dict[str, Any]] = []


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run (one point of a sweep) in the mode the config names; records its outcome."""
    mode: Callable[[DictConfig], dict[str, Any]] = MODES.get(cfg.get("mode"), MODES["simulate"])
    result = mode(cfg)
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
        points.append(rec if rec is not None else {
            "point": d.name, "ok": False, "failed": True,
            "errors": [f"the job of point {d.name} ended without a result; its log: {where}"]})
    return points


@hydra.main(config_path="pkg://launcher.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    return run(cfg)


def _preflight(argv: list[str]) -> tuple[list[str], SweepCheck]:
    """Check the command line's own typos (see the module doc) before Hydra starts; returns the
    argv to hand Hydra and the check. In a multirun each value of a sweep is checked on its own
    and an invalid one is taken out of the argv (:func:`check_sweep_overrides`). Nothing is
    checked when Hydra is only asked to show something (``--help``, ``--cfg``, ``--info``)."""
    from hydra._internal.utils import get_args_parser

    nothing = SweepCheck([], [], [])
    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return argv, nothing  # argparse has printed its usage error; Hydra will repeat it
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return argv, nothing
    dirs = [args.config_dir] if args.config_dir else []
    multirun = args.multirun or any(o.replace(" ", "") in ("hydra.mode=MULTIRUN", "hydra.mode=multirun")
                                    for o in args.overrides)
    if not multirun:
        found = check_overrides(args.overrides, dirs)
        if not found:
            found = _check_training(args.config_name or "config", list(args.overrides), dirs)
        return argv, SweepCheck(list(args.overrides), found, [])
    found = check_sweep_overrides(args.overrides, dirs)
    if found.fatal or not found.skipped:
        return argv, found
    # the overrides are argv's positional arguments, in order: swap each for its filtered form
    new, pending = list(argv), list(zip(args.overrides, found.overrides))
    for i, token in enumerate(new):
        if pending and token == pending[0][0]:
            new[i] = pending.pop(0)[1]
    return new, found


def _import_from_cwd() -> None:
    """``python -m launcher`` imports from the working directory; the ``launcher`` console script
    must too, or a ``_target_=mymodule.fn`` that works one way fails the other."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _check_training(config_name: str, overrides: list[str], dirs: list[str]) -> list[str]:
    """A single training run is checked whole before Hydra starts (composed here with Hydra's
    compose API, then built by :func:`launcher.modes.train.prepare` without starting anything), so
    an invalid one leaves no run directory behind. Simulations keep reporting from their run."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from .config import ConfigError
    from .config.validate import errors as config_errors
    from .modes import train

    from hydra import initialize_config_dir
    from omegaconf import open_dict

    try:
        if dirs:  # --config-dir: its configs first, then the package's (as Hydra searches them)
            init = initialize_config_dir(os.path.abspath(dirs[0]), version_base="1.3")
            extra = ["hydra.searchpath=[pkg://launcher.conf]"]
        else:
            init, extra = initialize_config_module("launcher.conf", version_base="1.3"), []
        with init:
            cfg = compose(config_name, overrides + extra, return_hydra_config=True)
    except Exception as e:  # noqa: BLE001 - Hydra's composition error, e.g. a key not in the config: one sentence
        if dirs or config_name != "config":
            return []  # a config of the user's own: Hydra reports its problems itself
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()][:2]
        return [" ".join(lines).rstrip(".") + "."]
    finally:
        GlobalHydra.instance().clear()
    if str(cfg.hydra.mode) == "RunMode.MULTIRUN" or cfg.hydra.mode == "MULTIRUN":
        return []  # a sweep set up in the config file: each point is checked when it runs
    with open_dict(cfg):
        del cfg["hydra"]
    if cfg.get("mode") != "train":
        return [s for s in config_errors(cfg) if s.startswith("mode=")]
    try:
        train.prepare(cfg, None)
    except ConfigError as e:
        return e.sentences
    return []


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    from .runtime import Interrupted

    raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} before any worker started")


def main() -> None:
    from .runtime import Interrupted

    _import_from_cwd()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        _main()
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("error: stopped by SIGINT before any worker started", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)


def _main() -> None:
    argv, found = _preflight(sys.argv[1:])
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
    try:
        _hydra_main()
    except SystemExit:
        # Hydra reported its own error and exits 1; when a remote job died without a result
        # (killed, out of memory) the sweep still ends with the table of what each point left
        if not SWEEP or POINTS:
            raise
    if SWEEP and not POINTS:  # the points ran in other processes (a Slurm job array)
        POINTS.extend(_points_on_disk())
    if len(POINTS) > 1:
        from .report import sweep_table

        common.console().print(sweep_table(POINTS, title=f"sweep: {len(POINTS)} points"))
    failed = [p for p in POINTS if p.get("failed")]
    bad = [p for p in POINTS if not p["ok"] and not p.get("failed")]
    if bad and len(POINTS) > 1:
        print(f"error: {len(bad)} of {len(POINTS)} points were invalid and skipped", file=sys.stderr)
    if failed and len(POINTS) > 1:
        print(f"error: {len(failed)} of {len(POINTS)} points failed while training", file=sys.stderr)
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
