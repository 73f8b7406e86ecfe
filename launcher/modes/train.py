"""``mode=train``: train the configured LightningModule on ``W = G*R`` workers through
:class:`~launcher.lightning.UnifiedStrategy` (or on one device with ``strategy=single``), then
print the run's metrics and leave ``metrics.json``, ``pipeline.png``, checkpoints and the W&B run
in the run directory.

Everything is validated and built (:func:`prepare`) before any worker starts: a bad config is one
sentence per rule, ``invalid.json``, and no worker, W&B run or result. A worker that fails stops
the others and the run is recorded in ``failed.json`` with the error; Ctrl-C and SIGTERM stop
every worker and end the command (:class:`launcher.runtime.Interrupted`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from .. import signals
from ..config import ConfigError
from ..config.sentences import one_line
from ..config.training import is_single, run_settings_of, train_errors
from .common import (
    HELD,
    DirInUse,
    console,
    hold,
    in_sweep,
    joined_rank,
    let_go,
    output_dir,
    point,
    reject,
    write_invalid,
)
from .model_checks import check_data_hooks, check_inputs, check_model, first_training_batch, keyed
from .outcomes import error_line, record_failure, record_interrupted

#: what a run directory holds about how the run ended; a new run removes the old ones
OUTCOMES = ("metrics.json", "failed.json", "invalid.json", "pipeline.png")
#: how long a rank other than 0 of a torchrun or Slurm job waits for rank 0's metrics.json
METRICS_WAIT_S = 120.0


@dataclass
class Prepared:
    """Everything ``trainer.fit`` needs, built and checked."""

    model: Any
    data: Any
    trainer: Any
    strategy: Any
    run: dict[str, Any]
    chosen: list[str] | None = None  # strategy=auto: the planner's overrides
    built: Any = None  # what was built before the Trainer (Built)


def _build(node: Any, key: str, want: type, what: str) -> Any:
    from hydra.utils import instantiate

    from ..config.sentences import target_error
    from ..config.training import argument_errors

    target = node.get("_target_")
    missing = target_error(str(target))  # a module not found: where Python looked for it
    if missing:
        raise ConfigError([f"{key}._target_={target} could not be built: {missing}."])
    found = argument_errors(node, key)  # a value of the wrong type for an annotated argument
    if found:
        raise ConfigError(found)
    try:
        # plain dicts and lists, not Hydra's config objects: the module's saved hyperparameters
        # then load with torch.load(weights_only=True), as Lightning loads a checkpoint to resume
        obj = instantiate(node, _convert_="all")
    except Exception as e:  # noqa: BLE001 - a user's class may raise anything: one sentence
        raise ConfigError([keyed(e, node, key) or f"{key}._target_={target} could not be built: {one_line(e)}."]) from e
    if not isinstance(obj, want):
        raise ConfigError([f"{key}._target_={target} built a {type(obj).__name__}, not a {what}."])
    return obj


def _order_name(cfg: DictConfig) -> str:
    """The order the run uses: the one named, else the scheme's default (``Settings.default_order``)."""
    from ..config.validate import raw_settings
    from ..schedule.settings import SCHEME_DEFAULT

    return raw_settings(cfg).order_name if cfg.order.name == SCHEME_DEFAULT else str(cfg.order.name)


def _run_info(cfg: DictConfig) -> dict[str, Any]:
    single = is_single(cfg)
    return {"scheme": "single" if single else cfg.strategy.name, "G": cfg.G, "R": cfg.R,
            "W": 1 if single else cfg.G * cfg.R, "stages": cfg.stages, "microbatches": cfg.microbatches,
            "order": _order_name(cfg), "model": cfg.model.get("_target_"), "batch_size": cfg.data.get("batch_size"),
            "point": point()}


def _plannable(spec: Any) -> None:
    """Simulate and lower the step once here: a memory limit it cannot finish under, or a
    placement the runtime cannot run, is refused before any worker starts."""
    from ..schedule import ScheduleError, simulate
    from ..schedule.lowering import LoweringError, lower

    try:
        lower(simulate(spec.schedule()), spec.weight_cache, spec.prefetch)
    except (ScheduleError, LoweringError) as e:
        raise ConfigError([str(e).rstrip(".") + "."]) from e
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a custom placement or order failed: one sentence
        raise ConfigError([f"the custom placement or order failed while the step was planned: {one_line(e)}."]) from e


