"""The process group under :class:`~launcher.lightning.UnifiedStrategy`: Lightning's parallel
strategy's plumbing (devices, ranks, the default group, barrier, broadcast, reduce) without a DDP
wrapper, since the engine moves every tensor itself."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from ..runtime.failure import Watchdog, blocked, current_watchdog, set_current_watchdog
from ..runtime.processes import auto_backend
from ..runtime.recovery import current_membership
from ..torch_support.torch_private import default_store
from .lightning_private import init_dist_connection, sync_ddp_if_available
from .precision import process_group_up


class ProcessGroupStrategy(ParallelStrategy):
    """A parallel strategy over one default process group (gloo on CPU, NCCL on GPU, or
    ``process_group_backend``), started by our fork launcher or joined from torchrun or Slurm;
    ``timeout``: seconds within which every worker stops after one fails (the watchdog's)."""

    def __init__(self, timeout: float, process_group_backend: str | None = None, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.timeout = timeout
        self._backend = process_group_backend
        self._num_nodes = 1
        self._watchdog: Watchdog | None = None

    @property
    def backend(self) -> str:
        return self._backend or ("nccl" if self.root_device.type == "cuda" else auto_backend("gloo"))

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # every worker reads the whole batch (the engine cuts it into micro-batches), so Lightning
        # must not shard the data with a DistributedSampler
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup_environment(self) -> None:
        self.setup_distributed()
        super().setup_environment()

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        if not process_group_up():  # torchrun or Slurm started us; the fork launcher did it already
            from .elastic import attempt_store

            # a torchrun restart: the agent's store, under this attempt's prefix (.elastic)
            store = attempt_store(self.world_size)
            init_dist_connection(self.cluster_environment, self.backend, timeout=default_pg_timeout,
                                 **({"store": store} if store is not None else {}))
            store = default_store()
            self._watchdog = Watchdog(dist.PrefixStore("launcher/watchdog", store), self.global_rank,
                                      self.world_size, self.timeout, on_hard_exit=_hard_exit).start()
            set_current_watchdog(self._watchdog)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            m = current_membership()
            if m is not None and m.generation > 0:  # after a recovery (fit entered again): the new group's
                self.cluster_environment.set_global_rank(m.new_rank)
                self.cluster_environment.set_world_size(len(m.members))
            else:
                self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
                self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's own attribute of the function

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if process_group_up():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not process_group_up():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def stop_watchdog(self) -> None:
        """Stop the watchdog this strategy started for a process group it joined (torchrun, Slurm)."""
        if self._watchdog is not None:
            self._watchdog.stop(done=True)
            self._watchdog = None


def _hard_exit(message: str) -> None:
    """A joined worker's watchdog stops its process: its one line (in one write, so that ranks' lines
    never interleave), and on Slurm the requeue a lost task asks for (:mod:`.lost_task`)."""
    import os
    import sys

    from . import lost_task

    try:
        sys.stderr.flush()
        os.write(2, (message + "\n").encode())
    except OSError:
        pass
    lost_task.on_hard_exit(message)


def agreed_seed(device: torch.device) -> int:
    """Rank 0's ``torch.initial_seed()`` on every rank (63 bits): the seed of every job's random
    streams (:mod:`launcher.torch_support.streams`), so processes started apart agree."""
    t = torch.tensor([torch.initial_seed() & (2**63 - 1)], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        with blocked(current_watchdog()):
            dist.broadcast(t, 0)
    return int(t.item())
