"""Sharded checkpoints (``checkpoint.format=sharded``, the default of fsdp, gpipe and fslpp): each
stage's first owner writes it with torch.distributed.checkpoint, the directory appears whole or
not at all, and it loads anywhere exactly.

- a run resumed across fsdp W=4 -> lpp G=2 R=2 -> gpipe with 3 stages -> strategy=single ends where
  one device's uninterrupted run ends (float64, within 1e-10), for the built-in GPT and a tied GPT-2;
- the consolidated file equals the file ``checkpoint.format=single`` writes; Lightning's
  ``load_from_checkpoint`` reads the directory through ``launcher.checkpoint.as_file``;
- the ``save_pretrained`` export loads in ``transformers`` with the same logits;
- a worker killed during a save leaves the previous ``last.ckpt`` whole and loadable;
- an incomplete directory, a missing or truncated shard, another model: one sentence naming the
  file, exit 2, before any worker starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.cli import launcher_env, run_launcher
from helpers.training import max_diff
from launcher.atomic import replace_dir
from launcher.checkpoint import as_file, load
from launcher.lightning import sharded
from launcher.preflight import preflight as _preflight

pytestmark = pytest.mark.timeout(900)

TINY = ["data.batch_size=8", "data.seq_len=8", "data.chars=600", "data.val_fraction=0.2", "logger=none",
        "trainer.precision=64-true", "trainer.val_check_interval=1000", "model.max_steps=8"]
GPT = ["model.n_layer=2", "model.d_model=16", "model.n_head=2"]
GPT2 = ["model=hf", "model.arch=gpt2", "model.config.n_layer=2", "model.config.n_embd=16", "model.config.n_head=2"]
#: (scheme, the step it trains to); each resumes from the one before
CHAIN = [(["strategy=fsdp", "G=4", "R=1", "stages=4", "microbatches=4"], 2),
         (["strategy=lpp", "G=2", "R=2", "stages=4", "microbatches=4"], 4),
         (["strategy=gpipe", "G=1", "R=3", "stages=3", "microbatches=4"], 6),
         (["strategy=single", "microbatches=4"], 8)]
SINGLE = ["strategy=single", "microbatches=4"]


def _launch(*args: str, cwd: Path, env: dict[str, str] | None = None) -> None:
    p = run_launcher(*args, cwd=cwd, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]


def _chain(tmp: Path, model: list[str]) -> SimpleNamespace:
    """The chain of resumed runs, and one device's uninterrupted run to step 8."""
    r = SimpleNamespace(whole=tmp / "whole", runs=[])
    _launch(*SINGLE, *TINY, *model, "trainer.max_steps=8", f"hydra.run.dir={r.whole}", cwd=tmp)
    ckpt: Path | None = None
    for i, (scheme, steps) in enumerate(CHAIN):
        run = tmp / f"part{i}"
        _launch(*scheme, *TINY, *model, f"trainer.max_steps={steps}", f"hydra.run.dir={run}",
                *([f"ckpt_path={ckpt}"] if ckpt else []), cwd=tmp)
        ckpt = run / "checkpoints" / "last.ckpt"
        r.runs.append(run)
    return r


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> SimpleNamespace:
    return _chain(tmp_path_factory.mktemp("gpt"), GPT)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> SimpleNamespace:
    return _chain(tmp_path_factory.mktemp("gpt2"), GPT2)