def _devices(W: int) -> dict[str, Any]:
    """Trainer(devices=..., num_nodes=...) for how the processes are started: torchrun or Slurm
    with one task per worker join those processes; otherwise the strategy forks W workers."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:  # torchrun
        local = int(env["LOCAL_WORLD_SIZE"])
        return {"devices": local, "num_nodes": int(env["WORLD_SIZE"]) // local}
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        nodes = int(env.get("SLURM_NNODES", "1"))
        # Slurm's warning signal is handled between steps (lightning/requeue.py), not by
        # Lightning's handler, which checkpoints in the middle of a step
        return {"devices": int(env["SLURM_NTASKS"]) // nodes, "num_nodes": nodes,
                "plugins": [SLURMEnvironment(auto_requeue=False)]}
    extra: dict[str, Any] = {"devices": W, "num_nodes": 1}
    if "SLURM_NTASKS" in env:  # one Slurm task: fork the workers inside it
        extra["plugins"] = [LightningEnvironment()]
    return extra


def _quiet() -> None:
    """Lightning's start-up notes (accelerators found, tips) go to its own handler only, not also
    to Hydra's root logger, and a torch deprecation warning it triggers in every worker is hidden:
    the run's output is the progress bar, the summary and any error."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).propagate = False
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # val_loss is summed over the workers before it is logged: nothing left to synchronise
    warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting")
    # on a machine with Slurm installed, Lightning suggests `srun` to a run started outside a job;
    # this command forks its workers itself, and inside a job it is started by srun already
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")


@dataclass
class Built:
    """What a config builds before its Trainer: checked by :func:`check`, and taken over by the run
    of the same config."""

    cfg: DictConfig  # the config as run (strategy=auto: with the planner's pick applied)
    chosen: list[str] | None
    model: Any
    data: Any
    spec: Any  # the step's Settings; None for strategy=single
    checked: Any = None  # the strategy that staged the model as the workers will run it (check_before_fork)
    rng: Any = None  # the random state after the check, which the run goes on from
    key: str | None = None  # the resolved config it was built from (:func:`_key`): a run of another config builds anew


def check(cfg: DictConfig) -> Built | None:
    """Check a single training run whole before Hydra starts it (raises :class:`ConfigError`);
    returns what was built, which the run of the same config (:func:`run`) takes over rather than
    build the model, data and staging a second time (``None`` when the config cannot be keyed)."""
    job = prepare(cfg, None)
    key = _key(cfg)
    if key is None:
        return None
    job.built.checked = job.strategy if job.built.spec is not None else None
    from ..torch_support.rng import random_state

    job.built.rng = random_state()
    job.built.key = key
    return job.built


def _key(cfg: DictConfig) -> str | None:
    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation only the run resolves: no reuse
        return None


def _build_job(cfg: DictConfig) -> Built:
    """Validate ``cfg``; build and check its data, model and step settings (nothing is started)."""
    chosen = None
    if cfg.strategy.name == "auto" and cfg.strategy.get("placement") is None:
        from .planning import chosen as plan_choice

        cfg, best = plan_choice(cfg)  # the planner's pick, applied to the config
        chosen = list(best.overrides)
    found = train_errors(cfg)
    if found:
        raise ConfigError(found)
    from lightning.pytorch import LightningDataModule, LightningModule, seed_everything

    _quiet()
    seed_everything(int(cfg.seed), verbose=False)
    data = _build(cfg.data, "data", LightningDataModule, "LightningDataModule")
    with _model_context(cfg.model):
        model = _build(cfg.model, "model", LightningModule, "LightningModule")
    check_data_hooks(model)
    from ..torch_support.rng import kept_random_state

    batch = first_training_batch(data, cfg)
    with kept_random_state():  # a preflight: training goes on from the state one device starts with
        check_inputs(model, data, batch, cfg)  # the data's output against the model
    spec = None
    if not is_single(cfg):
        from ..config import settings_of

        # the settings checked above, as the strategy and its workers will trust them; a custom
        # placement or order is built (and so checked) here, once
        spec = settings_of(cfg, check=False)
        _plannable(spec)
    return Built(cfg, chosen, model, data, spec)


