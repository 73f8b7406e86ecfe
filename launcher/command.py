"""One invocation of ``python -m launcher``: what it carries from the command line's check to its
exit code, on one object made per command (:class:`Command`) instead of in module globals.

- The check before Hydra starts (:func:`launcher.preflight.preflight`) records the run directory a
  single training run will write (:attr:`Command.run_dir`, held until the run ends) and what it
  built (:attr:`Command.checked`, which that run takes over).
- Hydra runs :meth:`Command.task` for each run (each point of a sweep), which records the point's
  outcome (:attr:`Command.points`) and returns ``optimized_metric`` to the sweeper.
- When a multirun starts, a Hydra callback (:class:`SweepDir`, named in ``conf/config.yaml``)
  records the sweep directory and the Optuna study on the command: the end-of-sweep table reads
  back points that ran in other processes (a Slurm job array), and the study's best trial is found
  from what its sweeper wrote.

Hydra instantiates its callbacks itself, from the config, so the callback reaches the command that
runs Hydra through a context variable set only while it does (:meth:`Command.hydra`): nothing is
left behind for the next command in the same process (a test, a notebook).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .hparams import StudyInfo, study_of
from .modes import MODES, common, train

#: the command whose Hydra is running (its callbacks record on it); unset outside :meth:`Command.hydra`
_RUNNING: contextvars.ContextVar[Command | None] = contextvars.ContextVar("launcher_command", default=None)


@dataclass
class Command:
    """The state of one command, from its check to its exit code."""

    run_dir: Path | None = None  #: the run directory a single training run will write, as the check composed it
    checked: train.Built | None = None  #: what the check built, taken over by the run of that config
    points: list[dict[str, Any]] = field(default_factory=list)  #: the outcome of each point run in this process
    sweep_dir: str | None = None  #: the sweep's directory, once a multirun started
    study: StudyInfo | None = None  #: the Optuna study, once a multirun with the Optuna sweeper started

    def __getstate__(self) -> dict[str, Any]:
        # a remote launcher (submitit) pickles the task function with its command: what the check
        # built stays here (a multirun has none; a model need not pickle)
        return dict(self.__dict__, checked=None)

    def run_point(self, cfg: DictConfig) -> dict[str, Any]:
        """One run (one point of a sweep) in the mode the config names; records its outcome."""
        import sys

        mode = MODES.get(cfg.get("mode"), MODES["simulate"])
        checked, self.checked = self.checked, None  # the check's build is for the first run only
        try:
            result = train.run(cfg, checked) if mode is train.run else mode(cfg)
        except OSError as e:  # a file the run could not write (a full disk): one sentence naming it
            from .atomic import WriteError, is_disk_full, write_sentence

            if not (isinstance(e, WriteError) or is_disk_full(e)):
                raise
            said = write_sentence(e.filename or "a file of the run", e)
            print(f"error: {said}", file=sys.stderr, flush=True)
            result = {"point": common.point(), "ok": False, "failed": True, "errors": [said]}
        self.points.append(result)
        return result

    def task(self, cfg: DictConfig) -> Any:
        """Hydra's task function: one run; returns its ``optimized_metric`` to the sweeper (Optuna's
        value of the trial, or :class:`launcher.hparams.NoValue`, which it records as a failed trial)."""
        from . import hparams

        result = self.run_point(cfg)
        result.setdefault("dir", str(common.output_dir()))
        return hparams.objective(cfg, result)

    def hydra(self) -> None:
        """Run Hydra on ``sys.argv`` with :meth:`task`; its callbacks record on this command meanwhile."""
        import hydra

        token = _RUNNING.set(self)
        try:
            hydra.main(config_path="pkg://launcher.conf", config_name="config", version_base="1.3")(self.task)()
        finally:
            _RUNNING.reset(token)

    def points_on_disk(self) -> list[dict[str, Any]]:
        """Each point of the sweep, from its directory (numbered as Hydra numbers them); a point that
        left nothing (its job died before writing) is recorded as failed with where to look."""
        root = Path(str(self.sweep_dir))
        dirs = sorted((d for d in root.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
        points = []
        for d in dirs:
            rec = common.outcome_of(d)
            logs = sorted(root.glob(f".submitit/*_{d.name}/*_{d.name}_*log.err"))
            where = logs[-1] if logs else root / ".submitit"
            points.append(dict(rec, dir=str(d)) if rec is not None else {
                "point": d.name, "ok": False, "failed": True, "dir": str(d),
                "errors": [f"the job of point {d.name} ended without a result; its log: {where}"]})
        return points


class SweepDir(Callback):
    """When a multirun starts: records its directory and its Optuna study (if any) on the command
    that runs Hydra, so the end-of-sweep table can read back the points that a remote launcher
    (Slurm) ran in other processes, and the study's best trial be found. (``conf/config.yaml``
    names it ``launcher.cli.SweepDir``.)"""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        command = _RUNNING.get()
        if command is not None:
            command.sweep_dir = str(config.hydra.sweep.dir)
            command.study = study_of(config)
