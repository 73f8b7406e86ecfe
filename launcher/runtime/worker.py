"""The engine: one worker runs its program of a step over ``torch.distributed``.

Usable on its own (plain Python) in any initialized process group, one engine per rank::

    engine = Engine(staged_model, make_step("lpp", S, B, G=2, R=2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    record = engine.train_step(microbatches)   # a list of B (input, target) pairs, the same on every rank

A loss that is a mean over a data-dependent count (tokens with a label, rows of unequal
micro-batches) weighs each micro-batch by its share of the step's items, ``items=[n_0, ...]``
(:mod:`.items`; by default the rows of each micro-batch), so the step's loss and gradient are one
device's on the whole batch.

Rank ``w`` of the group is worker ``w`` of the schedule; ranks at or above ``W`` have nothing to
do. Every rank builds every stage, then keeps real weights (and optimizer state) only for the
stages it owns; for every stage it also keeps a skeleton (parameters on the meta device, its own
copy of the buffers) to run fetched copies of the weights (``torch.func.functional_call``), and,
apart, meta-device copies that only tell what each stage returns (:mod:`.values`).

Activations: ``F(s, b)`` stashes its inputs ``x_s^b`` (and, unless it recomputes, the autograd
graph of stage ``s``) from its start to the end of ``B(s, b)`` (or ``I(s, b)``), as the simulator
counts. A forward on fetched weights under ``weight_cache="job"`` frees its copy when it ends, so
its backward fetches again (unless the worker owns the stage) and recomputes the stage's forward
from the stashed input (activation checkpointing, as FSDP does); so does every forward of a stage
in ``recompute`` (its units draw from the job's random streams, :mod:`.streams`, or without them
on the random state the forward ran with: dropout draws the same mask);
everything else keeps the graph and does not recompute, and its backward fetches nothing under
``"job"``. The meter counts a kept graph's saved tensors (:mod:`.saved`) with the input, until
the backward frees it (``W`` when split), as :meth:`Engine.activation_peaks` predicts; it hooks a
forward only when its key (stage, input shapes, grad mode, autocast, ...) is new or not yet
confirmed, and on check steps (:class:`~launcher.runtime.saved.GraphCounts`: a hook per saved
tensor costs a few percent of a transformer's step, and equal shapes save equal storages). A split backward's ``W``
takes its gradient from its ``I``'s graph: under ``"job"`` it fetches nothing, and the copy ``I``
fetched (if any) stays resident until ``W`` ends.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from launcher.schedule.activations import activation_peaks
from launcher.schedule.lowering import TAG_LIMIT, lower
from launcher.schedule.program import ACT, GRAD, WEIGHTS, JobOp, Lowered, Msg, forward_only
from launcher.schedule.rules import StepError, value_error
from launcher.schedule.simulate import Step, Timeline, simulate

from .batches import check_same_batches
from .comm import Comm, irecv, isend
from .deferred import input_grads
from .failure import Watchdog, blocked, current_watchdog
from .groups import BUCKET_BYTES, Replicas, warm_pairs
from .init import has_meta, init_units
from .items import Count
from .items import shares as item_shares
from .measure import HOST, Meter, worker_record
from .model import (
    Batch,
    ModelError,
    NoMeta,
    OptimizerFactory,
    StagedModel,
    StageLayout,
    as_meta,
    meta_copy,
    model_errors,
    real_signatures,
    run_stage,
    signatures,
    skeleton,
    stage_grads,
    stage_grads_into,
)
from .saved import GraphCounts, stage_saved_bytes
from .saved import tensors as saved_tensors
from .stats import RunningStats
from .streams import job as stream_job
from .streams import kept_generators
from .torch_private import foreach_add_, has_post_accumulate_hooks, pytree
from .values import Signature, detach_inputs, item_leaves, pick, to_device
from .values import nbytes as value_bytes

#: steps whose messages are timed (what a message takes, :class:`~launcher.runtime.comm.Clock`):
#: enough for a profile, and a long run's records do not grow with every message of every step
TIMED_STEPS = 64
#: steps between two batch checks (after the first step's): ranks fed different data are almost
#: always so from the start (a loader seeded by rank), and the check is a collective, so it runs on
#: step 1 and then every CHECK_EVERY steps (``Engine(check_batches=1)``: every step)
CHECK_EVERY = 50


@dataclass
class _Stash:
    values: list[Any]  # what the stage was called with
    leaves: list[torch.Tensor]  # their differentiable leaves (a gradient goes back to each)
    counts: list[int]  # how many of ``leaves`` came from each predecessor
    out: Any  # None: recompute in the backward
    loss: torch.Tensor | None
    targets: list[torch.Tensor]  # the weight tensors the stage's weight gradient is taken against
    nbytes: int
    saved: int = 0  # bytes the forward's autograd graph holds (0 when it recomputes)
    rng: Any = None  # recompute: the random state the forward ran with, so dropout draws the same mask
    views: list[torch.Tensor] | None = None  # a fetched copy's per-parameter views the forward used


@dataclass
class _Edge:
    """What one edge ``p -> c`` carries for one micro-batch shape: the value's signature, and
    where each of its differentiable leaves sits among the leaves of ``p``'s whole output."""

    sig: Signature
    out_index: list[int]


class _Shapes:
    """Signatures of every stage's output and every edge's value, for one micro-batch's shapes."""

    def __init__(self, model: StagedModel, outs: list[Signature], metas: list[Any],
                 compute_dtype: torch.dtype | None = None) -> None:
        self.out = outs
        self.edges: dict[tuple[int, int], _Edge] = {}
        # mixed precision: every floating leaf crosses between stages in the compute dtype
        for c, preds in enumerate(model.graph.preds):
            for p in preds:
                items = model.edge(p, c)
                if items is None:
                    self.edges[(p, c)] = _Edge(outs[p].cast(compute_dtype), list(outs[p].grads))
                    continue
                ranges = item_leaves(metas[p])
                where = [k for i in items for k in ranges[i]]
                sig = Signature.of(pick(metas[p], items))
                self.edges[(p, c)] = _Edge(sig.cast(compute_dtype), [where[j] for j in sig.grads])

    def input_bytes(self, s: int, preds: tuple[int, ...]) -> int:
        return sum(self.edges[(p, s)].sig.nbytes() for p in preds)


def _key(x: Any) -> Any:
    """What a micro-batch's input shapes are keyed by (a tensor's shape and dtype, cheaply)."""
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else Signature.of(x)


def _leaves_key(values: Sequence[Any]) -> tuple:
    """:func:`_key` of each value, with a tensor's ``requires_grad``."""
    return tuple((_key(v), v.requires_grad) if isinstance(v, torch.Tensor) else _key(v) for v in values)


def _meta_of(sig: Signature) -> Any:
    return sig.meta()


def tied(stages: Sequence[torch.nn.Module]) -> list[list[tuple[int, int]]]:
    """Parameters shared by several stages (tied embeddings): per shared parameter, its
    ``(stage, index among the stage's parameters)`` in every stage that holds it."""
    where: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for s, m in enumerate(stages):
        for i, p in enumerate(m.parameters()):
            where[id(p)].append((s, i))
    return [uses for uses in where.values() if len(uses) > 1]


