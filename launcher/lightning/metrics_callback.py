"""``RunMetrics``: the Lightning callback that turns a run into ``metrics.json`` (and its diagram
and W&B summary). A thin adapter: the numbers come from :mod:`launcher.report.metrics_json`, the W&B
records from :mod:`launcher.report.wandb_log`.

Every worker times its training steps and keeps the loss Lightning hands back; at the end of
``fit``, rank 0 gathers every worker's records (:func:`gather_run`), writes
``metrics.json``, ``pipeline.png`` and ``trace.json`` (the last training step as a Chrome trace,
:mod:`launcher.report.trace`; not under the single-device strategy) into the run directory and
logs them to every W&B logger of the trainer, then finishes the W&B run (a forked worker never
runs wandb's exit hook).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override

from ..report import metrics_json as report
from ..runtime.link_probe import measure as measure_link
from . import lost_task
from .lightning_private import optimizer_step_of_batch, started_experiment
from .strategy import UnifiedStrategy


class RunMetrics(Callback):
    """Writes ``metrics.json`` into ``out_dir`` at the end of ``fit``; ``run`` labels it."""

    def __init__(self, out_dir: str | Path, config: Mapping[str, Any], run: Mapping[str, Any]) -> None:
        self.out_dir, self.config, self.run = Path(out_dir), dict(config), dict(run)
        self.walls: list[float] = []
        self.cpus: list[float] = []  # this worker's process CPU seconds of each step
        self.losses: list[float] = []
        self.samples: list[int] = []
        self.skipped: list[int] = []  # steps dropped for a non-finite value (nonfinite=skip)
        #: accumulate_grad_batches > 1: the optimizer step (from 1) each batch's engine step belongs to
        self.optimizer_steps: list[int] = []
        self.val: list[dict[str, float]] = []
        self.metrics: dict[str, Any] | None = None
        self._t0 = self._cpu0 = 0.0
        self._span: tuple[float, float] | None = None  # the last step's start and end (trace.json)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = time.perf_counter()
        wall, self._span = end - self._t0, (self._t0, end)
        self.cpus.append(time.process_time() - self._cpu0)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        n = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
        k = trainer.accumulate_grad_batches
        self.walls.append(wall)
        self.losses.append(float(loss) * k)  # Lightning hands back the loss divided by k: the batch's own
        if k > 1:  # the step this batch ends (it has stepped then) or is a part of
            self.optimizer_steps.append(optimizer_step_of_batch(trainer))
        self.samples.append(n)
        if getattr(trainer.strategy, "step_skipped", False):
            self.skipped.append(len(self.losses))
        pl_module.log_dict({"step_s": wall, "samples_per_s": n / wall}, on_step=True, on_epoch=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The curve so far, so that a run resumed from a checkpoint (a requeued Slurm job) reports
        every step, not only those after the resume."""
        return {"walls": self.walls, "losses": self.losses, "samples": self.samples, "val": self.val,
                "skipped": self.skipped, "optimizer_steps": self.optimizer_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("walls", "losses", "samples", "val", "skipped", "optimizer_steps"):
            setattr(self, key, list(state_dict.get(key, [])))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "val_loss" in trainer.callback_metrics and not trainer.sanity_checking:
            self.val.append({"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"])})

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, UnifiedStrategy):
            gathered = gather_run(strategy, self.walls, self.cpus, self._span)  # collective
            if gathered is None:
                return
            sizes = strategy.sizes()
            engine = strategy.engine
            assert engine is not None  # a step ran: the strategy's engine exists
            walls = [max(r["walls"][i] for r in gathered if i < len(r["walls"])) for i in range(len(self.walls))]
            msg, act, params = sizes
            saved = strategy.saved_sizes()  # each forward's autograd graph, per stage and micro-batch
            opt = {}
            for r in gathered:
                opt.update(r["optimizer_bytes"])
            # gradients (and optimizer state) of the trainable parameters only: frozen ones have none
            stage_bytes = {"params": params, "grads": engine.grad_sizes(),
                           "optimizer": [opt.get(s, 0) for s in range(len(params))],
                           "activation": [max(a) for a in act], "saved": [max(g) for g in saved]}
            self.metrics, tl = report.build(
                config=self.config, run=self.run, lowered=engine.lowered, per_rank=gathered, msg_bytes=msg,
                act_bytes=act, stage_bytes=stage_bytes, steps=self._steps(walls), val=self.val,
                samples_per_step=self.samples[-1] if self.samples else 0,
                module_costs=[c.to_json() for c in strategy.module_costs] if strategy.module_costs else None,
                saved_bytes=saved, recomputed=engine.recomputed())
            _predict_memory(self.metrics, strategy, gathered, stage_bytes)
            # runtime.transport as set, and what rank 0's messages took: shared memory or the backend's own
            self.metrics["transport"] = {"setting": strategy.run.transport,
                                         "used": "shm" if engine.links is not None else dist.get_backend(engine.group)}
            from ..report.png import save_png, want_png

            if want_png(self.config.get("png", "auto"), len(tl.start)):  # the config's png, as mode=simulate reads it
                save_png(tl, self.out_dir / "pipeline.png",
                         title=f"{self.run.get('scheme')} G={self.run.get('G')} R={self.run.get('R')} "
                               f"(predicted from the profiled step)",
                         unit="seconds")
            else:
                self.metrics["diagram"] = None
            _write_trace(self.out_dir, gathered, tl, self.run, len(self.walls), self.metrics["latency_s"]["predicted"])
            _post_validation(self.metrics, gathered)
        else:
            if trainer.global_rank != 0:
                return
            self.metrics = report.single_device(
                config=self.config, run=self.run, steps=self._steps(self.walls), val=self.val,
                samples_per_step=self.samples[-1] if self.samples else 0,
                peak_memory_bytes=_peak_memory(pl_module.device), memory_kind="cuda_max_allocated"
                if pl_module.device.type == "cuda" else "rss")
        self.metrics["skipped_steps"] = len(self.skipped)  # dropped for a NaN or infinity (nonfinite=skip)
        # each lost worker recovered from inside the job (launcher.lightning.recovery), as rank 0 saw it,
        # after each requeue of the job after a lost Slurm task (launcher.lightning.lost_task)
        self.metrics["recoveries"] = lost_task.recoveries(self.out_dir) + list(getattr(strategy, "recoveries", []))
        copies = getattr(strategy, "copies", None)
        if copies is not None:  # fault.copies=1: what keeping them cost rank 0 (launcher.lightning.copies)
            self.metrics["copies"] = copies.summary()
        report.write(self.metrics, self.out_dir)
        from ..report import wandb_log

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                wandb_log.log_summary(logger.experiment, self.metrics, self.out_dir)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                run = started_experiment(logger) if isinstance(logger, WandbLogger) else None
                if run is not None:
                    run.finish()

    def _steps(self, walls: list[float]) -> list[dict[str, Any]]:
        """Per engine step (one batch): its loss, wall time and throughput; with
        ``accumulate_grad_batches`` > 1 also the optimizer step it belongs to."""
        skipped = set(self.skipped)
        opt = self.optimizer_steps if len(self.optimizer_steps) == len(self.losses) else []
        return [{"step": i + 1, "loss": loss, "step_s": w, "samples_per_s": n / w if w else None,
                 **({"optimizer_step": opt[i]} if opt else {}), **({"skipped": True} if i + 1 in skipped else {})}
                for i, (loss, w, n) in enumerate(zip(self.losses, walls, self.samples))]


