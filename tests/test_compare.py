"""``python -m launcher.compare``: the comparison page built from real runs, and rendered in a real
headless Chromium (when Debian's chromium is installed; .ci/run installs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

SMALL = ["stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000", "model.d_model=16",
         "model.n_head=2", "model.n_layer=2", "trainer.max_steps=4", "trainer.val_check_interval=2"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, COLUMNS="200"))


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("compare")
    sweep = tmp / "sweep"
    # two schemes that train, and one point that is invalid (ddp needs W = microbatches)
    p = run("-m", "launcher", "-m", "strategy=gpipe,fslpp,ddp", "G=2", "R=2", "microbatches=8", *SMALL[:1], *SMALL[2:],
            f"hydra.sweep.dir={sweep}", cwd=tmp)
    assert p.returncode == 2, p.stderr[-3000:]  # the invalid points are reported, the others ran
    out = tmp / "page" / "index.html"
    p = run("-m", "launcher.compare", str(sweep), "-o", str(out), cwd=tmp)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"wrote {out}"
    return out


def test_page_has_the_table_charts_and_diagrams(page):
    html = page.read_text()
    rows = re.findall(r'<tr class="(\w+)">', html)
    assert rows.count("ok") == 2 and rows.count("invalid") == 1, rows
    for title in ("Predicted beside measured", "Loss", "Traffic per message kind (received)",
                  "Pipeline diagrams (predicted)"):
        assert f"<h2>{title}</h2>" in html
    assert len(re.findall(r'<img alt="pipeline ', html)) == 2
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 5  # self-contained
    for name in ("comparison", "loss", "traffic"):
        assert (page.parent / f"index.{name}.png").stat().st_size > 10_000


def test_bad_input_is_one_sentence(tmp_path):
    p = run("-m", "launcher.compare", str(tmp_path / "nope"), cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [f"error: {tmp_path / 'nope'} is not a directory."]
    p = run("-m", "launcher.compare", str(tmp_path), cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error: no runs (metrics.json, failed.json or invalid.json)")


CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                "--enable-logging=stderr", "--v=0"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_page_renders_in_headless_chromium(page, tmp_path):
    def chromium(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                              capture_output=True, text=True, timeout=120)

    # sorted on load by measured step time, descending (the same sort a click on its header does)
    col = 10
    p = chromium("--dump-dom", f"{page.as_uri()}#sort=-{col}")
    assert p.returncode == 0, p.stderr[-2000:]
    dom = p.stdout
    assert 'data-sorted="-10"' in dom
    keys = [re.findall(r'data-v="([^"]*)"', row)[col]
            for row in re.findall(r'<tr class="ok">(.*?)</tr>', dom, re.S)]
    assert len(keys) == 2 and [float(k) for k in keys] == sorted((float(k) for k in keys), reverse=True)
    console = [line for line in p.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console

    shot = tmp_path / "page.png"
    p = chromium("--window-size=1400,2400", f"--screenshot={shot}", page.as_uri())
    assert p.returncode == 0 and shot.stat().st_size > 50_000, p.stderr[-2000:]
