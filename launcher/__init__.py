"""launcher: one schedule engine for DDP, FSDP, GPipe, LPP and FSLPP.

``launcher.schedule`` is the pure-Python core (no torch import); the runtime, Lightning and Hydra
layers build on it.
"""

__version__ = "0.1.0"
