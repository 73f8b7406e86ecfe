"""``python -m launcher.checkpoint consolidate`` streams a sharded checkpoint stage by stage: the file
it writes is the single-device checkpoint dict key for key, and the process's resident memory grows
by about one stage and its optimizer state, not by the checkpoint's size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import torch
from torch import nn

from launcher.checkpoint import consolidate, load
from launcher.lightning import sharded


class LinearStages(nn.Module):
    def __init__(self, stages: int, width: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.Linear(width, width) for _ in range(stages))
        self.register_buffer("scale", torch.ones(3))  # an entry outside the stages


def _sharded(path: Path, stages: int, width: int, dtype: torch.dtype = torch.float32) -> int:
    """A sharded checkpoint of a trained :class:`LinearStages` written by one process; its stages' bytes."""
    torch.manual_seed(0)
    model = LinearStages(stages, width).to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    sum(m.weight.sum() + m.bias.sum() for m in model.stages).backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    ids = {id(p): n for n, p in model.named_parameters()}
    ckpt = {"state_dict": model.state_dict(), "global_step": 2, "epoch": 0,
            "optimizer_states": [sharded.optimizer_entries(opt, ids, set(names))]}
    staged = {k for k in model.state_dict() if k.startswith("stages.")}
    sharded.save(ckpt, path, staged, names, {}, rank=0)
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def _equal(a: object, b: object) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_the_streamed_file_is_the_single_device_checkpoint(tmp_path):
    for dtype in (torch.float64, torch.bfloat16):
        ckpt = tmp_path / f"{dtype}" / "last.ckpt"
        _sharded(ckpt, stages=3, width=5, dtype=dtype)
        out = tmp_path / f"{dtype}.ckpt"
        consolidate(ckpt, out)
        assert zipfile.ZipFile(out).testzip() is None  # each record's CRC-32 matches the bytes written after it
        got, want = torch.load(out, weights_only=True), load(ckpt)
        assert _equal(got, want)
        assert got["optimizer_states"][0]["state"][0]["exp_avg"].abs().sum() > 0


PEAK = """
import json, sys
from pathlib import Path
import launcher
from launcher.checkpoint import consolidate

def hwm():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
consolidate(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "after": hwm()}))
"""


def test_consolidation_holds_about_one_stage(tmp_path):
    stages, width = 8, 2048
    ckpt = tmp_path / "last.ckpt"
    weights = _sharded(ckpt, stages, width)
    stage = 3 * weights // stages  # one stage's parameters and AdamW's two moments
    total = 3 * weights
    out = tmp_path / "one.ckpt"
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(PEAK), str(ckpt), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    grew = m["after"] - m["before"]
    # DCP reads each tensor's bytes and copies them: up to two copies of a stage, plus slack
    assert grew < 2 * stage + 64 * 2**20 < total, (grew, stage, total)
    assert out.stat().st_size > total
