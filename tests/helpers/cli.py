"""The command as its users type it: ``python -m launcher ...`` in a subprocess, the environment it
runs in, and the processes a run leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

#: ``python -m launcher``, with this test session's interpreter
LAUNCHER = (sys.executable, "-m", "launcher")

#: 4 stages, 4 micro-batches, a tiny GPT on 20,000 characters: a run takes seconds
SMALL_RUN = ["stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000",
             "model.d_model=16", "model.n_head=2", "model.n_layer=2"]


def launcher_env(cwd: Path | str | None = None, *, columns: int = 200, hydra_full_error: str | None = None,
                 pythonpath: str = "keep", base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment) with ``COLUMNS`` set (the width of the printed tables);
    ``HYDRA_FULL_ERROR`` set when given; ``PYTHONPATH`` kept (``"keep"``), set to ``cwd`` (``"cwd"``:
    the modules a test writes there import) or removed (``"drop"``)."""
    env = dict(os.environ if base is None else base, COLUMNS=str(columns))
    if hydra_full_error is not None:
        env["HYDRA_FULL_ERROR"] = hydra_full_error
    if pythonpath == "cwd":
        env["PYTHONPATH"] = str(cwd)
    elif pythonpath == "drop":
        env.pop("PYTHONPATH", None)
    elif pythonpath != "keep":
        raise ValueError(f"pythonpath={pythonpath!r}: use keep, cwd or drop")
    return env


def run_launcher(*args: str, cwd: Path, timeout: float = 120, env: Mapping[str, str] | None = None,
                 command: Sequence[str] = LAUNCHER, **env_options) -> subprocess.CompletedProcess:
    """``command`` (``python -m launcher``) with ``args`` in ``cwd``, to the end: its exit code and
    text output. ``env``: the whole environment, else :func:`launcher_env` with ``env_options``."""
    if env is None:
        env = launcher_env(cwd, **env_options)
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start_launcher(*args: str, cwd: Path, env: Mapping[str, str] | None = None, command: Sequence[str] = LAUNCHER,
                   start_new_session: bool = True, preexec_fn=None, **env_options) -> subprocess.Popen:
    """``command`` with ``args`` in ``cwd``, started and not waited for (stdout and stderr piped,
    text); by default in a session of its own, so a test can signal its whole process group."""
    if env is None:
        env = launcher_env(cwd, **env_options)
    return subprocess.Popen([*command, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=start_new_session, preexec_fn=preexec_fn)


def finished(p: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    """Waits for a started command: its exit code, stdout and stderr."""
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def survivors(marker: str) -> list[str]:
    """Processes still running whose command line mentions ``marker`` (the test's own directory)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]
