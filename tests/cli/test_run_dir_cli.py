"""What a run leaves in its directory when something goes wrong around it, as the user types the
commands:

- one run per directory: a run holds ``hydra.run.dir``; a second run there is refused in one
  sentence naming the holder's PID (exit 2) and touches nothing; a lock left by a dead process is
  taken over;
- an interrupted run (Ctrl-C) writes ``metrics.json`` with what it measured and
  ``"status": "interrupted"``;
- a full disk (here ``RLIMIT_FSIZE``: mounting a small tmpfs needs privileges) is one sentence
  naming the file, exit 1, a valid ``failed.json``, and no file under its final name that is cut
  short: what was written before stays as it was.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.cli import SMALL_RUN, start_launcher, survivors

pytestmark = pytest.mark.timeout(240)

SMALL = [*SMALL_RUN, "logger=none"]

launcher = partial(start_launcher, pythonpath="cwd")


def _errors(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("error:")]


def _steps(run: Path) -> int:
    try:
        return sum(1 for line in (run / "progress.jsonl").read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.slow
def test_one_run_per_directory_and_an_interrupted_run_keeps_its_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".launcher.lock").write_text(f"{_dead_pid()}\n")  # left by a run that died: taken over
    a = launcher("strategy=lpp", "G=1", "R=2", *SMALL, "trainer.max_steps=100000", "trainer.val_check_interval=1000",
                 f"hydra.run.dir={run}", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while _steps(run) < 3 and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _steps(run) >= 3, a.stderr.read() if a.poll() is not None else "no step within 120 s"
        assert (run / ".launcher.lock").read_text().strip() == str(a.pid)
        overrides = (run / ".hydra" / "overrides.yaml").read_text()

        b = launcher("strategy=lpp", "G=2", "R=2", *SMALL, "trainer.max_steps=3", f"hydra.run.dir={run}", cwd=tmp_path)
        _, err = b.communicate(timeout=120)
        assert b.returncode == 2, err[-3000:]
        assert err.strip().splitlines() == [
            f"error: hydra.run.dir={run} is in use by another run (PID {a.pid}); wait for it to end, or give this "
            f"run its own hydra.run.dir."]
        assert a.poll() is None  # the holder goes on, its directory untouched
        assert (run / ".hydra" / "overrides.yaml").read_text() == overrides
        assert not any((run / name).exists() for name in ("metrics.json", "failed.json", "invalid.json"))

        os.killpg(a.pid, signal.SIGINT)  # Ctrl-C
        _, err = a.communicate(timeout=60)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    assert a.returncode == 130, err[-3000:]
    assert len(_errors(err)) == 1 and "stopped by SIGINT" in _errors(err)[0], err[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and "stopped by SIGINT" in metrics["error"]
    assert len(metrics["steps"]) >= 3
    assert [s["step"] for s in metrics["steps"]] == list(range(1, len(metrics["steps"]) + 1))
    assert all(isinstance(s["loss"], float) and s["loss"] > 0 for s in metrics["steps"])
    assert metrics["run"]["scheme"] == "lpp" and metrics["latency_s"]["measured"] > 0
    assert not (run / "progress.jsonl").exists() and not (run / ".launcher.lock").exists()
    assert not survivors(str(tmp_path))


@pytest.mark.slow
def test_a_directory_holding_a_checkpoint_is_refused_unless_resumed_from(tmp_path):
    """A second run into a directory whose earlier run left ``last.ckpt`` would write its own beside
    it (``last-v1.ckpt``): it is refused in one sentence, exit 2, and touches nothing; resuming from
    that checkpoint in the same directory goes on writing ``last.ckpt`` there."""
    run = tmp_path / "run"
    common = ["strategy=lpp", "G=1", "R=2", *SMALL, "model.max_steps=3", "trainer.val_check_interval=1000",
              f"hydra.run.dir={run}"]
    first = launcher(*common, "trainer.max_steps=2", cwd=tmp_path)
    _, err = first.communicate(timeout=180)
    assert first.returncode == 0, err[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    before = {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}

    again = launcher(*common, "trainer.max_steps=2", cwd=tmp_path)
    _, err = again.communicate(timeout=180)
    assert again.returncode == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"error: hydra.run.dir={run} holds an earlier run's checkpoint {last}, and a new run there would write its "
        f"own beside it: resume from it with ckpt_path={last} (with trainer.max_steps above its steps), or choose "
        f"another hydra.run.dir (or remove {run / 'checkpoints'})."]
    assert {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before

    resumed = launcher(*common, "trainer.max_steps=3", f"ckpt_path={last}", cwd=tmp_path)
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err[-3000:]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["last.ckpt"]
    assert torch.load(last, weights_only=True)["global_step"] == 3


LIMIT = 100_000  # bytes: the run's small files fit, a checkpoint (~170 kB) does not


def _small_disk() -> None:
    """In the launcher's process (and so its workers): files may not grow past LIMIT; a write past
    it fails with EFBIG, as one on a full disk fails with ENOSPC (SIGXFSZ ignored, so it returns)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
    os.setsid()