def prepare(cfg: DictConfig, out_dir: Path | None, checked: Built | None = None) -> Prepared:
    """Validate ``cfg`` and build the model, data, strategy and trainer (and, with ``out_dir``, the
    logger and callbacks writing there); raise :class:`ConfigError` with one sentence per problem.
    What the command line's :func:`check` built (``checked``) is taken over when it is of ``cfg``."""
    built = checked if checked is not None and checked.key == _key(cfg) else None
    if built is None:
        built = _build_job(cfg)
    else:  # as if built again: the same generators' state, on the same objects
        from ..torch_support.rng import set_random_state

        _quiet()
        set_random_state(built.rng)
    from lightning.pytorch import Trainer

    from ..lightning import UnifiedStrategy

    cfg, model, data, spec = built.cfg, built.model, built.data, built.spec
    single = spec is None
    # a ListConfig's container is a list (of module paths)
    split = cast(list[str], OmegaConf.to_container(cfg.split)) if OmegaConf.is_list(cfg.split) else cfg.split
    if single:  # Lightning's single-device strategy, each batch's micro-batches through the random streams
        from ..lightning.single import StreamedSingleDevice

        strategy: Any = StreamedSingleDevice(microbatches=int(cfg.microbatches), split=split)
        devices: dict[str, Any] = {"devices": 1}
    else:
        strategy = UnifiedStrategy(settings=spec, run=run_settings_of(cfg), split=split)
        if built.checked is not None:
            strategy.adopt(built.checked)
        devices = _devices(spec.workers)
    run = _run_info(cfg)
    # a DictConfig's container is a dict
    kwargs: dict[str, Any] = dict(cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True) or {}))
    kwargs.update(devices, strategy=strategy, logger=False, enable_checkpointing=False)
    if out_dir is not None:
        kwargs.update(_outputs(cfg, out_dir, run))
    _atomic_checkpoints(kwargs, strategy)
    try:
        trainer = Trainer(**kwargs)
    except Exception as e:  # noqa: BLE001 - Lightning's own checks of its arguments: one sentence
        raise ConfigError([f"trainer: lightning's Trainer refused the configuration: {one_line(e)}."]) from e
    check_model(strategy, model, data, cfg)  # strategy=single too: it traces a module without self.stages
    if single:
        # Lightning's single-device strategy loads a checkpoint before it converts the module to the
        # trainer's precision, which would round a float64 checkpoint through float32: convert first
        trainer.precision_plugin.convert_module(model)
        import torch

        from ..torch_support.init import has_meta, init_units

        if has_meta(model):  # the rule the workers follow for the stages they own, for every stage here
            init_units(list(model.stages), torch.initial_seed(), reset=model.reset_stage)
    from ..lightning.resume import check_resume

    check_resume(cfg, model)  # ckpt_path: loads, fits the model, has steps left, keeps its LR schedule
    return Prepared(model, data, trainer, strategy, run, built.chosen, built)


def _atomic_checkpoints(kwargs: dict[str, Any], strategy: Any) -> None:
    """Checkpoints written whole or not at all (:class:`~launcher.lightning.checkpoint_io.AtomicCheckpointIO`),
    unless the strategy or the trainer's plugins bring their own checkpoint writer."""
    from lightning.fabric.plugins import CheckpointIO

    from ..lightning.checkpoint_io import AtomicCheckpointIO

    plugins = kwargs.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if getattr(strategy, "_checkpoint_io", None) is None and not any(isinstance(p, CheckpointIO) for p in plugins):
        kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]


def _model_context(node: Any) -> Any:
    """A model that says how each of its stages starts (``reset_stage``, as the built-in and Hugging
    Face models do) is built on the meta device: the launching process never holds its weights,
    and each worker materialises only the stages it owns (:mod:`launcher.torch_support.init`)."""
    import contextlib

    from ..config.hydra_private import locate  # get_class's lookup, without its error log line
    from ..torch_support.init import empty_init

    try:
        cls = locate(str(node.get("_target_")))
    except Exception:  # noqa: BLE001 - _build reports a target that cannot be found, in one sentence
        return contextlib.nullcontext()
    return empty_init() if callable(getattr(cls, "reset_stage", None)) else contextlib.nullcontext()


