"""Point-to-point messages of one step over ``torch.distributed``, issued in the program's pair order.

Every operation is asynchronous (``isend``/``irecv``); the communication backend moves data on its
own threads while the worker computes: a prefetch running beside the compute, without a Python thread
fighting the compute for the GIL. Between workers on one host the activations and their gradients
go through shared memory instead (:mod:`.shared_links`), with the same send, receive and wait.

When each operation goes out is :class:`~launcher.schedule.program.PairIssue`'s rule (per peer,
strictly in the pair order, as NCCL needs), the one the lowering's memory prediction replays.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

from launcher.schedule.program import ACT, GRAD, WGRAD, Lowered, Msg, PairIssue

from ..torch_support.values import spec_bytes
from .failure import Watchdog, blocked, raise_named
from .shared_links import SharedLinks, SharedRecv

Spec = tuple[tuple[int, ...], torch.dtype]


# ---- point-to-point, on any device -----------------------------------------------------------
def host_staged(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether a point-to-point message of ``t`` must go through host memory: gloo's ``send`` and
    ``recv`` hand the tensor's pointer to its TCP transport as host memory (its collectives copy
    CUDA tensors through pinned buffers themselves; its point-to-point does not), so a GPU tensor
    crosses through a pinned host copy. NCCL moves GPU tensors itself."""
    return t.device.type != "cpu" and dist.get_backend(group) == "gloo"


