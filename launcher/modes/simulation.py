"""``mode=simulate``: plan one training step with the greedy simulator and report it (tables, the
text diagram, ``simulation.json`` and ``pipeline.png`` in the run directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ..config import ConfigError, to_schedule
from ..config.sentences import one_line
from ..config.validate import errors as config_errors
from ..report.png import AUTO_MAX_JOBS as PNG_AUTO_MAX_JOBS
from ..report.png import want_png
from ..schedule import ScheduleError, Timeline, simulate
from ..schedule.activations import unit_peaks
from ..schedule.diagram import ascii_diagram, legend
from ..schedule.lowering import LoweringError, lower
from ..schedule.metrics import summarize
from ..schedule.overlap import priced
from ..schedule.settings import DEFAULT, SCHEME_DEFAULT
from .common import clear_outcomes, console, in_sweep, output_dir, phase, point, reject, write_invalid


def simulate_config(cfg: DictConfig) -> tuple[Timeline, dict[str, Any]]:
    """Validate, build and simulate the step ``cfg`` describes; raise :class:`ConfigError` (one
    sentence per failure) when it is invalid or cannot finish."""
    found = config_errors(cfg)
    if found:
        raise ConfigError(found)
    step = to_schedule(cfg, check=False)
    try:
        with phase("simulating", step.space.N):
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
    _check_file_places(tl, cfg.weight_cache, cfg.prefetch)
    with phase("summarizing", tl.schedule.space.N):
        summary = summarize(tl, cfg.weight_cache)
        summary.update(priced(tl, cfg.get("step_overlap", DEFAULT.step_overlap)))
        units = unit_peaks(tl)  # what memory_limit bounds: the one memory model's units
        summary["per_worker"]["peak_activation_units"] = units
        summary["total"]["peak_activation_units"] = sum(units)
    if cfg.weight_cache == "job":
        with phase(f"predicting the runtime's resident weights for prefetch={cfg.prefetch}", tl.schedule.space.N):
            runtime_peaks(tl, summary, cfg.prefetch)
    if OmegaConf.select(cfg, "fault.copies", default=0):
        copies(tl, summary)
    return tl, summary


def copies(tl: Timeline, summary: dict[str, Any]) -> None:
    """``fault.copies=1``: per worker, the stages whose state it sends round the ring after each step
    and those whose copy it keeps (:mod:`launcher.schedule.copies`), in stages as the weights are."""
    from ..plan.memory import owned_and_fetched
    from ..schedule.copies import ring_copies

    sent, kept = ring_copies(owned_and_fetched(tl)[0])
    for key, per in (("copies_sent", sent), ("copies_kept", kept)):
        summary["per_worker"][key] = [len(st) for st in per]
        summary["total"][key] = sum(len(st) for st in per)


def _check_file_places(tl: Timeline, weight_cache: str, prefetch: int) -> None:
    """``order=file`` with a file that places actions (a whole step in our text, torch's full CSV):
    lower the step here, so an action that does not fit is refused in one sentence before anything
    is written (the programs are lowered again for ``actions.txt``)."""
    from ..schedule.lowering import lower_actions
    from ..schedule.order_file import FileOrder

    if isinstance(tl.schedule.order, FileOrder):
        try:
            lower_actions(tl, weight_cache, prefetch)
        except LoweringError as e:
            raise ConfigError([str(e).rstrip(".") + "."]) from e


def runtime_peaks(tl: Timeline, summary: dict[str, Any], prefetch: int) -> None:
    """Under ``weight_cache=job`` the runtime holds weights ``prefetch`` jobs ahead, so its peak
    resident weights depend on ``prefetch``: report the value its lowered programs predict (and
    it measures), not the simulator's just-in-time lower bound. A placement the runtime cannot
    lower (a job apart from its forward's worker) keeps the lower bound."""
    try:
        lowered = lower(tl, "job", prefetch)
    except LoweringError:
        return
    peaks = list(lowered.predicted["weights_peak_resident"])
    summary["per_worker"]["weights_peak_resident"] = peaks
    summary["total"]["weights_peak_resident"] = sum(peaks)


#: steps of at most this many jobs print their workers' action lists; larger ones only write them
PRINT_ACTIONS_MAX_JOBS = 256


def print_program(tl: Timeline, weight_cache: str, prefetch: int, out_dir: Path, con: Any) -> None:
    """The action lists the workers run (:func:`~launcher.schedule.lowering.lower_actions`, the
    lookahead resolved): written to ``actions.txt``, printed for a small step. A placement the
    runtime cannot lower has none."""
    from ..schedule.actions import format_programs
    from ..schedule.lowering import lower_actions

    try:
        text = format_programs(lower_actions(tl, weight_cache, prefetch))
    except LoweringError:
        return
    from ..atomic import write_text

    path = write_text(out_dir / "actions.txt", text + "\n")
    if tl.schedule.space.N <= PRINT_ACTIONS_MAX_JOBS:
        con.print(f"program (what each worker runs, weight_cache={weight_cache} prefetch={prefetch}):",
                  highlight=False)
        print(text, flush=True)
    con.print(f"wrote the workers' action lists to {path}", highlight=False, soft_wrap=True)


def report_simulation(cfg: DictConfig, tl: Timeline, summary: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Print the tables and the text diagram; write ``simulation.json`` and ``pipeline.png``."""
    from ..report import closed_form_table, per_worker_table, record, write_record
    from ..report.png import save_png

    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's container is a dict
    scheme = cfg.strategy.name if cfg.strategy.get("placement") is None else "custom"
    rec = record(config, summary, scheme)
    jobs = tl.schedule.space.N
    with phase("writing simulation.json", jobs):
        json_path = write_record(rec, out_dir)
    draw = want_png(cfg.get("png", "auto"), jobs)
    if draw:
        with phase("drawing pipeline.png", jobs):
            png_path = save_png(tl, out_dir / "pipeline.png")

    con = console()
    warmup = tl.schedule.order.warmup
    if cfg.order.get("name") == SCHEME_DEFAULT and cfg.order.get("n") is None:  # no order named: say why this one
        from ..config.validate import raw_settings

        warmup = f"{warmup}; {scheme}'s default: {raw_settings(cfg).default_order()[1]}"
    con.print(
        f"[bold]simulate[/bold] strategy={cfg.strategy.name} G={cfg.G} R={cfg.R} W={summary['workers']} "
        f"stages={cfg.stages} microbatches={cfg.microbatches} order={tl.schedule.order.name} (warmup {warmup})"
        f"{' split_backward' if cfg.split_backward else ''}"
        f"{' ownership ' + cfg.strategy.ownership if cfg.strategy.ownership != DEFAULT.ownership else ''}",
        highlight=False,
    )
    con.print(
        f"latency {summary['latency']:g} ({summary['latency_fb']:g} x (F+B)), utilization "
        f"{summary['utilization']:.3f}, bubble fraction {max(0.0, summary['bubble_fraction']):.3f}, "
        f"rho {summary['rho']:.3f}",
        highlight=False,
    )
    con.print(step_cost_line(summary), highlight=False)
    con.print(per_worker_table(summary))
    con.print(closed_form_table(rec))
    con.print(f"pipeline ({legend('both')}):", highlight=False)
    print(ascii_diagram(tl, cells="both"), flush=True)
    print_program(tl, cfg.weight_cache, cfg.prefetch, out_dir, con)
    export = cfg.order.get("export")
    if export:  # the step's job sequences, for order=file here or torch's _load_csv (a .csv)
        from ..schedule.order_file import write_schedule

        con.print(f"wrote the schedule to {write_schedule(tl.schedule.space, tl.sequences, export)}", highlight=False,
                  soft_wrap=True)
    if draw:
        con.print(f"wrote {json_path} and {png_path}", highlight=False, soft_wrap=True)
    else:
        why = ("png=false" if cfg.get("png", "auto") is False
               else f"{jobs:,} jobs > {PNG_AUTO_MAX_JOBS:,}; png=true draws it anyway")
        con.print(f"wrote {json_path} (pipeline.png skipped: {why})", highlight=False, soft_wrap=True)
    return rec


def step_cost_line(summary: dict[str, Any]) -> str:
    """What a step costs back to back, and under which rule (``step_overlap``)."""
    if summary["step_overlap"] == "none":
        return (f"step cost {summary['step_cost']:g} under step_overlap=none (every step ends on every worker with an "
                f"all-reduce before any optimizer step: the makespan {summary['latency']:g} plus that all-reduce)")
    return (f"step cost {summary['step_cost']:g} under step_overlap={summary['step_overlap']} (the steady state of "
            f"{summary['steady_steps']} consecutive steps; one isolated step's makespan {summary['latency']:g}), "
            f"bubble fraction {max(0.0, summary['step_bubble_fraction']):.4f}")


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run (or one point of a sweep): never raises for an invalid config, records it.
    ``strategy=auto`` simulates the planner's choice (:func:`launcher.modes.planning.chosen`)."""
    where = point()
    clear_outcomes()  # a reused run directory must not keep the last run's verdict
    try:
        if cfg.strategy.name == "auto" and cfg.strategy.get("placement") is None:
            from .planning import chosen

            cfg, best = chosen(cfg)
            console().print("auto: chose " + " ".join(best.overrides), highlight=False, soft_wrap=True)
        tl, summary = simulate_config(cfg)
    except ConfigError as e:
        result = reject(e.sentences, where, in_sweep())
        write_invalid(cfg, e.sentences)
        return result
    try:
        report_simulation(cfg, tl, summary, output_dir())
    except OSError as e:  # the directory went away or filled up after the up-front check
        return reject([f"the run directory {output_dir()} could not be written: {one_line(e)}."], where, in_sweep())
    return {"point": where, "ok": True, "summary": summary}
