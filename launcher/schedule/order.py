"""Tie-break orders, one class each (:data:`ORDERS`): which ready job a free worker takes first (smaller first).

An order never overrides ``pred``; it only ranks jobs that are ready on the same worker at the
same time.

- ``1f1b``: backward before forward, then the older micro-batch first. By default it also applies
  the classic warm-up limit (a worker whose lowest stage is ``s`` keeps at most ``S - s``
  micro-batches in flight), which is where 1F1B's low memory comes from; ``warmup="none"`` gives
  the pure tie-break.
- ``breadth_first``: forward before backward; every micro-batch of a lower stage before the next
  stage (GPipe's fill-drain; looped breadth-first for LPP).
- ``depth_first``: the job that has waited longest since it became ready (ties as ``1f1b``).
- ``zb_h1``: ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), on the split
  backward: 1F1B's classic warm-up, then each stage alternating ``F`` and ``I`` (ranks from the
  paper's per-stage sequence, :func:`_zb_h1_keys`), and the weight-gradient jobs ``W`` deferred.
  A worker whose lowest stage is ``s`` keeps up to ``height(0) - height(s)`` (``s`` on a
  chain) ready ``W`` jobs waiting; one more, and the oldest runs before anything else; once the
  worker has no ``F`` or ``I`` left, the rest are flushed. Every worker then has the same number
  of micro-batches in flight counting deferred ``W`` (the paper's memory argument), and the ``W``
  jobs fill the tail of the step. :mod:`launcher.schedule.simulate` applies the deferral.
- ``zb_h2``: ZB-H2 of the same paper (split backward only): a fixed sequence per worker
  (:func:`zb_h2_sequence`) that the simulator follows strictly. The worker at place ``r`` of a
  pipeline of ``P`` keeps up to ``2 (P - 1 - r) + 1`` micro-batches between ``F`` and ``I`` (the
  first worker ``2P - 1``), runs an ``I`` as soon as it is ready and holds back ``2 r`` ``W`` jobs
  for the tail: at ``T_F = T_B = T_W`` the paper's parallelogram (its Figure 3, bottom).
- ``interleaved_1f1b``: the interleaved 1F1B of Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM" (SC 2021), as Megatron and
  ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` order it, for looped pipelines
  (:func:`interleaved_sequence`). Its ranks depend on where jobs run, so the simulator computes
  them from the placement. With its default ``warmup="classic"`` each worker runs exactly that
  sequence, waiting for the next job in it (its warm-up count is what bounds its memory);
  ``warmup="none"`` uses the sequence's ranks as a pure tie-break.
- ``auto``: the sequences a search finds for the step's own durations, ``comm`` and
  ``memory_limit`` (:mod:`launcher.schedule.auto_order`), on the split backward.
- ``zbv``: ZB-V of Qi et al. (section 6), as ``torch.distributed.pipelining.ScheduleZBVZeroBubble``
  orders it (:func:`zbv_sequence`), on the split backward and the V-shaped placement
  (``strategy=vshape``) only; each worker runs exactly that sequence.
- ``dualpipev``: DualPipeV (DeepSeek-V3's DualPipe folded onto the V shape), as
  ``torch.distributed.pipelining.ScheduleDualPipeV`` orders it (:func:`dualpipev_sequence`), on
  the split backward and the V-shaped placement only, with at least as many micro-batches as
  stages; each worker runs exactly that sequence.
- any callable ``key(s, b, d) -> comparable`` (:class:`Custom`; ``order.n`` in the config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from .graph import JobSpace

#: rank of each kind: 1F1B drains (backward first), breadth-first fills (forward first).
#: ``W`` is last in both: it is off the critical path and fills bubbles.
_RANK_1F1B = {"B": 0, "I": 0, "F": 1, "W": 2}
_RANK_BREADTH = {"F": 0, "B": 1, "I": 1, "W": 2}

WARMUPS = ("classic", "none")


@dataclass(frozen=True)
class Order:
    """A tie-break rule: :meth:`keys` ranks every job (smaller first) among the jobs ready on one
    worker at one time. ``warmup="classic"`` adds 1F1B's limit of micro-batches in flight."""

    warmup: str = "none"
    name: ClassVar[str] = ""
    default_warmup: ClassVar[str] = "none"
    by_ready_time: ClassVar[bool] = False  # the job's ready time goes ahead of its key
    defer_w: ClassVar[bool] = False  # ZB-H1's deferral of weight-gradient jobs (needs the split backward)
    integer_keys: ClassVar[bool] = True  # keys are small non-negative ints the simulator may pack
    looped_only: ClassVar[bool] = False  # valid only on a looped pipeline (1 < R < stages)
    split_only: ClassVar[bool] = False  # valid only on the split backward (F, I, W)
    scheme_only: ClassVar[str | None] = None  # the one named scheme it is made for, if any
    at_least_stages: ClassVar[bool] = False  # needs microbatches >= stages (PyTorch's DualPipeV rule)

    @property
    def in_flight_limit(self) -> bool:
        """Whether 1F1B's classic limit of micro-batches in flight applies."""
        return self.warmup == "classic"

    @property
    def in_sequence(self) -> bool:
        """Whether each worker runs its jobs strictly in key order, waiting for the next one."""
        return False

    def keys(self, space: JobSpace) -> list:
        """The key of every job, indexed by job id."""
        raise NotImplementedError

    def placed_keys(self, space: JobSpace, compute: Sequence[int]) -> list:
        """The key of every job, given ``compute[j]``, the worker that runs job ``j`` (what the
        simulator calls; only orders whose ranks depend on the placement need it)."""
        return self.keys(space)


