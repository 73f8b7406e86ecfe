"""The runtime: run any schedule on real workers over ``torch.distributed``.

It runs the per-worker programs :mod:`launcher.schedule.lowering` lowers a simulated timeline
into (pure Python, beside the simulator):

- :mod:`.model` holds staged models, a small staged MLP and the single-process oracle;
- :mod:`.comm` issues a step's point-to-point messages in the programs' pair order;
- :mod:`.worker` is the :class:`Engine` that runs a worker's program;
- :mod:`.measure` records what happened beside what the simulator predicted;
- :mod:`.failure` stops every worker, naming the culprit, when one fails;
- :mod:`.processes` starts workers locally (fork) or joins a torchrun group.
"""

from .failure import DEFAULT_TIMEOUT, Watchdog, WorkerAborted, WorkerFailed
from .measure import merge, mismatches
from .model import StagedModel, mlp_batches, reference_step, staged_mlp
from .processes import Interrupted, auto_backend, init_from_env, launch
from .worker import Engine

__all__ = [
    "DEFAULT_TIMEOUT", "Interrupted", "Watchdog", "WorkerAborted", "WorkerFailed", "auto_backend", "init_from_env",
    "launch",
    "merge", "mismatches", "StagedModel", "mlp_batches", "reference_step", "staged_mlp",
    "Engine",
]
