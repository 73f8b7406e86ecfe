"""Every private name of Hydra, OmegaConf and Hydra's plugins that the launcher relies on, in one
place: each behind a small function saying what it wraps and why no public API does the job.

Private names may change in any release: pyproject.toml keeps hydra-core to >=1.3.2,<1.4, omegaconf
to >=2.3,<2.4 and hydra-optuna-sweeper to >=1.2,<1.4 (checked with hydra-core 1.3.8 and
hydra-optuna-sweeper 1.3.0). A new version that moves one of them breaks here, not across the package.
"""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any


def args_parser() -> argparse.ArgumentParser:
    """Hydra's command-line parser (``hydra._internal.utils.get_args_parser``): the options
    ``@hydra.main`` accepts (``--multirun``, ``--config-dir``, ``--help``, ...) with the overrides
    as positional arguments.

    No public API parses a command line as Hydra will: the launcher reads it before Hydra starts
    (to check the overrides and to reproduce a run's command) and must agree with Hydra on every
    option. Tested with hydra-core 1.3 (>=1.3.2,<1.4)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def locate(path: str) -> Any:
    """The object at a dotted path, importing its module (``hydra._internal.utils._locate``, the
    lookup ``_target_`` uses).

    The public ``hydra.utils.get_object`` / ``get_class`` call it too, but log an error line before
    raising when the path does not resolve; the launcher looks targets up ahead of building them and
    reports a missing one in its own sentence, so it needs the lookup without that line. Tested with
    hydra-core 1.3 (>=1.3.2,<1.4)."""
    from hydra._internal.utils import _locate

    return _locate(path)


def element_value_and_text(element: Any) -> tuple[Any, str]:
    """One element of a parsed override (a choice of a sweep, say) as the value the config gets and
    as its command-line spelling: ``Override._convert_value`` and
    ``Override._get_value_element_as_str``.

    The public ``Override.value()`` and ``Override.get_value_element_as_str()`` give the same for
    an override's whole value, but have nothing for one element of a sweep; the public
    ``sweep_iterator``/``sweep_string_iterator`` list the elements, but shuffled for
    ``shuffle(...)`` and unconverted (quoted strings stay quoted). Tested with hydra-core 1.3 (>=1.3.2,<1.4)."""
    from hydra.core.override_parser.types import Override

    return Override._convert_value(element), Override._get_value_element_as_str(element)


def optuna_sweeper_impl() -> ModuleType | None:
    """The Optuna sweeper plugin's implementation module
    (``hydra_plugins.hydra_optuna_sweeper._impl``), or None when the plugin is not installed.

    Its ``OptunaSweeperImpl.sweep`` is what raises when no trial completed, and the module's logger
    (named after it) writes the per-trial failure lines: the public ``OptunaSweeper`` only
    delegates to it and has neither. Pinned to hydra-optuna-sweeper >=1.2,<1.4; checked with 1.3.0."""
    try:
        from hydra_plugins.hydra_optuna_sweeper import _impl
    except ImportError:
        return None
    return _impl
