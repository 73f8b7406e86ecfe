"""The runtime: run any schedule on real workers over ``torch.distributed``.

It runs the per-worker programs :mod:`launcher.schedule.lowering` lowers a simulated timeline
into (pure Python, beside the simulator):

- :mod:`.oracle` holds a small staged MLP and the single-process oracle (staged models themselves,
  and the other torch helpers that ``models/`` and ``split/`` use too, are :mod:`launcher.torch_support`);
- :mod:`.comm` issues a step's point-to-point messages in the programs' pair order;
- :mod:`.engine` is the :class:`Engine` that runs a worker's program, one step at a time
  (:mod:`.step_state`; its backward jobs and the autograd calls are :mod:`.backward`);
- :mod:`.measure` records what happened beside what the simulator predicted;
- :mod:`.failure` stops every worker, naming the culprit, when one fails;
- :mod:`.processes` starts workers locally (fork) or joins a torchrun group.
"""

from .engine import Engine
from .failure import DEFAULT_TIMEOUT, Watchdog, WorkerAborted, WorkerFailed
from .measure import merge, mismatches
from .oracle import mlp_batches, reference_step, staged_mlp
from .processes import Interrupted, auto_backend, init_from_env, launch

__all__ = [
    "DEFAULT_TIMEOUT", "Interrupted", "Watchdog", "WorkerAborted", "WorkerFailed", "auto_backend", "init_from_env",
    "launch",
    "merge", "mismatches", "mlp_batches", "reference_step", "staged_mlp",
    "Engine",
]
