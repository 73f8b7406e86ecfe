"""The planner: search the schedule space with the simulator for the fastest step that fits a
per-worker budget, and hand back the Hydra overrides that reproduce it. Pure Python, no torch.

``choose(cfg)`` is ``strategy=auto``'s planning half: the best :class:`Candidate` for a launcher
config's ``plan.*`` keys (its ``overrides`` reproduce it under ``mode=simulate`` or training).
"""

from .from_config import choose, plan
from .profile import Profile, ProfileError, load, parse_bytes, unit
from .search import Budget, Candidate, Ranking, search

__all__ = ["choose", "plan", "Profile", "ProfileError", "load", "parse_bytes", "unit", "Budget", "Candidate", "Ranking",
           "search"]