def _outputs(cfg: DictConfig, out_dir: Path, run: dict[str, Any]) -> dict[str, Any]:
    """Logger, checkpoints and the metrics callback, all writing into the run directory."""
    from hydra.utils import instantiate

    from ..lightning import lost_task, requeue
    from ..lightning.metrics_callback import RunMetrics

    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's container is a dict
    from ..report.progress import Progress

    callbacks: list[Any] = [RunMetrics(out_dir, config, run), Progress(out_dir)]
    if cfg.trainer.get("enable_progress_bar", True):
        from ..lightning.progress_bar import StepProgressBar  # "Step 3/40", not "Epoch 0/-2"

        callbacks.append(StepProgressBar())
    if cfg.trainer.get("enable_checkpointing", True):
        from ..lightning.resume import LastCheckpoint  # last.ckpt: where training ended

        callbacks.append(LastCheckpoint(dirpath=out_dir / "checkpoints"))
    if lost_task.under_slurm_tasks():  # a job requeued after a lost task: its record completed at the first step
        callbacks.append(lost_task.ResumeTimes(out_dir))
    if requeue.in_slurm_job():  # last: its checkpoint is not part of the step's measured time
        callbacks.append(requeue.RequeueOnSignal())
    out: dict[str, Any] = {"callbacks": callbacks, "default_root_dir": str(out_dir),
                           "enable_checkpointing": bool(cfg.trainer.get("enable_checkpointing", True))}
    if cfg.logger:
        os.environ.setdefault("WANDB_SILENT", "true")
        tags = [run["scheme"], f"G={run['G']}", f"R={run['R']}", run["order"]]
        # partial: instantiate() takes `config` itself, and wandb.init wants ours under that name
        make = instantiate(cfg.logger, _partial_=True)
        out["logger"] = make(save_dir=str(out_dir), group=_group(out_dir), tags=tags, name=run["point"], config=config)
        _no_anonymous(out["logger"])
    return out


def _no_anonymous(logger: Any) -> None:
    """Lightning's ``WandbLogger`` passes ``anonymous=None`` to ``wandb.init`` even when it is not
    asked for, and wandb (0.19 on) warns on every run that this deprecated setting has no effect.
    Left out, wandb sees it unset and says nothing; ``logger.anonymous=true`` is passed on."""
    from lightning.pytorch.loggers import WandbLogger

    init = getattr(logger, "_wandb_init", None) if isinstance(logger, WandbLogger) else None
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]