@pytest.mark.slow
def test_full_disk_is_one_sentence_and_keeps_what_was_written(tmp_path):
    run = tmp_path / "run"
    # one file per checkpoint (sharded ones: tests/test_checkpoint_sharded.py)
    common = ["strategy=fslpp", "G=2", "R=2", *SMALL, "model.max_steps=4", "trainer.val_check_interval=2",
              "timeout=10", "checkpoint.format=single", f"hydra.run.dir={run}"]
    first = launcher(*common, "trainer.max_steps=2", cwd=tmp_path)  # its checkpoints must stay as they were
    assert first.wait(timeout=120) == 0, first.stderr.read()[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    old, before = last.read_bytes(), torch.load(last, weights_only=True)
    # resumed in its own directory, where the full disk stops it at its next checkpoint
    p = launcher(*common, "trainer.max_steps=4", f"ckpt_path={last}", cwd=tmp_path, preexec_fn=_small_disk,
                 start_new_session=False)  # _small_disk starts the session
    try:
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, err[-3000:]
    ckpt = run / "checkpoints" / "epoch=0-step=4.ckpt"
    assert _errors(err) == [f"error: could not write {ckpt}: the file is larger than this process may write (the "
                            f"file-size limit, ulimit -f)."], err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # a worker's write error is its sentence alone
    failed = json.loads((run / "failed.json").read_text())
    assert failed["status"] == "failed" and str(ckpt) in failed["error"]
    assert len(failed["steps"]) == 2  # what it measured before the fault: steps 3 and 4
    # nothing cut short under a final name, no temporary file left, the old checkpoints intact
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert last.read_bytes() == old
    assert torch.load(last, weights_only=True)["global_step"] == before["global_step"] == 2
    assert not [f.name for f in run.iterdir() if f.name.startswith(".") and f.name != ".hydra"]
    assert not survivors(str(tmp_path))


def _write_past_the_limit(path: Path) -> str:
    """In a child limited to LIMIT bytes per file: replace ``path`` by a larger JSON; the error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = "no error"
        try:
            _small_disk()
            from launcher.atomic import write_json

            write_json(path, {"big": "x" * (2 * LIMIT)})
        except BaseException as e:  # noqa: BLE001 - sent to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said


def test_a_failed_write_leaves_the_previous_file(tmp_path):
    from launcher.atomic import write_json

    path = tmp_path / "metrics.json"
    write_json(path, {"status": "ok", "steps": [1, 2]})
    said = _write_past_the_limit(path)
    assert said == (f"WriteError: could not write {path}: the file is larger than this process may write (the "
                    f"file-size limit, ulimit -f).")
    assert json.loads(path.read_text()) == {"status": "ok", "steps": [1, 2]}
    assert [f.name for f in tmp_path.iterdir()] == ["metrics.json"]


def test_failed_never_raises_when_nothing_can_be_written(tmp_path, capsys):
    """The error path itself: a run directory that cannot take ``failed.json`` still ends with the
    one error line, which says the file could not be written."""
    from omegaconf import OmegaConf

    from launcher.modes.outcomes import record_failure

    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"  # under a file: nothing can be created there
    got = record_failure(OmegaConf.create({"a": 1}), out, "(config)", "rank 1 failed: boom")
    assert got == {"point": "(config)", "ok": False, "failed": True, "errors": ["rank 1 failed: boom"]}
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: rank 1 failed: boom (could not write {out / 'failed.json'}: Not a directory)"]
