"""The PNG pipeline diagram, and that matplotlib stays out of the schedule core."""

from __future__ import annotations

import subprocess
import sys

from launcher.report.png import save_png
from launcher.schedule import make_schedule, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_png_is_written(tmp_path):
    tl = simulate(make_schedule("fslpp", 4, 4, G=2, R=2))
    path = save_png(tl, tmp_path / "sub" / "pipeline.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 2000


def test_png_split_backward_and_many_jobs(tmp_path):
    tl = simulate(make_schedule("lpp", 16, 64, G=4, R=4, split_backward=True))  # > MAX_LABELS: colours only
    path = save_png(tl, tmp_path / "big.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_schedule_and_png_module_do_not_import_matplotlib():
    code = (
        "import sys, launcher.schedule, launcher.report.png, launcher.config; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
