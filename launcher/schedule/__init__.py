"""The schedule core: jobs, placements, orders and the greedy simulator. Pure Python, no torch."""

from .graph import Job, JobSpace, StageGraph
from .order import Order, Sequenced, check_sequences, make_order
from .placement import Placement, h
from .rules import StepError
from .schemes import SCHEMES, named
from .settings import DEFAULT, Settings, make_schedule, unchecked_schedule
from .simulate import Schedule, ScheduleError, Timeline, simulate

__all__ = [
    "Job", "JobSpace", "StageGraph", "Order", "Sequenced", "check_sequences", "make_order", "Placement", "h",
    "named", "SCHEMES",
    "ScheduleError", "StepError", "Schedule", "Timeline", "simulate", "DEFAULT", "Settings", "make_schedule",
    "unchecked_schedule",
]