def default_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _lowered(schedule: Step | Timeline | Lowered, weight_cache: str, prefetch: int) -> Lowered:
    """The engine's program: the schedule lowered (simulated first, if need be) for ``prefetch``."""
    found = [e for e in (value_error("prefetch", prefetch), value_error("weight_cache", weight_cache)) if e]
    if found:  # the command line's sentences
        raise StepError(found)
    if isinstance(schedule, Lowered):
        if schedule.prefetch != prefetch:
            raise ValueError(f"the plan was lowered for prefetch={schedule.prefetch} but the engine got "
                             f"prefetch={prefetch}; its predicted peak resident weights would not hold")
        return schedule
    tl = schedule if isinstance(schedule, Timeline) else simulate(schedule)
    return lower(tl, weight_cache, prefetch)


def _check_model(model: StagedModel, space: Any) -> None:
    found = model_errors(model, space.S)  # what StagedModel checked, in case the stages changed since
    if found:
        raise ModelError(found)
    if model.graph.preds != space.graph.preds:
        raise ValueError(f"the model has stage graph {model.graph.preds} but the schedule has {space.graph.preds}")


def _recompute(timeline: Timeline, recompute: Iterable[int] | None) -> frozenset[int]:
    """Stages whose forward keeps only its input and whose backward recomputes it (activation
    checkpointing); default: what the schedule was simulated with."""
    S = timeline.step.space.S
    stages = frozenset(timeline.step.recompute if recompute is None else recompute)
    if any(not 0 <= s < S for s in stages):
        raise StepError([f"recompute={sorted(stages)} is invalid: stage "
                         f"{next(s for s in sorted(stages) if not 0 <= s < S)} does not exist with stages={S}."])
    return stages


