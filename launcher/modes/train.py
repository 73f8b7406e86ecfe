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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import ConfigError
from ..config.step import one_line
from ..config.training import is_single, train_errors
from .common import console, in_sweep, output_dir, point, reject, write_invalid

#: what a run directory holds about how the run ended; a new run removes the old ones
OUTCOMES = ("metrics.json", "failed.json", "invalid.json")


@dataclass
class Job:
    """Everything ``trainer.fit`` needs, built and checked."""

    model: Any
    data: Any
    trainer: Any
    strategy: Any
    run: dict[str, Any]
    chosen: list[str] | None = None  # strategy=auto: the planner's overrides


def _build(node: Any, key: str, want: type, what: str) -> Any:
    from hydra.utils import instantiate

    target = node.get("_target_")
    try:
        obj = instantiate(node)
    except Exception as e:  # noqa: BLE001 - a user's class may raise anything: one sentence
        raise ConfigError([f"{key}._target_={target} could not be built: {one_line(e)}."]) from e
    if not isinstance(obj, want):
        raise ConfigError([f"{key}._target_={target} built a {type(obj).__name__}, not a {what}."])
    return obj


def _check_model(strategy: Any, model: Any, data: Any, cfg: DictConfig) -> None:
    """The module staged as the workers will (its self.stages cut, or its training step traced and
    cut) and one micro-batch of the data's first batch through the stages, before any worker
    starts; the workers inherit the staging."""
    from ..runtime.model import ModelError

    target = cfg.model.get("_target_")
    try:
        data.setup("fit")
        next(iter(data.train_dataloader()))
    except Exception as e:  # noqa: BLE001 - the user's data module: one sentence
        raise ConfigError([f"data._target_={cfg.data.get('_target_')} could not give a first training batch: "
                           f"{one_line(e)}."]) from e
    try:
        strategy.check_before_fork(model, data)
    except ModelError as e:
        # a sentence about a key of the run (stages=9) names it already; the others are the model's
        raise ConfigError([s if s.startswith(("stages=", "split=")) else
                           f"model._target_={target} cannot be trained by the schedule: {s}" for s in e.sentences]) from e


def _data_hooks_of(model: Any) -> None:
    """The configured data module feeds the run: a module's own data hooks (Lightning's demo
    downloads WikiText-2 in ``prepare_data``) are not called."""
    from lightning.pytorch import LightningModule

    if type(model).prepare_data is not LightningModule.prepare_data:
        model.prepare_data = lambda: None


def _run_info(cfg: DictConfig) -> dict[str, Any]:
    single = is_single(cfg)
    return {"scheme": "single" if single else cfg.strategy.name, "G": cfg.G, "R": cfg.R,
            "W": 1 if single else cfg.G * cfg.R, "stages": cfg.stages, "microbatches": cfg.microbatches,
            "order": cfg.order.name, "model": cfg.model.get("_target_"), "batch_size": cfg.data.get("batch_size"),
            "point": point()}


def _plannable(step: Any, cfg: DictConfig) -> None:
    """Simulate and lower the step once here: a memory limit it cannot finish under, or a
    placement the runtime cannot run, is refused before any worker starts."""
    from ..runtime.plan import PlanError, lower
    from ..schedule import ScheduleError, simulate

    try:
        lower(simulate(step), str(cfg.weight_cache), int(cfg.prefetch))
    except (ScheduleError, PlanError) as e:
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


def prepare(cfg: DictConfig, out_dir: Path | None) -> Job:
    """Validate ``cfg`` and build the model, data, strategy and trainer (and, with ``out_dir``, the
    logger and callbacks writing there); raise :class:`ConfigError` with one sentence per problem."""
    chosen = None
    if cfg.strategy.name == "auto" and cfg.strategy.get("placement") is None:
        from .plan import chosen as plan_choice

        cfg, best = plan_choice(cfg)  # the planner's pick, applied to the config
        chosen = list(best.overrides)
    found = train_errors(cfg)
    if found:
        raise ConfigError(found)
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything

    from ..lightning import UnifiedStrategy

    _quiet()
    seed_everything(int(cfg.seed), verbose=False)
    single = is_single(cfg)
    data = _build(cfg.data, "data", LightningDataModule, "LightningDataModule")
    with _model_context(cfg.model):
        model = _build(cfg.model, "model", LightningModule, "LightningModule")
    _data_hooks_of(model)
    if single:
        strategy: Any = "auto"
        devices: dict[str, Any] = {"devices": 1}
    else:
        from ..config import to_step

        step = to_step(cfg, check=False)  # builds (and so checks) a custom placement or order
        _plannable(step, cfg)
        scheme = step.placement if cfg.strategy.get("placement") is not None else cfg.strategy.name
        order = step.order.n if cfg.order.get("n") is not None else cfg.order.name
        ml = cfg.memory_limit
        strategy = UnifiedStrategy(
            scheme, G=cfg.G, R=cfg.R, stages=cfg.stages, microbatches=cfg.microbatches, order=order,
            timeout=float(cfg.timeout), memory_limit=OmegaConf.to_container(ml) if OmegaConf.is_list(ml) else ml,
            warmup=cfg.warmup, split_backward=cfg.split_backward, weight_cache=cfg.weight_cache,
            prefetch=cfg.prefetch, durations=dict(cfg.durations), comm=cfg.comm,
            ownership=cfg.strategy.get("ownership", "seed"), partition=cfg.get("partition", "params"),
            plan={"memory": cfg.plan.get("memory")},
            recompute=OmegaConf.to_container(rc) if OmegaConf.is_list(rc := cfg.get("recompute", "none")) else rc,
            split=OmegaConf.to_container(cfg.split) if OmegaConf.is_list(cfg.split) else cfg.split)
        devices = _devices(cfg.G * cfg.R)
    run = _run_info(cfg)
    kwargs: dict[str, Any] = dict(OmegaConf.to_container(cfg.trainer, resolve=True) or {})
    kwargs.update(devices, strategy=strategy, logger=False, enable_checkpointing=False)
    if out_dir is not None:
        kwargs.update(_outputs(cfg, out_dir, run))
    try:
        trainer = Trainer(**kwargs)
    except Exception as e:  # noqa: BLE001 - Lightning's own checks of its arguments: one sentence
        raise ConfigError([f"trainer: lightning's Trainer refused the configuration: {one_line(e)}."]) from e
    if not single:
        _check_model(strategy, model, data, cfg)
    if single:
        # Lightning's single-device strategy loads a checkpoint before it converts the module to the
        # trainer's precision, which would round a float64 checkpoint through float32: convert first
        trainer.precision_plugin.convert_module(model)
        import torch

        from ..runtime.init import has_meta, init_units

        if has_meta(model):  # the rule the workers follow for the stages they own, for every stage here
            init_units(list(model.stages), torch.initial_seed(), reset=model.reset_stage)
    return Job(model, data, trainer, strategy, run, chosen)


