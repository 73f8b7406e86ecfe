"""Every private name of torch that the launcher relies on, in one place: each behind a small
function (or a named alias, for a module or a class) saying what it wraps and why no public API
does the job.

Private names may change in any release: pyproject.toml asks for torch>=2.5; these were checked
with torch 2.13. A new version that moves one of them breaks here, not across the package.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree

if TYPE_CHECKING:
    from torch import fx

#: ``torch.utils._pytree``: flattening nested values (tuples, lists, dicts, dataclasses registered
#: with it) into tensor leaves and back, the utilities ``torch.distributed.pipelining``, ``torch.fx``
#: and ``torch.export`` use. Its tree specs are the ones traced graphs carry (``in_spec``,
#: ``out_spec``), so no other pytree library can stand in; torch has no public module for it in the
#: versions pinned.
pytree = _pytree

#: ``torch.nn.modules.batchnorm._BatchNorm``: the base class of every batch norm that keeps running
#: statistics (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy ones, and subclasses of them).
#: No public class covers them all.
BatchNormBase = _BatchNorm


def autograd_run_backward() -> Callable[..., tuple[torch.Tensor | None, ...]] | None:
    """The autograd engine's entry (``torch.autograd.Variable._execution_engine.run_backward``),
    what ``torch.autograd.grad`` calls after its argument checks, or None where this torch has no
    such handle (callers then use ``torch.autograd.grad``).

    The public call's checks cost as much as a small stage's whole backward, once per backward
    job. Arguments: ``(outputs, grad_outputs, retain_graph, create_graph, inputs, allow_unused,
    accumulate_grad)``."""
    try:
        from torch.autograd import Variable

        return Variable._execution_engine.run_backward
    except AttributeError:  # pragma: no cover - a torch without the engine handle
        return None


def storage_key(t: torch.Tensor) -> int:
    """An identity of the storage ``t`` lives in, shared by its views
    (``untyped_storage()._cdata``).

    The public ``untyped_storage().data_ptr()`` is 0 for every meta and fake tensor, which hold
    no memory, so it cannot tell their storages apart."""
    return t.untyped_storage()._cdata


def fake_tensor_mode() -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes, dtypes and
    devices but no data, through which a forward runs without computing.

    The meta device is public but runs no op that needs a device (a ``.to(device)``, a device
    check); fake tensors do, and have no public constructor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def import_dynamo() -> None:
    """Import ``torch._dynamo``, which torch's meta kernels import lazily on first use (about a
    second). Importing it once, before forking workers, saves each worker the import; nothing
    public triggers it."""
    import torch._dynamo  # noqa: F401


def foreach_add_(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """``tensors[i] += others[i]`` for every ``i`` in one call (``torch._foreach_add_``, the
    multi-tensor kernel torch's optimizers use). No public function adds lists of tensors in
    place without a loop of one kernel per tensor."""
    torch._foreach_add_(tensors, others)


def has_post_accumulate_hooks(t: torch.Tensor) -> bool:
    """Whether hooks were registered on ``t`` with ``register_post_accumulate_grad_hook``
    (``Tensor._post_accumulate_grad_hooks``): they run each time autograd adds into ``t.grad``.
    Torch has no public way to ask whether a tensor has any."""
    return bool(getattr(t, "_post_accumulate_grad_hooks", None))


def default_store() -> Any:
    """The key-value store of the default process group
    (``torch.distributed.distributed_c10d._get_default_store``).

    A process group started from the environment (torchrun, Slurm) makes its own store; there is
    no public handle to it, and a second store would need a second rendezvous."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def parameter_dict(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters by name, the live dict (``Module._parameters``): entries set
    here replace a parameter without ``register_parameter``'s hooks and checks.

    For reading, ``named_parameters(recurse=False)`` is the public way; nothing public replaces a
    parameter in place under its name, or swaps the dict's contents for a while."""
    return module._parameters


def buffer_dict(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name, the live dict (``Module._buffers``).

    For reading, ``named_buffers(recurse=False)`` is the public way; nothing public swaps a
    buffer in place without touching its persistence."""
    return module._buffers


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers left out of its state dict, the live set
    (``Module._non_persistent_buffers_set``).

    ``register_buffer(..., persistent=False)`` is the public way to add one; nothing public says
    which buffers are persistent, or marks an existing buffer so."""
    return module._non_persistent_buffers_set


def is_op_overload(target: Any) -> bool:
    """Whether a graph node's target is an ATen operator overload (``torch._ops.OpOverload``,
    what ``torch.ops.aten.<op>.<overload>`` is). The class has no public name."""
    return isinstance(target, torch._ops.OpOverload)


def op_schema(op: Any) -> Any:
    """An operator overload's schema (``OpOverload._schema``): its arguments and returns with
    their types and aliasing (which it writes, which it returns a view of). No public attribute
    gives the parsed schema."""
    return op._schema


def runtime_assert_ops() -> set[Any]:
    """The ATen operators ``torch.export`` records a runtime assertion with
    (``aten._assert_scalar.default``, ``aten._assert_async.msg``): underscore operators, which
    have no public alias."""
    return {torch.ops.aten._assert_scalar.default, torch.ops.aten._assert_async.msg}


def propagate_real_tensors() -> contextlib.AbstractContextManager[Any]:
    """Within it, fake tensors carry real values too, so tracing takes a branch on data as the
    example does (``torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True)``,
    what ``torch.export``'s draft mode sets). No public switch does it for ``torch.export.export``."""
    import torch._functorch.config

    return torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True)


def pytree_codegen_info(graph: fx.Graph) -> Any:
    """The pytree signature of a graph exported with nested inputs or outputs (its
    ``_PyTreeCodeGen``'s ``pytree_info``: ``orig_args``, ``in_spec``, ``out_spec``), or None for a
    graph of plain positional inputs and outputs.

    ``torch.export`` keeps it in the graph's private code generator; no public attribute has it."""
    from torch.fx.graph import _PyTreeCodeGen

    codegen = graph._codegen
    return codegen.pytree_info if isinstance(codegen, _PyTreeCodeGen) else None


def set_pytree_codegen(graph: fx.Graph, orig_args: list[str], in_spec: Any, out_spec: Any) -> None:
    """Make ``graph``'s code flatten its arguments by ``in_spec`` and rebuild its output by
    ``out_spec`` (None: as it is), as an exported graph's does (``_PyTreeCodeGen`` of a
    ``_PyTreeInfo``). ``Graph.set_codegen`` is public, the pytree code generator is not."""
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

    graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(orig_args, in_spec, out_spec)))


class FoundInfHookScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose per-device counts of infinities and NaNs found while unscaling pass
    through :meth:`combine_found_inf` before the step uses them (``GradScaler._unscale_grads_``,
    overridden).

    Whether a step is skipped, and how the scale changes, follow those counts; the public methods
    (``unscale_``, ``step``, ``update``) compute them internally, and only this private method
    returns them."""

    def combine_found_inf(self, per_device: dict[torch.device, torch.Tensor],
                          found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """The counts the step uses, from those found on each device (``found_inf``: a zero tensor
        of the right dtype and device for a new count). As found, here."""
        return per_device

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        return self.combine_found_inf(super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16),
                                      found_inf)


def retype_grad_scaler(scaler: torch.amp.GradScaler, cls: type) -> None:
    """Make ``scaler`` an instance of ``cls``, a subclass of its class that only overrides methods
    (it adds no state), by assigning ``__class__``. A scaler made by someone else (Lightning's
    precision plugin) keeps its scale and state; ``GradScaler`` keeps them in ``__dict__`` (no
    ``__slots__``), so the assignment is sound."""
    scaler.__class__ = cls


def persistent_iterator(loader: Any) -> Any:
    """The iterator a ``DataLoader`` with ``persistent_workers=True`` keeps between epochs
    (``DataLoader._iterator``), or None. Such a loader hands every later ``iter()`` the same
    iterator, workers and all, so an iterator made for a look ahead of training must be taken away
    again; no public API exposes or resets it."""
    return getattr(loader, "_iterator", None)


def drop_persistent_iterator(loader: Any, keep: Any) -> None:
    """Stop the worker processes of the iterator ``loader`` keeps (if it is not ``keep``, the one it
    kept before) and put ``keep`` back (``_MultiProcessingDataLoaderIter._shutdown_workers``)."""
    made = getattr(loader, "_iterator", None)
    if made is None or made is keep:
        return
    shutdown = getattr(made, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    loader._iterator = keep


def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a mode that sees every
    ATen op as it runs, below autograd, whether Python code or a traced graph called it; what
    the stage check uses to find the first op where a split and its module part (no public class
    sees ops at that level: ``TorchFunctionMode`` sees the Python calls, which differ between the two)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def skip_indices(iterator: Any, batches: int) -> bool:
    """Advance a single-process DataLoader iterator over ``batches`` batches without loading them:
    only its index sampler moves (``_sampler_iter``; ``_num_yielded`` keeps the count a length check
    reads). False, moving nothing, for an iterator that has no such sampler of its own (worker
    processes read indices ahead; an iterable dataset has no indices). No public API skips a
    DataLoader's batches unread."""
    from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

    if (type(iterator) is not _SingleProcessDataLoaderIter or not hasattr(iterator, "_sampler_iter")
            or getattr(iterator, "_dataset_kind", None) != _DatasetKind.Map):
        return False
    for _ in range(batches):
        next(iterator._sampler_iter)
    iterator._num_yielded += batches
    return True
