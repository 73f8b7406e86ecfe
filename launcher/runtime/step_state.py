"""One step of one worker: what it holds while the step runs (:class:`StepState`), its forward jobs,
the one place a message of the step starts (:meth:`StepState.send`), and the loops that run its
program's operations as printed (:func:`run_program`, then :func:`run_end` for the end of the step).
The backward jobs are :mod:`.backward`'s; the gradient sums :class:`~launcher.runtime.grad_totals.GradTotals`'."""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

import torch

from launcher.schedule.actions import AFTER, FREE_WGRAD, JOBS, RECV_WGRAD, REDUCE, SEND_WEIGHTS, SEND_WGRAD, SENDS
from launcher.schedule.program import ACT, GRAD, WEIGHTS, JobOp, Lowered, Msg, Program

from ..torch_support.staged import Batch, run_stage
from ..torch_support.streams import job as stream_job
from ..torch_support.torch_private import pytree
from ..torch_support.values import detach_inputs, pick, to_device
from ..torch_support.values import nbytes as value_bytes
from .backward import Stash, backward, rng_state, weight_grad
from .comm import Comm
from .measure import Meter
from .saved import tensors as saved_tensors
from .shapes import Shapes, leaves_key

if TYPE_CHECKING:
    from .engine import Engine
    from .grad_totals import GradTotals

#: steps whose messages are timed (what a message takes, :class:`~launcher.runtime.comm.Clock`):
#: enough for a profile, and a long run's records do not grow with every message of every step
TIMED_STEPS = 64


def _detached(value: Any) -> Any:
    """``value`` with each tensor detached from its graph."""
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