class Engine:
    """Runs this rank's share of every training step of one schedule."""

    def __init__(
        self,
        model: StagedModel,
        schedule: Step | Timeline | Lowered,
        optimizer: OptimizerFactory | None = None,
        *,
        prefetch: int = 1,
        weight_cache: str = "step",
        group: dist.ProcessGroup | None = None,
        rank: int | None = None,
        device: torch.device | str | None = None,
        watchdog: Watchdog | None = None,
        check_batches: bool | int = True,
        recompute: Iterable[int] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.plan = _lowered(schedule, weight_cache, prefetch)
        self.timeline = self.plan.timeline
        space = self.timeline.step.space
        _check_model(model, space)
        self.model, self.space, self.prefetch = model, space, prefetch
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        W = self.plan.workers
        if dist.get_world_size(group) < W:
            raise ValueError(f"the schedule needs W={W} workers but the process group has {dist.get_world_size(group)}")
        self.ranks = list(range(W))
        self.worker: int | None = self.rank if self.rank < W else None
        self.device = torch.device(device) if device is not None else default_device(dist.get_backend(group))
        self.watchdog = watchdog if watchdog is not None else current_watchdog()
        self._place_stages(model, space)
        # the batch check: on the first step, then every ``check_batches`` steps (True: every
        # CHECK_EVERY; 1: every step; False or 0: never)
        self.check_every = CHECK_EVERY if check_batches is True else int(check_batches)
        # random streams (:mod:`.streams`): the seed every job's draws are derived from, with the
        # step and micro-batch; None: each worker draws from its own generator in the order it runs
        self.streams: int | None = None
        self.recompute = _recompute(self.timeline, recompute)
        self.replicas = Replicas(self.plan, self.worker, self.ranks, group, self.layouts, self.device, bucket_bytes)
        if dist.get_backend(group) == "nccl":
            warm_pairs(self.plan, self.worker, self.ranks, group, self.device)
        if self.materialized:
            self._sync_ties()
        self._sync_replicas()
        # a parameter several owned stages share (tied embeddings) is one parameter of the optimizer
        params = list(dict.fromkeys(p for s in self.owned for p in self.modules[s].parameters()))
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self._step_state(compute_dtype)

    def _place_stages(self, model: StagedModel, space: Any) -> None:
        """The owned stages on the device (materialised if built on the meta device), a skeleton
        for every other one, and the running statistics over both."""
        self.layouts = [StageLayout.of(m) for m in model.stages]
        self.skeletons = [skeleton(m, self.device) for m in model.stages]
        self._metas: list[torch.nn.Module] | None = None  # meta copies, to learn shapes (never computed with)
        self.ties = tied(model.stages)
        self.owned = self.plan.programs[self.worker].owned if self.worker is not None else []
        # only owners keep weights: every other stage of the user's model becomes its skeleton
        # The owned stages are the caller's own module objects (moved to the device in place), so
        # an optimizer or a Lightning module holding their parameters steps what the engine
        # computes with; the other stages are the engine's meta skeletons. The caller's list
        # itself is never changed.
        self.materialized = self._materialize()
        self.modules = {s: model.stages[s].to(self.device) for s in self.owned}
        self.stages: list[torch.nn.Module] = [self.modules.get(s, self.skeletons[s]) for s in range(space.S)]
        # each submodule of a skeleton beside the user's (a deep copy: the same order), whose
        # training flag it copies at every step
        self._mirrored = [pair for m, sk in zip(model.stages, self.skeletons)
                          for pair in zip(m.modules(), sk.modules())]
        self.stats = RunningStats([[self.modules[s], self.skeletons[s]] if s in self.modules else [self.skeletons[s]]
                                   for s in range(space.S)], space.B)

    def _step_state(self, compute_dtype: torch.dtype | None) -> None:
        """What the engine keeps from step to step, and what it derives once from the schedule."""
        space = self.space
        self.last_grads: dict[int, torch.Tensor] = {}  # owned stage -> reduced flat gradient of the last step
        # (stage, owner) -> this worker's gradient sum, a buffer reused every step (replicated
        # stages sum into their all-reduce bucket instead): the last step's totals are valid until
        # the next step starts, as DistributedDataParallel's gradient buckets are
        self.totals: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_views: dict[int, tuple] = {}  # owned stage -> (its total, its parameters, their views of it)
        self.steps = 0
        self.step_index = 0  # the global step of the current step (:meth:`compute_step`'s ``step``)
        self._traced: dict[str, Any] | None = None  # the last training step's events (:meth:`trace`)
        self.split = "I" in space.kinds  # a split backward: W takes a fetched copy's gradient per parameter
        self._shapes: dict[Any, _Shapes] = {}
        self._saved: dict[Any, list[int]] = {}  # input shapes -> bytes each stage's graph saves
        # what the forwards' graphs saved, measured: hooked only for new keys and on check steps
        # (step 1, then every ``check_every`` steps, CHECK_EVERY when the batch check is off)
        self.graph_counts = GraphCounts()
        self._recount = True
        comp, B, SB = self.timeline.compute, space.B, space.S * space.B
        # F(s, b)'s output feeds how many forwards on the same worker
        self._local_succ = [
            sum(1 for c in space.stage_succs[j // B] if comp[c * B + j % B] == comp[j]) for j in range(SB)
        ]
        self._grad_kind = space.K - 1
        self._eval_plan: Lowered | None = None
        # mixed precision (bf16-mixed, 16-mixed): owners keep their weights (fp32 masters) and
        # compute under the caller's autocast; fetched weights, activations and their gradients
        # cross in this dtype; weight-gradient sums and all-reduces stay in the weights' dtype.
        # None: everything crosses in its own dtype.
        self.compute_dtype = compute_dtype
        self.loss_scale = 1.0  # 16-mixed: the GradScaler's scale, applied to every loss's backward
        self.finite: Any = None  # nonfinite: a launcher.runtime.nonfinite.Finite marking each job's values

    # ---- shapes ------------------------------------------------------------------------------
    def shapes(self, microbatches: Sequence[Batch]) -> list[_Shapes]:
        """What every stage returns and every edge carries, per micro-batch: meta-device copies of
        the stages run once per distinct input shape."""
        keys = [_key(mb[0]) for mb in microbatches]
        for k, mb in zip(keys, microbatches):
            if k not in self._shapes:
                if self._metas is None:
                    self._metas = [meta_copy(m) for m in self.model.stages]
                try:
                    sigs = signatures(self.model, [as_meta(mb[0])], self._metas)[0]
                except NoMeta:  # a stage reads values (or lacks a meta kernel): one real forward
                    sigs = real_signatures(self.model, mb[0])
                self._shapes[k] = _Shapes(self.model, sigs, [_meta_of(sg) for sg in sigs], self.compute_dtype)
        return [self._shapes[k] for k in keys]

    def sizes(self, microbatches: Sequence[Batch]) -> tuple[list[int], list[list[int]], list[int]]:
        """Bytes of every planned message, of every stage input ``x_s^b`` (per micro-batch) and of
        every stage's parameters, for these micro-batches' shapes: what crosses, as packed."""
        shapes, space = self.shapes(microbatches), self.space
        params = [L.numel * torch.empty((), dtype=L.dtype).element_size() for L in self.layouts]

        def size(m: Msg) -> int:
            if m.kind == ACT:
                return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.nbytes()
            if m.kind == GRAD:
                return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.grad_nbytes()
            if m.kind == WEIGHTS:
                return self.layouts[m.stage].numel * torch.empty((), dtype=self.wire_dtype(m.stage)).element_size()
            return params[m.stage]

        act = [[shapes[b].input_bytes(s, space.stage_preds[s]) if space.stage_preds[s]
                else value_bytes(microbatches[b][0]) for b in range(space.B)] for s in range(space.S)]
        return [size(m) for m in self.plan.messages], act, params

    def wire_dtype(self, s: int) -> torch.dtype:
        """The dtype stage ``s``'s weights are fetched in: the compute dtype under mixed
        precision (half the bytes of fp32 masters), else the weights' own."""
        dt = self.layouts[s].dtype
        return self.compute_dtype if self.compute_dtype is not None and dt.is_floating_point else dt

    def saved_sizes(self, microbatches: Sequence[Batch]) -> list[list[int]]:
        """Bytes each stage's forward graph saves for its backward, per micro-batch (as the engine
        counts them, :class:`~launcher.runtime.saved.SavedBytes`): found once per input shape,
        by a run on fake tensors of this engine's device (or one real forward, see
        :func:`~launcher.runtime.saved.stage_saved_bytes`)."""
        self.shapes(microbatches)
        if self._metas is None:
            self._metas = [meta_copy(m) for m in self.model.stages]
        per_key: dict[Any, list[int]] = {}
        for mb in microbatches:
            k = _key(mb[0])
            if k not in self._saved:
                self._saved[k] = stage_saved_bytes(self.model, mb[0], mb[1], self._metas, self.device)
            per_key[k] = self._saved[k]
        by_b = [per_key[_key(mb[0])] for mb in microbatches]
        return [[by_b[b][s] for b in range(self.space.B)] for s in range(self.space.S)]

    def recomputed(self) -> list[bool]:
        """Per forward job ``s * B + b``: whether it keeps only its input (its stage recomputes,
        or it frees its fetched copy under ``weight_cache="job"``), as the programs run it."""
        out = [False] * (self.space.S * self.space.B)
        for prog in self.plan.programs:
            for op in prog.jobs:
                if op.kind == "F":
                    out[op.stage * self.space.B + op.microbatch] = op.free_weights or op.stage in self.recompute
        return out

    def activation_peaks(self, microbatches: Sequence[Batch]) -> list[int]:
        """Predicted peak activation bytes per worker for these micro-batches: inputs ``x_s^b``
        plus the forwards' graphs, swept over the timeline (:mod:`launcher.schedule.activations`);
        equal to what each worker's meter measures (``peak_activation_bytes``)."""
        _, act, _ = self.sizes(microbatches)
        saved = self.saved_sizes(microbatches)
        return activation_peaks(self.timeline, lambda s, b: act[s][b], lambda s, b: saved[s][b], self.recomputed())

    # ---- the step ----------------------------------------------------------------------------
    def train_step(self, microbatches: Sequence[Batch], items: Sequence[Count] | None = None) -> dict[str, Any]:
        """Run one step (every rank calls it with the same micro-batches) and step the owners'
        optimizer; returns this worker's record. ``items``: see :meth:`compute_step`."""
        record = self.compute_step(microbatches, items)
        if self.optimizer is not None:
            self.install_grads()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return record

    def compute_step(self, microbatches: Sequence[Batch], items: Sequence[Count] | None = None,
                     step: int | None = None) -> dict[str, Any]:
        """Every job of one step and the gradient reduction, without the optimizer step: each
        owned stage's total gradient is left in :attr:`last_grads` (see :meth:`install_grads`).
        ``items``: how many items each micro-batch's loss averages over (numbers or 0-d tensors,
        the same on every rank); micro-batch ``b``'s loss weighs ``items[b] / sum(items)``
        (:mod:`.items`). None: the rows of each micro-batch's input (equal rows: ``1 / B``).
        ``step``: the global step the random streams draw for (default: this engine's count of
        steps from 0; a resumed run passes its own)."""
        self.steps += 1
        self.step_index = self.steps - 1 if step is None else int(step)
        if self.finite is not None:
            self.finite.begin()
        B = self.space.B
        if len(microbatches) != B:
            raise ValueError(f"the schedule has B={B} micro-batches but train_step got {len(microbatches)}")
        shares = item_shares(microbatches, items)
        if self.check_every and (self.steps == 1 or self.steps % self.check_every == 0):  # every rank takes part
            check_same_batches(microbatches, self.group, self.device, self.watchdog, self.steps)
        self._recount = self.steps == 1 or self.steps % (self.check_every or CHECK_EVERY) == 0
        if self.worker is None:
            self.stats.begin()  # idle ranks add nothing to the statistics' all-reduce, but take part
            self.stats.end(self.group, self.device, dist.get_world_size(self.group))
            return {}
        w, plan = self.worker, self.plan
        meter = Meter(spans=[])  # every training step is traced; only the last one's events are kept
        self.replicas.reset()
        self.stats.begin()
        for mine, copy in self._mirrored:  # the engine's copies train as the user's modules do, submodule
            if copy.training != mine.training:  # by submodule (a frozen part in eval mode stays so)
                copy.training = mine.training
        with kept_generators(self.device) if self.streams is not None else contextlib.nullcontext():
            st = self._run_program(plan, microbatches, meter, train=True, shares=shares)
        t, cpu = time.perf_counter(), time.process_time()
        totals = st.reduce(plan.programs[w])
        st.comm.finish()
        self._sum_tied(totals)
        if self.finite is not None:  # each owned stage's gradient, summed, before any optimizer step
            self.finite.reduced(totals)
        self.stats.end(self.group, self.device, dist.get_world_size(self.group))
        for mid in list(st.weights):
            st.free(mid)
        self.last_grads = totals
        if self.watchdog is not None:
            self.watchdog.set_job("")
        end = time.perf_counter()
        meter.end_s, meter.end_cpu_s = end - t, time.process_time() - cpu
        meter.step_s, meter.cpu_s = end - meter.t0, time.process_time() - meter.cpu0
        self._traced = {"step": self.steps, "start": meter.t0, "end": end, "sync": (t, end), "meter": meter,
                        "waits": st.comm.waits, "sends": st.comm.handed}
        return worker_record(w, plan.predicted, meter, st.comm, len(self.owned), self.steps, self.device.type)

    def trace(self) -> dict[str, Any] | None:
        """This worker's events of its last training step (None before one, or on a rank with
        nothing to do), for :mod:`launcher.report.trace`; times are ``time.perf_counter``
        seconds, this host's monotonic clock. Every training step records them (a clock reading
        per job, a tuple per message: its cost is negligible) and each replaces the previous
        step's, so nothing grows with the run.

        ``{"worker", "host", "step", "start", "end"`` (the engine's step), ``"sync"`` (the
        end of step: ``[start, end]``), ``"allreduce"`` (its all-reduce of replicated stages, or
        None), ``"jobs"``: ``[stage, microbatch, kind, start, end, work seconds]``, ``"waits"``:
        per message received ``[kind, from worker, bytes, stage, microbatch, began, ended, id]``,
        ``"sends"``: per message sent ``[id, kind, bytes, handed over at]}``."""
        t = self._traced
        if t is None or self.worker is None:
            return None
        msgs, meter = self.plan.messages, t["meter"]
        waits = []
        for mid, began, ended, nbytes in t["waits"] or ():
            m = msgs[mid]
            waits.append([m.kind, m.src, nbytes, m.stage, m.microbatch, began, ended, mid])
        return {"worker": self.worker, "host": HOST, "step": t["step"], "start": t["start"], "end": t["end"],
                "sync": list(t["sync"]), "allreduce": list(meter.allreduce_span) if meter.allreduce_span else None,
                "jobs": [[j[0], j[1], j[2], a, b, j[3]] for j, (a, b) in zip(meter.jobs, meter.spans or ())],
                "waits": waits, "sends": [[mid, msgs[mid].kind, nbytes, at] for mid, at, nbytes in t["sends"] or ()]}

    def install_grads(self) -> None:
        """Point every owned parameter's ``.grad`` at its slice of the step's reduced gradient."""
        for s in self.owned:
            total = self.last_grads[s]
            cached = self._grad_views.get(s)
            if cached is None or cached[0] is not total:  # the totals' buffers are kept: so are their views
                cached = self._grad_views[s] = (total, list(self.modules[s].parameters()),
                                                list(self.layouts[s].views(total).values()))
            for p, g in zip(cached[1], cached[2]):
                p.grad = g

    def evaluate(self, microbatches: Sequence[Batch],
                 items: Sequence[Count] | None = None) -> tuple[float, dict[int, torch.Tensor]]:
        """A forward-only pass of the step's schedule (no gradients, no optimizer): every forward
        job where the training step runs it, with the same activation and weight messages.

        Returns this worker's share of the loss (the sum of its micro-batches' losses, each
        weighted as :meth:`compute_step` weighs it by ``items``; summed over workers it is the
        batch loss) and the loss stages' outputs it computed, by micro-batch."""
        if self.worker is None:
            return 0.0, {}
        if len(microbatches) != self.space.B:
            raise ValueError(f"the schedule has B={self.space.B} micro-batches but evaluate got {len(microbatches)}")
        shares = item_shares(microbatches, items)
        if self._eval_plan is None:
            self._eval_plan = forward_only(self.plan)
        meter = Meter()
        modes = [(m, m.training) for top in (*self.stages, *self.skeletons) for m in top.modules()]
        for m in (*self.stages, *self.skeletons):
            m.eval()
        try:
            with torch.no_grad():
                st = self._run_program(self._eval_plan, microbatches, meter, train=False, shares=shares)
                st.comm.finish()
                for mid in list(st.weights):
                    st.free(mid)
        finally:
            for m, mode in modes:  # each submodule as it was (``train(mode)`` would set them all alike)
                m.training = mode
        if self.watchdog is not None:
            self.watchdog.set_job("")
        return meter.loss, st.predictions

    def _run_program(self, plan: Lowered, microbatches: Sequence[Batch], meter: Meter, train: bool,
                     shares: list[float] | None = None) -> "_StepState":
        """Run this worker's jobs of ``plan`` in order, with prefetch and just-in-time weight hand-over;
        ``shares``: each micro-batch's weight in the loss (None: ``1 / B`` each)."""
        w = self.worker
        prog, msgs = plan.programs[w], plan.messages
        shapes = self.shapes(microbatches)

        def spec(m: Msg) -> tuple:
            if m.kind == ACT:
                return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.spec()
            if m.kind == GRAD:
                return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.grad_spec()
            L = self.layouts[m.stage]
            return (L.numel,), self.wire_dtype(m.stage) if m.kind == WEIGHTS else L.dtype

        comm = Comm(plan, w, spec, self.device, self.watchdog, self.group, self.ranks,
                    on_alloc=lambda m: meter.hold_weights() if m.kind == WEIGHTS else None,
                    timed=train and self.steps <= TIMED_STEPS, traced=meter.spans is not None)
        # owners hand weights over just in time (the program's release points, ``prefetch`` jobs early)
        packed: dict[int, torch.Tensor] = {}

        def hand_over(mid: int) -> None:
            s = msgs[mid].stage
            if s not in packed:
                flat = self.layouts[s].pack([p.detach() for p in self.modules[s].parameters()])
                packed[s] = flat.to(self.wire_dtype(s))  # mixed precision: cast once, sent to all
            comm.send(mid, packed[s])

        st = _StepState(self, comm, meter, microbatches, shapes, train, shares)
        jobs = prog.jobs
        what = "step" if train else "evaluation step"
        clock, cpu_clock, thread_clock = time.perf_counter, time.process_time, time.thread_time
        for i, op in enumerate(jobs):
            # a job's time runs from here (the engine's own work for it included) to its end
            t, cpu, mine, waited = clock(), cpu_clock(), thread_clock(), comm.waited
            # the order of calls the lowering's memory prediction replays (Program.handovers, .wants)
            for mid in prog.handovers(i, self.prefetch):
                hand_over(mid)
            for mid in prog.wants(i, self.prefetch):  # the next jobs' inputs and weights, partial sums to take in
                comm.want(mid)
            st.incoming += prog.wgrad_post.get(i, ())
            for mid in prog.wgrad_deliver.get(i, ()):  # sums sent earlier, received by now: free them
                comm.deliver(mid)
            if self.watchdog is not None:
                self.watchdog.check()
                self.watchdog.set_job(f"{op.kind}({op.stage},{op.microbatch}) of {what} {self.steps}")
            st.run(op)
            for mid in op.wgrad_send:  # this worker's sum for that owner is complete: send it now
                key = (op.stage, msgs[mid].dst)
                comm.send(mid, st.acc.pop(key) if plan.weight_cache == "job" else st.acc[key])
                st.views.pop(key, None)  # cache "job": the send holds the sum, and frees it once delivered
            st.absorb()
            if train:  # buckets of replicated stages whose share is complete start their all-reduce
                self.replicas.launch_ready(i)
            # work: what it spent blocked on a peer's data is idle time, not work; cpu: the
            # process's CPU meanwhile (its communication threads' too), what it asks of a core;
            # and the compute thread's own share of it
            end = clock()
            meter.jobs.append([op.stage, op.microbatch, op.kind, end - t - (comm.waited - waited), cpu_clock() - cpu,
                               thread_clock() - mine])
            if meter.spans is not None:
                meter.spans.append((t, end))
        for mid in prog.handovers(len(jobs), self.prefetch):
            hand_over(mid)
        return st

    # ---- state -------------------------------------------------------------------------------
    def _materialize(self) -> bool:
        """Owned stages built on the meta device get storage and their initial values here, by
        the model's rule (:mod:`.init`: the same values single-device training starts from); no
        other stage of the model ever gets storage on this worker. True if any did."""
        meta = [s for s in self.owned if has_meta(self.model.stages[s])]
        if not meta:
            return False
        if self.model.init is not None:
            self.model.init(meta)
        else:
            init_units(self.model.stages, torch.initial_seed(), meta)
        return True

    def _sync_ties(self) -> None:
        """A parameter several stages share takes the value its first stage's rule gives it: that
        stage's first owner hands it to the tie's other owners (who initialised it by another
        unit's rule, or not at all)."""
        if self.worker is None:
            return
        w, owners, works, into = self.worker, self.plan.owners, [], []
        for g, uses in enumerate(self.ties):
            s0, i0 = min(uses)
            root = owners[s0][0]
            union = sorted({o for s, _ in uses for o in owners[s]} - set(owners[s0]))
            tag = TAG_LIMIT - 1 - g
            if w == root:
                value = list(self.modules[s0].parameters())[i0].detach().contiguous()
                works += [isend(value, self.ranks[o], group=self.group, tag=tag) for o in union]
            elif w in union:
                s, i = next((s, i) for s, i in uses if w in owners[s])
                param = list(self.modules[s].parameters())[i]
                buf = torch.empty_like(param.detach())
                works.append(irecv(buf, self.ranks[root], group=self.group, tag=tag))
                into += [(list(self.modules[s].parameters())[i], buf) for s, i in uses if s in self.modules]
        self._receive_into(works, into)

    def _sync_replicas(self) -> None:
        """Every owner of a replicated stage (DDP, LPP with G > 1) starts from the weights of the
        stage's lowest-ranked owner: ranks that built their model apart (torchrun, a per-rank
        seed) would otherwise train replicas that silently diverge.

        Messages go out in one order shared by both ends of every pair, (stage, src, dst), so
        the exchange is also correct where point-to-point operations match in issue order (NCCL).
        """
        if self.worker is None:
            return
        w, tag0 = self.worker, self.plan.tag_base + self.space.S  # after the step's and gather_state's tags
        works, into = [], []
        for s, owners in enumerate(self.plan.owners):
            if len(owners) < 2 or w not in owners:
                continue
            root, L = owners[0], self.layouts[s]
            if w == root:
                flat = L.pack([p.detach() for p in self.modules[s].parameters()])
                works += [isend(flat, self.ranks[o], group=self.group, tag=tag0 + s) for o in owners[1:]]
            else:
                flat = torch.empty(L.numel, dtype=L.dtype, device=self.device)
                works.append(irecv(flat, self.ranks[root], group=self.group, tag=tag0 + s))
                into += list(zip(self.modules[s].parameters(), L.views(flat).values()))
        self._receive_into(works, into)

    def _receive_into(self, works: list[Any], into: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Wait for an exchange's sends and receives, then copy each received value into its
        parameter: the one ending of every weight exchange at set-up (ties, replicas)."""
        with blocked(self.watchdog):
            for work in works:
                work.wait()
        with torch.no_grad():
            for param, value in into:
                param.copy_(value)

    def _sum_tied(self, totals: dict[int, torch.Tensor]) -> None:
        """Give every use of a shared parameter the sum of all its uses' gradients, as one process
        would (the parameter is one tensor there). Each stage's first owner sends its use's
        gradient to the other owners of the tie that do not own that stage; every one of them
        adds the uses in the same order, so every copy gets the same sum and the same update."""
        w, owners = self.worker, self.plan.owners
        for g, uses in enumerate(self.ties):
            union = sorted({o for s, _ in uses for o in owners[s]})
            if w not in union:
                continue
            works, parts = [], []
            for k, (s, i) in enumerate(uses):
                tag = TAG_LIMIT - 1 - (g * self.space.S + s)  # far above the step's own tags
                root = owners[s][0]
                if w in owners[s]:
                    view = self._param_view(totals[s], s, i)
                    parts.append(view)
                    if w == root:
                        works += [isend(view.contiguous(), self.ranks[o], group=self.group, tag=tag)
                                  for o in union if o not in owners[s]]
                else:
                    L = self.layouts[s]
                    buf = torch.empty(L.shapes[i], dtype=L.dtype, device=self.device)
                    works.append(irecv(buf, self.ranks[root], group=self.group, tag=tag))
                    parts.append(buf)
            with blocked(self.watchdog):
                for work in works:
                    work.wait()
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            for (s, i) in uses:
                if w in owners[s]:
                    self._param_view(totals[s], s, i).copy_(total)

    def _param_view(self, flat: torch.Tensor, s: int, i: int) -> torch.Tensor:
        L = self.layouts[s]
        at = sum(L.numels[:i])
        return flat[at : at + L.numels[i]].view(L.shapes[i])

    def gather_state(self, dst: int = 0) -> list[dict[str, torch.Tensor]] | None:
        """Every stage's parameters at worker ``dst`` (each from its lowest-ranked owner); None elsewhere."""
        out: list[dict[str, torch.Tensor]] = []
        tag0 = self.plan.tag_base  # after the step's message tags
        for s in range(self.space.S):
            root = self.plan.owners[s][0]
            L = self.layouts[s]
            if self.worker == root:
                flat = L.pack([p.detach() for p in self.modules[s].parameters()])
                if dst != root:
                    with blocked(self.watchdog):
                        isend(flat, self.ranks[dst], group=self.group, tag=tag0 + s).wait()
            elif self.worker == dst:
                flat = torch.empty(L.numel, dtype=L.dtype, device=self.device)
                with blocked(self.watchdog):
                    irecv(flat, self.ranks[root], group=self.group, tag=tag0 + s).wait()
            if self.worker == dst:
                out.append({k: v.detach().clone().cpu() for k, v in L.views(flat).items()})
        return out if self.worker == dst else None

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write every stage's weights to ``path`` from worker 0; atomic, so never partial."""
        state = self.gather_state(0)
        if state is not None:
            tmp = f"{path}.tmp-{os.getpid()}"
            torch.save({"stages": state, "step": self.steps}, tmp)
            os.replace(tmp, path)


def _rng_state(device: torch.device) -> tuple:
    """The random state a recomputed forward must replay (CPU, and the device's on CUDA)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _replayed_rng(state: tuple | None, device: torch.device) -> Any:
    """Run under ``state`` (a forward's random state), then go back to the current one."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _detached(value: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


class _StepState:
    """Everything a worker holds during one step."""

    def __init__(self, engine: Engine, comm: Comm, meter: Meter, microbatches: Sequence[Batch], shapes: list[_Shapes],
                 train: bool = True, shares: list[float] | None = None) -> None:
        self.e, self.comm, self.meter, self.mb, self.train = engine, comm, meter, microbatches, train
        self.shares = shares  # micro-batch -> its weight in the step's loss (None: 1 / B each)
        self.shapes = shapes
        self.predictions: dict[int, Any] = {}  # evaluation: micro-batch -> loss stage output
        self.msgs = engine.plan.messages
        self.outs: dict[tuple[int, int], list] = {}  # (s, b) -> [output, local forwards still to read it]
        # (p, b) -> {c: dL/d(the differentiable leaves of what p sent c)}
        self.grads: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = defaultdict(dict)
        self.stash: dict[tuple[int, int], _Stash] = {}
        self.ys: dict[int, Any] = {}  # micro-batch -> its target on the device (loss stages)
        self.wstash: dict[tuple[int, int], tuple] = {}  # split backward: I's graph kept for W
        self.acc: dict[tuple[int, int], torch.Tensor] = {}  # (stage, owner) -> summed weight gradient
        self.weights: dict[int, torch.Tensor] = {}  # weights message -> fetched flat copy (a leaf)
        self.params: dict[int, list[torch.Tensor]] = {}  # owned stage -> its parameters, looked up once a step
        self.views: dict[tuple[int, int], list[torch.Tensor]] = {}  # acc key -> per-parameter views of the total
        self.incoming: list[int] = []  # partial sums asked for before this job (cache "job"), not yet added
        self.absorbed: set[int] = set()  # partial sums already added into an owned stage's total

    # ---- weights -----------------------------------------------------------------------------
    def fetch(self, op: JobOp) -> tuple[torch.nn.Module, dict | None, list[torch.Tensor]]:
        """Module, parameter override and gradient targets for ``op``'s stage."""
        s = op.stage
        if op.weights is None:
            mod = self.e.modules[s]
            params = self.params.get(s)
            if params is None:
                params = self.params[s] = list(mod.parameters())
            return mod, None, params
        mid = op.weights
        if mid not in self.weights:
            flat = self.comm.wait(mid)
            self.comm.drop(mid)
            self.weights[mid] = flat.requires_grad_(True)
        flat = self.weights[mid]
        self.meter.fetched_jobs += 1
        self.meter.fetched_stages.add(s)
        return self.e.skeletons[s], self.e.layouts[s].views(flat), [flat]

    def free(self, mid: int) -> None:
        if self.weights.pop(mid, None) is not None:
            self.meter.free_weights()

    # ---- jobs --------------------------------------------------------------------------------
    def run(self, op: JobOp) -> None:
        if op.kind == "F":
            self.forward(op)
        elif op.kind in ("B", "I"):
            self.backward(op, split=op.kind == "I")
        else:
            self.weight_grad(op)

    def _inputs(self, op: JobOp) -> tuple[list[Any], list[torch.Tensor], list[int]]:
        """The values stage ``s`` is called with, their differentiable leaves (each a leaf of its
        own, so the stage's backward stops at its inputs) and how many came from each predecessor."""
        s, b = op.stage, op.microbatch
        preds = self.e.space.stage_preds[s]
        device = self.e.device
        if not preds:
            x = self.mb[b][0]
            return [x.to(device) if isinstance(x, torch.Tensor) else to_device(x, device)], [], []
        values, leaves, counts = [], [], []
        edges = self.shapes[b].edges
        for p in preds:
            edge = edges[(p, s)]
            if p in op.recv:
                v = edge.sig.unpack(self.comm.wait(op.recv[p]))
                self.comm.drop(op.recv[p])
            else:
                entry = self.outs[(p, b)]
                v = pick(entry[0], self.e.model.edge(p, s))
                entry[1] -= 1
                if entry[1] == 0:
                    del self.outs[(p, b)]
                dt = edge.sig.compute
                if dt is not None:  # mixed precision: cast as a sent value is, so placement changes no result
                    v = pytree.tree_map(lambda x: x.detach().to(dt) if isinstance(x, torch.Tensor)
                                        and x.is_floating_point() else x, v)
            if isinstance(v, torch.Tensor):  # the common case, without the tree
                v = v.detach()
                if edge.sig.grads:
                    v.requires_grad_(True)
                    leaves.append(v)
                counts.append(len(edge.sig.grads))
            else:
                v, mine = detach_inputs(v, edge.sig)
                leaves.extend(mine)
                counts.append(len(mine))
            values.append(v)
        return values, leaves, counts

    def _send_output(self, op: JobOp, out: Any) -> None:
        s, b = op.stage, op.microbatch
        for mid in op.send:  # activations: what each consumer stage receives
            c = self.msgs[mid].peer_stage
            edge = self.shapes[b].edges[(s, c)]
            self.comm.send(mid, edge.sig.pack(pick(out, self.e.model.edge(s, c)), self.e.device))

    def _loss(self, op: JobOp, out: Any) -> torch.Tensor | None:
        """A loss stage's share of the step's loss: its loss over ``B``, or weighted by the
        micro-batch's share of the step's items (:mod:`.items`); a micro-batch with no item adds
        a constant zero (its mean over nothing is left out, and its backward gives no gradient)."""
        if not self.e.space.is_sink[op.stage]:
            return None
        loss = self.e.model.loss(out, self._target(op.microbatch))
        if self.shares is None:
            return loss / self.e.space.B
        share = self.shares[op.microbatch]
        if share == 0:
            return torch.zeros((), dtype=loss.dtype, device=loss.device)
        return loss * share

    def _job(self, b: int) -> Any:
        """A training job's forward on micro-batch ``b``: its units draw from their streams."""
        e = self.e
        if e.streams is None or not self.train:
            return contextlib.nullcontext()
        return stream_job(e.streams, e.step_index, b, e.device)

    def _weightless(self, s: int, b: int) -> bool:
        """Whether stage ``s`` is a loss stage and micro-batch ``b`` has no item to average over."""
        return self.shares is not None and self.shares[b] == 0 and self.e.space.is_sink[s]

    def _target(self, b: int) -> Any:
        """Micro-batch ``b``'s target on the device, moved once (the forward and a recomputing
        backward share it, and the graph's count can leave it out: it is data, not activation)."""
        y = self.ys.get(b)
        if y is None:
            y = self.mb[b][1]
            y = self.ys[b] = y.to(self.e.device) if isinstance(y, torch.Tensor) else to_device(y, self.e.device)
        return y

    def forward(self, op: JobOp) -> None:
        if not self.train:
            return self.forward_eval(op)
        s, b = op.stage, op.microbatch
        values, leaves, counts = self._inputs(op)
        nbytes = value_bytes(values)
        self.meter.take(nbytes)  # x_s^b is live from the start of F(s, b)
        mod, params, targets = self.fetch(op)
        # keep only the input when the copy goes away after this job, or when the stage recomputes
        recompute = op.free_weights or s in self.e.recompute
        stats = self.e.stats
        stats.before(s, b, mod)
        # without streams, a recomputing backward replays the state this forward started from
        rng = _rng_state(self.e.device) if recompute and self.e.streams is None else None
        with torch.set_grad_enabled(not recompute), self._job(b), \
                self._counting(recompute, op, mod, targets, values, False) as graph:
            out = run_stage(mod, params, values)
            loss = self._loss(op, out)
        stats.after(s, b, mod)
        saved = graph.nbytes if graph is not None else 0
        self.meter.hold_bytes(saved)  # the graph lives until the backward that frees it
        if loss is not None:
            self.meter.add_loss(loss)
        if self.e.finite is not None:  # a weightless loss stage's output may be its (NaN) mean over nothing
            self.e.finite.forward(s, b, None if self._weightless(s, b) else out, loss)
        # a recomputing backward fetches the weights again: keeping ``targets`` (a fetched copy)
        # here would hold every fetched stage's weights until its backward
        views = list(params.values()) if params is not None and not recompute and self.e.split else None
        self.stash[(s, b)] = _Stash(values, leaves, counts, None if recompute else out, None if recompute else loss,
                                    [] if recompute else targets, nbytes, saved, rng, views)
        n = self.e._local_succ[s * self.e.space.B + b]
        if n:
            self.outs[(s, b)] = [out.detach() if isinstance(out, torch.Tensor) else _detached(out), n]
        self._send_output(op, out)
        if op.free_weights:
            self.free(op.weights)

    def _counting(self, off: bool, op: JobOp, mod: torch.nn.Module, targets: list[torch.Tensor],
                  values: list[Any], recomputing: bool) -> Any:
        """Counts what a forward's graph saves (:class:`~launcher.runtime.saved.SavedBytes`),
        except the stage's weights, buffers, inputs and (loss stage) target; nothing when ``off``.
        A forward whose key was counted before (and agreed) reuses that count without hooks, except
        on check steps (:class:`~launcher.runtime.saved.GraphCounts`): equal shapes save equal bytes."""
        if off:
            return contextlib.nullcontext()
        sink = self.e.space.is_sink[op.stage]

        def skip() -> list[torch.Tensor]:
            y = saved_tensors(self._target(op.microbatch)) if sink else []
            return [*targets, *mod.buffers(), *saved_tensors(values), *y]

        return self.e.graph_counts.counter(self._graph_key(op, mod, targets, values, sink, recomputing),
                                           self.e._recount, skip)

    def _graph_key(self, op: JobOp, mod: torch.nn.Module, targets: list[torch.Tensor], values: list[Any],
                   sink: bool, recomputing: bool) -> Any:
        """What decides the storages a forward's graph saves: the stage, its inputs' and target's
        shapes, dtypes and ``requires_grad``, its weights' (owned or fetched), training and grad
        mode, autocast; None (always counted) when an input's constant cannot be hashed."""
        dev = self.e.device.type
        try:
            key = (op.stage, recomputing, op.weights is None, mod.training, torch.is_grad_enabled(),
                   torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev),
                   tuple(t.requires_grad for t in targets), _leaves_key(values),
                   _leaves_key([self._target(op.microbatch)]) if sink else None)
            hash(key)
        except TypeError:
            return None
        return key

    def forward_eval(self, op: JobOp) -> None:
        """A forward that keeps nothing for a backward: no stash, its copy of the weights freed
        when the job ends whatever the cache (no backward will use it)."""
        s, b = op.stage, op.microbatch
        mod, params, _ = self.fetch(op)
        out = run_stage(mod, params, self._inputs(op)[0])
        loss = self._loss(op, out)
        if loss is not None:
            self.meter.add_loss(loss)
            self.predictions[b] = out
        n = self.e._local_succ[s * self.e.space.B + b]
        if n:
            self.outs[(s, b)] = [out, n]
        self._send_output(op, out)
        if op.free_weights:
            self.free(op.weights)

    def backward(self, op: JobOp, split: bool) -> None:
        s, b = op.stage, op.microbatch
        st = self.stash.pop((s, b))
        views = st.views
        if st.out is None:  # recompute the stage's forward on freshly fetched weights
            mod, params, targets = self.fetch(op)
            views = None if params is None else list(params.values())
            self.e.stats.before(s, b, mod)
            with torch.enable_grad(), _replayed_rng(st.rng, self.e.device), self._job(b), \
                    self._counting(False, op, mod, targets, st.values, True) as graph:
                out = run_stage(mod, params, st.values)
                loss = self._loss(op, out)
            self.e.stats.after(s, b, mod, count=False)  # counted by the forward already
            st.saved = graph.nbytes
            self.meter.hold_bytes(st.saved)  # the recomputed graph, until this job (or W) ends
        else:
            out, loss, targets = st.out, st.loss, st.targets
            if op.weights is not None:
                self.fetch(op)  # cache "step" only: the copy F used; counted as a job on fetched weights
        if loss is not None:
            roots: list[torch.Tensor] = [] if self._weightless(s, b) else [loss]  # none: zero gradients
            scale = self.e.loss_scale  # 16-mixed: the GradScaler's scale (the owners' optimizer step unscales)
            grads: list[torch.Tensor] | None = None if scale == 1.0 else [torch.full_like(loss, scale)]
        else:
            roots, grads = self._output_grads(op, out)
        into = None if split else self._into(op, targets)
        if split:  # I: the inputs' gradient now, the weights' (per parameter) at W from where I left off
            weights = targets if views is None else views
            res, deferred = input_grads(roots, grads, st.leaves, weights)
        elif into is not None:  # later micro-batches: added into the total during the backward
            res = stage_grads_into(roots, st.leaves, targets, into, grads)
        else:
            res = stage_grads(roots, st.leaves + targets, grads)
        if self.e.finite is not None:
            self.e.finite.backward(s, b, res)
        self._route_input_grads(op, st, res[: len(st.leaves)])
        if not split and into is None:
            self._accumulate(op, targets, res[len(st.leaves) :])
        self.meter.release(st.nbytes)  # x_s^b dies with the job that consumes it
        if not split:
            self.meter.drop_bytes(st.saved)  # and the graph with it
        if split:
            hold = op.weights if op.free_weights else None  # I's copy lives in the graph until W
            self.wstash[(s, b)] = (deferred, weights, hold, st.saved)
            if hold is not None:
                self.weights.pop(hold, None)  # not freed yet: still counted as resident
        elif op.free_weights:
            self.free(op.weights)

    def _output_grads(self, op: JobOp, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stage's differentiable outputs and dL/d of each: the sum, in graph order, of what
        every successor sent back for the part of the output it received."""
        s, b = op.stage, op.microbatch
        edges = self.shapes[b].edges
        if isinstance(out, torch.Tensor):  # the common case: one tensor, one gradient per successor
            g = None
            for c in self.e.space.stage_succs[s]:
                if c in op.recv:
                    gc = edges[(s, c)].sig.unpack_grads(self.comm.wait(op.recv[c]))
                    self.comm.drop(op.recv[c])
                else:
                    gc = self.grads[(s, b)].pop(c)
                if gc:
                    g = gc[0] if g is None else g + gc[0]
            self.grads.pop((s, b), None)
            return ([out], [g]) if g is not None else ([], [])
        flat = pytree.tree_leaves(out)
        total: dict[int, torch.Tensor] = {}
        for c in self.e.space.stage_succs[s]:
            edge = edges[(s, c)]
            if c in op.recv:
                gc = edge.sig.unpack_grads(self.comm.wait(op.recv[c]))
                self.comm.drop(op.recv[c])
            else:
                gc = self.grads[(s, b)].pop(c)
            for k, g in zip(edge.out_index, gc):
                total[k] = g if k not in total else total[k] + g
        self.grads.pop((s, b), None)
        keys = sorted(total)
        return [flat[k] for k in keys], [total[k] for k in keys]

    def weight_grad(self, op: JobOp) -> None:
        deferred, targets, hold, saved = self.wstash.pop((op.stage, op.microbatch))
        if op.weights is not None:
            # cache "step" only: W on the step's copy, counted as a job on fetched weights; the
            # gradient itself comes from I's graph (under "job" the plan sends W no copy at all)
            self.fetch(op)
        wgrads = deferred.weight_grads()
        if self.e.finite is not None:
            self.e.finite.backward(op.stage, op.microbatch, wgrads)
        self._accumulate(op, targets, wgrads)
        self.meter.drop_bytes(saved)  # I's graph, kept for this job, is freed now
        if hold is not None:
            self.meter.free_weights()

    def _route_input_grads(self, op: JobOp, st: _Stash, grads: Sequence[torch.Tensor | None]) -> None:
        s, b = op.stage, op.microbatch
        preds = self.e.space.stage_preds[s]
        if not preds:
            return
        to = {self.msgs[mid].stage: mid for mid in op.send}
        edges = self.shapes[b].edges
        at = 0
        for p, n in zip(preds, st.counts):
            # a differentiable input the stage ignored: its gradient is zero
            gl = [torch.zeros_like(leaf) if g is None else g
                  for g, leaf in zip(grads[at : at + n], st.leaves[at : at + n])]
            at += n
            if p in to:
                self.comm.send(to[p], edges[(p, s)].sig.pack_grads(gl, self.e.device))
            else:
                self.grads[(p, b)][s] = gl

    def _into(self, op: JobOp, targets: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Where a backward adds ``targets``'s gradients in place: the views of the stage's total once
        a micro-batch has started it; None where the job's gradients are needed apart (the first,
        a non-finite check of each job's gradients) or a target has hooks run on accumulation."""
        key = (op.stage, op.owner)
        total = self.acc.get(key)
        if total is None or not targets or (self.e.finite is not None and self.e.finite.grads):
            return None
        if any(has_post_accumulate_hooks(t) for t in targets):
            return None
        if total.dtype != targets[0].dtype:  # mixed precision: a low-precision copy's gradient, added up in fp32
            return None
        return [total.view_as(targets[0])] if len(targets) == 1 else self._views(key, total)

    def _views(self, key: tuple[int, int], total: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of the stage's total ``total`` (made once per total)."""
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = list(self.e.layouts[key[0]].views(total).values())
        return views

    def _accumulate(self, op: JobOp, targets: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        gs = [torch.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]
        key = (op.stage, op.owner)
        layout = self.e.layouts[op.stage]
        total = self.acc.get(key)
        if total is not None:  # add each gradient into its view of the total: no packed copy
            if len(gs) == 1:
                total += gs[0].reshape(-1)
            else:
                foreach_add_(self._views(key, total), gs)
            return
        total = self.e.replicas.buffer(op.stage) if op.owner == self.e.worker else None
        if total is not None:  # a replicated stage: the total lives in its bucket's buffer
            self.e.replicas.fill(op.stage)
        elif op.owner != self.e.worker and self.e.plan.weight_cache == "job":
            # cache "job": a fetched stage's sum lives only until it is delivered (freed, not kept)
            total = torch.empty(layout.numel, dtype=layout.dtype, device=self.e.device)
        else:
            total = self.e.totals.get(key)
            if total is None:
                total = self.e.totals[key] = torch.empty(layout.numel, dtype=layout.dtype, device=self.e.device)
        # written in place into a buffer kept from step to step (a fresh megabyte a step costs a
        # page fault per 4 KiB); the engine's sends of it are done before the next step starts
        layout.pack(gs, out=total)
        self.acc[key] = total

    def absorb(self) -> None:
        """Add the partial sums asked for before this job into their owned stage's total (cache
        ``job``): each sender's copy is freed once delivered, not at the end of the step."""
        if not self.incoming:
            return
        e, w = self.e, self.e.worker
        for mid in self.incoming:
            part = self.comm.wait(mid)
            self.comm.drop(mid)
            s = self.msgs[mid].stage
            total = self.acc.get((s, w))
            if total is None:  # before this worker's own share: the sum starts from this part
                layout = e.layouts[s]
                total = e.totals.get((s, w))
                if total is None:
                    total = e.totals[(s, w)] = torch.empty(layout.numel, dtype=layout.dtype, device=e.device)
                total.copy_(part)
                self.acc[(s, w)] = total
            else:
                total += part
            self.absorbed.add(mid)
        self.incoming = []

    # ---- end of step -------------------------------------------------------------------------
    def reduce(self, prog) -> dict[int, torch.Tensor]:
        """Each owned stage's total gradient: this worker's own sum plus the sums other workers
        sent (they went out during the backward), all-reduced across the stage's replicas."""
        e, comm, w = self.e, self.comm, self.e.worker
        totals: dict[int, torch.Tensor] = {}
        for red in prog.reduces:
            s = red.stage
            if s not in e.owned:
                continue
            if e.watchdog is not None:
                e.watchdog.check()
                e.watchdog.set_job(f"gradient reduction of stage {s} in step {e.steps}")
            total = self.acc.get((s, w))
            if total is None:
                total = e.replicas.buffer(s)
                if total is None:
                    total = torch.zeros(e.layouts[s].numel, dtype=e.layouts[s].dtype, device=e.device)
                elif red.recv_from and e.replicas.fill(s):  # not launched yet: it waits for these sums
                    total.zero_()
            for mid in red.recv_from:
                if mid in self.absorbed:
                    continue
                total += comm.wait(mid)
                comm.drop(mid)
            totals[s] = total
            if red.replicas:
                self.meter.allreduce += 1
        if e.replicas.buckets:
            if e.watchdog is not None:
                e.watchdog.set_job(f"all-reduce of replicated stages in step {e.steps}")
            began = time.perf_counter()
            e.replicas.finish(e.watchdog, comm.clock)
            self.meter.allreduce_span = (began, time.perf_counter())
        return totals
