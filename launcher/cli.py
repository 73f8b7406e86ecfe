"""``python -m launcher`` / ``launcher``: the Hydra front end.

Thin by design: Hydra composes the config (``conf/``, typed by :mod:`launcher.config.schema`),
:mod:`launcher.config.validate` checks it, :func:`launcher.config.to_step` turns it into a
:class:`~launcher.schedule.Step`, and ``mode=simulate`` reports the simulated step.

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
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, check_overrides, to_step
from .config.step import one_line
from .config.validate import SweepCheck, check_sweep_overrides
from .config.validate import errors as config_errors
from .schedule import ScheduleError, Timeline, simulate
from .schedule.diagram import ascii_diagram, legend
from .schedule.metrics import summarize

EXIT_INVALID = 2

#: the points this process ran (one for a run, one per point of a sweep on the in-process launcher)
POINTS: list[dict[str, Any]] = []


def _console():
    from rich.console import Console

    # not a terminal (a pipe, a log file): wide enough that the tables never wrap
    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def _point() -> str:
    try:
        return " ".join(HydraConfig.get().overrides.task) or "(defaults)"
    except ValueError:  # not inside Hydra (tests calling run_config directly)
        return "(config)"


def _output_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def _reject(sentences: list[str], point: str, sweep: bool) -> dict[str, Any]:
    for s in sentences:
        print(f"error: {s}", file=sys.stderr)
    if sweep:
        print(f"skipped: {point} (invalid config; the other points still run)", file=sys.stderr)
    return {"point": point, "ok": False, "errors": sentences}


def _write_invalid(cfg: DictConfig, sentences: list[str]) -> None:
    """``invalid.json`` in the run directory: why this run (sweep point) did not run."""
    import json

    try:
        out = _output_dir()
    except ValueError:
        return
    try:
        config: Any = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that cannot resolve: keep it as written
        config = OmegaConf.to_container(cfg, resolve=False)
    (out / "invalid.json").write_text(json.dumps({"config": config, "errors": sentences}, indent=2, default=str) + "\n")


def simulate_config(cfg: DictConfig) -> tuple[Timeline, dict[str, Any]]:
    """Validate, build and simulate the step ``cfg`` describes; raise :class:`ConfigError` (one
    sentence per failure) when it is invalid or cannot finish."""
    found = config_errors(cfg)
    if found:
        raise ConfigError(found)
    step = to_step(cfg, check=False)
    try:
        tl = simulate(step)
    except ScheduleError as e:
        raise ConfigError([str(e).rstrip(".") + "."]) from e
    except ConfigError:  # a custom callable's failure, already one sentence
        raise
    except Exception as e:  # a user's placement or order callable failed: say which
        custom = [k for k in ("strategy.placement", "order.n") if OmegaConf.select(cfg, k) is not None]
        if not custom:
            raise
        raise ConfigError(
            [f"the custom {' or '.join(custom)} failed while the step was planned: {one_line(e)}."]
        ) from e
    return tl, summarize(tl, cfg.weight_cache)


def report_simulation(cfg: DictConfig, tl: Timeline, summary: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Print the tables and the text diagram; write ``simulation.json`` and ``pipeline.png``."""
    from .report import closed_form_table, per_worker_table, record, write_record
    from .report.png import save_png

    config = OmegaConf.to_container(cfg, resolve=True)
    scheme = cfg.strategy.name if cfg.strategy.get("placement") is None else "custom"
    rec = record(config, summary, scheme)
    json_path = write_record(rec, out_dir)
    png_path = save_png(tl, out_dir / "pipeline.png")

    con = _console()
    warmup = tl.step.order.warmup
    con.print(
        f"[bold]simulate[/bold] strategy={cfg.strategy.name} G={cfg.G} R={cfg.R} W={summary['workers']} "
        f"stages={cfg.stages} microbatches={cfg.microbatches} order={cfg.order.name} (warmup {warmup})"
        f"{' split_backward' if cfg.split_backward else ''}",
        highlight=False,
    )
    con.print(
        f"latency {summary['latency']:g} ({summary['latency_fb']:g} x (F+B)), utilization "
        f"{summary['utilization']:.3f}, bubble fraction {summary['bubble_fraction']:.3f}, "
        f"rho {summary['rho']:.3f}",
        highlight=False,
    )
    con.print(per_worker_table(summary))
    con.print(closed_form_table(rec))
    con.print(f"pipeline ({legend('both')}):", highlight=False)
    print(ascii_diagram(tl, cells="both"), flush=True)
    con.print(f"wrote {json_path} and {png_path}", highlight=False, soft_wrap=True)
    return rec


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run (or one point of a sweep): never raises for an invalid config, records it."""
    point = _point()
    try:
        sweep = HydraConfig.get().mode.name == "MULTIRUN"
    except ValueError:
        sweep = False
    try:
        tl, summary = simulate_config(cfg)
    except ConfigError as e:
        result = _reject(e.sentences, point, sweep)
        _write_invalid(cfg, e.sentences)
    else:
        report_simulation(cfg, tl, summary, _output_dir())
        result = {"point": point, "ok": True, "summary": summary}
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


def main() -> None:
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

        _console().print(sweep_table(POINTS, title=f"sweep: {len(POINTS)} points"))
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
