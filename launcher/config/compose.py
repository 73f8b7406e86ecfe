"""The config as Hydra will compose it, composed before Hydra runs (Hydra's compose API): for the
command line's checks (:mod:`launcher.preflight`) and for the command that reproduces a trial
(:func:`launcher.hparams.reproduce`)."""

from __future__ import annotations

import os
from typing import Sequence

from omegaconf import DictConfig


def compose(config_name: str, overrides: Sequence[str], dirs: Sequence[str]) -> DictConfig:
    """The config as Hydra will compose it (with its ``hydra`` node), through Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    # --config-dir adds a directory to the search path after the package's configs, as the
    # command does (hydra/_internal/utils.py: prepended before the structured configs); the
    # compose API looks for the primary config before it reads hydra.searchpath, so a primary
    # config of the user's own is composed from their directory, with the package's after it
    overrides = list(overrides)
    extra = [f"hydra.searchpath=['file://{os.path.abspath(dirs[0])}']"] if dirs else []
    try:
        try:
            with initialize_config_module("launcher.conf", version_base="1.3"):
                return hydra_compose(config_name, overrides + extra, return_hydra_config=True)
        except MissingConfigException:
            if not dirs:
                raise
            GlobalHydra.instance().clear()
            with initialize_config_dir(os.path.abspath(dirs[0]), version_base="1.3"):
                return hydra_compose(config_name, overrides + ["hydra.searchpath=[pkg://launcher.conf]"],
                                     return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def plain_overrides(overrides: Sequence[str]) -> list[str]:
    """A multirun's overrides less its sweeps and its ``hydra.mode`` (raises Hydra's syntax error)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [text for text, o in zip(overrides, parsed) if not o.is_sweep_override()
            and o.key_or_group not in ("hydra.mode",)]


def config_args(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """The options of ``argv`` that choose the config (for a command that reproduces a run of
    it), the primary config's name and the ``--config-dir``."""
    from .hydra_private import args_parser

    try:
        args, _ = args_parser().parse_known_args(list(argv))
    except SystemExit:
        return [], "config", []
    given = [f"--config-dir={args.config_dir}"] if args.config_dir else []
    given += [f"--config-path={args.config_path}"] if args.config_path else []
    given += [f"--config-name={args.config_name}"] if args.config_name else []
    return given, args.config_name or "config", [args.config_dir] if args.config_dir else []


def yaml_error(e: BaseException, dirs: Sequence[str]) -> str | None:
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
