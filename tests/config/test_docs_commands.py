"""Every ``python -m launcher`` command shown in README.md and docs/*.md is a valid config: its
overrides compose (Hydra's compose API, as the command line does) and break no rule of the step.
Commands that train are run end to end elsewhere (tests/end_to_end/test_train_cli.py and the model tests);
this keeps the documentation from drifting when keys or rules change. Commands with placeholders
(your own module, a path of yours, ``...``) and the error examples (``$ ...``, which must fail)
are left out; recipes are composed in tests/end_to_end/test_readme_commands.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from launcher.config import check_overrides, errors
from launcher.config.compose import compose as _compose
from launcher.config.validate import check_sweep_overrides

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = ("mymodule", "mymodel", "/path/to", "...", "outputs/", "/shared/", "--config-dir", "<", "node0")


def commands() -> list[tuple[str, str]]:
    """``(page, command)`` for each ``python -m launcher`` line of an indented code block (a
    trailing backslash continues it), without its ``# comment``."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if re.match(r"^ {4,}python -m launcher ", line):
                cmd = line.strip()
                while cmd.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
                cmd = re.sub(r"\s+#.*$", "", cmd)
                if not any(p in cmd for p in PLACEHOLDERS):
                    found.append((page.name, cmd))
            i += 1
    return found


COMMANDS = commands()


def test_the_pages_show_commands():
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "configuration.md", "models.md", "sweeps.md", "planner.md"} <= pages, pages
    assert len(COMMANDS) >= 20, len(COMMANDS)


@pytest.mark.parametrize("page,cmd", COMMANDS, ids=[f"{p}:{c[17:60]}" for p, c in COMMANDS])
def test_documented_command_is_a_valid_config(page, cmd):
    args = shlex.split(cmd)[3:]  # after `python -m launcher`
    multirun = "-m" in args or "--multirun" in args
    overrides = [a for a in args if not a.startswith("-")]
    if multirun:
        found = check_sweep_overrides(overrides)
        assert not found.fatal and not found.skipped, (cmd, found)
        # the sweep's first value of each swept key, as one point of it
        parsed = OverridesParser.create().parse_overrides(overrides)
        point = []
        for text, o in zip(overrides, parsed):
            if o.is_sweep_override():
                values = list(o.sweep_string_iterator()) if o.is_discrete_sweep() else []
                if not values:
                    continue  # an interval: the sampler picks; its key is checked above
                point.append(f"{o.get_key_element()}={values[0]}")
            else:
                point.append(text)
        overrides = point
    else:
        assert check_overrides(overrides) == [], cmd
    cfg = _compose("config", overrides, [])
    if cfg.get("mode") == "plan" or cfg.strategy.name == "auto":
        return  # the planner's keys are checked by the planner's own tests
    assert errors(cfg) == [], cmd
