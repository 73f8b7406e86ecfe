"""What several test modules share: plain functions and constants (the fixtures are in
``tests/conftest.py``).

- :mod:`helpers.cli`: the command as users type it (``python -m launcher ...`` in a subprocess),
  its environment, and the processes a run leaves;
- :mod:`helpers.training`: tiny models, data and Lightning trainers for in-process runs, and how
  far two trained states are apart;
- :mod:`helpers.faults`: failures injected at a chosen (rank, step) of an in-process run with
  recovery, the recoveries each worker lists, and what a run may leave running;
- :mod:`helpers.schedules`: independent checks of a simulated timeline, and random steps.
"""
