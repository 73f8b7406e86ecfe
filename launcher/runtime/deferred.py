"""The split backward: ``I`` takes the gradient of a stage's inputs, ``W`` its weights' later,
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

from collections import defaultdict
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from .model import stage_grads


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


def _junctions(roots: list[torch.Tensor], leaves: Sequence[torch.Tensor],
               weights: Sequence[torch.Tensor]) -> tuple[list[tuple[list[int], list[Node]]], list[GradientEdge]] | None:
    """The weights in groups that share junctions, each with its junctions, and each weight's
    edge in the graph; None where ``W`` must go from the outputs."""
    if any(r.grad_fn is None for r in roots):
        return None
    tops = {r.grad_fn for r in roots}
    above: dict[Node, list[Node]] = defaultdict(list)  # node -> the nodes whose gradient flows into it
    seen: set[Node] = set(tops)
    accumulators: dict[int, Node] = {}  # id(leaf tensor) -> its node (get_gradient_edge makes a view per call)
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
        start = e.node
        found: set[Node] = set()
        branch, todo = {start}, [start]
        while todo:
            node = todo.pop()
            ups = above[node]
            if not ups:
                return None  # an output reached without passing the input side
            for parent in ups:
                if parent in side:
                    found.add(parent)
                elif parent not in branch:
                    branch.add(parent)
                    todo.append(parent)
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
