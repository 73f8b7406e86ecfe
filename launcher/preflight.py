"""The command line's check, before Hydra starts (see :mod:`launcher.cli` for what it refuses and
how): its own typos, each value of a sweep on its own, the search's metric and parameters, and a
single training run whole (built, not started), so an invalid config runs nothing and leaves no
run directory behind. The config is composed as Hydra will compose it (:mod:`launcher.config.compose`)."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig

from .command import Command
from .config import check_overrides
from .config.compose import compose, plain_overrides, yaml_error
from .config.validate import SweepCheck, check_sweep_overrides, sweeps_without_multirun
from .modes import common


def preflight(argv: list[str], command: Command | None = None) -> tuple[list[str], SweepCheck]:
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
        said = sweeps_without_multirun(args.overrides) or check_overrides(args.overrides, dirs)
        if not said:
            said = _check_training(args.config_name or "config", list(args.overrides), dirs, command or Command())
        return argv, SweepCheck(list(args.overrides), said, [])
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


def _check_training(config_name: str, overrides: list[str], dirs: list[str], command: Command) -> list[str]:
    """A single training run is checked whole before Hydra starts (composed here with Hydra's
    compose API, then built by :func:`launcher.modes.train.check` without starting anything; the run
    takes over what it built, which ``command`` records with the run directory), so an invalid one
    leaves no run directory behind. Simulations keep reporting from their run."""
    from omegaconf import open_dict

    from .config import ConfigError
    from .config.validate import errors as config_errors
    from .modes import train

    try:
        cfg = compose(config_name, overrides, dirs)
    except Exception as e:  # noqa: BLE001 - Hydra's composition error, e.g. a key not in the config: one sentence
        broken = yaml_error(e, dirs)
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
        checked = train.check(cfg)
    except ConfigError as e:
        return e.sentences
    command.checked = checked
    command.run_dir = Path(run_dir) if run_dir is not None else None  # held by the command before Hydra starts
    return []


def _not_in_config(e: BaseException, config_name: str, overrides: list[str], dirs: list[str]) -> list[str]:
    """A key the config lacks (``trainer.max_step=10``): Hydra advises ``+trainer.max_step=10``,
    whose answer is then another error ("did you mean trainer.max_steps?"). The run is checked as
    that advice would have it and its answer said at once; only when the key may be added does the
    sentence say to add it with ``+``. Empty when ``e`` is not about such a key."""
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
    # checked on a command of its own: not this command's run, which still stops here
    found = _check_training(config_name, [*overrides[:at[0]], "+" + given, *overrides[at[0] + 1:]], dirs, Command())
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
        cfg = compose(config_name, [t for t, o in zip(overrides, parsed) if not o.is_sweep_override()], dirs)
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
    try:
        plain = plain_overrides(overrides)
        cfg = compose(config_name, plain, dirs)
    except Exception as e:  # noqa: BLE001 - a config Hydra cannot compose: Hydra's own report when it runs
        # except a key the config lacks: the single run's answer (did you mean ...), not Hydra's
        # "Key ... is not in struct" from every point
        given = re.match(r"Could not override '([^']+)'", str(e))
        said = _not_in_config(e, config_name, plain, dirs) if given else []
        return [s for s in said if s.startswith(given.group(1) + "=")] if given else []
    return _search_check(cfg, dirs)


def _yaml_error_of_sweep(config_name: str, overrides: list[str], dirs: list[str]) -> str | None:
    """A multirun's config composed once with its plain overrides (a sweep's values are checked by
    each point): its YAML error, if any."""
    try:
        compose(config_name, plain_overrides(overrides), dirs)
    except Exception as e:  # noqa: BLE001 - anything but YAML: Hydra's own report when it runs
        return yaml_error(e, dirs)
    return None
