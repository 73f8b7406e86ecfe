"""Checkpoint state of a partitioned module, in the single-device layout.

Each worker holds only the stages it owns. A checkpoint gathers every stage from its first owner
(replicas are equal) into the state dict the unpartitioned LightningModule would have, and the
optimizer state into the layout the single-device optimizer would have: parameters numbered in the
module's ``named_parameters()`` order, each parameter group listing its parameters in that order.
So the file loads with ``load_from_checkpoint`` on one process, resumes under Lightning's default
strategy, and resumes under any other scheme (each worker takes back its own stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Layout:
    """Where every parameter and buffer of the full module lives.

    ``names``: the full module's parameter names, in ``named_parameters()`` order (a parameter
    shared by several modules, tied embeddings, under its first name);
    ``stage_names[s]``: those names for stage ``s``'s parameters, in the stage module's order;
    ``stage_buffers[s]``: the full names of stage ``s``'s buffers that the module's state dict
    holds (``None`` for one it does not keep, a non-persistent buffer), in the stage's order;
    ``aliases``: every other name of a shared parameter -> its first name;
    ``writers``: the stages this worker writes into a checkpoint (those it is the first owner of).
    """

    names: list[str]
    stage_names: list[list[str]]
    writers: list[int]
    stage_buffers: list[list[str | None]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, module: nn.Module, stages: list[nn.Module], writers: list[int],
           ties: list[list[tuple[int, int]]] | None = None) -> "Layout":
        """The layout of ``module`` cut into the stage modules ``stages`` (made of its own
        submodules or holding its own tensors), read off the objects, not their names. ``ties``:
        the parameters several stages share, as ``(stage, index)`` uses (:attr:`Engine.ties`,
        found before the stages were placed): a worker that materialises one use of a tied
        parameter and not the other holds two objects where one device holds one."""
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                aliases[n] = first[id(p)]
            else:
                first[id(p)] = n
        kept = set(module.state_dict(keep_vars=True))
        buffer_name = {id(b): n for n, b in module.named_buffers(remove_duplicate=False) if n in kept}
        stage_names = [[first[id(p)] for p in m.parameters()] for m in stages]
        names = list(first.values())
        for uses in ties or []:
            (s0, i0), *later = sorted(uses)
            for s, i in later:
                other = stage_names[s][i]
                if other != stage_names[s0][i0]:  # the tie broken on this worker: one name again
                    aliases[other] = stage_names[s0][i0]
                    stage_names[s][i] = stage_names[s0][i0]
                    names.remove(other)
        return cls(names, stage_names, writers, [[buffer_name.get(id(b)) for b in m.buffers()] for m in stages],
                   aliases)

    @property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @property
    def staged_names(self) -> set[str]:
        """Every state-dict key that belongs to a stage (parameters, their aliases, buffers)."""
        out = {n for names in self.stage_names for n in names} | set(self.aliases)
        return out | {n for names in self.stage_buffers for n in names if n is not None}

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def first_stage(self) -> dict[str, int]:
        """Every parameter's and stage buffer's name -> the first stage that holds it (a tied
        parameter is written once, by that stage's writer)."""
        out: dict[str, int] = {}
        buffers_of = self.stage_buffers or [[] for _ in self.stage_names]
        for s, (params, buffers) in enumerate(zip(self.stage_names, buffers_of)):
            for n in [*params, *buffers]:
                if n is not None:
                    out.setdefault(n, s)
        return out

    @property
    def written(self) -> set[str]:
        """The names this worker writes into a sharded checkpoint: those whose first stage it writes."""
        mine = set(self.writers)
        return {n for n, s in self.first_stage().items() if s in mine}


#: ``group=ALONE``: the state of a worker that holds every stage, taken from it alone with no
#: collective (a survivor's state handed to a replacement process, :mod:`.replacement`)
ALONE: Any = object()


def _gather(obj: Any, group: Any) -> list[Any] | None:
    """Every rank's ``obj`` at rank 0 (None elsewhere); every rank must call it (``ALONE``: this one's)."""
    if group is ALONE:
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def gather_module_state(module: nn.Module, layout: Layout, modules: dict[int, nn.Module],
                        stages: list[nn.Module], group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The full module's state dict at rank 0 (empty elsewhere). ``modules``: owned stage -> module;
    ``stages``: the module each stage computes with here (every worker holds every stage's
    buffers, the same everywhere, so rank 0 writes them all)."""
    mine = {}
    for s in layout.writers:
        for name, p in zip(layout.stage_names[s], modules[s].parameters()):
            mine[name] = p.detach().cpu()
    parts = _gather(mine, group)
    if parts is None:
        return {}
    every = {k: v for part in parts for k, v in part.items()}
    # entries outside the stages (buffers or parameters of the module itself) come from rank 0
    out: dict[str, torch.Tensor] = {}
    staged = layout.staged_names
    for k, v in module.state_dict().items():
        if k not in staged and not k.startswith("_launcher"):
            out[k] = v.detach().cpu()
    for names, m in zip(layout.stage_buffers, stages):
        for buffer_name, b in zip(names, m.buffers()):
            if buffer_name is not None:
                out[buffer_name] = b.detach().cpu()
    missing = [n for n in layout.names if n not in every and not n.startswith("_launcher")]
    if missing:
        raise RuntimeError(f"no worker wrote {missing[:3]} into the checkpoint; every stage must have an owner")
    out.update(every)
    for alias, name in layout.aliases.items():  # a shared parameter under each of its names, as one process saves it
        out[alias] = every[name]
    return out


def local_module_state(module: nn.Module, layout: Layout, modules: dict[int, nn.Module], stages: list[nn.Module],
                       rank_zero: bool) -> dict[str, torch.Tensor]:
    """This worker's share of the module's state dict for a sharded checkpoint: the parameters and
    buffers it writes (:attr:`Layout.written`), and on rank 0 also the module's entries outside the stages."""
    written = layout.written
    out: dict[str, torch.Tensor] = {}
    if rank_zero:
        staged = layout.staged_names
        for k, v in module.state_dict().items():
            if k not in staged and not k.startswith("_launcher"):
                out[k] = v.detach().cpu()
    for s in layout.writers:
        for name, p in zip(layout.stage_names[s], modules[s].parameters()):
            if name in written:
                out[name] = p.detach().cpu()
        for buffer_name, b in zip(layout.stage_buffers[s], stages[s].buffers()):
            if buffer_name is not None and buffer_name in written:
                out[buffer_name] = b.detach().cpu()
    return out


def load_stage_state(state: dict[str, Any], layout: Layout, modules: dict[int, nn.Module],
                     holders: list[nn.Module]) -> None:
    """Copy a single-device state dict into the owned stages' parameters and into the buffers of
    every module that computes a stage here (``holders``: per stage, in stage order, repeated)."""
    with torch.no_grad():
        for s, m in modules.items():
            for name, p in zip(layout.stage_names[s], m.parameters()):
                if name in state:
                    p.copy_(state[name])
        S = len(layout.stage_buffers)
        for i, m in enumerate(holders):
            for buffer_name, b in zip(layout.stage_buffers[i % S], m.buffers()):
                if buffer_name is not None and buffer_name in state:
                    b.copy_(state[buffer_name])


def gather_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, layout: Layout,
                           group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The optimizer's state in the single-device layout at rank 0 (empty elsewhere)."""
    names = {id(p): layout.canonical(n) for n, p in module.named_parameters()}
    writes = {n for s in layout.writers for n in layout.stage_names[s]}
    local = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    entries: dict[str, tuple[int, dict]] = {}
    for gi, g in enumerate(local["param_groups"]):
        for i in g["params"]:
            n = names.get(id(params[i]))
            if n in writes:
                entries[n] = (gi, {k: v.detach().cpu() if torch.is_tensor(v) else v
                                   for k, v in local["state"].get(i, {}).items()})
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in local["param_groups"]]
    parts = _gather((entries, hyper), group)
    if parts is None:
        return {}
    index = layout.index
    merged = {n: e for part, _ in parts for n, e in part.items()}
    groups = [dict(h, params=[]) for h in parts[0][1]]
    state: dict[int, dict] = {}
    for n in sorted(merged, key=index.__getitem__):
        gi, st = merged[n]
        groups[gi]["params"].append(index[n])
        if st:
            state[index[n]] = st
    return {"state": state, "param_groups": groups}


def scatter_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, layout: Layout,
                            full: dict[str, Any]) -> dict[str, Any]:
    """This worker's share of a single-device-layout optimizer state, ready for
    ``optimizer.load_state_dict``."""
    names = {id(p): layout.canonical(n) for n, p in module.named_parameters()}
    index = layout.index
    state: dict[int, dict] = {}
    groups = []
    i = 0
    for gi, g in enumerate(optimizer.param_groups):
        saved = full["param_groups"][gi]
        mine = []
        for p in g["params"]:
            n = names.get(id(p))
            if n in index and index[n] in full["state"]:
                state[i] = full["state"][index[n]]
            mine.append(i)
            i += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": mine})
    return {"state": state, "param_groups": groups}
