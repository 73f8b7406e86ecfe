"""What a step's gradient exchange adds to the simulated compute: a latency-bandwidth link model.

The simulator's timeline ends with each worker's last job; the runtime then finishes the step
(docs/design.md, "Placement and data movement", and the lowering in :mod:`launcher.schedule.lowering`):

- every worker sends its weight-gradient sum of stage ``s`` to each other owner it computed for,
  and each owner receives them: one message of ``grad_bytes[s]`` per ``(s, sender, owner)``, all
  at once (one round);
- the ``n`` owners of replicated stages (DDP, LPP with G > 1) all-reduce them with the runtime's
  algorithms (:mod:`launcher.runtime.groups`): through one root in 2 rounds when small, else
  by the backend's ring (:func:`exchanges`). A model of the runtime, not a copy: one
  exchange per owner set after the compute, where the runtime cuts large sets into buckets and
  reduces those a worker completes early during its backward (gloo's ring), or all with NCCL's.

A message of ``n`` bytes costs ``latency_s + n / bytes_per_s`` (a :class:`Link`, measured on the
real workers by a ping-pong, :mod:`launcher.runtime.link_probe`). A worker's end phase lasts its
message rounds' latency plus its busier direction's bytes over the bandwidth (links are full
duplex), and the step ends when the last worker's end phase does:

    T = max_w (finish_w + rounds_w * latency + max(sent_w, received_w) / bandwidth)

Weight fetches (FSDP, FSLPP) are not in ``T``: the runtime prefetches them during the compute;
they are in the traffic. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .simulate import Timeline


@dataclass(frozen=True)
class Link:
    """A point-to-point link between two workers: seconds per message and bytes per second."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        """What one message of ``nbytes`` costs."""
        return self.latency_s + nbytes / self.bytes_per_s

    def to_json(self) -> dict[str, float]:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s}


#: a replicated stage set whose root would move at most this many bytes each way ((n - 1) x size)
#: is all-reduced through one root in two rounds, a larger one by the backend's ring (the runtime's
#: choice, :mod:`launcher.runtime.groups`)
ROOT_BYTES = 2 * 2**20


@dataclass(frozen=True)
class Exchange:
    """One worker's gradient exchange after its last job: message rounds and bytes each way."""

    rounds: int
    sent: float
    received: float

    def seconds(self, link: Link) -> float:
        """Rounds times the latency, plus the busier direction's bytes over the bandwidth."""
        return self.rounds * link.latency_s + max(self.sent, self.received) / link.bytes_per_s


def exchanges(tl: Timeline, grad_bytes: Sequence[float], shared: bool = False) -> list[Exchange]:
    """Per worker: its partial sums to owners (one message each, all at once: one round) and the
    all-reduce of the replicated stages it owns, per owner set, with the runtime's end-of-step
    algorithms: through one root (2 rounds; the root moves ``(n - 1)`` times the bytes each way) when small, else by
    the backend's ring (``2 (n - 1)`` rounds, ``2 (n - 1) / n`` of the bytes each way). ``shared``:
    through shared memory on one host (:mod:`launcher.runtime.shared_reduce`), 2 rounds of notices
    and no bytes over a link (the sums and copies are the worker's own CPU, measured with its end of step)."""
    space, W = tl.schedule.space, tl.schedule.workers
    S, B = space.S, space.microbatches
    grad_kind = space.K - 1  # B, or W when split: the job that makes stage s's weight gradient
    pairs: set[tuple[int, int, int]] = set()
    owners: list[set[int]] = [set() for _ in range(S)]
    for j in range(space.N):
        k, s = divmod(j // B, S)
        o = tl.owner[j]
        owners[s].add(o)
        if k == grad_kind and tl.compute[j] != o and s not in tl.schedule.frozen:
            pairs.add((s, tl.compute[j], o))
    sent, received = [0.0] * W, [0.0] * W
    sends, receives, rounds = [0] * W, [0] * W, [0] * W
    for s, w, o in pairs:
        sent[w] += grad_bytes[s]
        received[o] += grad_bytes[s]
        sends[w] = 1
        receives[o] = 1
    sets: dict[tuple[int, ...], float] = {}
    for s, stage_owners in enumerate(owners):
        if len(stage_owners) > 1 and s not in tl.schedule.frozen:
            key = tuple(sorted(stage_owners))
            sets[key] = sets.get(key, 0.0) + grad_bytes[s]
    for group, nbytes in sets.items():
        n = len(group)
        if shared:
            for o in group:
                rounds[o] += 2
        elif (n - 1) * nbytes <= ROOT_BYTES:
            root = group[0]
            for o in group:
                moved = (n - 1) * nbytes if o == root else nbytes
                sent[o] += moved
                received[o] += moved
                rounds[o] += 2
        else:
            for o in group:
                sent[o] += 2 * (n - 1) / n * nbytes
                received[o] += 2 * (n - 1) / n * nbytes
                rounds[o] += 2 * (n - 1)
    return [Exchange(max(sends[w], receives[w]) + rounds[w], sent[w], received[w]) for w in range(W)]


def end_of_step(tl: Timeline, grad_bytes: Sequence[float], link: Link, shared: bool = False) -> list[float]:
    """Per worker, the seconds of its gradient exchange after its last job (formula above;
    ``shared``: as :func:`exchanges`)."""
    return [e.seconds(link) for e in exchanges(tl, grad_bytes, shared)]


def partners(tl: Timeline) -> list[list[int]]:
    """Per worker, the workers its end of the step waits for: the other owners of the replicated
    stages it owns (they all-reduce together) and the workers that send it partial sums."""
    space, W = tl.schedule.space, tl.schedule.workers
    S, B = space.S, space.microbatches
    grad_kind = space.K - 1
    owners: list[set[int]] = [set() for _ in range(S)]
    out: list[set[int]] = [set() for _ in range(W)]
    for j in range(space.N):
        k, s = divmod(j // B, S)
        owners[s].add(tl.owner[j])
        if k == grad_kind and tl.compute[j] != tl.owner[j]:
            out[tl.owner[j]].add(tl.compute[j])
    for group in owners:
        if len(group) > 1:
            for o in group:
                out[o] |= group - {o}
    return [sorted(x) for x in out]


def step_time(tl: Timeline, grad_bytes: Sequence[float], link: Link, tails: Sequence[float] | None = None) -> float:
    """``T``: the simulated compute of every worker followed by its gradient exchange.

    ``tails``: :func:`end_of_step` of this placement, when the caller already has it (it depends
    on who computes and who owns each job, not on when jobs run)."""
    if tails is None:
        tails = end_of_step(tl, grad_bytes, link)
    # a worker runs its program one job at a time: its last job finishes last
    return max((tl.finish[prog[-1]] if prog else 0.0) + t for prog, t in zip(tl.sequences, tails))
