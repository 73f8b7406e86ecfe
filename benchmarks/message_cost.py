"""What one point-to-point message between two workers on one host costs: gloo against shared memory (a benchmark).

    python benchmarks/message_cost.py                        # 64 KB messages, 1 ms of compute between them
    python benchmarks/message_cost.py --kb 32 --messages 800 --reps 5

Two forked processes, one thread each for compute, as two pipeline workers on two cores: the
sender computes for ``--work-ms`` of CPU and then sends a message, ``--messages`` times; the
receiver waits for each message and then computes as long. Two transports, alternated
repetition by repetition:

- ``gloo``: ``dist.isend`` / ``dist.irecv`` with a tag per message, as the engine's messages go
  (a loopback TCP connection, moved by gloo's own threads);
- ``shared``: the sender copies the tensor into its slot of a buffer both processes map
  (``multiprocessing.shared_memory``) and writes the slot's number into a pipe; the receiver reads
  numbers from the pipe until its message's has come (the pipe's kernel locking orders the copy
  before the number, on any CPU) and copies the slot out. Not a transport of the engine: what one
  would save.

Printed: per message, the CPU each process spent beyond its compute (``time.process_time``, every
thread of the process), and the wall time of a repetition; medians over ``--reps``. Exit status 1
when a repetition's last message arrived different from what was sent.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("gloo", "shared")


def _compute(a: torch.Tensor, seconds: float) -> torch.Tensor:
    """Matrix products for ``seconds`` of this thread's CPU: a worker's job."""
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        a = a @ a
        a /= a.norm()
    return a


def _worker(rank: int, port: int, shm_name: str, pipe: tuple[int, int], args: argparse.Namespace,
            out: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shm = shared_memory.SharedMemory(name=shm_name)
    n, nbytes, work = args.messages, args.kb * 1024, args.work_ms / 1e3
    arena = torch.frombuffer(shm.buf, dtype=torch.float32)
    slot = nbytes // 4
    data, into, a = torch.randn(slot), torch.empty(slot), torch.randn(64, 64)
    read_fd, write_fd = pipe
    try:
        for rep in range(args.reps):
            for mode in MODES:
                dist.barrier()
                cpu, wall = time.process_time(), time.perf_counter()
                if rank == 0:
                    sends = []
                    for i in range(n):
                        a = _compute(a, work)
                        if mode == "gloo":
                            sends.append(dist.isend(data, 1, tag=i))
                        else:
                            arena[i * slot:(i + 1) * slot].copy_(data)
                            os.write(write_fd, i.to_bytes(4, "little"))
                    for s in sends:
                        s.wait()
                else:
                    arrived: set[int] = set()
                    pending = b""
                    for i in range(n):
                        if mode == "gloo":
                            dist.irecv(into, 0, tag=i).wait()
                        else:
                            while i not in arrived:
                                pending += os.read(read_fd, 4096)
                                whole = len(pending) // 4 * 4
                                arrived.update(int.from_bytes(pending[k:k + 4], "little") for k in range(0, whole, 4))
                                pending = pending[whole:]
                            into.copy_(arena[i * slot:(i + 1) * slot])
                        a = _compute(a, work)
                spent, took = time.process_time() - cpu, time.perf_counter() - wall
                dist.barrier()
                same = rank == 0 or torch.equal(into, data)  # the receiver got the sender's tensor
                into.zero_()
                out.put((rank, mode, rep, (spent - n * work) / n, took, same))
    finally:
        del arena
        shm.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kb", type=int, default=64, help="message size in KiB")
    ap.add_argument("--messages", type=int, default=400, help="messages per repetition")
    ap.add_argument("--work-ms", type=float, default=1.0, help="CPU milliseconds of compute between messages")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per transport, alternated")
    ap.add_argument("--port", type=int, default=0, help="the rendezvous port (0: a free one)")
    args = ap.parse_args(argv)
    if not args.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    shm = shared_memory.SharedMemory(create=True, size=args.messages * args.kb * 1024)
    read_fd, write_fd = os.pipe()
    out: mp.SimpleQueue = mp.get_context("fork").SimpleQueue()
    try:
        mp.start_processes(_worker, args=(args.port, shm.name, (read_fd, write_fd), args, out), nprocs=2,
                           start_method="fork")
    finally:
        shm.close()
        shm.unlink()
    rows = [out.get() for _ in range(2 * len(MODES) * args.reps)]
    print(f"{args.messages} messages of {args.kb} KiB, {args.work_ms} ms of compute between them, "
          f"medians of {args.reps} alternated repetitions")
    for mode in MODES:
        cpu = [statistics.median(r[3] for r in rows if r[0] == rank and r[1] == mode) * 1e6 for rank in (0, 1)]
        wall = statistics.median(r[4] for r in rows if r[0] == 0 and r[1] == mode)
        print(f"  {mode:7s} CPU beyond compute per message: sender {cpu[0]:7.1f} us, receiver {cpu[1]:7.1f} us; "
              f"wall {wall:.3f} s")
    bad = sorted({r[1] for r in rows if not r[5]})
    if bad:
        print(f"the received tensor differs from the sent one under {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
