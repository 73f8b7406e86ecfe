"""``mode=plan``: search the schedule space for the fastest step that fits ``plan.*``'s budget,
print the top candidates and write ``plan.json`` (``best``, ``candidates``, each with the Hydra
overrides that reproduce it under ``mode=simulate``); with ``plan.trials`` the top candidates are
trained on real workers first and the fastest measured is the best (:mod:`launcher.modes.trials`).
Also :func:`chosen`, ``strategy=auto``'s planning half: the config with the planner's best applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ..config import ConfigError
from ..config.validate import errors as config_errors
from ..plan.from_config import budget_of, microbatches_of, plan, profile_of
from ..plan.profile import ProfileError
from ..plan.search import Candidate, Ranking
from ..plan.table import candidates_table, describe, plan_record, write_plan
from ..schedule.settings import DEFAULT
from .common import clear_outcomes, console, in_sweep, output_dir, point, reject, write_invalid
from .trials import fastest, run_trials, trials_record, trials_table


def apply(cfg: DictConfig, c: Candidate) -> DictConfig:
    """``cfg`` with candidate ``c``'s settings, as its overrides would set them."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    assert isinstance(out, DictConfig)  # made from a mapping
    for key, value in c.point.settings().items():
        key = {"strategy": "strategy.name", "order": "order.name"}.get(key, key)
        OmegaConf.update(out, key, value, force_add=True)
    return out


def _hydra_command() -> tuple[list[str], list[str], Path]:
    """The running command's overrides, the arguments that chose its config (``--config-dir``,
    ``--config-name``) and its working directory; empty outside Hydra (a config built in code)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hc = HydraConfig.get()
    except ValueError:
        return [], [], Path.cwd()
    args = [f"--config-dir={s.path}" for s in hc.runtime.config_sources if s.provider == "command-line"]
    if hc.job.config_name and hc.job.config_name != "config":
        args.append(f"--config-name={hc.job.config_name}")
    return list(hc.overrides.task), args, Path(hc.runtime.cwd)


def measured_best(cfg: DictConfig, ranking: Ranking) -> tuple[Candidate | None, dict[str, Any] | None]:
    """The best candidate: with ``plan.trials`` > 0 the fastest of the top ``plan.trials`` trained
    (:mod:`launcher.modes.trials`, under the run directory's ``trials/``), else the prediction's;
    and ``plan.json``'s record of the trials (``None`` without)."""
    k = int(cfg.plan.get("trials") or 0)
    if k == 0 or not ranking.candidates:
        return ranking.best, None
    user, args, cwd = _hydra_command()
    steps, rounds = int(cfg.plan.trial_steps), int(cfg.plan.trial_rounds)
    con = console()
    con.print(f"trials: training the top {min(k, len(ranking.candidates))} for {steps} steps x {rounds} rounds",
              highlight=False)
    trials = run_trials(ranking.candidates[:k], user, output_dir() / "trials", steps, rounds, cwd, args)
    con.print(trials_table(trials, steps, rounds))
    won = fastest(trials)
    if won is None:
        con.print("trials: every trial failed; the predicted best stands", highlight=False)
    return (won.candidate if won else ranking.best), trials_record(trials, steps, rounds)


def chosen(cfg: DictConfig) -> tuple[DictConfig, Candidate]:
    """``strategy=auto``: plan with the config's ``plan.*`` keys and apply the predicted best
    (``plan.trials`` is ``mode=plan``'s); raise :class:`ConfigError` when the config is invalid or
    nothing fits."""
    found = config_errors(cfg)
    if found:
        raise ConfigError(found)
    try:
        best = plan(cfg).best
    except ProfileError as e:
        raise ConfigError([f"{e}."]) from e
    if best is None:
        raise ConfigError([f"strategy=auto found no schedule that fits {_budget_text(cfg)}; raise the budget or "
                           f"plan.workers."])
    return apply(cfg, best), best


def _budget_text(cfg: DictConfig) -> str:
    b = budget_of(cfg)
    parts = ([f"plan.max_activations={b.activations}"] if b.activations is not None else []) + (
        [f"plan.memory={cfg.plan.memory}"] if b.bytes is not None else [])
    return " and ".join(parts) or "no budget"


def run(cfg: DictConfig) -> dict[str, Any]:
    """One planning run (or one point of a sweep): never raises for an invalid config."""
    where = point()
    clear_outcomes()  # a reused run directory must not keep the last run's verdict
    found = config_errors(cfg)
    if found:
        write_invalid(cfg, found)
        return reject(found, where, in_sweep())
    try:
        prof = profile_of(cfg)
        result = plan(cfg)
    except ProfileError as e:
        write_invalid(cfg, [f"{e}."])
        return reject([f"{e}."], where, in_sweep())
    workers = cfg.plan.workers or cfg.G * cfg.R
    con = console()
    con.print(
        f"[bold]plan[/bold] workers={workers} stages={cfg.stages} microbatches={microbatches_of(cfg)} "
        f"budget {_budget_text(cfg)}; {'profile ' + str(cfg.plan.profile) if cfg.plan.profile else 'unit costs'}"
        + (f" (workers share {prof.cores} cores)" if prof.cores else "")
        + f"; steps priced under step_overlap={cfg.get('step_overlap', DEFAULT.step_overlap)}",
        highlight=False)
    con.print(f"simulated {result.simulated} steps; pruned {result.pruned_time} by the time bound and "
              f"{result.pruned_memory} by the memory bound; {result.did_not_fit} evaluated candidates did not fit; "
              f"{result.equivalent} were a listed schedule under other settings; order=auto searched at "
              f"{result.auto_searched} of the best placements",
              highlight=False)
    con.print(candidates_table(result, prof.seconds, rows=min(10, len(result.candidates)), title="top candidates"))
    chosen_one, trials = measured_best(cfg, result)
    if chosen_one:
        con.print(f"best{' (measured)' if trials and chosen_one is not result.best else ''}: {describe(chosen_one)}",
                  highlight=False, soft_wrap=True)
        con.print("reproduce: python -m launcher mode=simulate " + " ".join(chosen_one.overrides),
                  highlight=False, soft_wrap=True)
    else:
        con.print(f"nothing fits {_budget_text(cfg)} on {workers} workers", highlight=False)
    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's container is a dict
    record = plan_record(result, config, prof.seconds, chosen_one)
    if trials:
        record["trials"] = trials
    path = write_plan(record, output_dir())
    con.print(f"wrote {path}", highlight=False, soft_wrap=True)
    best = chosen_one.to_json() if chosen_one else None
    return {"point": where, "ok": True, "summary": None, "plan": best}