def _last(run: Path) -> Path:
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt", "gpt2"])
def test_resume_across_schemes_equals_one_device(which, request):
    r = request.getfixturevalue(which)
    first = _last(r.runs[0])
    assert first.is_dir() and sorted(p.name for p in first.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", sharded.META]
    assert _last(r.runs[1]).is_file()  # lpp's default: one file
    assert _last(r.runs[2]).is_dir()  # gpipe's: sharded
    final, whole = load(_last(r.runs[-1])), load(_last(r.whole))
    assert final["global_step"] == whole["global_step"] == 8
    assert max_diff(final["state_dict"], whole["state_dict"]) < 1e-10
    # the optimizer's state too, in the single-device numbering
    a, b = final["optimizer_states"][0], whole["optimizer_states"][0]
    assert a["state"].keys() == b["state"].keys()
    assert max((a["state"][i][k].double() - b["state"][i][k].double()).abs().max().item()
               for i in a["state"] for k in a["state"][i]) < 1e-10


@pytest.mark.slow
def test_consolidation_equals_the_single_file_and_load_from_checkpoint_reads_it(gpt, tmp_path):
    single = tmp_path / "single"
    scheme, steps = CHAIN[0]
    _launch(*scheme, *TINY, *GPT, f"trainer.max_steps={steps}", "checkpoint.format=single",
            f"hydra.run.dir={single}", cwd=tmp_path)
    out = tmp_path / "consolidated.ckpt"
    p = run_launcher("consolidate", str(_last(gpt.runs[0])), str(out), cwd=tmp_path,
                     command=(os.sys.executable, "-m", "launcher.checkpoint"))
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    want = torch.load(_last(single), weights_only=True)
    assert got.keys() == want.keys()
    assert max_diff(got["state_dict"], want["state_dict"]) == 0.0
    assert list(got["state_dict"]) == list(want["state_dict"])
    og, ow = got["optimizer_states"][0], want["optimizer_states"][0]
    assert og["param_groups"] == ow["param_groups"]
    assert og["state"].keys() == ow["state"].keys()
    assert all(torch.equal(og["state"][i][k], ow["state"][i][k]) for i in og["state"] for k in og["state"][i])
    for k in want:
        if k not in ("state_dict", "optimizer_states", "callbacks"):
            assert got[k] == want[k], k
    from launcher.models import GPT as GPTModel

    model = GPTModel.load_from_checkpoint(as_file(_last(gpt.runs[0])), map_location="cpu")
    state = model.state_dict()
    assert all(torch.equal(v, want["state_dict"][k].to(v.dtype)) for k, v in state.items())


@pytest.mark.slow
def test_the_hf_export_loads_in_transformers_with_the_same_logits(gpt2, tmp_path):
    from transformers import AutoModelForCausalLM

    from launcher.models.hf import HFCausalLM

    ckpt = _last(gpt2.runs[0])
    out = tmp_path / "pretrained"
    p = run_launcher("export", str(ckpt), str(out), cwd=tmp_path,
                     command=(os.sys.executable, "-m", "launcher.checkpoint"))
    assert p.returncode == 0, p.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    saved = load(ckpt)
    ours = HFCausalLM(**saved["hyper_parameters"]).double()
    ours.load_state_dict(saved["state_dict"])
    ours.eval()
    x = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        assert (hf(x).logits - ours.hf(x).logits).abs().max().item() < 1e-12


KILL = '''
import os
if os.environ.get("KILL_IN_SAVE"):
    import signal
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs
    write = fs._write_item

    def _write_item(*args, **kwargs):
        if dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies in the middle of writing its shard
        return write(*args, **kwargs)

    fs._write_item = _write_item
'''


@pytest.mark.slow
def test_a_worker_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    model = [*TINY, *GPT, "strategy=fsdp", "G=2", "R=1", "stages=2", "microbatches=2"]
    _launch(*model, "trainer.max_steps=2", f"hydra.run.dir={run}", cwd=tmp_path)
    last = _last(run)
    before = load(last)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL)
    env = launcher_env(tmp_path)
    env.update(KILL_IN_SAVE="1", PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]))
    p = run_launcher(*model, "trainer.max_steps=4", f"ckpt_path={last}", f"hydra.run.dir={run}", cwd=tmp_path,
                     env=env, timeout=300)
    assert p.returncode != 0
    assert sharded.problems(last) is None
    after = load(last)
    assert after["global_step"] == before["global_step"] == 2
    assert max_diff(after["state_dict"], before["state_dict"]) == 0.0
    _launch(*model, "trainer.max_steps=4", f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'again'}",
            cwd=tmp_path)
    assert load(_last(tmp_path / "again"))["global_step"] == 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A sharded checkpoint of the tiny GPT, 2 steps under fsdp W=2."""
    tmp = tmp_path_factory.mktemp("saved")
    _launch(*TINY, *GPT, "strategy=fsdp", "G=2", "R=1", "stages=2", "microbatches=2", "trainer.max_steps=2",
            f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    return _last(tmp / "run")


def _fatal(ckpt: Path, *extra: str) -> list[str]:
    _, found = _preflight(["strategy=fsdp", "G=2", "R=1", "stages=2", "microbatches=2", *TINY, *GPT,
                           "trainer.max_steps=4", f"ckpt_path={ckpt}", *extra])
    return found.fatal


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_bad_sharded_checkpoints_are_one_sentence_naming_the_file(saved, tmp_path):
    assert _fatal(saved) == []
    missing = _copy(saved, tmp_path / "missing.ckpt")
    (missing / "__1_0.distcp").unlink()
    assert _fatal(missing) == [f"ckpt_path={missing} lacks its shard {missing / '__1_0.distcp'}: resume from another "
                               f"checkpoint (a save interrupted midway leaves the previous last.ckpt whole), or start "
                               f"without ckpt_path."]
    cut = _copy(saved, tmp_path / "cut.ckpt")
    shard = cut / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    found = _fatal(cut)
    assert len(found) == 1 and found[0].startswith(
        f"ckpt_path={cut} has its shard {shard} cut short ({size // 2:,} of "), found
    incomplete = _copy(saved, tmp_path / "incomplete.ckpt")
    (incomplete / sharded.META).unlink()
    found = _fatal(incomplete)
    assert len(found) == 1 and found[0].startswith(
        f"ckpt_path={incomplete} lacks {incomplete / sharded.META}, which a save writes last"), found
    other = _fatal(saved, "model.d_model=32")
    assert len(other) == 1 and other[0].startswith(f"ckpt_path={saved} holds another model"), other
    assert "stages.0.tok.weight has shape [128, 16] where this model's has [128, 32]" in other[0]


def test_replace_dir_swaps_whole_directories(tmp_path):
    final, tmp = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.tmp"
    tmp.mkdir()
    (tmp / "a").write_text("1")
    replace_dir(tmp, final)
    assert (final / "a").read_text() == "1" and not tmp.exists()
    tmp.mkdir()
    (tmp / "b").write_text("2")
    replace_dir(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["b"] and not tmp.exists()
    file = tmp_path / "x.ckpt"
    file.write_text("old")
    tmp.mkdir()
    replace_dir(tmp, file)
    assert file.is_dir() and not tmp.exists()


def _small_disk(limit: int) -> None:
    """Files may not grow past ``limit`` bytes: a write past it fails with EFBIG, as on a full disk."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
def test_a_full_disk_during_a_sharded_save_is_one_sentence_and_keeps_the_previous(saved, tmp_path):
    from functools import partial

    run = saved.parent.parent
    before = load(saved)
    model = [*TINY, *GPT, "strategy=fsdp", "G=2", "R=1", "stages=2", "microbatches=2", "timeout=10"]
    import subprocess

    p = subprocess.run([os.sys.executable, "-m", "launcher", *model, "trainer.max_steps=3", f"ckpt_path={saved}",
                        f"hydra.run.dir={run}"], cwd=tmp_path, env=launcher_env(tmp_path), capture_output=True,
                       text=True, timeout=300, preexec_fn=partial(_small_disk, 100_000))
    assert p.returncode == 1, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: could not write {saved}: the file is larger than this process may write (the "
                      f"file-size limit, ulimit -f)."], p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert sorted(p.name for p in saved.parent.iterdir()) == ["last.ckpt"]  # no temporary directory left
    after = load(saved)
    assert after["global_step"] == before["global_step"] == 2
    assert max_diff(after["state_dict"], before["state_dict"]) == 0.0
