"""The Hydra front end's config layer: schema (types), validation (rules), config -> Settings -> Schedule.

Importing this package registers the ``mul`` resolver and the ``launcher_schema`` structured
config with Hydra.
"""

from .schema import LauncherConf, register
from .spec import settings_of, to_schedule
from .validate import ConfigError, check_overrides, errors, step_errors, validate

__all__ = ["LauncherConf", "settings_of", "register", "to_schedule", "ConfigError", "check_overrides", "errors",
           "step_errors", "validate"]