class StepState:
    """Everything a worker holds during one step."""

    def __init__(self, engine: Engine, comm: Comm, meter: Meter, totals: GradTotals, microbatches: Sequence[Batch],
                 shapes: list[Shapes], train: bool = True, shares: list[float] | None = None) -> None:
        self.engine, self.comm, self.meter, self.mb, self.train = engine, comm, meter, microbatches, train
        self.totals = totals  # the worker's gradient sums (the backward jobs add into them)
        self.shares = shares  # micro-batch -> its weight in the step's loss (None: 1 / B each)
        self.shapes = shapes
        self.predictions: dict[int, Any] = {}  # evaluation: micro-batch -> loss stage output
        self.msgs = engine.lowered.messages
        self.outs: dict[tuple[int, int], list] = {}  # (s, b) -> [output, local forwards still to read it]
        # (p, b) -> {c: dL/d(the differentiable leaves of what p sent c)}
        self.grads: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = defaultdict(dict)
        self.stash: dict[tuple[int, int], Stash] = {}
        self.ys: dict[int, Any] = {}  # micro-batch -> its target on the device (loss stages)
        self.wstash: dict[tuple[int, int], tuple] = {}  # split backward: I's graph kept for W
        # weights message -> (fetched flat copy, the leaf its gradient is taken against: the copy
        # itself, its trainable prefix, or None when nothing of the stage trains)
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.static_keys: dict[tuple[int, bool], tuple] = {}  # (stage, own weights) -> its forwards' fixed key part
        # an act/grad message's data, packed by its job until its send (by the message's kind, edge
        # and micro-batch: what a SEND_ACT/SEND_GRAD operation names)
        self.outbox: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self.packed: dict[int, torch.Tensor] = {}  # owned stage -> its weights packed for sending, once a step

    # ---- weights -----------------------------------------------------------------------------
    def fetch(self, op: JobOp) -> tuple[torch.nn.Module, dict | None, list[torch.Tensor]]:
        """Module, parameter override and gradient targets for ``op``'s stage: its trainable
        parameters, or a fetched copy's trainable prefix (a leaf of its own; the frozen rest of
        the copy is computed with, never differentiated)."""
        s = op.stage
        if op.weights_mid is None:
            mod = self.engine.modules[s]
            return mod, None, self.engine.trainable(s)
        mid = op.weights_mid
        L = self.engine.layouts[s]
        if mid not in self.weights:
            flat = self.comm.wait(mid)
            self.comm.drop(mid)
            # the leaf autograd differentiates: the whole copy when nothing of the stage is frozen
            if not L.frozen:
                grad: torch.Tensor | None = flat.requires_grad_(True)
            else:
                grad = flat[: L.grad_numel].detach().requires_grad_(True) if L.trainable else None
            self.weights[mid] = (flat, grad)
        flat, grad = self.weights[mid]
        self.meter.fetched_jobs += 1
        self.meter.fetched_stages.add(s)
        if grad is flat:
            return self.engine.skeletons[s], L.views(flat), [flat]
        return self.engine.skeletons[s], L.views(flat, grad), [] if grad is None else [grad]

    def free(self, mid: int | None) -> None:
        if mid is not None and self.weights.pop(mid, None) is not None:
            self.meter.free_weights()

    # ---- jobs --------------------------------------------------------------------------------
    def run(self, op: JobOp) -> None:
        if op.kind == "F":
            self.forward(op)
        elif op.kind in ("B", "I"):  # an I in Engine.whole runs the whole backward (program.whole_backwards)
            backward(self, op, split_backward=op.kind == "I" and (op.stage, op.microbatch) not in self.engine.whole)
        else:
            weight_grad(self, op)

    def _inputs(self, op: JobOp) -> tuple[list[Any], list[torch.Tensor], list[int]]:
        """The values stage ``s`` is called with, their differentiable leaves (each a leaf of its
        own, so the stage's backward stops at its inputs) and how many came from each predecessor."""
        s, b = op.stage, op.microbatch
        preds = self.engine.space.stage_preds[s]
        device = self.engine.device
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
                v = pick(entry[0], self.engine.model.edge(p, s))
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
        """What each consumer stage on another worker receives, packed for its ``SEND_ACT``."""
        s, b = op.stage, op.microbatch
        e = self.engine
        comp, B = e.timeline.compute, e.space.microbatches
        for c in e.space.stage_succs[s]:
            if comp[c * B + b] != comp[s * B + b]:  # F(c, b) elsewhere: a message carries the edge
                edge = self.shapes[b].edges[(s, c)]
                self.outbox[(ACT, s, b, c)] = edge.sig.pack(pick(out, e.model.edge(s, c)), e.device)

    # ---- sends -------------------------------------------------------------------------------
    def send(self, kind: str, mid: int) -> None:
        """Hand message ``mid`` over to the communication (a send of the program, ``kind``): the one
        place a message of the step starts. Its data: a job's output or input gradient, packed by
        the job (``SEND_ACT``, ``SEND_GRAD``); the owner's copy of a stage, packed once a step and
        sent to every worker that fetches it (``SEND_WEIGHTS``); this worker's sum of a stage's
        weight gradient for its owner (``SEND_WGRAD``; cache ``job``: the send holds the sum and
        frees it once delivered)."""
        if kind == SEND_WEIGHTS:
            engine, s = self.engine, self.msgs[mid].stage
            data = self.packed.get(s)
            if data is None:  # mixed precision: cast once, sent to all
                data = self.packed[s] = engine.layouts[s].pack_module(engine.modules[s]).to(engine.wire_dtype(s))
        elif kind == SEND_WGRAD:
            data = self.totals.take(self.msgs[mid].stage, self.msgs[mid].dst)
        else:
            m = self.msgs[mid]
            data = self.outbox.pop((m.kind, m.stage, m.microbatch, m.peer_stage))
        self.comm.send(mid, data)

    def loss(self, op: JobOp, out: Any) -> torch.Tensor | None:
        """A loss stage's share of the step's loss: its loss over ``B``, or weighted by the
        micro-batch's share of the step's items (:mod:`.items`); a micro-batch with no item adds
        a constant zero (its mean over nothing is left out, and its backward gives no gradient)."""
        if not self.engine.space.is_sink[op.stage]:
            return None
        loss = self.engine.model.loss(out, self._target(op.microbatch))
        if self.shares is None:
            return loss / self.engine.space.microbatches
        share = self.shares[op.microbatch]
        if share == 0:
            return torch.zeros((), dtype=loss.dtype, device=loss.device)
        return loss * share

    def in_streams(self, b: int) -> Any:
        """A training job's forward on micro-batch ``b``: its units draw from their streams."""
        e = self.engine
        if e.streams is None or not self.train:
            return contextlib.nullcontext()
        return stream_job(e.streams, e.step_index, e.first_microbatch + b, e.device)

    def weightless(self, s: int, b: int) -> bool:
        """Whether stage ``s`` is a loss stage and micro-batch ``b`` has no item to average over."""
        return self.shares is not None and self.shares[b] == 0 and self.engine.space.is_sink[s]

    def _target(self, b: int) -> Any:
        """Micro-batch ``b``'s target on the device, moved once (the forward and a recomputing
        backward share it, and the graph's count can leave it out: it is data, not activation)."""
        y = self.ys.get(b)
        if y is None:
            y, device = self.mb[b][1], self.engine.device
            y = self.ys[b] = y.to(device) if isinstance(y, torch.Tensor) else to_device(y, device)
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
        recompute = op.free_weights or s in self.engine.recompute
        stats = self.engine.stats
        stats.before(s, b, mod)
        # without streams, a recomputing backward replays the state this forward started from
        rng = rng_state(self.engine.device) if recompute and self.engine.streams is None else None
        with torch.set_grad_enabled(not recompute), self.in_streams(b), \
                self.counting(recompute, op, mod, targets, values, False) as graph:
            out = run_stage(mod, params, values)
            loss = self.loss(op, out)
        stats.after(s, b, mod)
        saved = graph.nbytes if graph is not None else 0
        self.meter.hold_bytes(saved)  # the graph lives until the backward that frees it
        if loss is not None:
            self.meter.add_loss(loss)
        if self.engine.finite is not None:  # a weightless loss stage's output may be its (NaN) mean over nothing
            self.engine.finite.forward(s, b, None if self.weightless(s, b) else out, loss)
        # a recomputing backward fetches the weights again: keeping ``targets`` (a fetched copy)
        # here would hold every fetched stage's weights until its backward
        views = (list(params.values())[: self.engine.layouts[s].trainable] if params is not None and not recompute
                 and self.engine.split_backward else None)
        self.stash[(s, b)] = Stash(values, leaves, counts, None if recompute else out, None if recompute else loss,
                                    [] if recompute else targets, nbytes, saved, rng, views)
        n = self.engine.local_succ[s * self.engine.space.microbatches + b]
        if n:
            self.outs[(s, b)] = [out.detach() if isinstance(out, torch.Tensor) else _detached(out), n]
        self._send_output(op, out)
        if op.free_weights:
            self.free(op.weights_mid)

    def counting(self, off: bool, op: JobOp, mod: torch.nn.Module, targets: list[torch.Tensor],
                  values: list[Any], recomputing: bool) -> Any:
        """Counts what a forward's graph saves (:class:`~launcher.runtime.saved.SavedBytes`),
        except the stage's weights, buffers, inputs and (loss stage) target; nothing when ``off``.
        A forward whose key was counted before (and agreed) reuses that count without hooks, except
        on check steps (:class:`~launcher.runtime.saved.GraphCounts`): equal shapes save equal bytes."""
        if off:
            return contextlib.nullcontext()
        sink = self.engine.space.is_sink[op.stage]

        def skip() -> list[torch.Tensor]:
            y = saved_tensors(self._target(op.microbatch)) if sink else []
            return [*targets, *mod.buffers(), *saved_tensors(values), *y]

        return self.engine.graph_counts.counter(self._graph_key(op, mod, targets, values, sink, recomputing),
                                           self.engine.recount, skip)

    def _graph_key(self, op: JobOp, mod: torch.nn.Module, targets: list[torch.Tensor], values: list[Any],
                   sink: bool, recomputing: bool) -> Any:
        """What decides the storages a forward's graph saves: the stage, its inputs' and target's
        shapes, dtypes and ``requires_grad``, its weights' (owned or fetched), training and grad
        mode, autocast; None (always counted) when an input's constant cannot be hashed."""
        try:
            fixed = self.static_keys.get((op.stage, op.weights_mid is None))
            if fixed is None:  # training mode, autocast and the weights' requires_grad hold for the step
                dev = self.engine.device.type
                fixed = self.static_keys[(op.stage, op.weights_mid is None)] = (
                    mod.training, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev),
                    tuple(t.requires_grad for t in targets))
            key = (op.stage, recomputing, op.weights_mid is None, torch.is_grad_enabled(), fixed, leaves_key(values),
                   leaves_key([self._target(op.microbatch)]) if sink else None)
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
        loss = self.loss(op, out)
        if loss is not None:
            self.meter.add_loss(loss)
            self.predictions[b] = out
        n = self.engine.local_succ[s * self.engine.space.microbatches + b]
        if n:
            self.outs[(s, b)] = [out, n]
        self._send_output(op, out)
        if op.free_weights:
            self.free(op.weights_mid)