def _ranked(space: JobSpace, rank: dict[str, int], breadth: bool) -> list[int]:
    """Keys by kind rank, then (breadth-first) stage level and micro-batch, or (depth-first)
    micro-batch and stage level."""
    S, B = space.S, space.microbatches
    out: list[int] = []
    for kind in space.kinds:
        r = rank[kind]
        for s in range(S):
            level = s if kind == "F" else S - 1 - s  # forward walks stages upward, the backward downward
            if breadth:
                base = (r * S + level) * B
                out.extend(range(base, base + B))
            else:
                out.extend((r * B + b) * S + level for b in range(B))
    return out


@dataclass(frozen=True)
class OneFOneB(Order):
    """Backward before forward, then the older micro-batch, then the stage."""

    name: ClassVar[str] = "1f1b"
    default_warmup: ClassVar[str] = "classic"

    def keys(self, space: JobSpace) -> list:
        return _ranked(space, _RANK_1F1B, breadth=False)


@dataclass(frozen=True)
class BreadthFirst(Order):
    """Forward before backward; every micro-batch of a lower stage before the next stage."""

    name: ClassVar[str] = "breadth_first"

    def keys(self, space: JobSpace) -> list:
        return _ranked(space, _RANK_BREADTH, breadth=True)


@dataclass(frozen=True)
class LongestWaiting(OneFOneB):
    """The job that has waited longest since it became ready; ties as 1F1B."""

    name: ClassVar[str] = "depth_first"
    default_warmup: ClassVar[str] = "none"
    by_ready_time: ClassVar[bool] = True


@dataclass(frozen=True)
class ZBH1(Order):
    """ZB-H1 on the split backward (:func:`_zb_h1_keys`), its ``W`` jobs deferred by the simulator."""

    name: ClassVar[str] = "zb_h1"
    default_warmup: ClassVar[str] = "classic"
    defer_w: ClassVar[bool] = True
    split_only: ClassVar[bool] = True

    def keys(self, space: JobSpace) -> list:
        return _zb_h1_keys(space)


@dataclass(frozen=True)
class Sequenced(Order):
    """An order given as each worker's job sequence (:meth:`sequences`). With ``warmup="classic"``
    (the default) each worker runs exactly its sequence, waiting for the next job in it; with
    ``warmup="none"`` the sequence's positions are a pure tie-break. Handcrafted schedules, those
    read from a file and those found by search are all this one kind of order."""

    default_warmup: ClassVar[str] = "classic"

    @property
    def in_flight_limit(self) -> bool:
        return False  # its warm-up is the sequence's own

    @property
    def in_sequence(self) -> bool:
        return self.warmup == "classic"

    def keys(self, space: JobSpace) -> list:
        raise TypeError(f"order={self.name} ranks jobs by where they run: use placed_keys(space, compute)")

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        """Each worker's jobs (ids of ``space``) in the order it runs them; ``compute[j]`` is the
        worker that runs job ``j``."""
        raise NotImplementedError

    @property
    def where(self) -> str:
        """What names this order's sequences in an error sentence."""
        return f"order={self.name}"

    def placed_keys(self, space: JobSpace, compute: Sequence[int]) -> list:
        seqs = self.sequences(space, compute)
        check_sequences(space, compute, seqs, self.where)
        keys = [0] * space.N
        for seq in seqs:
            for i, j in enumerate(seq):
                keys[j] = i
        return keys


