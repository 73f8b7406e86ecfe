"""Reports of a simulated step: the ``simulation.json`` record, rich tables, the PNG diagram.

``png`` imports matplotlib lazily; nothing here is imported by :mod:`launcher.schedule`.
"""

from .record import record, write_record
from .tables import closed_form_table, per_worker_table, sweep_table

__all__ = ["record", "write_record", "closed_form_table", "per_worker_table", "sweep_table"]
