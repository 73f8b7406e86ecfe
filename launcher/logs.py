"""The launcher's diagnostics go through :mod:`logging` (``launcher.*`` loggers): warnings and
progress notes. The command's output proper (the tables, ``error:`` sentences naming a key, the
files a run wrote) is printed as such: it is what the user asked for.

The command line shows the diagnostics as plain lines on stderr (:func:`show`), apart from Hydra's
console handler, which would put them on stdout with a prefix and mix them into the report. Used as
a library, warnings reach stderr through Python's last-resort handler, and an application configures
the ``launcher`` logger as it likes (``logging.getLogger("launcher").setLevel(logging.ERROR)``
silences them).
"""

from __future__ import annotations

import logging
import sys

ROOT = "launcher"


class _Stderr(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is then (pytest and redirections swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def show() -> None:
    """Print the ``launcher`` loggers' records from INFO up as plain lines on stderr; idempotent."""
    log = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
    log.setLevel(logging.INFO)
    log.propagate = False
