"""``python -m launcher --help``: Hydra's help mechanism with the launcher's own text
(conf/hydra/help/launcher.yaml): what the tool does, the modes, the sizes, the schemes, examples,
the config groups and where to look next; quick (it imports no torch)."""

from __future__ import annotations

import sys

import pytest

from helpers.cli import run_launcher
from launcher.config.validate import group_options
from launcher.modes import MODES
from launcher.schedule import SCHEMES

pytestmark = pytest.mark.timeout(120)

#: prints whether torch was imported, as the process ends (--help exits through sys.exit)
PROBE = ("import atexit, sys; "
         "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
         "sys.argv = ['launcher', '--help']; from launcher.cli import main; main()")


@pytest.fixture(scope="module")
def helped(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("help")
    return run_launcher(cwd=cwd, command=(sys.executable, "-c", PROBE), timeout=100)


def test_help_says_what_the_launcher_does(helped):
    assert helped.returncode == 0, helped.stderr[-3000:]
    out = helped.stdout
    assert out.startswith("launcher: train a PyTorch Lightning model under DDP, FSDP, GPipe")
    for mode in MODES:  # every mode the command runs, each on its own line
        assert f"\n  {mode} " in out, mode
    for size in ("G ", "R ", "W ", "stages (S)", "microbatches (B)"):
        assert f"\n  {size}" in out, size
    for scheme in group_options("strategy"):  # every strategy the config offers
        assert f"\n  {scheme} " in out, scheme
    for scheme in SCHEMES.values():  # the registry's line for each named scheme
        assert f"\n  {scheme.name:<9}{scheme.description}\n" in out, scheme.name
    for example in ("python -m launcher  ", "python -m launcher strategy=gpipe G=1 R=4 stages=4",
                    "python -m launcher -m strategy=gpipe,lpp", "python -m launcher hparams_search=optuna"):
        assert example in out, example
    for group in ("data", "logger", "model", "order", "strategy", "trainer"):  # Hydra's $APP_CONFIG_GROUPS
        assert f"\n{group}: " in out, group
    assert "strategy: auto, custom, ddp, fsdp, fslpp, gpipe, lpp, single" in out
    assert "python -m launcher --cfg job" in out and "docs/configuration.md" in out
    # not Hydra's stock page: no config dump, no "powered by Hydra"
    assert "== Config ==" not in out and "powered by Hydra" not in out and "\nG: 2\n" not in out


def test_help_is_quick(helped):
    """--help goes through without the command-line checks and without importing torch."""
    assert "torch imported: False" in helped.stderr, helped.stderr[-3000:]
