"""Point-to-point messages between workers on one host through shared memory (``transport="shm"``).

Over gloo a message between two processes on one host is a loopback TCP round: the sender's call
writes it into a socket, gloo's threads on both sides move it, and on two busy cores that costs
hundreds of microseconds of CPU a message (``benchmarks/message_cost.py``). Here each pair of
workers has one Unix socket, for notices only, and each direction a buffer both processes map:

- the sender copies the tensor into the message's slot of its buffer and writes a notice (the
  message's id) to the socket; the receiver, when it waits for the message, reads notices until
  its id has come, copies the slot out and sends an acknowledgement back. The socket's kernel
  locking orders the copy before the notice on any CPU.
- Slots are laid out per step from the messages themselves (their ids and sizes, which both sides
  compute from the same program and shapes), so each side knows every offset without asking. A
  send completes when acknowledged, as a gloo send completes when received, and the end of a
  worker's step waits for all of them (:meth:`~launcher.runtime.comm.Comm.finish`): a slot is
  never written again before it is read, and a worker never leaves while a peer still reads from
  it. A buffer too small for a step's messages is replaced by a larger one (a ``memfd`` handed
  over on the socket).
- A peer that dies closes its end of the socket: a wait reads the end of the stream and raises
  :class:`ConnectionError`, which the engine's failure handling reports like a lost gloo
  connection. A wait also checks the watchdog between notices.

The same links carry the replicas' gradient all-reduce through shared memory
(:mod:`.shared_reduce`): its buffers are handed over as ``AREA`` notices, and its progress as
``SHARE`` and ``SUMMED`` notices (each with the bucket's index), read by the same waits. Weights,
partial sums and every other collective stay on gloo. Every worker of the group must be on this host.
"""

from __future__ import annotations

import mmap
import os
import secrets
import select
import socket
import struct
import sys
import time
from typing import Callable, Iterable

import torch

from .failure import Watchdog

# a notice: its kind and a number, DATA (the message's id), ACK (the message's id), BUFFER (its size);
# for the shared all-reduce (:mod:`.shared_reduce`) AREA, SHARE and SUMMED (a bucket's index)
NOTICE = struct.Struct("<Bq")
DATA, ACK, BUFFER, AREA, SHARE, SUMMED = 0, 1, 2, 3, 4, 5
ALIGN = 64  # slot alignment in bytes: a cache line
CONNECT_S = 60.0  # how long a worker waits for a peer's listening socket at set-up
POLL_S = 0.2  # how often a wait looks at the watchdog while no notice comes


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class MappedFile:
    """One direction's shared buffer: an anonymous memory file mapped by both processes (the
    mapping keeps it; its descriptor is closed once handed over)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.bytes
        try:
            self.map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
            pass


class _Peer:
    """The link with one peer: its socket, what has come on it, and both directions' buffers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = b""
        self.fds: list[int] = []  # descriptors received, not yet taken by their notice
        self.arrived: set[int] = set()  # the peer's messages to this worker, in its buffer, not read yet
        self.unacked: set[int] = set()  # this worker's messages the peer has not read yet
        self.out: MappedFile | None = None  # this worker's messages to the peer
        # the peer's buffer of messages to this worker (a new one replaces it only once every
        # message in it was read: the peer's step ended on their acknowledgements)
        self.inbox: MappedFile | None = None
        # the shared all-reduce: the peer's buffer per bucket, and the buckets whose notices came
        self.areas: dict[int, MappedFile] = {}
        self.shared: set[int] = set()  # the peer's share of the bucket is complete
        self.summed: set[int] = set()  # the peer's chunk of the bucket is summed


