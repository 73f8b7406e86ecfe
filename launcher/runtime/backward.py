"""The backward: a stage's gradients through autograd, whole (``B``) or split into the inputs'
now (``I``) and the weights' later (``W``), and a worker's backward jobs.

- :func:`stage_grads` and :func:`stage_grads_into` call the autograd engine once per job;
- :func:`input_grads` and :class:`Deferred` split it: ``I`` then ``W``;
- :func:`backward` and :func:`weight_grad` are those jobs as a worker's step runs them
  (:class:`~launcher.runtime.step_state.StepState`): the output's gradient from the successors,
  the inputs' sent back, the weights' added into the stage's total
  (:meth:`~launcher.runtime.grad_totals.GradTotals.accumulate`).

The split backward: ``I`` takes the gradient of a stage's inputs, ``W`` its weights' later,
without ``W`` going over the part of the graph ``I`` already went over.

Taking the weight gradient from the stage's outputs again would redo most of the backward (every
operation between the outputs and a weight lies on the input side too): ``I`` and ``W`` together
cost about one and a half backwards. Instead ``I`` notes, for each weight, where its branch of the
autograd graph leaves the input side (its *junctions*: a linear layer's ``AddmmBackward``, a layer
norm's backward), and records the gradient that reaches each junction while it runs (a node
pre-hook). ``W`` then starts at the junctions with those gradients and goes down the weight
branches only: the junction node computes just the outputs that lead to a weight (autograd asks
each node only for what the requested inputs need). Together they cost about one backward.

Weights whose junctions are shared (a weight used twice, or a fetched flat copy's views) are taken
in one call; a junction that lies below another in the same call keeps the gradient ``I`` recorded
for it, so nothing is counted twice. Where the analysis does not apply (no differentiable input,
an output that is itself a leaf, a weight reachable from an output without passing the input
side), ``W`` takes the gradient from the outputs as before: always correct, only slower.

The same idea as ``torch.distributed.pipelining``'s ``stage_backward_input`` and
``stage_backward_weight``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from launcher.schedule.program import GRAD, JobOp

from ..torch_support.staged import run_stage
from ..torch_support.torch_private import autograd_run_backward, pytree

if TYPE_CHECKING:
    from .step_state import StepState


# ---- autograd, once per job ---------------------------------------------------------------------


# what torch.autograd.grad calls after its argument checks (about 40 us a call on this CPU); None: a
# torch without the engine handle, which takes the public call
_run_backward = autograd_run_backward()


def _seeds(roots: Sequence[torch.Tensor | GradientEdge],
           grads: Sequence[torch.Tensor] | None) -> Sequence[torch.Tensor]:
    """The gradients a backward starts from: ``grads``, or 1 for a single scalar loss."""
    if grads is not None:
        return grads
    if not isinstance(roots[0], torch.Tensor) or roots[0].numel() != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    return (torch.ones_like(roots[0]),)


def stage_grads(roots: Sequence[torch.Tensor | GradientEdge], wrt: Sequence[torch.Tensor | GradientEdge],
                grads: Sequence[torch.Tensor] | None, retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, wrt, grads, retain_graph=..., allow_unused=True)``.

    Called once per backward job, so it goes straight to the autograd engine: the public call's
    argument checks cost as much as a small stage's whole backward. ``grads=None`` means ``roots``
    is one scalar loss tensor (gradient 1). Roots and ``wrt`` may be graph edges, as for
    ``torch.autograd.grad``."""
    if not wrt:
        return ()
    if not roots:  # nothing differentiable reaches the stage's output: every gradient is zero
        return (None,) * len(wrt)
    grads = _seeds(roots, grads)
    if _run_backward is None:
        # torch types roots and wrt as all tensors or all edges; a mix is what autograd's engine takes
        return torch.autograd.grad(tuple(roots), wrt, tuple(grads), retain_graph=retain_graph,  # type: ignore[arg-type]
                                   allow_unused=True)
    return _run_backward(tuple(roots), tuple(grads), retain_graph, False, tuple(wrt), True, False)


