"""Jobs of one training step and their dependencies, held as data.

A step trains the stages of a :class:`StageGraph` on ``B`` micro-batches. Its jobs are
``(stage, microbatch, kind)`` with kind ``F`` (forward) and ``B`` (backward), or ``F``, ``I``
(input gradient) and ``W`` (weight gradient) when the backward is split. ``pred``/``succ`` are
derived from the stage graph's edges, so a DAG of stages (several encoder legs) needs no
special case:

- ``F(s,b)`` needs ``F(p,b)`` for every stage ``p`` feeding ``s``;
- the backward of a loss stage (a sink) needs ``F(s,b)``;
- the backward of ``s`` needs the backward of every stage ``s`` feeds;
- ``W(s,b)`` needs ``I(s,b)``; nothing waits on ``W``.

Jobs are numbered densely, ``j = (k * S + s) * B + b``, so per-job data lives in flat lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 (I: the input-gradient job kind, the paper's name)
KINDS_JOINT: tuple[str, ...] = (F, B)
KINDS_SPLIT: tuple[str, ...] = (F, I, W)


class Job(NamedTuple):
    """One unit of work: stage ``stage`` of micro-batch ``microbatch`` in direction ``kind``."""

    stage: int
    microbatch: int
    kind: str


@dataclass(frozen=True)
class StageGraph:
    """Stages and the edges between them; ``preds[s]`` feed stage ``s``.

    Stages are numbered in a topological order (every predecessor has a smaller number), which
    is what a ``list`` of stage modules gives.
    """

    preds: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for s, ps in enumerate(self.preds):
            for p in ps:
                if not 0 <= p < s:
                    raise ValueError(f"stage graph edge {p}->{s} must go from a lower to a higher stage")

    @classmethod
    def chain(cls, stages: int) -> "StageGraph":
        """The plain pipeline ``0 -> 1 -> ... -> S-1``."""
        return cls(tuple(() if s == 0 else (s - 1,) for s in range(stages)))

    @property
    def stages(self) -> int:
        return len(self.preds)

    @property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.preds]
        for s, ps in enumerate(self.preds):
            for p in ps:
                out[p].append(s)
        return tuple(tuple(x) for x in out)

    @property
    def sinks(self) -> tuple[int, ...]:
        """Stages nothing depends on: they compute the loss."""
        return tuple(s for s, cs in enumerate(self.succs) if not cs)

    def height(self) -> list[int]:
        """Stages on the longest path from each stage to a loss stage, itself included.

        For a chain this is ``S - s``: the classic 1F1B warm-up depth of stage ``s``.
        """
        succs = self.succs
        h = [1] * self.stages
        for s in reversed(range(self.stages)):
            if succs[s]:
                h[s] = 1 + max(h[c] for c in succs[s])
        return h


class JobSpace:
    """All jobs of one step, with ``pred``/``succ`` as data derived from the stage graph."""

    def __init__(self, graph: StageGraph, microbatches: int, split_backward: bool = False) -> None:
        self.graph = graph
        self.S = graph.stages
        self.microbatches = microbatches
        self.split_backward = split_backward
        self.kinds = KINDS_SPLIT if split_backward else KINDS_JOINT
        self.K = len(self.kinds)
        self.N = self.K * self.S * self.microbatches
        self.stage_preds = graph.preds
        self.stage_succs = graph.succs
        sinks = set(graph.sinks)
        self.is_sink = [s in sinks for s in range(self.S)]

    # ---- numbering -------------------------------------------------------------------------
    def id(self, stage: int, microbatch: int, kind: str) -> int:
        return (self.kinds.index(kind) * self.S + stage) * self.microbatches + microbatch

    def job(self, j: int) -> Job:
        q, b = divmod(j, self.microbatches)
        k, s = divmod(q, self.S)
        return Job(s, b, self.kinds[k])

    def __iter__(self) -> Iterator[Job]:
        return (self.job(j) for j in range(self.N))

    def __len__(self) -> int:
        return self.N

    # ---- dependencies ----------------------------------------------------------------------
    def pred(self, j: int) -> list[int]:
        """Jobs that must finish before ``j`` starts."""
        S, B = self.S, self.microbatches
        q, b = divmod(j, B)
        k, s = divmod(q, S)
        if k == 0:  # F(s,b) <- F(p,b)
            return [p * B + b for p in self.stage_preds[s]]
        if k == 1:  # backward(s,b) <- backward(c,b); the loss stage's backward <- F(s,b)
            out = [(S + c) * B + b for c in self.stage_succs[s]]
            if self.is_sink[s]:
                out.append(s * B + b)
            return out
        return [(S + s) * B + b]  # W(s,b) <- I(s,b)

    def succ(self, j: int) -> list[int]:
        """Jobs that wait on ``j``."""
        S, B = self.S, self.microbatches
        q, b = divmod(j, B)
        k, s = divmod(q, S)
        if k == 0:
            out = [c * B + b for c in self.stage_succs[s]]
            if self.is_sink[s]:
                out.append((S + s) * B + b)
            return out
        if k == 1:
            out = [(S + p) * B + b for p in self.stage_preds[s]]
            if self.K == 3:
                out.append((2 * S + s) * B + b)
            return out
        return []
