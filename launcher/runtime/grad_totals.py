"""One worker's gradient totals (:class:`GradTotals`): the one owner of every sum of a stage's
weight gradient, from a backward job's share to the ``.grad`` the optimizer steps with.

A stage's total on a worker, per owner it computes for, is its micro-batches' gradients summed
(:meth:`GradTotals.accumulate`, or added in place by autograd, :meth:`GradTotals.into`); a sum for
another owner leaves with its ``SEND_WGRAD`` (:meth:`GradTotals.take`); an owner adds the sums
others send (:meth:`GradTotals.absorb` during the step under cache ``job``, :meth:`GradTotals.take_in`
at its end: each ``RECV_WGRAD`` action where it stands), replicas all-reduce theirs once each
``REDUCE`` action says a share is complete (:meth:`GradTotals.share_complete`; the waits:
:meth:`GradTotals.finish`) (:class:`~launcher.runtime.groups.Replicas`, whose bucket
buffers the replicated stages' totals live in), a parameter several stages share gets the sum of its
uses (:meth:`GradTotals.sum_tied`), and the reduced totals become the parameters' ``.grad``
(:meth:`GradTotals.install`). The engine and the step pass what each needs as arguments.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from launcher.schedule.assembly import TAG_LIMIT
from launcher.schedule.program import Msg

from ..torch_support.torch_private import foreach_add_, has_post_accumulate_hooks
from .comm import Comm, irecv, isend
from .failure import Watchdog, blocked
from .groups import Replicas
from .layout import StageLayout
from .measure import Meter

Key = tuple[int, int]  # (stage, owner): a worker's sum of a stage's gradient for one owner


class GradTotals:
    """Every gradient sum of one worker, kept from step to step (buffers reused, as
    DistributedDataParallel's buckets are: the last step's totals are valid until the next starts)."""

    def __init__(self, worker: int | None, layouts: Sequence[StageLayout], device: torch.device, owned: Sequence[int],
                 owners: Sequence[Sequence[int]], replicas: Replicas, weight_cache: str) -> None:
        self.worker, self.layouts, self.device, self.owned = worker, layouts, device, list(owned)
        self.owners, self.replicas, self.weight_cache = owners, replicas, weight_cache
        self.buffers: dict[Key, torch.Tensor] = {}  # a stage's sum for an owner, reused every step
        self.last: dict[int, torch.Tensor] = {}  # owned stage -> its reduced flat gradient of the last step
        self._installed: dict[int, tuple] = {}  # owned stage -> (its total, its parameters, their views of it)
        self.begin()

    # ---- during the step ---------------------------------------------------------------------
    def begin(self) -> None:
        """A new step: no sum started, nothing bound, nothing received."""
        self.acc: dict[Key, torch.Tensor] = {}  # the sums this step has started
        self.views: dict[Key, list[torch.Tensor]] = {}  # a sum's per-parameter views
        self.targets: dict[Key, list[torch.Tensor] | None] = {}  # where a backward adds in place (None: apart)
        self.unbound: dict[int, tuple[torch.Tensor, Any]] = {}  # weight id -> (weight, its .grad before the step)
        self.incoming: list[int] = []  # partial sums posted before the current job (cache "job"), not yet added
        self.replicas.reset()

    def accumulate(self, stage: int, owner: int, targets: list[torch.Tensor],
                   grads: Sequence[torch.Tensor | None]) -> None:
        """Add a job's weight gradients into the stage's sum for ``owner`` (started by the first
        job that adds)."""
        gs = [torch.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]
        key = (stage, owner)
        total = self.acc.get(key)
        if total is not None:  # add each gradient into its view of the total: no packed copy
            if not gs:  # nothing of the stage trains: its (empty) total stays as it is
                return
            if len(gs) == 1:
                total += gs[0].reshape(-1)
            else:
                foreach_add_(self._views(key, total), gs)
            return
        layout = self.layouts[stage]
        total = self.replicas.buffer(stage) if owner == self.worker else None
        if total is not None:  # a replicated stage: the total lives in its bucket's buffer
            self.replicas.fill(stage)
        elif owner != self.worker and self.weight_cache == "job":
            # cache "job": a fetched stage's sum lives only until it is delivered (freed, not kept)
            total = torch.empty(layout.grad_numel, dtype=layout.dtype, device=self.device)
        else:
            total = self._buffer(key)
        # written in place into a buffer kept from step to step (a fresh megabyte a step costs a
        # page fault per 4 KiB); the engine's sends of it are done before the next step starts
        layout.pack(gs, out=total)
        self.acc[key] = total

    def into(self, stage: int, owner: int, targets: list[torch.Tensor], apart: bool) -> list[torch.Tensor] | None:
        """Where a backward adds ``targets``'s gradients in place: the views of the stage's sum once
        a micro-batch has started it; None where the job's gradients are needed ``apart`` (the
        first, a non-finite check of each job's) or a target has hooks run on accumulation. Decided
        once per sum in a step: hooks and dtypes do not change while it runs."""
        key = (stage, owner)
        total = self.acc.get(key)
        if total is None or not targets or apart:
            return None
        if key in self.targets:  # decided for this sum (a sent one leaves with its entry)
            return self.targets[key]
        views: list[torch.Tensor] | None = None
        # mixed precision (a low-precision copy's gradient, added up in fp32) or hooks: added apart
        if total.dtype == targets[0].dtype and not any(has_post_accumulate_hooks(t) for t in targets):
            views = [total.view_as(targets[0])] if len(targets) == 1 else self._views(key, total)
        self.targets[key] = views
        return views

    def bind(self, targets: Sequence[torch.Tensor], into: Sequence[torch.Tensor]) -> None:
        """Point each weight's ``.grad`` at its tensor of ``into`` (where autograd adds it in place)
        until :meth:`unbind`: once for a stage's backwards in a step, not around each (another
        stage sharing a weight points it at its own total before its backward)."""
        if all(t.grad is g for t, g in zip(targets, into)):
            return
        for t, g in zip(targets, into):
            if id(t) not in self.unbound:
                self.unbound[id(t)] = (t, t.grad)
            t.grad = g

    def unbind(self) -> None:
        """Give every weight :meth:`bind` pointed elsewhere its ``.grad`` from before the step."""
        for t, g in self.unbound.values():
            t.grad = g
        self.unbound.clear()

    def take(self, stage: int, owner: int) -> torch.Tensor:
        """This worker's complete sum of ``stage`` for another ``owner``, for its ``SEND_WGRAD``
        (cache ``job``: the send holds it and frees it once delivered)."""
        key = (stage, owner)
        self.views.pop(key, None)
        self.targets.pop(key, None)
        return self.acc.pop(key) if self.weight_cache == "job" else self.acc[key]

    def absorb(self, comm: Comm, msgs: Sequence[Msg]) -> None:
        """Add the partial sums posted before this job into their owned stage's total (cache
        ``job``): each sender's copy is freed once delivered, not at the end of the step."""
        if not self.incoming:
            return
        w = self.worker
        assert w is not None  # only a worker runs a step
        for mid in self.incoming:
            part = comm.wait(mid)
            comm.drop(mid)
            s = msgs[mid].stage
            total = self.acc.get((s, w))
            if total is None:  # before this worker's own share: the sum starts from this part
                total = self.acc[(s, w)] = self._buffer((s, w))
                total.copy_(part)
            else:
                total += part
        self.incoming = []

    def _buffer(self, key: Key) -> torch.Tensor:
        total = self.buffers.get(key)
        if total is None:
            layout = self.layouts[key[0]]
            total = self.buffers[key] = torch.empty(layout.grad_numel, dtype=layout.dtype, device=self.device)
        return total

    def _views(self, key: Key, total: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of the stage's sum ``total`` (made once per sum)."""
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = self.layouts[key[0]].grad_views(total)
        return views

    def share_complete(self, done: int, meter: Meter) -> None:
        """A ``REDUCE`` of the program: this worker's share of a replicated stage is complete once
        job ``done`` has ended (``len(jobs)``: at the end of the step), so the buckets whose shares
        all are may start their all-reduce (:meth:`~launcher.runtime.groups.Replicas.launch_ready`)."""
        meter.allreduce += 1
        self.replicas.launch_ready(done)

    # ---- end of step -------------------------------------------------------------------------
    def _total(self, s: int) -> torch.Tensor:
        """Owned stage ``s``'s total on this worker: its sum so far, else its bucket's buffer (a
        replicated stage), else zeros (this worker added nothing to it)."""
        assert self.worker is not None  # only a worker runs a step
        total = self.acc.get((s, self.worker))
        if total is None:
            total = self.replicas.buffer(s)
        if total is None:
            L = self.layouts[s]
            total = torch.zeros(L.grad_numel, dtype=L.dtype, device=self.device)
        return total

    def take_in(self, mid: int, comm: Comm, msgs: Sequence[Msg]) -> None:
        """A ``RECV_WGRAD`` at the end of the step: wait for partial sum ``mid`` and add it into its
        owned stage's total, which starts at zero where this worker added nothing to it (a
        replicated stage's in its bucket's buffer)."""
        w = self.worker
        assert w is not None  # only a worker runs a step
        s = msgs[mid].stage
        if (s, w) not in self.acc:
            total = self._total(s)
            if self.replicas.buffer(s) is not None and self.replicas.fill(s):
                total.zero_()  # the bucket's, not launched yet: its REDUCE stands after this sum
            self.acc[(s, w)] = total
        self.acc[(s, w)] += comm.wait(mid)
        comm.drop(mid)

    def finish(self, comm: Comm, meter: Meter, watchdog: Watchdog | None, step: int) -> None:
        """After the program's last action: each owned stage's total gradient (:attr:`last`), its
        replicas' all-reduces done. The buckets reduced at the end of the step go here, after every
        ``REDUCE``, in the one order common to every worker (all-reduces among different owner
        sets must be issued in one global order, which a worker's own actions do not give)."""
        w = self.worker
        assert w is not None  # only a worker runs a step
        totals: dict[int, torch.Tensor] = {}
        for s in self.owned:
            totals[s] = self._total(s)
        if self.replicas.buckets:
            if watchdog is not None:
                watchdog.check()
                watchdog.set_job(f"all-reduce of replicated stages in step {step}")
            began = time.perf_counter()
            self.replicas.finish(watchdog, comm.clock)
            meter.allreduce_span = (began, time.perf_counter())
        self.last = totals

    def sum_tied(self, ties: Sequence[Sequence[tuple[int, int]]], S: int, ranks: Sequence[int],
                 group: dist.ProcessGroup | None, watchdog: Watchdog | None) -> None:
        """Give every use of a shared parameter (``ties``: per shared parameter, its uses as
        ``(stage, index)``) the sum of all its uses' gradients, as one process would (the
        parameter is one tensor there). Each stage's first owner sends its use's gradient to the
        other owners of the tie that do not own that stage; every one of them adds the uses in the
        same order, so every copy gets the same sum and the same update."""
        w, owners, totals = self.worker, self.owners, self.last
        for g, uses in enumerate(ties):
            union = sorted({o for s, _ in uses for o in owners[s]})
            s0, i0 = uses[0]
            if w not in union or not self.layouts[s0].is_trainable(i0):  # a frozen one has no gradient
                continue
            works, parts = [], []
            for s, i in uses:
                tag = TAG_LIMIT - 1 - (g * S + s)  # far above the step's own tags
                root = owners[s][0]
                if w in owners[s]:
                    view = self.layouts[s].param_view(totals[s], i)
                    parts.append(view)
                    if w == root:
                        works += [isend(view.contiguous(), ranks[o], group=group, tag=tag)
                                  for o in union if o not in owners[s]]
                else:
                    L = self.layouts[s]
                    buf = torch.empty(L.shapes[L.index[i]], dtype=L.dtype, device=self.device)
                    works.append(irecv(buf, ranks[root], group=group, tag=tag))
                    parts.append(buf)
            with blocked(watchdog):
                for work in works:
                    work.wait()
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            for s, i in uses:
                if w in owners[s]:
                    self.layouts[s].param_view(totals[s], i).copy_(total)

    # ---- into the parameters -----------------------------------------------------------------
    def install(self, modules: dict[int, torch.nn.Module], scale: float = 1.0, accumulate: bool = False) -> None:
        """Point every owned trainable parameter's ``.grad`` at its slice of the last step's
        reduced gradient (a frozen one keeps ``None``, as on one device); ``scale`` and
        ``accumulate`` as :meth:`~launcher.runtime.engine.Engine.install_grads` says."""
        for s in self.owned:
            _, params, views = self._installed_views(s, modules)
            for p, g in zip(params, views):
                if accumulate and p.grad is not None:
                    p.grad.add_(g, alpha=scale)
                elif accumulate or scale != 1.0:
                    p.grad = g * scale
                else:
                    p.grad = g

    def grad_views(self, s: int, modules: dict[int, torch.nn.Module]) -> dict[int, torch.Tensor]:
        """Owned stage ``s``'s trainable parameters' slices of the last step's reduced gradient, by
        the parameter's ``id`` (a frozen one has none): what :meth:`install` makes their ``.grad``."""
        _, params, views = self._installed_views(s, modules)
        return {id(p): g for p, g in zip(params, views)}

    def _installed_views(self, s: int, modules: dict[int, torch.nn.Module]) -> tuple:
        total = self.last[s]
        cached = self._installed.get(s)
        if cached is None or cached[0] is not total:  # the totals' buffers are kept: so are their views
            L = self.layouts[s]
            cached = self._installed[s] = (total, L.ordered(modules[s], trainable_only=True), L.grad_views(total))
        return cached
