"""The Hydra front end's config layer: schema (types), validation (rules), config -> Step.

Importing this package registers the ``mul`` resolver and the ``launcher_schema`` structured
config with Hydra.
"""

from .schema import LauncherConf, register
from .spec import RunSpec
from .step import to_step
from .validate import ConfigError, check_overrides, errors, step_errors, validate

__all__ = ["LauncherConf", "RunSpec", "register", "to_step", "ConfigError", "check_overrides", "errors", "step_errors",
           "validate"]
