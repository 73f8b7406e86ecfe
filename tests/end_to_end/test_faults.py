"""A fault names the right rank, and a hang stops within the timeout.

- ``kill -9`` of a worker names that worker, every time, never a peer's "Connection reset by peer"
  (gloo's C++ text never reaches the user);
- ``kill -STOP`` of a worker with ``timeout=10`` stops the run within the timeout plus a few
  seconds, naming the stopped rank and its job on one line;
- a seeded fault-injection run: kill -9, SIGSTOP and SIGTERM of a random worker, and SIGTERM or
  Ctrl-C to the launcher, at a random moment; each trial stops within its bound, names the right
  rank (or says interrupted), leaves no process and only loadable checkpoints.

The commands are the ones a user types (``python -m launcher ...``, in a subprocess); most of the
seeded trials drive :func:`launcher.runtime.launch` directly, which is what the command runs.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.cli import start_launcher, survivors
from helpers.training import load_checkpoint
from launcher.runtime import Engine, Interrupted, WorkerFailed, launch, mlp_batches, staged_mlp
from launcher.runtime.failure import HangMonitor, Watchdog, is_transport_error, transport_reason
from launcher.schedule import make_schedule

#: one small config for every command: W = 4 workers, a tiny GPT, checkpoints every 4 steps
SMALL = ["strategy=lpp", "G=2", "R=2", "stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8",
         "data.chars=20000", "model.d_model=16", "model.n_head=2", "model.n_layer=2", "logger=none", "png=false",
         "trainer.max_steps=100000", "trainer.val_check_interval=4", "trainer.limit_val_batches=1"]
#: what must never reach the user: a backend's C++ text, or a traceback of a consequence
NOISE = re.compile(r"gloo|GLHF|pair\.cc|Connection (reset|closed) by peer|\.cpp|Traceback")


def launcher(run: Path, *args: str) -> subprocess.Popen:
    return start_launcher(*SMALL, *args, f"hydra.run.dir={run}", cwd=run.parent, hydra_full_error="0",
                          pythonpath="drop")


def workers(pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's workers (each is named ``launcher-rank<r>``)."""
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True, text=True,
                         check=False).stdout
    found = (re.fullmatch(r"\s*(\d+)\s+launcher-rank(\d+)\s*", line) for line in out.splitlines())
    return {int(m[2]): int(m[1]) for m in found if m}