def job_name(space: JobSpace, j: int) -> str:
    """Job ``j`` as schedules write it: ``F2.b0`` (kind, stage, micro-batch)."""
    s, b, d = space.job(j)
    return f"{d}{s}.b{b}"


def check_sequences(space: JobSpace, compute: Sequence[int], seqs: Sequence[Sequence[int]], where: str) -> None:
    """Raise ``ValueError`` unless ``seqs`` lists every job exactly once, on the worker that computes
    it; ``where`` names the source in the sentence (``order=zb_h2``, ``order.path=...``)."""
    on = [-1] * space.N  # the worker whose sequence lists each job
    for w, seq in enumerate(seqs):
        for j in seq:
            if not 0 <= j < space.N:
                raise ValueError(f"{where}: worker {w}'s sequence names job {j}, which is not in the step")
            if on[j] >= 0:
                raise ValueError(f"{where} lists job {job_name(space, j)} twice (workers {on[j]} and {w})")
            if compute[j] != w:
                raise ValueError(f"{where} puts job {job_name(space, j)} on worker {w}, but the scheme computes it "
                                 f"on worker {compute[j]}")
            on[j] = w
    missing = [j for j in range(space.N) if on[j] < 0]
    if missing:
        raise ValueError(f"{where} lacks {len(missing)} of the step's jobs, first {job_name(space, missing[0])} "
                         f"(worker {compute[missing[0]]})")


@dataclass(frozen=True)
class Interleaved(Sequenced):
    """Megatron's interleaved 1F1B (:func:`interleaved_sequence`); with ``warmup="classic"`` (the
    default) each worker follows it strictly, as Megatron and PyTorch do."""

    name: ClassVar[str] = "interleaved_1f1b"
    looped_only: ClassVar[bool] = True

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        return interleaved_sequence(space, compute)


@dataclass(frozen=True)
class ZBH2(Sequenced):
    """ZB-H2 on the split backward (:func:`zb_h2_sequence`); each worker follows it strictly."""

    name: ClassVar[str] = "zb_h2"
    split_only: ClassVar[bool] = True

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        return zb_h2_sequence(space, compute)


class ZBV(Sequenced):
    """ZB-V (:func:`zbv_sequence`) on ``strategy=vshape`` with the split backward; each worker
    follows it strictly, as PyTorch does."""

    name: ClassVar[str] = "zbv"
    split_only: ClassVar[bool] = True
    scheme_only: ClassVar[str | None] = "vshape"

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        return zbv_sequence(space, compute)


class DualPipeV(Sequenced):
    """DualPipeV (:func:`dualpipev_sequence`) on ``strategy=vshape`` with the split backward and
    ``microbatches >= stages``; each worker follows it strictly, as PyTorch does."""

    name: ClassVar[str] = "dualpipev"
    split_only: ClassVar[bool] = True
    scheme_only: ClassVar[str | None] = "vshape"
    at_least_stages: ClassVar[bool] = True

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        return dualpipev_sequence(space, compute)


@dataclass(frozen=True)
class Custom(Order):
    """A callable ``key(s, b, d) -> comparable`` of the user's (``order.n`` in the config)."""

    key: Callable[[int, int, str], Any] | None = None
    integer_keys: ClassVar[bool] = False

    @property  # a custom order is named after its callable, not by its class
    def name(self) -> str:  # type: ignore[override]
        return getattr(self.key, "__name__", "custom")

    def keys(self, space: JobSpace) -> list:
        assert self.key is not None, "a custom order needs its key callable"
        return [self.key(*space.job(j)) for j in range(space.N)]


