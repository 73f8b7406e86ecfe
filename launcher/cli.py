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
  run. Either way the exit code is ``2`` once all of them have run;
- ``1``: anything else (Hydra's own errors, a crash).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import hydra
from omegaconf import DictConfig

from .config import check_overrides
from .config.validate import SweepCheck, check_sweep_overrides
from .modes import MODES, common

EXIT_INVALID = 2

#: the points this process ran (one for a run, one per point of a sweep on the in-process launcher)
POINTS: list[dict[str, Any]] = []


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run (one point of a sweep) in the mode the config names; records its outcome."""
    mode: Callable[[DictConfig], dict[str, Any]] = MODES.get(cfg.get("mode"), MODES["simulate"])
    result = mode(cfg)
    POINTS.append(result)
    return result


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
        return argv, SweepCheck(list(args.overrides), check_overrides(args.overrides, dirs), [])
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
    import os

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main() -> None:
    _import_from_cwd()
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
    _hydra_main()
    if len(POINTS) > 1:
        from .report import sweep_table

        common.console().print(sweep_table(POINTS, title=f"sweep: {len(POINTS)} points"))
    bad = [p for p in POINTS if not p["ok"]]
    if bad and len(POINTS) > 1:
        print(f"error: {len(bad)} of {len(POINTS)} points were invalid and skipped", file=sys.stderr)
    if found.skipped:
        values = ", ".join(point for point, _ in found.skipped)
        print(f"error: {len(found.skipped)} invalid sweep value{'s were' if len(found.skipped) > 1 else ' was'} "
              f"skipped before the sweep started: {values}", file=sys.stderr)
    if bad or found.skipped:
        sys.exit(EXIT_INVALID)


if __name__ == "__main__":
    main()
