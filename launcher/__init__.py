"""launcher: one schedule engine for DDP, FSDP, GPipe, LPP and FSLPP.

``launcher.schedule`` is the pure-Python core (no torch import); ``launcher.runtime`` runs its
schedules on real workers over torch.distributed; ``launcher.config`` and ``launcher.cli`` are the
Hydra front end.
"""

__version__ = "0.1.0"

from . import _torchvision

# before anything imports lightning, whose torchmetrics imports torchvision: see _torchvision.py
_torchvision.install()
