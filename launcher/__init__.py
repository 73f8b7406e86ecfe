"""launcher: one schedule engine for DDP, FSDP, GPipe, LPP and FSLPP.

``launcher.schedule`` is the pure-Python core (no torch import); ``launcher.runtime`` runs its
schedules on real workers over torch.distributed; ``launcher.config`` and ``launcher.cli`` are the
Hydra front end.
"""

__version__ = "0.1.0"

import os

# The local launcher forks its workers, and a child of a process that initialised CUDA cannot use
# it: torch.cuda.is_available() (Lightning's, transformers', a user's) asks NVML instead of
# initialising the CUDA driver, as torch documents for programs that fork.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from . import _torchvision  # noqa: E402

# before anything imports lightning, whose torchmetrics imports torchvision: see _torchvision.py
_torchvision.install()
