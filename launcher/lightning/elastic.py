"""torchrun's agent restart as the fallback of a lost worker: the run resumes from its ``last.ckpt``.

Under ``torchrun`` the workers are the agent's children, not the launcher's: when one dies, the
agent sends every other worker ``SIGTERM`` within its monitor interval and, with ``--max-restarts``
left, starts all of them again (``TORCHELASTIC_RESTART_COUNT`` counts the restarts); no survivor is
left to recover inside the job (``fault.restarts`` is the local launcher's). So a restarted worker
resumes from the last checkpoint the run wrote in its run directory (``checkpoints/last.ckpt``,
a file or a sharded checkpoint's directory), as a requeued Slurm job resumes from its own
(:mod:`.requeue`). The run directory must be the same for every restart: give ``hydra.run.dir``.

A restart must also join a clean store: torchrun's agent keeps one store for every attempt
(``TORCHELASTIC_USE_AGENT_STORE=True``, the same ``MASTER_PORT``) and torch does not prefix its keys by
attempt, so the restarted workers' gloo read the dead attempt's addresses ("Connection refused",
torch 2.13) and the watchdog its stale keys. :func:`attempt_store` gives each attempt its own prefix.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def under_torchrun() -> bool:
    """Whether torchrun's agent started this worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def max_restarts() -> int:
    """The agent's ``--max-restarts`` (0 outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return int(value) if value.isdigit() else 0


def fallback_note(restarts: int) -> str | None:
    """The console line for ``fault.restarts`` under torchrun, where the agent's restart stands in
    for recovery inside the job (the module docstring); ``None`` elsewhere or without restarts."""
    if not restarts or not under_torchrun():
        return None
    if max_restarts() == 0:
        return (f"warning: fault.restarts={restarts} recovers inside the job only where the launcher starts the "
                f"workers; under torchrun a lost worker ends them all, and --max-restarts=0 restarts none (give "
                f"torchrun --max-restarts=N to resume from the run's last.ckpt)")
    return (f"torchrun: a lost worker ends every worker (the agent's rule), so fault.restarts={restarts} is served by "
            f"its --max-restarts={max_restarts()}: the workers start again and resume from the run's last.ckpt")


def restart_count() -> int:
    """How many times torchrun's agent has restarted this run's workers (0 outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def resume_path(out: str | Path) -> Path | None:
    """The checkpoint a restarted torchrun worker resumes from: the run directory's ``last.ckpt``,
    on a restart only (the first start of a run into a directory with checkpoints is refused as
    ever: :func:`launcher.modes.train.previous_checkpoint`)."""
    last = Path(out) / "checkpoints" / "last.ckpt"
    return last if restart_count() > 0 and last.exists() else None


def attempt_store(world: int, timeout: float = 60.0) -> dist.Store | None:
    """The store a restarted torchrun worker joins the process group through: the agent's, under a
    prefix of this attempt; ``None`` on the first attempt, or where the workers' rank 0 hosts a
    fresh store every attempt (then torch's own ``env://`` is clean)."""
    if restart_count() == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timedelta(seconds=timeout))
    return dist.PrefixStore(f"launcher/attempt{restart_count()}", store)