class HostBufferWork:
    """A point-to-point operation through a host buffer, waited for as a ``dist.Work`` is: a receive
    copies the buffer into its device tensor on the current stream once it has arrived (work queued
    after the wait on that stream sees the data; the caching host allocator keeps the pinned buffer
    until the copy has run)."""

    def __init__(self, work: dist.Work, host: torch.Tensor, into: torch.Tensor | None = None) -> None:
        self.work, self.host, self.into = work, host, into

    def wait(self, timeout: Any = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.into is not None:
            self.into.copy_(self.host, non_blocking=True)
            self.into = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.into is None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """An empty host buffer for ``t`` (pinned when ``t`` is on a GPU: copies to and from it are DMA)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)


def host_isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> HostBufferWork:
    host = _host_copy(t)
    host.copy_(t)  # waits for the kernels that write ``t``: the transport reads the copy on its own thread
    work = dist.isend(host, dst, group=group, tag=tag)
    assert work is not None  # None only where this rank is outside the group: no worker sends there
    return HostBufferWork(work, host)


def host_irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> HostBufferWork:
    host = _host_copy(t)
    work = dist.irecv(host, src, group=group, tag=tag)
    assert work is not None  # None only where this rank is outside the group: no worker receives there
    return HostBufferWork(work, host, into=t)


def isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> Any:
    """``dist.isend`` for a tensor on any device the group's backend can reach (see :func:`host_staged`)."""
    if host_staged(t, group):
        return host_isend(t, dst, group, tag)
    return dist.isend(t, dst, group=group, tag=tag)


def irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> Any:
    """``dist.irecv`` into a tensor on any device the group's backend can reach (see :func:`host_staged`)."""
    if host_staged(t, group):
        return host_irecv(t, src, group, tag)
    return dist.irecv(t, src, group=group, tag=tag)

#: a wait shorter than this found its data already there (the call's own cost), not a late message
BLOCKED_S = 20e-6
TIMED = (ACT, GRAD, WGRAD)  # the step's dependencies, and partial sums (an exchange's rounds)
LINKED = (ACT, GRAD)  # the kinds a worker's shared-memory links carry (the engine's ``transport``)


class Clock:
    """When each outgoing message was handed over, and when each incoming message that had to be
    waited for arrived (on this host's monotonic clock): a sender's and a receiver's entries for
    one message, from the same host, give what the message took while the receiver waited.

    Two kinds are kept apart. A job's input (an activation or a gradient) counts from its hand-over:
    what a job that needs it waits after the job that made it. A round of the end-of-step exchange
    (a partial sum, an all-reduce's) counts from the later of its hand-over and its receive being
    posted: a partial sum handed over during the step and asked for at its end took only what
    followed the asking, the part of the exchange the step waits for."""

    def __init__(self, on: bool = True) -> None:
        self.on = on  # off: records nothing (a long run keeps its first steps' timings only)
        self.sent_at: dict[Any, float] = {}
        self.posted_at: dict[Any, float] = {}
        self.arrivals: list[tuple[Any, float]] = []  # job inputs: (key, arrival)
        self.rounds: list[tuple[Any, float, float]] = []  # exchange rounds: (key, arrival, seconds since posted)

    def sent(self, key: Any) -> None:
        if self.on:
            self.sent_at[key] = time.perf_counter()

    def posted(self, key: Any) -> None:
        if self.on:
            self.posted_at[key] = time.perf_counter()

    def arrived(self, key: Any, at: float, blocked_s: float, exchange: bool = False) -> None:
        if self.on and blocked_s > BLOCKED_S:
            if exchange:
                self.rounds.append((key, at, at - self.posted_at.get(key, at - blocked_s)))
            else:
                self.arrivals.append((key, at))


class Comm:
    """The messages of one worker in one step, with counts and bytes per kind."""

    def __init__(
        self,
        lowered: Lowered,
        worker: int,
        spec: Callable[[Msg], Spec],
        device: torch.device,
        watchdog: Watchdog | None = None,
        group: dist.ProcessGroup | None = None,
        ranks: list[int] | None = None,
        on_alloc: Callable[[Msg], None] | None = None,
        timed: bool = True,
        traced: bool = False,
        links: SharedLinks | None = None,
    ) -> None:
        self.msgs = lowered.messages
        self.me = worker
        self.spec = spec
        self.device = device
        self.watchdog = watchdog
        self.group = group
        self.ranks = ranks or list(range(lowered.workers))  # worker -> rank in ``group``
        self.on_alloc = on_alloc
        self.queue = lowered.programs[worker].pair_order
        self.issue = PairIssue(self.msgs, worker, self.queue)  # when each operation may go out
        self.ready: dict[int, torch.Tensor] = {}  # outgoing data handed over, not issued yet
        self.works: dict[int, Any] = {}  # mid -> its receive (a dist.Work, or a shared link's)
        self.buffers: dict[int, torch.Tensor] = {}
        self.sends: dict[int, tuple[Any, torch.Tensor]] = {}  # mid -> its send, until delivered
        self.waited = 0.0  # seconds spent blocked waiting for incoming data (not compute)
        # what a message between workers really takes here (:class:`Clock`), for the activations
        # and gradients (the dependencies the simulator charges), the partial sums and the
        # all-reduces' rounds (the end of the step)
        self.clock = Clock(timed)
        # the traced step (:meth:`~launcher.runtime.engine.Engine.trace`): each receive's first
        # wait ``(mid, began, ended, bytes)`` and each send's hand-over ``(mid, at, bytes)``, on this
        # host's monotonic clock; None when not traced
        self.waits: list[tuple[int, float, float, int]] | None = [] if traced else None
        self.handed: list[tuple[int, float, int]] | None = [] if traced else None
        # activations and their gradients between workers on one host through shared memory (the
        # engine's ``transport``): every message of those kinds with this worker, laid out for the step
        self.links = links
        if links is not None:
            linked = (self.msgs[mid] for q in self.queue.values() for mid in q)
            links.begin_step((m.mid, m.src, m.dst, spec_bytes(spec(m))) for m in linked if m.kind in LINKED)
        self.recv_count: dict[str, int] = defaultdict(int)
        self.recv_bytes: dict[str, int] = defaultdict(int)
        self.sent_count: dict[str, int] = defaultdict(int)
        self.sent_bytes: dict[str, int] = defaultdict(int)

    def _issue(self, mid: int) -> None:
        m = self.msgs[mid]
        self._check()
        try:
            if m.src == self.me:
                t = self.ready.pop(mid)
                if not t.is_contiguous():
                    t = t.contiguous()
                if self.links is not None and m.kind in LINKED:
                    self.sends[mid] = (self.links.send(mid, m.dst, t), t)
                else:
                    self.sends[mid] = (isend(t, self.ranks[m.dst], group=self.group, tag=mid), t)
                self.sent_count[m.kind] += 1
                self.sent_bytes[m.kind] += t.numel() * t.element_size()
            else:
                shape, dtype = self.spec(m)
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                if self.on_alloc is not None:
                    self.on_alloc(m)
                self.buffers[mid] = buf
                if self.links is not None and m.kind in LINKED:
                    self.works[mid] = self.links.recv(mid, m.src, buf)
                else:
                    self.works[mid] = irecv(buf, self.ranks[m.src], group=self.group, tag=mid)
                if m.kind == WGRAD:
                    self.clock.posted(mid)
        except Exception as e:
            self._failed(e)

    # ---- the worker's side ------------------------------------------------------------------
    def send(self, mid: int, tensor: torch.Tensor) -> None:
        """Hand over the data of an outgoing message; it goes out as soon as the pair order allows."""
        self.ready[mid] = tensor.detach()
        if self.handed is not None:
            self.handed.append((mid, time.perf_counter(), tensor.numel() * tensor.element_size()))
        if self.msgs[mid].kind in TIMED:
            self.clock.sent(mid)
        for m in self.issue.ready(mid):
            self._issue(m)

    def want(self, mid: int) -> None:
        """Ask for an incoming message ahead of time (prefetch)."""
        for m in self.issue.want(mid):
            self._issue(m)

    def wait(self, mid: int) -> torch.Tensor:
        """The data of an incoming message, blocking until it is here; counted once."""
        self.want(mid)
        work = self.works.pop(mid, None)
        if work is not None:
            self._check()
            t0 = time.perf_counter()
            try:
                with blocked(self.watchdog):
                    work.wait()
            except Exception as e:
                self._failed(e)
            t1 = time.perf_counter()
            if isinstance(work, SharedRecv):  # a shared-memory receive copies its data out after it came:
                t1 = t0 if work.came is None else work.came  # that copy is work, not a wait for the sender
            self.waited += t1 - t0
            m = self.msgs[mid]
            if m.kind in TIMED:
                self.clock.arrived(mid, t1, t1 - t0, exchange=m.kind == WGRAD)
            buf = self.buffers[mid]
            nbytes = buf.numel() * buf.element_size()
            self.recv_count[m.kind] += 1
            self.recv_bytes[m.kind] += nbytes
            if self.waits is not None:
                self.waits.append((mid, t0, t1, nbytes))
        if mid not in self.buffers:  # never posted: only possible if the pair order is broken
            raise RuntimeError(f"message {self.msgs[mid]} was not posted; the programs' pair order is inconsistent")
        return self.buffers[mid]

    def deliver(self, mid: int) -> None:
        """Wait until an outgoing message that went out is delivered, and let go of its data: the
        engine has dropped its own reference (a partial sum under cache ``job``), so the memory
        goes back now, not at the end of the step. (gloo reports a send complete only once it is
        waited for, so the program says when the receiver has posted it: the wait is short.)"""
        sent = self.sends.pop(mid, None)
        if sent is None:  # not issued yet (the pair order holds it back): it goes at the end
            return
        self._check()
        try:
            with blocked(self.watchdog):
                sent[0].wait()
        except Exception as e:
            self._failed(e)

    def drop(self, mid: int) -> None:
        """Forget a received buffer (the worker's reference is what keeps its memory)."""
        self.buffers.pop(mid, None)

    def finish(self) -> None:
        """Wait for every outgoing message to be delivered."""
        for peer in self.queue:
            for m in self.issue.pump(peer):
                self._issue(m)
            if pending := self.issue.pending(peer):
                raise RuntimeError(f"worker {self.me} ends its step with messages to/from {peer} not issued: "
                                   f"{[self.msgs[m] for m in pending[:3]]}")
        for work, _ in self.sends.values():
            self._check()
            try:
                with blocked(self.watchdog):
                    work.wait()
            except Exception as e:
                self._failed(e)
        self.sends.clear()

    def _check(self) -> None:
        if self.watchdog is not None:
            self.watchdog.check()

    def _failed(self, e: Exception) -> None:
        """A communication error: most likely a peer died. Name it if the watchdog can."""
        raise_named(self.watchdog, e)
