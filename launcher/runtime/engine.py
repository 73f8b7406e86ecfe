"""The engine: one worker runs its program of a step over ``torch.distributed``.

Usable on its own (plain Python) in any initialized process group, one engine per rank::

    engine = Engine(staged_model, make_schedule("lpp", S, B, G=2, R=2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    record = engine.train_step(microbatches)   # a list of B (input, target) pairs, the same on every rank

A loss that is a mean over a data-dependent count (tokens with a label, rows of unequal
micro-batches) weighs each micro-batch by its share of the step's items, ``items=[n_0, ...]``
(:mod:`.items`; by default the rows of each micro-batch), so the step's loss and gradient are one
device's on the whole batch.

Rank ``w`` of the group is worker ``w`` of the schedule; ranks at or above ``W`` have nothing to
do. Every rank builds every stage, then keeps real weights (and optimizer state) only for the
stages it owns; for every stage it also keeps a skeleton (parameters on the meta device, its own
copy of the buffers) to run fetched copies of the weights (:func:`launcher.torch_support.staged.call_with`, as
``torch.func.functional_call`` does), and, apart, meta-device copies that only tell what each stage
returns (:mod:`launcher.torch_support.values`).

Activations: ``F(s, b)`` stashes its inputs ``x_s^b`` (and, unless it recomputes, the autograd
graph of stage ``s``) from its start to the end of ``B(s, b)`` (or ``I(s, b)``), as the simulator
counts. A forward on fetched weights under ``weight_cache="job"`` frees its copy when it ends, so
its backward fetches again (unless the worker owns the stage) and recomputes the stage's forward
from the stashed input (activation checkpointing, as FSDP does); so does every forward of a stage
in ``recompute`` (its units draw from the job's random streams, :mod:`launcher.torch_support.streams`, or without them
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
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from launcher.schedule.activations import activation_peaks
from launcher.schedule.assembly import TAG_LIMIT
from launcher.schedule.lowering import lower
from launcher.schedule.program import ACT, GRAD, WEIGHTS, Lowered, Msg, forward_only, whole_backwards
from launcher.schedule.rules import StepError, value_error
from launcher.schedule.run_settings import DEFAULT_RUN, TRANSPORTS
from launcher.schedule.settings import DEFAULT
from launcher.schedule.simulate import Schedule, Timeline, simulate

from ..torch_support.checks import ModelError, model_errors
from ..torch_support.init import has_meta, init_units
from ..torch_support.signatures import NoMeta, real_signatures, signatures
from ..torch_support.staged import Batch, OptimizerFactory, StagedModel, as_meta, meta_copy, skeleton
from ..torch_support.streams import kept_generators
from ..torch_support.values import nbytes as value_bytes
from .batches import check_same_batches
from .comm import irecv, isend
from .failure import Watchdog, blocked, current_watchdog
from .grad_totals import GradTotals
from .groups import BUCKET_BYTES, Replicas, warm_pairs
from .items import Count
from .items import shares as item_shares
from .layout import StageLayout
from .measure import HOST, Meter, worker_record
from .saved import GraphCounts, stage_saved_bytes
from .shapes import Shapes, shape_key
from .shared_links import SharedLinks, host_identity, new_token, shared_links_possible
from .stats import RunningStats
from .step_state import run_end, run_program

#: steps between two batch checks (after the first step's): ranks fed different data are almost
#: always so from the start (a loader seeded by rank), and the check is a collective, so it runs on
#: step 1 and then every CHECK_EVERY steps (``Engine(check_batches=1)``: every step)
CHECK_EVERY = 50



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


def frozen_stages(stages: Sequence[torch.nn.Module]) -> frozenset[int]:
    """Stages with no trainable parameter (``requires_grad=False`` throughout, or none at all):
    no weight gradient leaves them, so the program sends them no partial sum and all-reduces nothing."""
    return frozenset(s for s, m in enumerate(stages) if not any(p.requires_grad for p in m.parameters()))


def _lowered(schedule: Schedule | Timeline | Lowered, weight_cache: str, prefetch: int,
             frozen: frozenset[int] = frozenset()) -> Lowered:
    """The engine's program: the schedule lowered (simulated first, if need be) for ``prefetch``,
    without gradient messages for the ``frozen`` stages."""
    found = [e for e in (value_error("prefetch", prefetch), value_error("weight_cache", weight_cache)) if e]
    if found:  # the command line's sentences
        raise StepError(found)
    if isinstance(schedule, Lowered):
        if schedule.prefetch != prefetch:
            raise ValueError(f"the program was lowered for prefetch={schedule.prefetch} but the engine got "
                             f"prefetch={prefetch}; its predicted peak resident weights would not hold")
        lowered_frozen = schedule.timeline.schedule.frozen
        if lowered_frozen != frozen:
            raise ValueError(f"the program was lowered with frozen stages {sorted(lowered_frozen)} but "
                             f"the model's stages {sorted(frozen)} have no trainable parameter; lower the step with "
                             f"frozen={sorted(frozen)}")
        return schedule
    if isinstance(schedule, Timeline):  # the timeline does not depend on what trains, its messages do
        sched = schedule.schedule
        tl = schedule if sched.frozen == frozen else replace(schedule, schedule=replace(sched, frozen=frozen))
    else:
        tl = simulate(schedule if schedule.frozen == frozen else replace(schedule, frozen=frozen))
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
    S = timeline.schedule.space.S
    stages = frozenset(timeline.schedule.recompute if recompute is None else recompute)
    if any(not 0 <= s < S for s in stages):
        raise StepError([f"recompute={sorted(stages)} is invalid: stage "
                         f"{next(s for s in sorted(stages) if not 0 <= s < S)} does not exist with stages={S}."])
    return stages


class Engine:
    """Runs this rank's share of every training step of one schedule."""

    def __init__(
        self,
        model: StagedModel,
        schedule: Schedule | Timeline | Lowered,
        optimizer: OptimizerFactory | None = None,
        *,
        prefetch: int = DEFAULT.prefetch,
        weight_cache: str = DEFAULT.weight_cache,
        group: dist.ProcessGroup | None = None,
        rank: int | None = None,
        device: torch.device | str | None = None,
        watchdog: Watchdog | None = None,
        check_batches: bool | int = True,
        recompute: Iterable[int] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        compute_dtype: torch.dtype | None = None,
        transport: str = DEFAULT_RUN.transport,
    ) -> None:
        # ``transport``: see launcher.schedule.run_settings.Transport (the config's runtime.transport)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is invalid: use one of {', '.join(TRANSPORTS)}")
        self.lowered = _lowered(schedule, weight_cache, prefetch, frozen_stages(model.stages))
        self.timeline = self.lowered.timeline
        space = self.timeline.schedule.space
        _check_model(model, space)
        self.model, self.space, self.prefetch = model, space, prefetch
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        W = self.lowered.workers
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
        # random streams (:mod:`launcher.torch_support.streams`): the seed every job's draws are derived from, with the
        # step and micro-batch; None: each worker draws from its own generator in the order it runs
        self.streams: int | None = None
        self.recompute = _recompute(self.timeline, recompute)
        # shared-memory links first: the replicas' buckets may live in memory they hand over
        self.links, shared = self._links(transport)
        self.replicas = Replicas(self.lowered, self.worker, self.ranks, group, self.layouts, self.device, bucket_bytes,
                                 shared=shared, links=self.links, watchdog=self.watchdog)
        # every gradient sum of this worker, from a job's share to the parameters' .grad
        self.grad_totals = GradTotals(self.worker, self.layouts, self.device, self.owned, self.lowered.owners,
                                      self.replicas, self.lowered.weight_cache)
        if dist.get_backend(group) == "nccl":
            warm_pairs(self.lowered, self.worker, self.ranks, group, self.device)
        if self.materialized:
            self._sync_ties()
        self._sync_replicas()
        # a parameter several owned stages share (tied embeddings) is one parameter of the optimizer
        # frozen parameters (requires_grad=False) get no gradient, so no optimizer state either
        params = list(dict.fromkeys(p for s in self.owned for p in self.modules[s].parameters() if p.requires_grad))
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self._step_state(compute_dtype)

    def _links(self, transport: str) -> tuple[SharedLinks | None, bool]:
        """This worker's shared-memory links (None where messages go over the backend), and whether
        the group's links are shared memory (the same on every rank, a worker or not): then the
        step's activations and gradients between workers, and the replicas' all-reduces, go through
        them (:mod:`.shared_reduce`), and only then."""
        cpu = self.device.type == "cpu" and dist.get_backend(self.group) == "gloo"
        alone = dist.get_world_size(self.group) == 1  # nobody to send to
        if transport == "gloo" or (transport == "auto" and (alone or not (cpu and shared_links_possible()))):
            return None, False
        if not cpu:
            raise ValueError(f"transport=shm moves host memory, but the workers compute on {self.device.type} over "
                             f"{dist.get_backend(self.group)}: use transport=gloo or auto")
        if not shared_links_possible():
            raise ValueError("transport=shm needs Linux (anonymous memory files passed over Unix sockets): "
                             "use transport=gloo or auto")
        # who runs where, and rank 0's name for the group's links: one collective
        found: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(found, (host_identity(), new_token()), group=self.group)
        hosts = {host for host, _ in found}
        if len(hosts) > 1:  # agreed by every rank: each sees the same list
            if transport == "shm":
                raise ValueError(f"transport=shm needs every worker on one host, but they run on {len(hosts)}: "
                                 "use transport=gloo or auto")
            return None, False
        if self.worker is None:  # a rank past the schedule's workers links nothing
            return None, True
        w, owners = self.worker, self.lowered.owners
        # the workers this one exchanges messages with, and those it reduces a replicated stage with
        peers = set(self.lowered.programs[w].pair_order)
        peers |= {o for s in self.lowered.reduce_order if w in owners[s] for o in owners[s]} - {w}
        return SharedLinks(found[0][1], w, peers, self.watchdog), True

    def _place_stages(self, model: StagedModel, space: Any) -> None:
        """The owned stages on the device (materialised if built on the meta device), a skeleton
        for every other one, and the running statistics over both."""
        self.layouts = [StageLayout.of(m) for m in model.stages]
        self.skeletons = [skeleton(m, self.device) for m in model.stages]
        self._metas: list[torch.nn.Module] | None = None  # meta copies, to learn shapes (never computed with)
        self.ties = tied(model.stages)
        self.owned = self.lowered.programs[self.worker].owned if self.worker is not None else []
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
                                   for s in range(space.S)], space.microbatches)

    def _step_state(self, compute_dtype: torch.dtype | None) -> None:
        """What the engine keeps from step to step, and what it derives once from the schedule."""
        space = self.space
        self.steps = 0
        self.step_index = 0  # the global step of the current step (:meth:`compute_step`'s ``step``)
        self.first_microbatch = 0  # the streams' index of this call's micro-batch 0 (:meth:`compute_step`)
        self._traced: dict[str, Any] | None = None  # the last training step's events (:meth:`trace`)
        self.split_backward = "I" in space.kinds  # a split backward: W takes a fetched copy's gradient per parameter
        self._shapes: dict[Any, Shapes] = {}
        self._saved: dict[Any, list[int]] = {}  # input shapes -> bytes each stage's graph saves
        # what the forwards' graphs saved, measured: hooked only for new keys and on check steps
        # (step 1, then every ``check_every`` steps, CHECK_EVERY when the batch check is off)
        self.graph_counts = GraphCounts()
        self.recount = True  # this step counts what the forwards' graphs save (GraphCounts)
        comp, B, SB = self.timeline.compute, space.microbatches, space.S * space.microbatches
        # F(s, b)'s output feeds how many forwards on the same worker
        self.local_succ = [
            sum(1 for c in space.stage_succs[j // B] if comp[c * B + j % B] == comp[j]) for j in range(SB)
        ]
        self._grad_kind = space.K - 1
        # split backward: the (stage, micro-batch) whose I runs as one whole backward, its W doing
        # nothing (program.whole_backwards: an I its W follows at once whose gradient no peer
        # needs before that W ends on the simulated step)
        self.whole = whole_backwards(self.lowered, self.worker) if self.worker is not None else frozenset()
        self._eval_lowered: Lowered | None = None
        # mixed precision (bf16-mixed, 16-mixed): owners keep their weights (fp32 masters) and
        # compute under the caller's autocast; fetched weights, activations and their gradients
        # cross in this dtype; weight-gradient sums and all-reduces stay in the weights' dtype.
        # None: everything crosses in its own dtype.
        self.compute_dtype = compute_dtype
        self.loss_scale = 1.0  # 16-mixed: the GradScaler's scale, applied to every loss's backward
        self.finite: Any = None  # nonfinite: a launcher.runtime.nonfinite.Finite marking each job's values
        self._meter = Meter()  # the current (or last) training step's meter
        self._trainable: dict[int, list[torch.Tensor]] = {}  # owned stage -> its trainable parameters

    # ---- shapes ------------------------------------------------------------------------------
    def shapes(self, microbatches: Sequence[Batch]) -> list[Shapes]:
        """What every stage returns and every edge carries, per micro-batch: meta-device copies of
        the stages run once per distinct input shape."""
        keys = [shape_key(mb[0]) for mb in microbatches]
        for k, mb in zip(keys, microbatches):
            if k not in self._shapes:
                if self._metas is None:
                    self._metas = [meta_copy(m) for m in self.model.stages]
                try:
                    sigs = signatures(self.model, [as_meta(mb[0])], self._metas)[0]
                except NoMeta:  # a stage reads values (or lacks a meta kernel): one real forward
                    sigs = real_signatures(self.model, mb[0])
                self._shapes[k] = Shapes(self.model, sigs, [sg.meta() for sg in sigs], self.compute_dtype)
        return [self._shapes[k] for k in keys]

    def sizes(self, microbatches: Sequence[Batch]) -> tuple[list[int], list[list[int]], list[int]]:
        """Bytes of every planned message, of every stage input ``x_s^b`` (per micro-batch) and of
        every stage's parameters, for these micro-batches' shapes: what crosses, as packed (a weight
        gradient sum: the stage's trainable parameters only, :meth:`grad_sizes`)."""
        shapes, space = self.shapes(microbatches), self.space
        params = [L.numel * torch.empty((), dtype=L.dtype).element_size() for L in self.layouts]
        grads = self.grad_sizes()

        def size(m: Msg) -> int:
            if m.kind == ACT:
                return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.nbytes()
            if m.kind == GRAD:
                return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.grad_nbytes()
            if m.kind == WEIGHTS:
                return self.layouts[m.stage].numel * torch.empty((), dtype=self.wire_dtype(m.stage)).element_size()
            return grads[m.stage]

        act = [[shapes[b].input_bytes(s, space.stage_preds[s]) if space.stage_preds[s]
                else value_bytes(microbatches[b][0]) for b in range(space.microbatches)] for s in range(space.S)]
        return [size(m) for m in self.lowered.messages], act, params

    def grad_sizes(self) -> list[int]:
        """Bytes of every stage's gradient: its trainable parameters' (a frozen one has none), in
        the weights' dtype, as gradient sums and replica all-reduces carry it."""
        return [L.grad_numel * torch.empty((), dtype=L.dtype).element_size() for L in self.layouts]

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
            k = shape_key(mb[0])
            if k not in self._saved:
                self._saved[k] = stage_saved_bytes(self.model, mb[0], mb[1], self._metas, self.device)
            per_key[k] = self._saved[k]
        by_b = [per_key[shape_key(mb[0])] for mb in microbatches]
        return [[by_b[b][s] for b in range(self.space.microbatches)] for s in range(self.space.S)]

    def recomputed(self) -> list[bool]:
        """Per forward job ``s * B + b``: whether it keeps only its input (its stage recomputes,
        or it frees its fetched copy under ``weight_cache="job"``), as the programs run it."""
        B = self.space.microbatches
        out = [False] * (self.space.S * B)
        for prog in self.lowered.programs:
            for op in prog.jobs:
                if op.kind == "F":
                    out[op.stage * B + op.microbatch] = op.free_weights or op.stage in self.recompute
        return out

    def activation_peaks(self, microbatches: Sequence[Batch]) -> list[float]:
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
                     step: int | None = None, first_microbatch: int = 0, stand_ins: int = 0) -> dict[str, Any]:
        """Every job of one step and the gradient reduction, without the optimizer step: each
        owned stage's total gradient is left in :attr:`last_grads` (see :meth:`install_grads`).
        ``items``: how many items each micro-batch's loss averages over (numbers or 0-d tensors,
        the same on every rank); micro-batch ``b``'s loss weighs ``items[b] / sum(items)``
        (:mod:`.items`). None: the rows of each micro-batch's input (equal rows: ``1 / B``).
        ``step``: the global step the random streams draw for (default: this engine's count of
        steps from 0; a resumed run passes its own). ``first_microbatch``: the random streams' index
        of micro-batch 0, when one optimizer step spans several calls (gradient accumulation over
        batches: the ``j``-th batch of a step passes ``j * B``, so no two batches draw alike).
        ``stand_ins``: the last micro-batches only fill the schedule (a batch of fewer samples than
        ``B``): they must count 0 items, and add nothing to BatchNorm's running statistics either."""
        self.steps += 1
        self.step_index = self.steps - 1 if step is None else int(step)
        self.first_microbatch = int(first_microbatch)
        if self.finite is not None:
            self.finite.begin()
        B = self.space.microbatches
        if len(microbatches) != B:
            raise ValueError(f"the schedule has B={B} micro-batches but train_step got {len(microbatches)}")
        shares = item_shares(microbatches, items)
        if self.check_every and (self.steps == 1 or self.steps % self.check_every == 0):  # every rank takes part
            check_same_batches(microbatches, self.group, self.device, self.watchdog, self.steps)
        self.recount = self.steps == 1 or self.steps % (self.check_every or CHECK_EVERY) == 0
        if self.worker is None:
            self.stats.begin(B - stand_ins)  # idle ranks add nothing to the statistics' all-reduce, but take part
            self.stats.end(self.group, self.device, dist.get_world_size(self.group))
            return {}
        w, lowered = self.worker, self.lowered
        meter = Meter(spans=[])  # every training step is traced; only the last one's events are kept
        self.grad_totals.begin()
        self.stats.begin(B - stand_ins)
        for mine, copy in self._mirrored:  # the engine's copies train as the user's modules do, submodule
            if copy.training != mine.training:  # by submodule (a frozen part in eval mode stays so)
                copy.training = mine.training
        with kept_generators(self.device) if self.streams is not None else contextlib.nullcontext():
            self._meter = meter  # its losses, for loss_share (called at the end of the step)
            st = run_program(self, lowered, microbatches, meter, train=True, shares=shares)
        t, cpu = time.perf_counter(), time.process_time()
        sums = self.grad_totals
        run_end(self, lowered, st)
        sums.finish(st.comm, meter, self.watchdog, self.steps)
        st.comm.finish()
        sums.sum_tied(self.ties, self.space.S, self.ranks, self.group, self.watchdog)
        if self.finite is not None:  # each owned stage's gradient, summed, before any optimizer step
            self.finite.reduced(sums.last)
        self.stats.end(self.group, self.device, dist.get_world_size(self.group))
        for mid in list(st.weights):
            st.free(mid)
        if self.watchdog is not None:
            self.watchdog.set_job("")
        end = time.perf_counter()
        now_cpu = time.process_time()  # one reading: it sums every thread's CPU (see step_state._run_jobs)
        meter.end_s, meter.end_cpu_s = end - t, now_cpu - cpu
        meter.step_s, meter.cpu_s = end - meter.t0, now_cpu - meter.cpu0
        self._traced = {"step": self.steps, "start": meter.t0, "end": end, "sync": (t, end), "meter": meter,
                        "waits": st.comm.waits, "sends": st.comm.handed}
        return worker_record(w, lowered.predicted, meter, st.comm, len(self.owned), self.steps, self.device.type,
                             self.replicas.shared)

    def trainable(self, s: int) -> list[torch.Tensor]:
        """Owned stage ``s``'s trainable parameters in its gradient's order, looked up once (a walk
        over the stage's modules costs tens of microseconds a job): the parameters the optimizer
        steps, which the engine never replaces."""
        params = self._trainable.get(s)
        if params is None:
            params = self._trainable[s] = self.layouts[s].ordered(self.modules[s], trainable_only=True)
        return params

    def after_reduce_launched(self, fn: Callable[[], None] | None) -> None:
        """Call ``fn`` on this worker's compute thread at the end of every training step, once
        every collective of its replicated stages' gradients is launched and before it waits for
        them, so that a small collective ``fn`` launches there (the step's loss and non-finite
        flag, :meth:`~launcher.lightning.strategy.UnifiedStrategy.training_step`) overlaps the
        gradient's. Under gloo, after the small buckets' rounds through a root, and through shared
        memory after every bucket is reduced (:mod:`.shared_reduce`): a collective in flight while
        ranks wait for each other could keep a failed rank's group from closing (a recovery would
        hang, :meth:`~launcher.runtime.groups.Replicas.finish`). Only on a worker that owns replicated
        stages (it has such collectives); None: nothing."""
        self.replicas.on_launched = fn

    def loss_share(self) -> torch.Tensor:
        """This worker's share of the current step's loss so far (its loss jobs' losses, added in
        job order in float64: the bits of the record's ``loss``), on the device, with no read back."""
        return self._meter.loss_tensor(self.device)

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
        msgs, meter = self.lowered.messages, t["meter"]
        waits = []
        for mid, began, ended, nbytes in t["waits"] or ():
            m = msgs[mid]
            waits.append([m.kind, m.src, nbytes, m.stage, m.microbatch, began, ended, mid])
        return {"worker": self.worker, "host": HOST, "step": t["step"], "start": t["start"], "end": t["end"],
                "sync": list(t["sync"]), "allreduce": list(meter.allreduce_span) if meter.allreduce_span else None,
                "jobs": [[j[0], j[1], j[2], a, b, j[3]] for j, (a, b) in zip(meter.jobs, meter.spans or ())],
                "waits": waits, "sends": [[mid, msgs[mid].kind, nbytes, at] for mid, at, nbytes in t["sends"] or ()]}

    def install_grads(self, scale: float = 1.0, accumulate: bool = False) -> None:
        """Point every owned trainable parameter's ``.grad`` at its slice of the step's reduced
        gradient (a frozen one keeps ``None``, as on one device).

        ``scale`` multiplies it (``1/k`` for one optimizer step over ``k`` batches, as Lightning
        divides each batch's loss by ``k``); ``accumulate`` adds it into the ``.grad`` an earlier
        call of the same optimizer step installed. Either makes ``.grad`` a tensor of its own: the
        totals' buffers are the next step's."""
        self.grad_totals.install(self.modules, scale, accumulate)

    def grad_views(self, s: int) -> dict[int, torch.Tensor]:
        """Owned stage ``s``'s trainable parameters' slices of the last step's reduced gradient, by
        the parameter's ``id`` (a frozen one has none): what :meth:`install_grads` makes their ``.grad``."""
        return self.grad_totals.grad_views(s, self.modules)

    @property
    def last_grads(self) -> dict[int, torch.Tensor]:
        """Owned stage -> its reduced flat gradient of the last step (valid until the next starts)."""
        return self.grad_totals.last

    def evaluate(self, microbatches: Sequence[Batch],
                 items: Sequence[Count] | None = None) -> tuple[float, dict[int, torch.Tensor]]:
        """A forward-only pass of the step's schedule (no gradients, no optimizer): every forward
        job where the training step runs it, with the same activation and weight messages.

        Returns this worker's share of the loss (the sum of its micro-batches' losses, each
        weighted as :meth:`compute_step` weighs it by ``items``; summed over workers it is the
        batch loss) and the loss stages' outputs it computed, by micro-batch."""
        if self.worker is None:
            return 0.0, {}
        if len(microbatches) != self.space.microbatches:
            raise ValueError(f"the schedule has B={self.space.microbatches} micro-batches but evaluate got "
                             f"{len(microbatches)}")
        shares = item_shares(microbatches, items)
        if self._eval_lowered is None:
            self._eval_lowered = forward_only(self.lowered)
        meter = Meter()
        modes = [(m, m.training) for top in (*self.stages, *self.skeletons) for m in top.modules()]
        for m in (*self.stages, *self.skeletons):
            m.eval()
        try:
            with torch.no_grad():
                st = run_program(self, self._eval_lowered, microbatches, meter, train=False, shares=shares)
                run_end(self, self._eval_lowered, st)
                st.comm.finish()
                for mid in list(st.weights):
                    st.free(mid)
        finally:
            for m, mode in modes:  # each submodule as it was (``train(mode)`` would set them all alike)
                m.training = mode
        if self.watchdog is not None:
            self.watchdog.set_job("")
        return meter.loss, st.predictions

    # ---- state -------------------------------------------------------------------------------
    def _materialize(self) -> bool:
        """Owned stages built on the meta device get storage and their initial values here, by
        the model's rule (:mod:`launcher.torch_support.init`: the same values single-device training starts from); no
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
        w, owners, works, into = self.worker, self.lowered.owners, [], []
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
        w, tag0 = self.worker, self.lowered.tag_base + self.space.S  # after the step's and gather_state's tags
        works, into = [], []
        for s, owners in enumerate(self.lowered.owners):
            if len(owners) < 2 or w not in owners:
                continue
            root, L = owners[0], self.layouts[s]
            if w == root:
                flat = L.pack_module(self.modules[s])
                works += [isend(flat, self.ranks[o], group=self.group, tag=tag0 + s) for o in owners[1:]]
            else:
                flat = torch.empty(L.numel, dtype=L.dtype, device=self.device)
                works.append(irecv(flat, self.ranks[root], group=self.group, tag=tag0 + s))
                into += list(zip(L.ordered(self.modules[s]), L.views(flat).values()))
        self._receive_into(works, into)

    def _receive_into(self, works: list[Any], into: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Wait for an exchange's sends and receives, then copy each received value into its
        parameter: the one ending of every weight exchange at set-up (ties, replicas)."""
        with blocked(self.watchdog):
            for work in works:
                work.wait()
        with torch.no_grad():
            for param, value in into:
                param.copy_(value)

    def gather_state(self, dst: int = 0) -> list[dict[str, torch.Tensor]] | None:
        """Every stage's parameters at worker ``dst`` (each from its lowest-ranked owner); None elsewhere."""
        out: list[dict[str, torch.Tensor]] = []
        tag0 = self.lowered.tag_base  # after the step's message tags
        for s in range(self.space.S):
            root = self.lowered.owners[s][0]
            L = self.layouts[s]
            if self.worker == root:
                flat = L.pack_module(self.modules[s])
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
