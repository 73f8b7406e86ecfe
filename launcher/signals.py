"""Every signal handler the launcher installs, and which process gets which, in one place.

- **The launching process, from the start** (:func:`on_launch`): SIGTERM raises
  :class:`Interrupted`, so a stop before any worker started ends the command with 143 and one
  line instead of a traceback. Ctrl-C is Python's own ``KeyboardInterrupt`` (130).
- **The launching process while a run trains** (:func:`while_training`): SIGINT and SIGTERM raise
  :class:`Interrupted`, on one device too, where Lightning would otherwise end the process itself
  on Ctrl-C (exit 1): the run then leaves ``metrics.json`` with ``"status": "interrupted"``.
- **The launching process while its forked workers run** (:func:`while_supervising`): SIGTERM raises
  :class:`Interrupted` like Ctrl-C does, so the supervisor stops (kills and joins) every worker
  before the stop goes on up: no process is left behind.
- **Each forked worker** (:func:`in_worker`): Ctrl-C reaches the whole foreground process group,
  so workers ignore SIGINT and the launcher alone handles it, stopping every worker with one line
  instead of a traceback from each; SIGTERM is the default (the supervisor's stop ends them).
- **Any process of a Slurm job while it trains** (:func:`slurm_warnings`): Slurm's warning before
  a time limit or a preemption (USR2, USR1) only raises a flag, which the workers agree on after
  the step (:mod:`launcher.lightning.requeue`); the handlers it replaced (submitit's, which
  requeues) are kept for the requeue.

Every installer returns (or restores on exit) the handlers it replaced; Python installs handlers
on the main thread only, so off it each installer does nothing.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Callable, Iterable, Iterator

Handler = Callable[[int, Any], Any]


class Interrupted(BaseException):
    """The launching process got SIGINT or SIGTERM; every worker has been stopped. A
    ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way up
    (Hydra's job runner, a user's retry loop) mistakes it for a failed run and goes on."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


def _install(handler: Any, signals: Iterable[int]) -> dict[int, Any]:
    """Install ``handler`` for each of ``signals``; the handlers replaced (none off the main thread)."""
    previous: dict[int, Any] = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, handler)
    except ValueError:  # not the main thread: Python installs handlers on the main thread only
        restore(previous)
        return {}
    return previous


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers an installer replaced."""
    for s, h in previous.items():
        signal.signal(s, h)


def _raise(message: Callable[[str], str]) -> Handler:
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum, message(signal.Signals(signum).name))

    return handler


def on_launch() -> None:
    """The launching process, from the start: SIGTERM stops the command before any worker started."""
    _install(_raise(lambda name: f"stopped by {name} before any worker started"), [signal.SIGTERM])


@contextlib.contextmanager
def while_training() -> Iterator[None]:
    """While a run trains in this process: Ctrl-C and SIGTERM stop it as :class:`Interrupted`."""
    previous = _install(_raise(lambda name: f"stopped by {name}"), [signal.SIGINT, signal.SIGTERM])
    try:
        yield
    finally:
        restore(previous)


def while_supervising() -> dict[int, Any]:
    """While forked workers run: SIGTERM stops them like Ctrl-C does (the supervisor catches the
    :class:`Interrupted` and names where they were); returns the handlers to :func:`restore`."""
    return _install(_raise(lambda name: ""), [signal.SIGTERM])


def in_worker() -> None:
    """A forked worker: the launcher alone handles Ctrl-C; SIGTERM ends the worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def slurm_warnings(signals: Iterable[int], flag: Handler) -> dict[int, Any]:
    """While training in a Slurm job: Slurm's warning signals only call ``flag``; returns the
    handlers they replaced (submitit's requeues the job), to :func:`restore` and to call."""
    return _install(flag, signals)