def gone(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def checkpoints_load(folder: Path, pattern: str) -> list[str]:
    """Every checkpoint under its final name loads; returns their names."""
    names = []
    for path in sorted(folder.glob(pattern)):
        ckpt = load_checkpoint(path)
        assert ckpt.get("state_dict") or ckpt.get("stages"), path
        names.append(path.name)
    return names


def start_and_wait(run: Path, *args: str, checkpoint: bool) -> tuple[subprocess.Popen, dict[int, int]]:
    """Start the command; return once its 4 workers train (and, if asked, a checkpoint exists)."""
    p = launcher(run, *args)
    deadline = time.monotonic() + 90
    ws: dict[int, int] = {}
    while time.monotonic() < deadline and p.poll() is None:
        ws = workers(p.pid)
        if len(ws) == 4 and (not checkpoint or list((run / "checkpoints").glob("*.ckpt"))):
            return p, ws
        time.sleep(0.1)
    _, err = p.communicate(timeout=60)
    pytest.fail(f"the run did not start: exit {p.returncode}\n{err[-3000:]}")


def finish(p: subprocess.Popen) -> tuple[float, str]:
    t0 = time.monotonic()
    _, err = p.communicate(timeout=60)
    return time.monotonic() - t0, err


# ---- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_of_a_worker_names_it_every_time(tmp_path):
    """``kill -9`` of worker 1 under strategy=lpp, five times: rank 1 is named,
    never a peer's "Connection reset by peer"."""
    rng = random.Random(19)
    named = []
    for trial in range(5):
        run = tmp_path / f"run{trial}"
        p, ws = start_and_wait(run, checkpoint=trial % 2 == 1)
        time.sleep(rng.uniform(0.0, 1.0))  # a random moment of a step (or of a validation)
        os.kill(ws[1], signal.SIGKILL)
        took, err = finish(p)
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert p.returncode == 1, err[-3000:]
        assert len(lines) == 1, err[-3000:]
        assert re.fullmatch(r"error: rank 1 failed while running [^:]+: the process died \(killed by SIGKILL\)",
                            lines[0]), lines[0]
        assert not NOISE.search(err), err[-3000:]
        assert json.loads((run / "failed.json").read_text())["error"] == lines[0][len("error: "):]
        assert took < 15, took  # the workers stop in well under a second; the rest is the command's exit
        assert gone(ws.values()) and not survivors(str(run))
        checkpoints_load(run / "checkpoints", "*.ckpt")
        named.append(lines[0])
    assert len(named) == 5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stopped_worker_is_named_and_the_run_stops_within_the_timeout(tmp_path):
    """``kill -STOP`` of a worker with timeout=10 stops the run within the timeout
    plus a few seconds (it took 29 s), naming the stopped rank and its job on one line."""
    run = tmp_path / "run"
    p, ws = start_and_wait(run, "timeout=10", checkpoint=True)
    time.sleep(0.5)
    os.kill(ws[2], signal.SIGSTOP)
    t0 = time.monotonic()
    while not gone(ws.values()) and time.monotonic() - t0 < 40:
        time.sleep(0.1)
    stopped = time.monotonic() - t0
    took, err = finish(p)
    took += stopped
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert p.returncode == 1, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(r"error: rank 2 failed while running [^:]+: it hung: its process is stopped \(SIGSTOP, or a "
                        r"debugger\); no progress for 10 s( while ranks? [\d, ]+ waited for it)?", lines[0]), lines[0]
    assert not NOISE.search(err), err[-3000:]
    assert 9.5 < stopped < 10 + 4, stopped  # every worker gone: the timeout, the grace and a poll
    assert took < 10 + 10, took  # and the command has exited
    assert not survivors(str(run))
    assert checkpoints_load(run / "checkpoints", "*.ckpt")


# ---- seeded fault injection, through launch() ------------------------------------------------------

TIMEOUT = 3.0
GRACE = min(2.0, TIMEOUT / 4)
#: from the fault to launch() returning: a death is seen at once, a stop after the timeout; each
#: then stops within the watchdog's grace; plus slack for a loaded 2-core machine
BOUNDS = {"kill": GRACE + 3.0, "term": GRACE + 3.0, "stop": TIMEOUT + GRACE + 3.0, "launcher-term": 3.0,
          "launcher-int": 3.0}
FAULTS = ["kill"] * 6 + ["stop"] * 6 + ["term"] * 6 + ["launcher-term"] * 3 + ["launcher-int"] * 3


def _train(tmp: str, victim: int, fault: str, delay: float) -> None:
    rank = dist.get_rank()
    Path(tmp, f"pid-{rank}").write_text(str(os.getpid()))
    engine = Engine(staged_mlp(4), make_schedule("lpp", 4, 4, G=2, R=2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    if rank == victim:
        def fire() -> None:  # a thread: it fires wherever the compute thread is, a receive included
            Path(tmp, "fired").write_text(repr(time.monotonic()))
            if fault == "launcher-int":  # Ctrl-C: the whole foreground group (workers ignore it)
                for r in range(4):
                    p = Path(tmp, f"pid-{r}")
                    if p.exists() and r != rank:
                        os.kill(int(p.read_text()), signal.SIGINT)
                os.kill(os.getppid(), signal.SIGINT)
            elif fault == "launcher-term":
                os.kill(os.getppid(), signal.SIGTERM)
            else:
                os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[fault])

        threading.Timer(delay, fire).start()
    for i in range(100_000):
        engine.train_step(mlp_batches(4, seed=i))
        if i % 3 == 2:
            engine.save_checkpoint(Path(tmp, f"ckpt-{i + 1}.pt"))


@pytest.fixture
def ctrl_c_raises():
    """Python's own Ctrl-C handler for the test: a shell without job control starts a background
    command (``pytest ... &``) with SIGINT ignored, which the launcher rightly keeps."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_seeded_fault_injection(tmp_path, ctrl_c_raises):
    """24 trials: kill -9, SIGSTOP and SIGTERM of a random worker, SIGTERM and Ctrl-C to the
    launcher, each at a random moment (start-up, a job, a receive, a checkpoint)."""
    rng = random.Random(1919)
    faults = FAULTS[:]
    rng.shuffle(faults)
    outcomes = []
    for trial, fault in enumerate(faults):
        tmp = tmp_path / f"t{trial}"
        tmp.mkdir()
        victim, delay = rng.randrange(4), rng.uniform(0.0, 1.5)
        what = f"trial {trial}: {fault} of rank {victim} after {delay:.2f} s"
        with pytest.raises((WorkerFailed, Interrupted)) as info:
            launch(_train, 4, str(tmp), victim, fault, delay, timeout=TIMEOUT, deadline=60)
        returned = time.monotonic()
        took = returned - float((tmp / "fired").read_text())
        err = info.value
        msg = str(err)
        assert "\n" not in msg and not NOISE.search(msg), (what, msg)
        if fault.startswith("launcher"):
            name = "SIGINT" if fault == "launcher-int" else "SIGTERM"
            assert isinstance(err, Interrupted), (what, msg)
            assert err.exit_code == 128 + getattr(signal, name)
            assert msg.startswith(f"stopped by {name}") and msg.endswith("all 4 workers stopped"), (what, msg)
        else:
            assert isinstance(err, WorkerFailed), (what, msg)
            how = {"kill": r"the process died \(killed by SIGKILL\)", "term": r"the process died \(killed by SIGTERM\)",
                   "stop": r"it hung: its process is stopped \(SIGSTOP, or a debugger\); no progress for 3 s.*"}[fault]
            assert re.fullmatch(rf"rank {victim} failed while running [^:]+: {how}", msg), (what, msg)
            for r, said in err.errors.items():  # every other rank stopped because of it, none blamed a peer
                assert said == msg or said.startswith((f"rank {r} stopped because {msg}",
                                                       f"rank {r} was killed")), (what, r, said)
                assert not NOISE.search(said), (what, r, said)
        assert took < BOUNDS[fault], (what, took)
        pids = [int((tmp / f"pid-{r}").read_text()) for r in range(4) if (tmp / f"pid-{r}").exists()]
        assert gone(pids), what
        for name in checkpoints_load(tmp, "ckpt-*.pt"):
            assert len(torch.load(tmp / name, weights_only=False)["stages"]) == 4, (what, name)
        outcomes.append((fault, round(took, 1)))
    print("fault, seconds from the fault to launch() returning:", outcomes)
    assert len(outcomes) == 24 and {f for f, _ in outcomes} == set(BOUNDS)


# ---- the rules, without processes ------------------------------------------------------------------


GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12710: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")


def test_a_broken_connection_is_a_consequence_and_is_told_in_words():
    assert is_transport_error(RuntimeError(GLOO_RESET))
    assert is_transport_error(dist.DistNetworkError("Connection closed by peer"))
    try:  # raised while handling one (Lightning's teardown, a wrapper): still a consequence
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as e:
            raise RuntimeError("all_reduce failed") from e
    except RuntimeError as e:
        assert is_transport_error(e)
    for cause in (ValueError("boom"), RuntimeError("CUDA out of memory"), ConnectionResetError("a download"),
                  RuntimeError("Default process group has not been initialized")):
        assert not is_transport_error(cause), cause
    assert transport_reason(RuntimeError(GLOO_RESET)) == "the connection was reset"


def test_a_worker_whose_connection_broke_names_the_peer_that_failed():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    wd = Watchdog(dist.PrefixStore("t", store), 2, 4, timeout=1.0, interval=0.05, grace=0.25, detect=False)
    wd.set_job("F(1,0) of step 3")
    cause = "rank 1 failed while running B(1,2) of step 3: the process died (killed by SIGKILL)"
    threading.Timer(0.2, lambda: dist.PrefixStore("t", store).set("abort", cause)).start()
    assert wd.fail(RuntimeError(GLOO_RESET)) == cause  # waited for it, did not claim the failure
    # nobody names a cause: the lost connection, in words, after timeout + grace
    store2 = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    wd = Watchdog(dist.PrefixStore("t", store2), 2, 4, timeout=0.5, interval=0.05, grace=0.1, detect=False)
    t0 = time.monotonic()
    assert wd.fail(RuntimeError(GLOO_RESET)) == (
        "rank 2 failed while running no job (between steps): it lost its connection to another rank (the connection "
        "was reset) and no rank reported a failure within 0.6 s")
    assert 0.5 < time.monotonic() - t0 < 2.0
    # its own error is claimed at once
    store3 = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    wd = Watchdog(dist.PrefixStore("t", store3), 3, 4, timeout=5.0, detect=False)
    t0 = time.monotonic()
    assert wd.fail(ValueError("boom")) == "rank 3 failed while running no job (between steps): ValueError: boom"
    assert time.monotonic() - t0 < 0.5


def test_the_launchers_hang_rules():
    def hb(n, progress, waiting, job):
        return f"{n}|{progress}|{int(waiting)}|{job}"

    m = HangMonitor(3.0)
    # rank 1 freezes (its heartbeat stops) while 0, 2 and 3 keep beating, waiting for it
    assert m.update({0: hb(1, 5, 0, "F(0,0)"), 1: hb(1, 4, 0, "F(1,0)"), 2: hb(1, 3, 0, ""), 3: hb(1, 3, 0, "")},
                    0.0) is None
    for t in range(1, 8):
        beats = {0: hb(1 + t, 6, 1, "F(0,1)"), 1: hb(1, 4, 0, "F(1,0)"), 2: hb(1 + t, 3, 1, "B(2,0)"),
                 3: hb(1 + t, 3, 1, "")}
        found = m.update(beats, t * 0.5, jobs={1: "F(1,0) of step 7"}, stopped=lambda r: r == 1)
        if t * 0.5 <= 3.0:
            assert found is None, t
        else:
            assert found == (1, ("rank 1 failed while running F(1,0) of step 7: it hung: its process is stopped "
                                 "(SIGSTOP, or a debugger); no progress for 3 s while ranks 0, 2, 3 waited for it"))
            break
    # a rank whose process lives but whose compute is stuck while the others wait for it
    m = HangMonitor(3.0)
    for t in range(10):
        found = m.update({0: hb(t, 5, 1, "F(0,1)"), 1: hb(t, 9, 0, "B(1,1) of step 2"), 2: hb(t, 3, 1, "")}, t * 0.5)
        if found:
            assert t * 0.5 > 3.0
            assert found == (1, ("rank 1 failed while running B(1,1) of step 2: it hung: no progress for 3 s while "
                                 "ranks 0, 2 waited for it"))
            break
    else:
        pytest.fail("the hung rank was not found")
    # everyone busy outside the engine (saving, evaluating), however long: nobody is blamed
    m = HangMonitor(3.0)
    assert all(m.update({0: hb(t, 5, 0, ""), 1: hb(t, 9, 0, "")}, t * 0.5) is None for t in range(20))
    # a finished rank is never blamed
    m = HangMonitor(1.0)
    assert all(m.update({0: "done", 1: hb(t, 2, 0, "")}, t * 0.5) is None for t in range(10))