def _zb_h1_keys(space: JobSpace) -> list[int]:
    """ZB-H1's per-stage sequence as ranks: after its warm-up of ``height(s) - 1`` forwards, stage
    ``s`` alternates ``F(s, b + height(s) - 1)`` then ``I(s, b)``. So ``F(s, b)`` takes slot
    ``2 (b - height(s) + 1) - 1`` and ``I(s, b)`` slot ``2 b``; a ``W`` only ranks among ``W`` jobs
    (oldest first: the deferral itself is the simulator's). Plain 1F1B ranks (every ``I`` before
    any ``F``) would let early gradients starve the forwards once ``W`` jobs take slots."""
    S, B = space.S, space.microbatches
    height = space.graph.height()
    out: list[int] = []
    for kind in space.kinds:
        for s in range(S):
            level = s if kind == "F" else S - 1 - s
            for b in range(B):
                if kind == "F":
                    slot = 2 * (b - height[s] + 1) - 1
                elif kind == "W":
                    slot = 2 * b + 2 * B
                else:
                    slot = 2 * b
                out.append((slot + 2 * S) * S + level)  # + 2S: keep keys non-negative
    return out


def interleaved_sequence(space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
    """Each worker's jobs in Megatron's interleaved 1F1B order (``ScheduleInterleaved1F1B``'s).

    A worker at place ``r`` of a pipeline of ``P`` workers (those that micro-batch ``b``'s forwards
    visit, by lowest stage; ``P = R``, ``r = w mod R`` on a looped placement) holds ``n`` stages,
    its chunks, and ``M`` micro-batches. They go in rounds of ``m`` micro-batches (``M // m =
    max(1, M // P)`` rounds): the forwards chunk by chunk upward within a round, the backwards
    chunk by chunk downward. Its first ``(n - 1) m + 2 (P - 1 - r)`` jobs are forwards (the
    warm-up), then one forward and one backward alternate, then the last backwards; with the split
    backward, ``I`` takes the backward's place and the ``W`` jobs follow in the order of their ``I``.
    Where ``M`` is not a multiple of the rounds (PyTorch refuses it) the last round is shorter."""
    S, B = space.S, space.microbatches
    SB = S * B
    W = max(compute[:SB], default=-1) + 1
    forwards: list[list[int]] = [[] for _ in range(W)]
    for j in range(SB):
        forwards[compute[j]].append(j)
    out: list[list[int]] = []
    for w, jobs in enumerate(forwards):
        if not jobs:
            out.append([])
            continue
        b0 = min(j % B for j in jobs)
        path = list(dict.fromkeys(compute[s * B + b0] for s in range(S)))  # the pipeline, in stage order
        P, r = len(path), path.index(w)  # w runs F(s, b0) for some s, so it is on the path
        chunk = {s: c for c, s in enumerate(sorted({j // B for j in jobs}))}
        index: dict[int, int] = {}  # forward job -> its place among its stage's micro-batches here
        count = [0] * S
        for j in jobs:  # in (stage, micro-batch) order
            index[j] = count[j // B]
            count[j // B] += 1
        n, M = len(chunk), max(count)
        m = -(-M // max(1, M // P))
        fwd = sorted(jobs, key=lambda j: (index[j] // m, chunk[j // B], index[j]))
        bwd = [j + SB for j in sorted(jobs, key=lambda j: (index[j] // m, -chunk[j // B], index[j]))]
        warm = min((n - 1) * m + 2 * (P - 1 - r), len(fwd))
        seq = fwd[:warm]
        for k in range(len(fwd) - warm):
            seq += [fwd[warm + k], bwd[k]]
        seq += bwd[len(fwd) - warm:]
        if space.K == 3:
            seq += [j + SB for j in bwd]  # W(s, b) after I(s, b)'s turn, in the same order
        out.append(seq)
    return out


def zb_h2_sequence(space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
    """Each worker's jobs in ZB-H2's order (the paper's Figure 3, bottom; split backward only).

    The order is the one the figure draws with ``T_F = T_B = T_W`` and no communication, built
    here slot by slot in those unit times. A micro-batch visits its ``P`` workers in turn (a
    worker holding several consecutive stages of it runs them as one unit); in each slot the
    worker at place ``r`` runs the first of these that is ready: an ``I`` (the backward chain
    never waits); an ``F`` while fewer than ``2 (P - 1 - r) + 1`` micro-batches have run ``F`` and
    not ``I`` (the figure's longer warm-up); a ``W`` once more than ``2 r`` wait, or when nothing
    else can run (the figure's ``W`` jobs moved to the tail: the last worker ends with ``2P - 1``
    of them, the first with one). Every worker is then busy from its first job to its last."""
    if space.K != 3:
        raise ValueError("order=zb_h2 runs the weight-gradient jobs W apart, so it needs split_backward=True")
    S, B = space.S, space.microbatches
    SB = S * B
    nw = max(compute[:SB], default=-1) + 1
    # per micro-batch, the runs of consecutive stages on one worker, in forward order
    visits: list[list[tuple[int, list[int]]]] = []
    for b in range(B):
        runs: list[tuple[int, list[int]]] = []
        for s in range(S):
            w = compute[s * B + b]
            if runs and runs[-1][0] == w:
                runs[-1][1].append(s)
            else:
                runs.append((w, [s]))
        visits.append(runs)
    # each worker's forward units (b, place, stages) in micro-batch order, then place upward; its
    # backward units in micro-batch order, then place downward (on a looped pipeline a worker
    # holds several places of one micro-batch)
    units: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(nw)]
    for b, runs in enumerate(visits):
        for r, (w, stages) in enumerate(runs):
            units[w].append((b, r, stages))
    back = [sorted(u, key=lambda x: (x[0], -x[1])) for u in units]
    end_f: dict[tuple[int, int], int] = {}  # (micro-batch, place) -> the slot after its F
    end_i: dict[tuple[int, int], int] = {}
    nf, ni, nwj = [0] * nw, [0] * nw, [0] * nw
    out: list[list[int]] = [[] for _ in range(nw)]
    left = 3 * sum(len(u) for u in units)
    t = idle = 0
    while left:
        ran = False
        for w, u in enumerate(units):
            if nwj[w] == len(u):
                continue
            P, r0 = len(visits[u[0][0]]), u[0][1]
            f_ready = nf[w] < len(u) and (u[nf[w]][1] == 0 or end_f.get((u[nf[w]][0], u[nf[w]][1] - 1), t + 1) <= t)
            f_ok = f_ready and nf[w] - ni[w] < 2 * (P - 1 - r0) + 1  # the longer warm-up
            i_ready = False
            if ni[w] < len(u):
                b, r, _ = back[w][ni[w]]
                after = end_f.get((b, r), t + 1) if r == len(visits[b]) - 1 else end_i.get((b, r + 1), t + 1)
                i_ready = after <= t
            if i_ready:
                b, r, stages = back[w][ni[w]]
                out[w] += [SB + s * B + b for s in reversed(stages)]
                end_i[b, r] = t + 1
                ni[w] += 1
            elif f_ok:
                b, r, stages = u[nf[w]]
                out[w] += [s * B + b for s in stages]
                end_f[b, r] = t + 1
                nf[w] += 1
            elif nwj[w] < ni[w] and (ni[w] - nwj[w] > 2 * r0 or not f_ok):
                b, r, stages = back[w][nwj[w]]
                out[w] += [2 * SB + s * B + b for s in reversed(stages)]
                nwj[w] += 1
            else:
                continue
            left -= 1
            ran = True
        t += 1
        idle = 0 if ran else idle + 1
        if idle > 2 * S + 2:  # nothing ran for longer than any dependency chain: a cycle
            raise ValueError("order=zb_h2: the workers' jobs wait on each other on this placement")
    return out


@dataclass(frozen=True)
class AutoOrder(Sequenced):
    """Each worker's job sequence as the search found it (``seqs``; :mod:`launcher.schedule.auto_order`),
    run strictly. :meth:`launcher.schedule.settings.Settings.schedule` fills ``seqs`` from the step's profile."""

    seqs: tuple[tuple[int, ...], ...] | None = None
    name: ClassVar[str] = "auto"
    split_only: ClassVar[bool] = True

    def sequences(self, space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
        if self.seqs is None:
            raise ValueError("order=auto has no sequences yet: build the schedule with Settings.schedule, "
                             "which searches them")
        return [list(s) for s in self.seqs]


def zbv_sequence(space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
    """Each worker's jobs in ZB-V's order (``ScheduleZBVZeroBubble``'s), on the split backward.

    Worker ``w`` of ``P = S / 2`` holds its down stage ``a = w`` and its up stage ``c = S - 1 - w``.
    It counts as if there were ``M = max(B, 2P - 1)`` micro-batches (then drops the jobs of those
    past ``B``): ``2(P - w) - 1`` forwards of ``a``; ``w`` pairs ``F(c), F(a)``; ``P - w`` triples
    ``F(c), I(c), W(c)`` (the V's turn: ``c``'s gradient starts on the way up); then, while
    forwards remain, ``F(a)`` (when any is left), ``I(a), W(a), F(c), I(c), W(c)``; the drain is
    ``w`` pairs ``I(a), I(c)`` and ``P - w`` pairs ``I(a), W(a)``, and last the ``W`` jobs still
    owed, ``c``'s then ``a``'s, oldest first. With unit ``F``, ``I`` and ``W`` it has no bubble
    once ``B >= 2P - 1``, and every worker keeps at most ``2P`` micro-batches' activations."""
    P, B = _v_workers(space, ZBV.name), space.microbatches
    return [[space.id(s, b, k) for s, b, k in _zbv_worker(w, P, max(B, 2 * P - 1)) if b < B] for w in range(P)]


def _zbv_worker(w: int, P: int, M: int) -> list[tuple[int, int, str]]:
    """Worker ``w``'s ``(stage, micro-batch, kind)`` in ZB-V's order for ``M`` micro-batches."""
    a, c = w, 2 * P - 1 - w
    raw: list[tuple[int, int, str]] = []
    n = {(s, k): 0 for s in (a, c) for k in "FIW"}  # next micro-batch of each (stage, kind)

    def put(*jobs: tuple[int, str]) -> None:
        for s, k in jobs:
            raw.append((s, n[s, k], k))
            n[s, k] += 1

    for _ in range(2 * (P - w) - 1):
        put((a, "F"))
    for _ in range(w):
        put((c, "F"), (a, "F"))
    for _ in range(P - w):
        put((c, "F"), (c, "I"), (c, "W"))
    while n[c, "F"] < n[a, "F"] or n[a, "F"] < M:
        if n[a, "F"] < M:
            put((a, "F"))
        put((a, "I"), (a, "W"), (c, "F"), (c, "I"), (c, "W"))
    for _ in range(w):
        put((a, "I"), (c, "I"))
    for _ in range(P - w):
        put((a, "I"), (a, "W"))
    for s in (c, a):
        while n[s, "W"] < n[s, "I"]:
            put((s, "W"))
    return raw


def too_few_microbatches(order: type[Order], S: int, B: int) -> str | None:
    """The sentence for an order that needs at least as many micro-batches as stages
    (``dualpipev``, as PyTorch's ``ScheduleDualPipeV`` refuses fewer) given fewer; None otherwise."""
    if not order.at_least_stages or B >= S:
        return None
    return (f"microbatches={B} is invalid with order={order.name}: it needs at least as many micro-batches as "
            f"stages={S} (as PyTorch's schedule does); set microbatches >= {S}.")


def _v_workers(space: JobSpace, name: str) -> int:
    """``P = S / 2``, the V shape's workers, for an order made for it (split backward, even ``S``)."""
    if space.K != 3 or space.S % 2:
        raise ValueError(f"order={name} needs the split backward and an even number of stages, not stages={space.S} "
                         f"split_backward={space.K == 3}")
    return space.S // 2


def dualpipev_sequence(space: JobSpace, compute: Sequence[int]) -> list[list[int]]:
    """Each worker's jobs in DualPipeV's order (``ScheduleDualPipeV``'s), on the split backward.

    Worker ``w`` of ``P = S / 2`` holds its down stage ``a = w`` and its up stage ``c = S - 1 - w``;
    it needs ``B >= S``. PyTorch's full backward of a stage is our ``I`` then ``W`` of it, adjacent
    (which the engine runs as one autograd call where no peer waits for the gradient:
    :func:`~launcher.schedule.program.whole_backwards`);
    its overlapped forward + backward pair is the forward, then that backward (PyTorch runs the two
    one after the other on one stream too). In PyTorch's phases: ``2(P - w - 1)`` forwards of
    ``a``; ``w + 1`` pairs ``F(a), F(c)``; ``P - w - 1`` triples ``I(c), W(c), F(c)``; then
    ``B - 2P + w + 1`` rounds of ``F(a), B(c), F(c), B(a)`` (the two overlapped pairs); ``P - w - 1``
    rounds ``B(c), F(c), B(a)``; ``w + 1`` pairs ``B(c), B(a)``, whose second half runs ``I`` alone
    (the zero-bubble half); ``P - w - 1`` pairs of an owed ``W`` and ``B(a)`` (also ``I`` alone
    once the half is reached); last the ``w + 1`` owed ``W`` jobs. Owed ``W`` jobs run oldest first."""
    P = _v_workers(space, DualPipeV.name)
    if e := too_few_microbatches(DualPipeV, space.S, space.microbatches):
        raise ValueError(e)
    return [[space.id(s, b, k) for s, b, k in _dualpipev_worker(w, P, space.microbatches)] for w in range(P)]


def _dualpipev_worker(w: int, P: int, M: int) -> list[tuple[int, int, str]]:
    """Worker ``w``'s ``(stage, micro-batch, kind)`` in DualPipeV's order for ``M`` micro-batches,
    phase for phase ``ScheduleDualPipeV._calculate_single_rank_operations``."""
    a, c = w, 2 * P - 1 - w
    raw: list[tuple[int, int, str]] = []
    nf = {a: 0, c: 0}  # next micro-batch of each stage's F, and of its I
    ni = {a: 0, c: 0}
    owed: list[tuple[int, int]] = []  # (stage, micro-batch) of each I run alone, whose W is still to run

    def fwd(s: int) -> None:
        raw.append((s, nf[s], "F"))
        nf[s] += 1

    def bwd(s: int, alone: bool = False) -> None:
        """The backward of ``s``: ``I`` then ``W`` (PyTorch's full backward), or ``I`` alone with
        its ``W`` owed."""
        raw.append((s, ni[s], "I"))
        if alone:
            owed.append((s, ni[s]))
        else:
            raw.append((s, ni[s], "W"))
        ni[s] += 1

    def pay() -> None:
        if owed:
            s, b = owed.pop(0)
            raw.append((s, b, "W"))

    for _ in range(2 * (P - w - 1)):
        fwd(a)
    for _ in range(w + 1):
        fwd(a)
        fwd(c)
    for _ in range(P - w - 1):
        bwd(c, alone=True)
        pay()
        fwd(c)
    for _ in range(M - 2 * P + w + 1):
        fwd(a)
        bwd(c)
        fwd(c)
        bwd(a)
    for _ in range(P - w - 1):
        bwd(c)
        fwd(c)
        bwd(a)
    alone = False  # the zero-bubble half: from here on I runs alone and its W is owed
    for i in range(w + 1):
        alone = alone or (i == (w + 1) // 2 and w % 2 == 1)
        bwd(c, alone)
        alone = alone or (i == (w + 1) // 2 and w % 2 == 0)
        bwd(a, alone)
    for _ in range(P - w - 1):
        pay()
        bwd(a, alone)
    for _ in range(w + 1):
        pay()
    return raw


#: the built-in orders by name
ORDERS: dict[str, type[Order]] = {o.name: o for o in (OneFOneB, BreadthFirst, LongestWaiting, ZBH1, ZBH2, Interleaved,
                                                      ZBV, DualPipeV, AutoOrder)}
BUILTIN = tuple(ORDERS)
#: ``order`` when none is named: the scheme's own (:meth:`~launcher.schedule.settings.Settings.default_order`)
SCHEME_DEFAULT = "default"
#: built-in orders that only exist on the split backward
SPLIT_ONLY = tuple(name for name, o in ORDERS.items() if o.split_only)


def make_order(spec: str | Callable[[int, int, str], Any], warmup: str | None = None) -> Order:
    """Build an order from a built-in name or a callable ``key(s, b, d)``.

    ``warmup`` defaults to ``classic`` for ``1f1b``, ``zb_h1``, ``zb_h2`` and ``interleaved_1f1b``, ``none`` for
    every other order.
    """
    if warmup is not None and warmup not in WARMUPS:
        raise ValueError(f"warmup={warmup!r} is not valid; choose one of {list(WARMUPS)}")
    if callable(spec):
        return Custom(warmup=warmup or "none", key=spec)
    if spec not in ORDERS:
        raise ValueError(f"order={spec!r} is not a known order; choose one of {list(BUILTIN)}")
    cls = ORDERS[spec]
    return cls(warmup=warmup or cls.default_warmup)