def _predict_memory(metrics: dict, strategy: UnifiedStrategy, gathered: list[dict], stage_bytes: dict) -> None:
    """Each worker's predicted peak memory beside the measured one: the process as it was before
    its stages were materialised (measured), plus the planner's memory model of what the step
    holds (:mod:`launcher.plan.memory`: owned stages' parameters, gradients and optimizer state,
    fetched stages' gradients and copies, live activations as predicted); and each worker's owned
    share of the model's training state."""
    from ..plan import memory
    from ..plan.profile import Profile

    assert strategy.engine is not None
    lowered, pw = strategy.engine.lowered, metrics["per_worker"]
    prof = Profile({}, 0.0, bytes={k: tuple(v) for k, v in stage_bytes.items()})
    owned, fetched = memory.owned_and_fetched(lowered.timeline)
    act = pw["peak_activation_bytes"]["predicted"]
    model = memory.worker_bytes(lowered.timeline, prof, strategy.settings.weight_cache,
                                list(lowered.predicted["weights_peak_resident"]), owned, fetched, act)
    base = [r.get("base_memory_bytes", 0) for r in gathered if r["rank"] < lowered.workers]
    pw["peak_memory_bytes"]["base"] = base
    pw["peak_memory_bytes"]["predicted"] = [b + m for b, m in zip(base, model)]
    state = [p + g + o for p, g, o in zip(stage_bytes["params"], stage_bytes["grads"], stage_bytes["optimizer"])]
    tied_opt = {(s, i): b for r in gathered for s, i, b in r.get("tied_optimizer_bytes", ())}
    everything = set(range(len(state)))
    # a worker holding two uses of a shared parameter holds it (and its optimizer state) once, but
    # each stage's gradient sum apart; the model's total counts it once, as one device holds it
    pw["owned_state_bytes"] = {"predicted": [sum(state[s] for s in own) - _counted_again(strategy, set(own), tied_opt)
                                             for own in owned],
                               "measured": [None] * len(owned),
                               "total": sum(state) - _counted_again(strategy, everything, tied_opt, grads=True)}