def stage_grads_into(roots: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                     into: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                     bound: bool = False) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``leaves``, as :func:`stage_grads` gives them, while each of ``targets``'s
    gradients is added in place into its tensor of ``into`` (same shape) during the backward.

    Autograd's own accumulation (``AccumulateGrad``: ``grad += new``) adds a weight's gradient as
    soon as it is computed, while it is still in cache; adding the returned gradients after the
    backward reads them back from memory (a 6-block Llama stage, 8 micro-batches: 20 ms a step
    against 6). The targets' ``.grad`` point at ``into`` only during the call, unless ``bound``:
    the caller has pointed them there already and puts them back itself (a worker's step does,
    once for the step rather than around every job)."""
    if not roots:  # nothing differentiable reaches the stage's output: nothing to add
        return (None,) * len(leaves)
    grads = _seeds(roots, grads)
    before = [] if bound else [t.grad for t in targets]
    if not bound:
        for t, g in zip(targets, into):
            t.grad = g
    try:
        if _run_backward is None:
            torch.autograd.backward(tuple(roots), tuple(grads), inputs=[*leaves, *targets])
        else:
            _run_backward(tuple(roots), tuple(grads), False, False, (*leaves, *targets), True, True)
    finally:
        for t, old in zip(targets, before):
            t.grad = old
    out = tuple(leaf.grad for leaf in leaves)
    for leaf in leaves:
        leaf.grad = None
    return out


# ---- the split backward: I, then W ---------------------------------------------------------------


class Deferred:
    """What ``I`` leaves for ``W``: the graph (held through its outputs) and each junction's
    recorded gradient; :meth:`weight_grads` is ``W``."""

    def __init__(self, roots: list[torch.Tensor], grads: list[torch.Tensor] | None, weights: Sequence[torch.Tensor],
                 found: tuple[list[tuple[list[int], list[Node]]], list[GradientEdge], dict[Node, tuple]] | None = None
                 ) -> None:
        self.roots, self.grads, self.weights = roots, grads, list(weights)
        self.found = found  # (groups, each weight's edge, each junction's gradient); None: W goes from the outputs

    def weight_grads(self) -> tuple[torch.Tensor | None, ...]:
        """The gradient of each weight (None where it does not reach the outputs); frees the graph."""
        try:
            if self.found is None:
                return stage_grads(self.roots, self.weights, self.grads)
            groups, edges, captured = self.found
            out: list[torch.Tensor | None] = [None] * len(self.weights)
            for members, junctions in groups:
                for i, g in zip(members, _group([edges[i] for i in members], junctions, captured)):
                    out[i] = g
            return tuple(out)
        finally:
            self.roots, self.grads, self.found = [], None, None


def _group(weights: list[GradientEdge], junctions: list[Node], captured: dict[Node, tuple]
           ) -> tuple[torch.Tensor | None, ...]:
    """The gradient of ``weights`` from their ``junctions``, seeded with what ``I`` recorded there."""
    starts: list[GradientEdge] = []
    seeds: list[torch.Tensor] = []
    for node in junctions:
        for k, g in enumerate(captured[node]):
            if g is not None:
                starts.append(GradientEdge(node, k))
                seeds.append(g)
    if not starts:
        return (None,) * len(weights)
    # a junction below another of the same call gets what I recorded for it, not that plus what
    # flows down to it again from the one above
    hooks = [node.register_prehook(lambda _, kept=captured[node]: kept) for node in junctions] \
        if len(junctions) > 1 else []
    try:
        # kept (retain_graph): a call can pass through another group's junction
        return stage_grads(starts, weights, seeds, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()


def input_grads(roots: list[torch.Tensor], grads: list[torch.Tensor] | None, leaves: Sequence[torch.Tensor],
                weights: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor | None, ...], Deferred]:
    """``I``: the gradient of each of ``leaves`` (the stage's differentiable inputs) from ``roots``
    (its outputs, or its loss when ``grads`` is None), and the :class:`Deferred` that gives the
    gradient of each of ``weights`` afterwards."""
    found = _junctions(roots, leaves, weights) if leaves and roots else None
    if found is None:
        return stage_grads(roots, leaves, grads, retain_graph=True), Deferred(roots, grads, weights)
    groups, edges = found
    captured: dict[Node, tuple] = {}
    hooks = [node.register_prehook(lambda gs, node=node: captured.__setitem__(node, gs))
             for _, junctions in groups for node in junctions]
    try:
        res = stage_grads(roots, leaves, grads, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    if any(node not in captured for _, junctions in groups for node in junctions):
        return res, Deferred(roots, grads, weights)  # I did not pass a junction: W goes from the outputs
    return res, Deferred(roots, grads, weights, (groups, edges, captured))


def _graph_above(tops: set[Node]) -> tuple[dict[Node, list[Node]], set[Node], dict[int, Node]]:
    """The graph below ``tops``: for each node, the nodes whose gradient flows into it; every node
    reached; and each leaf tensor's accumulator node, by ``id`` of the tensor."""
    above: dict[Node, list[Node]] = defaultdict(list)
    seen: set[Node] = set(tops)
    accumulators: dict[int, Node] = {}  # get_gradient_edge makes a view per call: keyed by the tensor
    todo: list[Any] = list(tops)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            above[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
                leaf = getattr(child, "variable", None)
                if leaf is not None:
                    accumulators[id(leaf)] = child
    return above, seen, accumulators


def _branch_junctions(start: Node, above: dict[Node, list[Node]], side: set[Node]) -> set[Node] | None:
    """The input-side nodes the branch from ``start`` (a weight's node) up hangs from; None where
    the branch reaches an output without passing the input side."""
    found: set[Node] = set()
    branch, todo = {start}, [start]
    while todo:
        node = todo.pop()
        ups = above[node]
        if not ups:
            return None
        for parent in ups:
            if parent in side:
                found.add(parent)
            elif parent not in branch:
                branch.add(parent)
                todo.append(parent)
    return found


def _junctions(roots: list[torch.Tensor], leaves: Sequence[torch.Tensor],
               weights: Sequence[torch.Tensor]) -> tuple[list[tuple[list[int], list[Node]]], list[GradientEdge]] | None:
    """The weights in groups that share junctions, each with its junctions, and each weight's
    edge in the graph; None where ``W`` must go from the outputs."""
    if any(r.grad_fn is None for r in roots):
        return None
    above, seen, accumulators = _graph_above({r.grad_fn for r in roots if r.grad_fn is not None})

    def edge(t: torch.Tensor) -> GradientEdge | None:
        if t.grad_fn is not None:
            return GradientEdge(t.grad_fn, t.output_nr)
        node = accumulators.get(id(t))
        return None if node is None else GradientEdge(node, 0)

    # the input side: every node on a path from an output to an input
    side = {e.node for e in map(edge, leaves) if e is not None and e.node in seen}
    todo = list(side)
    while todo:
        for parent in above[todo.pop()]:
            if parent not in side:
                side.add(parent)
                todo.append(parent)
    if not side:
        return None
    # each weight's junctions: the input-side nodes its branch hangs from
    group_of: dict[Node, int] = {}
    members: list[list[int]] = []
    junctions: list[set[Node]] = []
    edges: list[GradientEdge] = []
    for i, w in enumerate(weights):
        e = edge(w)
        if e is None or e.node not in seen:
            return None  # the outputs do not depend on it (rare): the plain call says so
        edges.append(e)
        found = _branch_junctions(e.node, above, side)
        if found is None:
            return None  # an output reached without passing the input side
        # merge every group that shares a junction with this weight
        hit = sorted({group_of[n] for n in found if n in group_of})
        if hit:
            g = hit[0]
            for other in hit[1:]:
                members[g] += members[other]
                junctions[g] |= junctions[other]
                for n in junctions[other]:
                    group_of[n] = g
                members[other], junctions[other] = [], set()
        else:
            g = len(members)
            members.append([])
            junctions.append(set())
        members[g].append(i)
        junctions[g] |= found
        for n in found:
            group_of[n] = g
    return [(m, list(j)) for m, j in zip(members, junctions) if m], edges


# ---- a worker's backward jobs ---------------------------------------------------------------------


@dataclass
class Stash:
    """What a forward keeps for its backward."""

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


def rng_state(device: torch.device) -> tuple:
    """The random state a recomputed forward must replay (CPU, and the device's on CUDA)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replayed_rng(state: tuple | None, device: torch.device) -> Any:
    """Run under ``state`` (a forward's random state), then go back to the current one."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def backward(st: StepState, op: JobOp, split_backward: bool) -> None:
    """``B(s, b)`` (or ``I(s, b)`` when ``split_backward``): the gradient of the stage's inputs, sent or
    kept for their predecessors, and (unless split_backward) of its weights, added into its total."""
    s, b = op.stage, op.microbatch
    stash = st.stash.pop((s, b))
    views = stash.views
    if stash.out is None:  # recompute the stage's forward on freshly fetched weights
        mod, params, targets = st.fetch(op)
        views = None if params is None else list(params.values())[: st.engine.layouts[s].trainable]
        st.engine.stats.before(s, b, mod)
        with torch.enable_grad(), replayed_rng(stash.rng, st.engine.device), st.in_streams(b), \
                st.counting(False, op, mod, targets, stash.values, True) as graph:
            out = run_stage(mod, params, stash.values)
            loss = st.loss(op, out)
        st.engine.stats.after(s, b, mod, count=False)  # counted by the forward already
        stash.saved = graph.nbytes
        st.meter.hold_bytes(stash.saved)  # the recomputed graph, until this job (or W) ends
    else:
        out, loss, targets = stash.out, stash.loss, stash.targets
        if op.weights_mid is not None:
            st.fetch(op)  # cache "step" only: the copy F used; counted as a job on fetched weights
    if loss is not None:
        roots: list[torch.Tensor] = [] if st.weightless(s, b) else [loss]  # none: zero gradients
        scale = st.engine.loss_scale  # 16-mixed: the GradScaler's scale (the owners' optimizer step unscales)
        grads: list[torch.Tensor] | None = None if scale == 1.0 else [torch.full_like(loss, scale)]
    else:
        roots, grads = _output_grads(st, op, out)
    finite = st.engine.finite
    into = None if split_backward else st.totals.into(s, op.owner, targets, apart=finite is not None and finite.grads)
    if split_backward:  # I: the inputs' gradient now, the weights' (per parameter) at W from where I left off
        weights = targets if views is None else views
        res, deferred = input_grads(roots, grads, stash.leaves, weights)
    elif into is not None:  # later micro-batches: added into the total during the backward
        # the stage's own weights keep pointing at its total until the step ends; a fetched copy
        # only during the call (held until the step's end, it would outlive its job)
        own = op.weights_mid is None
        if own:
            st.totals.bind(targets, into)
        res = stage_grads_into(roots, stash.leaves, targets, into, grads, bound=own)
    else:
        res = stage_grads(roots, stash.leaves + targets, grads)
    if st.engine.finite is not None:
        st.engine.finite.backward(s, b, res)
    _route_input_grads(st, op, stash, res[: len(stash.leaves)])
    if not split_backward and into is None:
        st.totals.accumulate(s, op.owner, targets, res[len(stash.leaves) :])
    st.meter.release(stash.nbytes)  # x_s^b dies with the job that consumes it
    if not split_backward:
        st.meter.drop_bytes(stash.saved)  # and the graph with it
    if split_backward:
        hold = op.weights_mid if op.free_weights else None  # I's copy lives in the graph until W
        st.wstash[(s, b)] = (deferred, weights, hold, stash.saved)
        if hold is not None:
            st.weights.pop(hold, None)  # not freed yet: still counted as resident
    elif op.free_weights:
        st.free(op.weights_mid)


def _output_grads(st: StepState, op: JobOp, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The stage's differentiable outputs and dL/d of each: the sum, in graph order, of what
    every successor sent back for the part of the output it received."""
    s, b = op.stage, op.microbatch
    edges = st.shapes[b].edges
    if isinstance(out, torch.Tensor):  # the common case: one tensor, one gradient per successor
        g = None
        for c in st.engine.space.stage_succs[s]:
            if c in op.recv:
                gc = edges[(s, c)].sig.unpack_grads(st.comm.wait(op.recv[c]))
                st.comm.drop(op.recv[c])
            else:
                gc = st.grads[(s, b)].pop(c)
            if gc:
                g = gc[0] if g is None else g + gc[0]
        st.grads.pop((s, b), None)
        return ([out], [g]) if g is not None else ([], [])
    flat = pytree.tree_leaves(out)
    total: dict[int, torch.Tensor] = {}
    for c in st.engine.space.stage_succs[s]:
        edge = edges[(s, c)]
        if c in op.recv:
            gc = edge.sig.unpack_grads(st.comm.wait(op.recv[c]))
            st.comm.drop(op.recv[c])
        else:
            gc = st.grads[(s, b)].pop(c)
        for k, g in zip(edge.out_index, gc):
            total[k] = g if k not in total else total[k] + g
    st.grads.pop((s, b), None)
    keys = sorted(total)
    return [flat[k] for k in keys], [total[k] for k in keys]


def weight_grad(st: StepState, op: JobOp) -> None:
    """``W(s, b)``: the weights' gradient from where ``I`` left off, added into the stage's total."""
    if (op.stage, op.microbatch) in st.engine.whole:  # its I ran as the whole backward (Engine.whole)
        if op.weights_mid is not None:
            st.fetch(op)
        return
    deferred, targets, hold, saved = st.wstash.pop((op.stage, op.microbatch))
    if op.weights_mid is not None:
        # cache "step" only: W on the step's copy, counted as a job on fetched weights; the
        # gradient itself comes from I's graph (under "job" the program sends W no copy at all)
        st.fetch(op)
    wgrads = deferred.weight_grads()
    if st.engine.finite is not None:
        st.engine.finite.backward(op.stage, op.microbatch, wgrads)
    st.totals.accumulate(op.stage, op.owner, targets, wgrads)
    st.meter.drop_bytes(saved)  # I's graph, kept for this job, is freed now
    if hold is not None:
        st.meter.free_weights()


def _route_input_grads(st: StepState, op: JobOp, stash: Stash, grads: Sequence[torch.Tensor | None]) -> None:
    """The inputs' gradients to each predecessor: sent to another worker, or kept for a local one."""
    s, b = op.stage, op.microbatch
    preds = st.engine.space.stage_preds[s]
    if not preds:
        return
    comp, B = st.engine.timeline.compute, st.engine.space.microbatches
    edges = st.shapes[b].edges
    at = 0
    for p, n in zip(preds, stash.counts):
        # a differentiable input the stage ignored: its gradient is zero
        gl = [torch.zeros_like(leaf) if g is None else g
              for g, leaf in zip(grads[at : at + n], stash.leaves[at : at + n])]
        at += n
        if comp[p * B + b] != comp[s * B + b]:  # p's backward runs where F(p, b) ran: elsewhere, for its SEND_GRAD
            st.outbox[(GRAD, p, b, s)] = edges[(p, s)].sig.pack_grads(gl, st.engine.device)
        else:
            st.grads[(p, b)][s] = gl
