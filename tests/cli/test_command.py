"""What one command carries lives on its own object (:class:`launcher.command.Command`), signal
handlers are installed in one module (:mod:`launcher.signals`), and the package's modules import
each other in no circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.cli import SMALL_RUN, run_launcher
from launcher.command import Command
from launcher.preflight import preflight

PACKAGE = Path(__file__).resolve().parents[2] / "launcher"


def test_the_check_records_the_run_on_the_command_it_is_given(tmp_path):
    args = [*SMALL_RUN, "logger=none", "trainer.max_steps=1"]
    command = Command()
    _, found = preflight([*args, f"hydra.run.dir={tmp_path / 'a'}"], command)
    assert not found.fatal, found.fatal
    assert command.run_dir == tmp_path / "a" and command.checked is not None
    other = Command()
    _, found = preflight([*args, f"hydra.run.dir={tmp_path / 'b'}"], other)
    assert not found.fatal and other.run_dir == tmp_path / "b"
    assert command.run_dir == tmp_path / "a" and other.checked is not command.checked  # nothing shared
    _, found = preflight([*args, "microbatches=3"], command)  # an invalid run records nothing new
    assert found.fatal and command.run_dir == tmp_path / "a"


COUNTED = '''
import sys

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class Counted(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        print("built Counted", file=sys.stderr, flush=True)
        self.emb = nn.Embedding(128, width)
        self.head = nn.Linear(width, 128)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


@pytest.mark.slow
def test_the_run_takes_over_what_the_check_built(tmp_path):
    (tmp_path / "usermod.py").write_text(COUNTED)
    p = run_launcher("strategy=lpp", "G=2", "R=1", "stages=2", "microbatches=2", "data.batch_size=4", "data.seq_len=8",
                     "data.chars=2000", "logger=none", "model=custom", "split=auto", "model._target_=usermod.Counted",
                     "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("built Counted") == 1, p.stderr[-3000:]  # by the check, once; the run reuses it


def _modules() -> dict[str, tuple[ast.Module, bool]]:
    found = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (ast.parse(p.read_text()), package)
    return found


def test_signal_handlers_are_installed_in_one_module():
    sites = [f"{name}:{node.lineno}" for name, (tree, _) in _modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and ast.unparse(node.func) in ("signal.signal", "signal")]
    assert sites and all(s.startswith("launcher.signals:") for s in sites), sites


def test_the_package_imports_no_circle():
    """Every import, at module level or inside a function (a type-only import aside); a package
    importing its own submodules is no circle."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (tree, package) in modules.items():
        base = name if package else name.rpartition(".")[0]
        typing_only = {id(n) for i in ast.walk(tree) if isinstance(i, ast.If) and "TYPE_CHECKING" in ast.unparse(i.test)
                       for b in i.body for n in ast.walk(b)}
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                parts = base.split(".")
                root = ".".join(parts[:len(parts) - node.level + 1] + [node.module or ""]).rstrip(".") \
                    if node.level else node.module or ""
                targets.update([root, *(f"{root}.{a.name}" for a in node.names)])
        resolved = {r for t in targets if (r := resolve(t)) is not None}
        graph[name] = {r for r in resolved
                       if r != name and not r.startswith(name + ".") and not name.startswith(r + ".")}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
    assert not circles, [" -> ".join(c) for c in circles]