def _counted_again(strategy: UnifiedStrategy, stages: set[int], tied_opt: Mapping[tuple[int, int], int],
                   grads: bool = False) -> int:
    """Bytes that per-stage sums over ``stages`` count more than once: a parameter several of them
    share (tied embeddings, :attr:`Engine.ties`), at every use after its first among them; its
    value and optimizer state (``tied_opt``: per use), and its gradient with ``grads``."""
    assert strategy.engine is not None
    layouts, out = strategy.engine.layouts, 0
    for uses in strategy.engine.ties:
        for s, i in sorted(u for u in uses if u[0] in stages)[1:]:
            L = layouts[s]
            value = L.numels[L.index[i]] * torch.empty((), dtype=L.dtype).element_size()
            out += value * (2 if grads and L.is_trainable(i) else 1) + tied_opt.get((s, i), 0)
    return out


def _write_trace(out_dir: Path, gathered: list[dict], tl: Any, run: Mapping[str, Any], step: int,
                 predicted_s: float | None) -> None:
    """``trace.json``: the last training step as measured on every worker beside the predicted
    timeline (:mod:`launcher.report.trace`); written before ``metrics.json``, so a run directory
    with ``metrics.json`` has it. Not written when no worker trained a step in this process."""
    from ..report import trace

    workers = [r.get("trace") for r in gathered]
    if any(workers):
        trace.write(trace.build(workers, tl, run, step=step, predicted_step_s=predicted_s), out_dir)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _post_validation(metrics: dict[str, Any], gathered: list[dict[str, Any]]) -> None:
    """``step_overlap=post_validation``: each worker's rollbacks and dropped provisional steps (by rank)
    in ``metrics.json`` and on the console; the measured step cost is then the overlapped one's."""
    ranks = sorted(gathered, key=lambda r: r["rank"])
    if not any(r.get("post_validation") for r in ranks):
        return
    rollbacks = [r["post_validation"]["rollbacks"] for r in ranks]
    skipped = [r["post_validation"]["skipped"] for r in ranks]
    metrics["post_validation"] = {"rollbacks": rollbacks, "skipped": skipped,
                                  "redo_s": [r["post_validation"].get("redo_s", 0.0) for r in ranks]}
    metrics["step_cost_s"]["step_overlap"] = "post_validation"
    print(f"post_validation: rollbacks per worker {rollbacks} (of them dropped, non-finite: {skipped})", flush=True)


def gather_run(strategy: UnifiedStrategy, walls: list[float], cpus: list[float] | None = None,
               span: tuple[float, float] | None = None) -> list[dict[str, Any]] | None:
    """Every worker's step records, step wall and CPU times (``walls``, ``cpus``), peak memory and optimizer-state
    bytes per stage at rank 0 (collective: every rank calls it); and ``trace``, the events of its
    last training step (:meth:`~launcher.runtime.Engine.trace`) with ``span``, that step's Lightning start and end
    on the same clock."""
    assert strategy.engine is not None and strategy.layout is not None
    peak = (torch.cuda.max_memory_allocated(strategy.root_device) if strategy.root_device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    state = strategy.optimizers[0].state if strategy.optimizers else {}

    def opt_of(p: torch.Tensor) -> int:
        return sum(v.numel() * v.element_size() for v in state.get(p, {}).values() if torch.is_tensor(v))

    opt_bytes = {s: sum(opt_of(p) for p in strategy.engine.modules[s].parameters()) for s in strategy.layout.writers}
    # a parameter several stages share, at each of its uses: totals count it once (metrics)
    tied_opt = [(s, i, opt_of(list(strategy.engine.modules[s].parameters())[i]))
                for uses in strategy.engine.ties for s, i in uses if s in strategy.layout.writers]
    # the message cost the prediction and the planner use: workers 0 and 1 ping-pong (no step runs now)
    link = measure_link(strategy.engine.group, strategy.engine.device) if strategy.engine.lowered.workers > 1 else None
    mine = {"rank": strategy.global_rank, "records": strategy.records, "walls": list(walls), "cpus": list(cpus or []),
            "peak_memory_bytes": peak, "base_memory_bytes": strategy.base_memory,
            "memory_kind": "cuda_max_allocated" if strategy.root_device.type == "cuda" else "rss",
            "optimizer_bytes": opt_bytes, "tied_optimizer_bytes": tied_opt,
            "link": link.to_json() if link else None}
    pv = strategy.post_validation
    if pv is not None:  # step_overlap=post_validation: this worker's provisional steps undone (and dropped)
        mine["post_validation"] = {"rollbacks": pv.step.rollbacks, "skipped": pv.step.skipped,
                                   "redo_s": pv.step.redo_s}
    trace = strategy.engine.trace()
    if trace is not None:
        trace["span"] = list(span) if span else None
        mine["trace"] = trace
    out: list[Any] | None = [None] * dist.get_world_size() if strategy.global_rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out