def run_program(engine: Engine, lowered: Lowered, microbatches: Sequence[Batch], meter: Meter, train: bool,
                shares: list[float] | None = None) -> StepState:
    """Run ``engine``'s worker's program of ``lowered`` up to its end of step: its operations in
    order, as printed (:mod:`launcher.schedule.actions`); ``shares``: each micro-batch's weight in
    the loss (None: ``1 / B`` each). What follows the last job's own operations (:attr:`Program.tail`)
    is :func:`run_end`'s."""
    w = engine.worker
    assert w is not None  # ranks past the schedule's workers run no program
    prog = lowered.programs[w]
    shapes = engine.shapes(microbatches)
    comm = Comm(lowered, w, functools.partial(_spec, engine, shapes), engine.device, engine.watchdog, engine.group,
                engine.ranks, on_alloc=lambda m: meter.hold_weights() if m.kind == WEIGHTS else None,
                timed=train and engine.steps <= TIMED_STEPS, traced=meter.spans is not None, links=engine.links)
    engine.replicas.timed_by(comm.clock)  # the rounds through shared memory, as the exchange's rounds
    st = StepState(engine, comm, meter, engine.grad_totals, microbatches, shapes, train, shares)
    try:
        _run_ops(engine, lowered, prog, st)
    finally:
        st.totals.unbind()
    return st