class SharedLinks:
    """This worker's shared-memory links to its peers (see the module docstring)."""

    def __init__(self, token: str, worker: int, peers: Iterable[int], watchdog: Watchdog | None) -> None:
        """Link ``worker`` with each of ``peers`` (the workers it exchanges messages with, all on
        this host: :func:`host_identity`); ``token``: the same string on every worker of the group
        and unique to it (:func:`new_token`), which names the workers' sockets."""
        self.peers: dict[int, _Peer] = {}
        self.me, self.watchdog = worker, watchdog
        self.offsets: dict[int, int] = {}  # message id -> its slot's offset in its direction's buffer
        mine = sorted(set(peers))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(_address(token, worker))  # the abstract namespace: no file to clean up
        listener.listen(max(len(mine), 1))
        listener.settimeout(CONNECT_S)
        try:
            for p in (p for p in mine if p > worker):  # connect to the higher peers, which listen
                self.peers[p] = _Peer(self._connect(token, p))
                self.peers[p].sock.sendall(struct.pack("<i", worker))
            for _ in (p for p in mine if p < worker):  # and take the lower peers' connections
                conn, _ = listener.accept()
                conn.settimeout(None)
                (peer,) = struct.unpack("<i", _read_exactly(conn, 4))
                self.peers[peer] = _Peer(conn)
        finally:
            listener.close()

    def _connect(self, token: str, peer: int) -> socket.socket:
        deadline = time.monotonic() + CONNECT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(_address(token, peer))
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(f"worker {self.me} found no link to worker {peer} within {CONNECT_S:.0f} s")
                if self.watchdog is not None:
                    self.watchdog.check()
                time.sleep(0.01)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        for peer in self.peers.values():
            peer.sock.close()
            for buf in (peer.out, peer.inbox, *peer.areas.values()):
                if buf is not None:
                    buf.close()
            for fd in peer.fds:
                os.close(fd)
        self.peers.clear()

    # ---- a step --------------------------------------------------------------------------------
    def begin_step(self, messages: Iterable[tuple[int, int, int, int]]) -> None:
        """Lay out the step's messages ``(id, src, dst, bytes)`` that take these links: each
        direction's slots in id order, and a larger buffer for this worker's sends where needed
        (every message of the last step was read: its end waited for that)."""
        self.offsets = {}
        used: dict[tuple[int, int], int] = {}  # (src, dst) -> bytes laid out so far
        for mid, src, dst, nbytes in sorted(messages):
            at = used.get((src, dst), 0)
            self.offsets[mid] = at
            used[(src, dst)] = at + aligned(nbytes)
        for (src, dst), need in used.items():
            peer = self.peers[dst] if src == self.me else None
            need = max(need, ALIGN)  # messages of no bytes still have a (mappable) buffer
            if peer is None or (peer.out is not None and peer.out.size >= need):
                continue
            fd = os.memfd_create("launcher-p2p")
            try:
                os.ftruncate(fd, need)
                buf = MappedFile(fd, need)
                socket.send_fds(peer.sock, [NOTICE.pack(BUFFER, need)], [fd])
            finally:
                os.close(fd)
            if peer.out is not None:
                peer.out.close()
            peer.out = buf

    def send(self, mid: int, dst: int, t: torch.Tensor) -> "_Send":
        """Copy ``t`` into message ``mid``'s slot and tell ``dst``."""
        peer = self.peers[dst]
        out = peer.out
        assert out is not None  # begin_step made it
        data = t.detach().reshape(-1).view(torch.uint8)
        at = self.offsets[mid]
        out.bytes[at:at + data.numel()].copy_(data)
        peer.unacked.add(mid)
        peer.sock.sendall(NOTICE.pack(DATA, mid))
        return _Send(self, mid, dst)

    def recv(self, mid: int, src: int, into: torch.Tensor) -> "SharedRecv":
        """Message ``mid`` from ``src``, copied into ``into`` when waited for."""
        return SharedRecv(self, mid, src, into)

    # ---- notices -------------------------------------------------------------------------------
    def notify(self, dst: int, kind: int, n: int) -> None:
        """Write a notice to ``dst``."""
        self.peers[dst].sock.sendall(NOTICE.pack(kind, n))

    def hand_over(self, dst: int, kind: int, n: int, fd: int) -> None:
        """Write a notice that carries the memory file ``fd`` to ``dst`` (which maps it on reading)."""
        socket.send_fds(self.peers[dst].sock, [NOTICE.pack(kind, n)], [fd])

    def pump(self, src: int, until: Callable[[], bool], wait: bool = True) -> None:
        """Read ``src``'s notices until ``until()`` holds (``wait=False``: only those already there)."""
        peer = self.peers[src]
        while not until():
            ready, _, _ = select.select([peer.sock], [], [], POLL_S if wait else 0.0)
            if not ready:
                if not wait:
                    return
                if self.watchdog is not None:
                    self.watchdog.check()
                continue
            data, fds, _, _ = socket.recv_fds(peer.sock, 1 << 16, 8)
            if not data:
                raise ConnectionError(f"worker {src} closed its link to worker {self.me} (it stopped or died)")
            peer.fds += fds
            peer.pending += data
            whole = len(peer.pending) // NOTICE.size * NOTICE.size
            for k in range(0, whole, NOTICE.size):
                kind, n = NOTICE.unpack_from(peer.pending, k)
                if kind == DATA:
                    peer.arrived.add(n)
                elif kind == ACK:
                    peer.unacked.discard(n)
                elif kind == SHARE:
                    peer.shared.add(n)
                elif kind == SUMMED:
                    peer.summed.add(n)
                elif kind == AREA:  # the peer's buffer of bucket n (its size: the file's)
                    fd = peer.fds.pop(0)
                    try:
                        peer.areas[n] = MappedFile(fd, os.fstat(fd).st_size)
                    finally:
                        os.close(fd)
                else:  # a larger buffer of the peer's messages: every one in the old was read
                    if peer.inbox is not None:
                        peer.inbox.close()
                    fd = peer.fds.pop(0)
                    try:
                        peer.inbox = MappedFile(fd, n)
                    finally:
                        os.close(fd)
            peer.pending = peer.pending[whole:]

    def _take(self, mid: int, src: int, into: torch.Tensor) -> float | None:
        """Copy message ``mid`` out once its notice has come; return when it came, or ``None``
        when it was there already (the copy after it is the receiver's work, not a wait for the
        sender: timed as a wait, a message read long after it came would count as a slow one)."""
        peer = self.peers[src]
        here = lambda: mid in peer.arrived  # noqa: E731
        came = None
        self.pump(src, here, wait=False)
        if not here():
            self.pump(src, here)
            came = time.perf_counter()
        peer.arrived.discard(mid)
        assert peer.inbox is not None  # its notice came before the message's
        out = into.reshape(-1).view(torch.uint8)
        at = self.offsets[mid]
        out.copy_(peer.inbox.bytes[at:at + out.numel()])
        peer.sock.sendall(NOTICE.pack(ACK, mid))
        return came

    def _delivered(self, mid: int, dst: int) -> None:
        peer = self.peers[dst]
        self.pump(dst, lambda: mid not in peer.unacked)


