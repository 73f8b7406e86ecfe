"""Shared by every test module: the fixtures (plain helper functions are in ``tests/helpers/``)."""

# launcher first: where torchvision's extension cannot load (a CPU torch beside PyPI's CUDA
# torchvision), importing lightning fails unless launcher's torchvision fallback is installed
import launcher  # noqa: F401, I001

import pytest
from hydra import compose, initialize_config_module

import launcher.config  # noqa: F401  (registers the schema and the resolver)


@pytest.fixture(scope="module")
def cfg_of():
    """Composes the launcher's config in this process, as the command line does:
    ``cfg_of("strategy=ddp", "G=2")`` or ``cfg_of(["strategy=ddp", "G=2"])``. Hydra is initialised
    for the module's tests that use it."""

    def compose_overrides(*overrides):
        if len(overrides) == 1 and isinstance(overrides[0], (list, tuple)):
            overrides = overrides[0]
        return compose("config", overrides=list(overrides))

    with initialize_config_module("launcher.conf", version_base="1.3"):
        yield compose_overrides