def run_end(engine: Engine, lowered: Lowered, st: StepState) -> None:
    """The end of the step's operations of the worker's program, one by one as printed: an owner's
    last hand-overs (``SEND_WEIGHTS``), each partial sum taken in (``RECV_WGRAD``: waited for and
    added into its stage's total), each replicated stage's share complete (``REDUCE``: its bucket
    may start). Waiting for the all-reduces is :meth:`GradTotals.finish`'s, after the last action."""
    assert engine.worker is not None  # ranks past the schedule's workers run no program
    prog = lowered.programs[engine.worker]
    totals, watchdog = st.totals, engine.watchdog
    done = len(prog.jobs)  # every job is done
    for kind, arg in prog.ops[prog.tail :]:
        if kind == SEND_WEIGHTS:
            st.send(kind, arg)
        elif not st.train:  # evaluation takes in no gradient
            continue
        elif kind == RECV_WGRAD:
            if watchdog is not None:
                watchdog.check()
                watchdog.set_job(f"gradient reduction of stage {st.msgs[arg].stage} in step {engine.steps}")
            totals.take_in(arg, st.comm, st.msgs)
        elif kind == REDUCE:
            totals.share_complete(done, st.meter)


def _run_ops(engine: Engine, lowered: Lowered, prog: Program, st: StepState) -> None:
    """The worker's operations of ``prog`` up to its end of step, in order, each job timed with
    its own operations."""
    comm, meter = st.comm, st.meter
    what = "step" if st.train else "evaluation step"
    clock, thread_clock = time.perf_counter, time.thread_time
    # a job's time runs from the end of the one before (the engine's own work for it included) to
    # its end: one reading of the wall and the thread's CPU clock per job. The process's CPU clock
    # sums every thread's: it is read twice a step, not per job (on a loaded 2-core VM one reading
    # cost 0.25 to 0.35 ms, 3 to 4 ms of a 28 ms ddp step; docs/performance.md, "Collectives per
    # step"), and the communication threads' share is spread over the jobs by their wall time
    first, walls = len(meter.jobs), []
    cpu0 = time.process_time()
    t, mine = clock(), thread_clock()
    mine0 = mine
    op: JobOp | None = None  # the job whose own operations (AFTER kinds) run now
    i = -1  # the job the operations run after
    waited = comm.waited

    def close() -> None:
        """The job's own operations are done: add in the partial sums posted before it, time it."""
        nonlocal t, mine, op
        assert op is not None
        st.totals.absorb(comm, lowered.messages)
        # work: what it spent blocked on a peer's data is idle time, not work; cpu: the
        # process's CPU meanwhile (its communication threads' too), what it asks of a core;
        # and the compute thread's own share of it
        end, end_mine = clock(), thread_clock()
        meter.jobs.append([op.stage, op.microbatch, op.kind, end - t - (comm.waited - waited), 0.0, end_mine - mine])
        walls.append(end - t)
        if meter.spans is not None:
            meter.spans.append((t, end))
        t, mine, op = end, end_mine, None

    for kind, arg in prog.ops[: prog.tail]:
        if op is not None and kind not in _AFTER:
            close()
            waited = comm.waited
        if kind in JOBS:
            i, op = arg, prog.jobs[arg]
            if engine.watchdog is not None:
                engine.watchdog.check()
                engine.watchdog.set_job(f"{op.kind}({op.stage},{op.microbatch}) of {what} {engine.steps}")
            st.run(op)
        elif kind in SENDS:
            st.send(kind, arg)
        elif kind == REDUCE:
            if st.train:  # buckets of replicated stages whose share is complete start their all-reduce
                st.totals.share_complete(i, meter)
        elif kind == FREE_WGRAD:  # a sum sent earlier, received by now: free it
            comm.deliver(arg)
        else:  # a receive posted ahead of the job that needs it
            comm.want(arg)
            if kind == RECV_WGRAD:  # a partial sum, added in once the next job is done
                st.totals.incoming.append(arg)
    if op is not None:
        close()
    others = max(0.0, time.process_time() - cpu0 - (mine - mine0))  # the other threads' CPU meanwhile
    total = sum(walls) or 1.0
    for job, wall in zip(meter.jobs[first:], walls):
        job[4] = job[5] + others * wall / total


_AFTER = frozenset(AFTER)


def _spec(engine: Engine, shapes: list[Shapes], m: Msg) -> tuple:
    """The shape and dtype of message ``m``'s buffer, for these micro-batches' shapes."""
    if m.kind == ACT:
        return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.spec()
    if m.kind == GRAD:
        return shapes[m.microbatch].edges[(m.stage, m.peer_stage)].sig.grad_spec()
    L = engine.layouts[m.stage]
    if m.kind == WEIGHTS:
        return (L.numel,), engine.wire_dtype(m.stage)
    return (L.grad_numel,), L.dtype  # a weight-gradient sum: the trainable prefix
