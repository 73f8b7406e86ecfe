"""What one point-to-point message between two workers on one host costs: gloo against shared memory (a benchmark).

    python benchmarks/message_cost.py                        # 64 KB messages, 1 ms of compute between them
    python benchmarks/message_cost.py --kb 32 --messages 800 --reps 5

Two forked processes, one thread each for compute, as two pipeline workers on two cores: the
sender computes for ``--work-ms`` of CPU and then sends a message, ``--messages`` times; the
receiver waits for each message and then computes as long. Two transports, alternated
repetition by repetition:

- ``gloo``: ``dist.isend`` / ``dist.irecv`` with a tag per message, as the engine's messages go
  under ``transport="gloo"`` (a loopback TCP connection, moved by gloo's own threads);
- ``shared``: the engine's links between workers on one host
  (:class:`launcher.runtime.shared_links.SharedLinks`, its default there): the sender copies the
  tensor into its slot of a buffer both processes map and sends a notice; the receiver copies it
  out and acknowledges; the sender waits for the acknowledgements at the end, as a step does.

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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.runtime.shared_links import SharedLinks, new_token

MODES = ("gloo", "shared")


def _compute(a: torch.Tensor, seconds: float) -> torch.Tensor:
    """Matrix products for ``seconds`` of this thread's CPU: a worker's job."""
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        a = a @ a
        a /= a.norm()
    return a


def _worker(rank: int, port: int, token: str, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    links = SharedLinks(token, rank, [1 - rank], None)
    n, work = args.messages, args.work_ms / 1e3
    data, into, a = torch.randn(args.kb * 256), torch.empty(args.kb * 256), torch.randn(64, 64)
    try:
        for rep in range(args.reps):
            for mode in MODES:
                links.begin_step((i, 0, 1, data.numel() * data.element_size()) for i in range(n))
                dist.barrier()
                cpu, wall = time.process_time(), time.perf_counter()
                if rank == 0:
                    sends = []
                    for i in range(n):
                        a = _compute(a, work)
                        sends.append(dist.isend(data, 1, tag=i) if mode == "gloo" else links.send(i, 1, data))
                    for s in sends:
                        s.wait()
                else:
                    for i in range(n):
                        (dist.irecv(into, 0, tag=i) if mode == "gloo" else links.recv(i, 0, into)).wait()
                        a = _compute(a, work)
                spent, took = time.process_time() - cpu, time.perf_counter() - wall
                dist.barrier()
                same = rank == 0 or torch.equal(into, data)  # the receiver got the sender's tensor
                into.zero_()
                out.put((rank, mode, rep, (spent - n * work) / n, took, same))
    finally:
        links.close()
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
    out: mp.SimpleQueue = mp.get_context("fork").SimpleQueue()
    mp.start_processes(_worker, args=(args.port, new_token(), args, out), nprocs=2, start_method="fork")
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