def _model_context(node: Any) -> Any:
    """A model that says how each of its stages starts (``reset_stage``, as the built-in and Hugging
    Face models do) is built on the meta device: the launching process never holds its weights,
    and each worker materialises only the stages it owns (:mod:`launcher.runtime.init`)."""
    import contextlib

    from hydra.utils import get_class

    from ..runtime.init import empty_init

    try:
        cls = get_class(str(node.get("_target_")))
    except Exception:  # noqa: BLE001 - _build reports a target that cannot be found, in one sentence
        return contextlib.nullcontext()
    return empty_init() if callable(getattr(cls, "reset_stage", None)) else contextlib.nullcontext()


def _outputs(cfg: DictConfig, out_dir: Path, run: dict[str, Any]) -> dict[str, Any]:
    """Logger, checkpoints and the metrics callback, all writing into the run directory."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..lightning import requeue
    from ..lightning.metrics import RunMetrics

    config = OmegaConf.to_container(cfg, resolve=True)
    callbacks: list[Any] = [RunMetrics(out_dir, config, run)]
    if cfg.trainer.get("enable_checkpointing", True):
        callbacks.append(ModelCheckpoint(dirpath=out_dir / "checkpoints", save_last=True))
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
    return out


def _group(out_dir: Path) -> str:
    """Runs of one sweep share a W&B group: the sweep's directory; a single run is its own group."""
    from hydra.core.hydra_config import HydraConfig

    try:
        if HydraConfig.get().mode.name == "MULTIRUN":
            return str(Path(HydraConfig.get().sweep.dir).name) or "sweep"
    except ValueError:
        pass
    return out_dir.name


def run(cfg: DictConfig) -> dict[str, Any]:
    """One training run (one point of a sweep)."""
    from ..lightning import requeue
    from ..runtime import WorkerFailed

    where = point()
    out = output_dir()
    for name in OUTCOMES:
        (out / name).unlink(missing_ok=True)
    try:
        job = prepare(cfg, out)
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
    saved = set(requeue.hpc_checkpoints(out))
    try:
        with requeue.Watch() as watch:
            job.trainer.fit(job.model, datamodule=job.data, ckpt_path=ckpt_path)
    except WorkerFailed as e:
        return _failed(cfg, out, where, str(e))
    except Exception as e:  # noqa: BLE001 - a crash in this process (single-device runs): record it
        return _failed(cfg, out, where, one_line(e))
    new = [p for p in requeue.hpc_checkpoints(out) if p not in saved]
    if new:
        requeue.requeue(watch, new[-1])
    for p in requeue.hpc_checkpoints(out):  # finished: a later run in this directory starts afresh
        p.unlink(missing_ok=True)
    path = out / "metrics.json"
    if not path.exists():
        return _failed(cfg, out, where, "training ended without writing metrics.json")
    metrics = json.loads(path.read_text())
    from ..report.tables import metrics_headline, metrics_tables

    con = console()
    con.print(metrics_headline(metrics), highlight=False, soft_wrap=True)
    for table in metrics_tables(metrics):
        con.print(table)
    con.print(f"wrote {path}", highlight=False, soft_wrap=True)
    return {"point": where, "ok": True, "metrics": metrics}


def _failed(cfg: DictConfig, out: Path, where: str, error: str) -> dict[str, Any]:
    """A point whose training failed: the error on stderr, in the run's log and in ``failed.json``
    (with the log's path); a sweep goes on with its other points."""
    import logging
    import sys

    print(f"error: {error}", file=sys.stderr, flush=True)
    log = out / "launcher.log"
    with log.open("a") as f:  # Hydra's job log of this point (its console handler would print it twice)
        f.write(f"[{logging.Formatter().formatTime(logging.makeLogRecord({}))}][launcher][ERROR] - {error}\n")
    config = OmegaConf.to_container(cfg, resolve=False)
    (out / "failed.json").write_text(json.dumps({"config": config, "error": error, "log": str(log)}, indent=2,
                                                default=str) + "\n")
    return {"point": where, "ok": False, "failed": True, "errors": [error]}