class _Send:
    """A send through a shared buffer, waited for as a ``dist.Work`` is: until the peer has read it."""

    def __init__(self, links: SharedLinks, mid: int, dst: int) -> None:
        self.links, self.mid, self.dst, self.done = links, mid, dst, False

    def wait(self, timeout: object = None) -> bool:
        if not self.done:
            self.links._delivered(self.mid, self.dst)
            self.done = True
        return True


class SharedRecv:
    """A receive from a shared buffer, waited for as a ``dist.Work`` is: the data is in ``into`` after.
    ``came``: after the wait, when the data came if the wait blocked for it (``None``: it was there)."""

    def __init__(self, links: SharedLinks, mid: int, src: int, into: torch.Tensor) -> None:
        self.links, self.mid, self.src, self.into, self.done = links, mid, src, into, False
        self.came: float | None = None

    def wait(self, timeout: object = None) -> bool:
        if not self.done:
            self.came = self.links._take(self.mid, self.src, self.into)
            self.done = True
        return True


def new_token() -> str:
    """A fresh name for one group's links (every worker must use rank 0's)."""
    return secrets.token_hex(8)


def shared_links_possible() -> bool:
    """Whether this system has what the links need: anonymous memory files handed over a Unix
    socket, and the abstract socket namespace (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def host_identity() -> tuple[str, str]:
    """Who can link with whom: the running kernel (its boot id) and the network namespace (the
    abstract sockets are per namespace); equal on two workers exactly when they can link."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.readlink("/proc/self/ns/net")
    except OSError:  # no /proc to tell: this worker links with nobody
        return f"{socket.gethostname()}-{os.getpid()}", ""


def _address(token: str, worker: int) -> str:
    return f"\0launcher-p2p-{token}-{worker}"


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("a peer closed its link while setting it up")
        out += part
    return out