def _group(out_dir: Path) -> str:
    """Runs of one sweep share a W&B group: the sweep's directory; a single run is its own group."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return str(Path(HydraConfig.get().sweep.dir).name) or "sweep"
    except ValueError:
        pass
    return out_dir.name


def previous_checkpoint(cfg: DictConfig, out: Path, sweep: bool = False) -> str | None:
    """The sentence refusing a new run into ``out`` when it holds an earlier run's checkpoints: the
    new run's ``last.ckpt`` would go beside the old one as ``last-v1.ckpt`` (Lightning never
    overwrites a checkpoint it did not write), and which one is the run's would be a guess. Not
    refused: resuming from a checkpoint of that directory (it goes on writing there), a requeued
    Slurm job (it resumes from its own checkpoint, or from ``last.ckpt`` after a lost task), and a run
    that writes no checkpoints."""
    from ..lightning import elastic, lost_task, requeue

    folder = Path(out) / "checkpoints"
    if not bool(cfg.trainer.get("enable_checkpointing", True)) or requeue.resume_path(out) is not None \
            or elastic.resume_path(out) is not None or lost_task.resume_path(out) is not None:
        return None  # a restarted torchrun worker, or a job requeued after a lost task, resumes from it
    try:
        found = sorted(folder.glob("*.ckpt"), key=lambda p: (p.name != "last.ckpt", -p.stat().st_mtime))
    except OSError:  # a directory that cannot be read: the run's own writes will say so
        return None
    if not found:
        return None
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and Path(str(ckpt)).absolute().parent == folder.absolute():
        return None  # resumed from there: its own checkpoints go on
    path, key = found[0], "hydra.sweep.dir" if sweep else "hydra.run.dir"
    where = f"the run directory {out}" if sweep else f"{key}={out}"
    return (f"{where} holds an earlier run's checkpoint {path}, and a new run there would write its own "
            f"beside it: resume from it with ckpt_path={path} (with trainer.max_steps above its steps), or choose "
            f"another {key} (or remove {folder}).")


def run(cfg: DictConfig, checked: Built | None = None) -> dict[str, Any]:
    """One training run (one point of a sweep), holding its run directory while it runs: a second
    run in the same directory is refused (one sentence naming the holder's PID) and touches nothing.
    ``checked``: what the command line's :func:`check` built, taken over when it is of ``cfg``."""
    where = point()
    out = output_dir()
    held = joined_rank() == 0  # under torchrun or Slurm, rank 0 holds the directory for every rank
    if held:
        try:
            hold(out, None if in_sweep() else "hydra.run.dir")
        except DirInUse as e:
            return reject([str(e)], where, in_sweep())
        for other in [d for d in HELD if d != out.absolute()]:
            let_go(other)  # the command line's check held the directory it expected (another second)
    try:
        return _run(cfg, out, where, checked)
    finally:
        if held:
            let_go(out)


def _run(cfg: DictConfig, out: Path, where: str, checked: Built | None) -> dict[str, Any]:
    from ..lightning import elastic, lost_task, requeue
    from ..report import progress
    from ..runtime import Interrupted, WorkerFailed

    earlier = previous_checkpoint(cfg, out, in_sweep())
    if earlier is not None:  # refused before anything of the earlier run is removed
        return reject([earlier], where, in_sweep())
    for name in OUTCOMES:
        (out / name).unlink(missing_ok=True)
    if joined_rank() == 0:
        lost_task.forget(out)  # an earlier run's requeues, unless this job is one of them
    progress.remove(out)
    try:
        job = prepare(cfg, out, checked)
    except ConfigError as e:
        write_invalid(cfg, e.sentences)
        return reject(e.sentences, where, in_sweep())
    if job.chosen:
        console().print("auto: chose " + " ".join(job.chosen), highlight=False, soft_wrap=True)
    ckpt_path = cfg.ckpt_path
    resumed = requeue.resume_path(out)
    if resumed is not None:  # a requeued Slurm job: go on from where the warning stopped it
        ckpt_path = str(resumed)
        console().print(f"slurm: requeued; resuming from {resumed}", highlight=False, soft_wrap=True)
    elif (restarted := elastic.resume_path(out)) is not None:  # torchrun's agent restarted every worker
        ckpt_path = str(restarted)
        console().print(f"torchrun: restart {elastic.restart_count()} of the workers (a worker was lost); "
                        f"resuming from {restarted}", highlight=False, soft_wrap=True)
    elif (after := lost_task.pending(out)) is not None:  # requeued by a survivor of a lost Slurm task
        last = lost_task.resume_path(out)
        ckpt_path = None if last is None else str(last)
        console().print(f"slurm: requeued after a lost task ({after['cause']}); "
                        f"{f'resuming from {last}' if last else 'no checkpoint yet: starting afresh'}",
                        highlight=False, soft_wrap=True)
    restarts = run_settings_of(cfg).fault.restarts
    note = elastic.fallback_note(restarts) if elastic.restart_count() == 0 else None
    note = note or (lost_task.fallback_note(restarts) if lost_task.attempt() == 0 else None)
    if note is not None and joined_rank() == 0:
        console().print(note, highlight=False, soft_wrap=True)
    saved = set(requeue.hpc_checkpoints(out))
    label = f"{job.run['scheme']} G={job.run['G']} R={job.run['R']} (W={job.run['W']})"
    with lost_task.armed(out, restarts, job.trainer, label, int(job.run["W"])):
        try:
            with requeue.Watch() as watch, signals.while_training():
                job.trainer.fit(job.model, datamodule=job.data, ckpt_path=ckpt_path)
        except WorkerFailed as e:
            return record_failure(cfg, out, where, error_line(e))
        except Interrupted as e:
            record_interrupted(cfg, out, job.run, e)
            raise
        except Exception as e:  # noqa: BLE001 - a crash in this process (single-device runs): record it
            if lost_task.requeued(error_line(e)):  # a lost Slurm task: the job runs again; this one leaves no result
                lost_task.leave()
            return record_failure(cfg, out, where, error_line(e))
    progress.remove(out)
    new = [p for p in requeue.hpc_checkpoints(out) if p not in saved]
    if new:
        requeue.requeue(watch, new[-1])
    for p in requeue.hpc_checkpoints(out):  # finished: a later run in this directory starts afresh
        if p.is_dir():  # a sharded checkpoint
            import shutil

            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    path = out / "metrics.json"
    if joined_rank() != 0:
        # torchrun or Slurm started every worker: rank 0 writes metrics.json after the run's last
        # collective, so another rank's fit can return before the file is there
        deadline = time.monotonic() + METRICS_WAIT_S
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    if not path.exists():
        return record_failure(cfg, out, where, "training ended without writing metrics.json")
    metrics = json.loads(path.read_text())
    from ..report.tables import metrics_headline, metrics_tables

    con = console()
    con.print(metrics_headline(metrics), highlight=False, soft_wrap=True)
    for table in metrics_tables(metrics):
        con.print(table)
    con.print(f"wrote {path}", highlight=False, soft_wrap=True)
    return {"point": where, "ok": True, "metrics": metrics}
