"""What stages pass each other: a tensor, or tuples, lists and dicts of tensors and constants.

A stage is called with the values it receives, in order (:func:`arguments`): the micro-batch's
input for a source stage, else each predecessor's output along the edge (``picks`` selects items
of a tuple output per edge, so a value that only a later stage needs goes straight there). A tuple
or list is unpacked into positional arguments, a dict into keyword arguments, anything else is one
argument.

A value is flattened into leaves (``torch.utils._pytree``, as ``torch.distributed.pipelining``
does). Its :class:`Signature`, taken once per shape from a meta-device run, says which leaves are
tensors, which of those are differentiable (floating point and requiring grad: they get a
gradient back) and which are constants (rebuilt by the receiver, never sent). A message carries
the tensor leaves of a value packed into one buffer (bytes, when there are several or of several
dtypes), and a gradient message the differentiable leaves' gradients, so the bytes counted are the
bytes that cross.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .torch_private import pytree  # the pytree utilities torch's own pipelining uses

Spec = tuple[tuple[int, ...], torch.dtype]


def arguments(values: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments of a stage receiving ``values`` in order."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for v in values:
        if isinstance(v, (tuple, list)):
            args.extend(v)
        elif isinstance(v, dict):
            kwargs.update(v)
        else:
            args.append(v)
    return args, kwargs


def pick(value: Any, items: tuple[int, ...] | None) -> Any:
    """The part of a stage's output an edge carries: the whole value, or some items of a tuple."""
    if items is None:
        return value
    return tuple(value[i] for i in items)


def to_device(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())


@dataclass(frozen=True)
class Leaf:
    """A tensor leaf: its shape, dtype and whether a gradient flows back through it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class Const:
    """A constant leaf (``None``, a number, a string): the same on every worker, never sent."""

    value: Any


class Signature:
    """The structure of a value: its tree and, per leaf, a :class:`Leaf` or a :class:`Const`."""

    def __init__(self, tree: Any, leaves: Sequence[Leaf | Const]) -> None:
        self.tree = tree
        self.leaves = tuple(leaves)
        self.tensors = [i for i, x in enumerate(self.leaves) if isinstance(x, Leaf)]
        self.grads = [i for i in self.tensors if self.leaves[i].grad]  # type: ignore[union-attr]
        self.compute: torch.dtype | None = None  # set by :meth:`cast`: floating leaves are cast to it when packed

    @classmethod
    def of(cls, value: Any) -> "Signature":
        flat, tree = pytree.tree_flatten(value)
        return cls(tree, [Leaf(tuple(x.shape), x.dtype, differentiable(x)) if isinstance(x, torch.Tensor) else Const(x)
                          for x in flat])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and (self.tree, self.leaves) == (other.tree, other.leaves)

    def __hash__(self) -> int:
        return hash(self.leaves)

    def describe(self) -> str:
        return pytree.tree_unflatten([f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Leaf) else repr(x.value)
                                      for x in self.leaves], self.tree).__repr__()

    def meta(self) -> Any:
        """A value of this signature made of meta tensors (no storage), differentiable where it is."""
        flat = [torch.empty(x.shape, dtype=x.dtype, device="meta", requires_grad=x.grad) if isinstance(x, Leaf)
                else x.value for x in self.leaves]
        return pytree.tree_unflatten(flat, self.tree)

    # ---- the value's message -------------------------------------------------------------
    @property
    def single(self) -> bool:
        """One tensor leaf: sent as it is, no packing (the common case costs nothing extra)."""
        return len(self.tensors) == 1

    def spec(self) -> Spec:
        return _spec([self.leaves[i] for i in self.tensors])  # type: ignore[misc]

    def nbytes(self) -> int:
        """Bytes of its message."""
        return spec_bytes(self.spec())

    def cast(self, dtype: torch.dtype | None) -> "Signature":
        """This signature with every floating leaf in ``dtype`` (mixed precision: what crosses
        between stages is in the compute dtype, whatever dtype the meta run found, which autocast
        does not reach); itself when ``dtype`` is None."""
        if dtype is None:
            return self
        out = Signature(self.tree, [Leaf(x.shape, dtype, x.grad) if isinstance(x, Leaf) and x.dtype.is_floating_point
                                    else x for x in self.leaves])
        out.compute = dtype
        return out

    def _cast(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        dt = self.compute
        if dt is None:
            return tensors
        return [t.to(dt) if t.is_floating_point() else t for t in tensors]

    def pack(self, value: Any, device: torch.device | None = None) -> torch.Tensor:
        return _pack(self._cast([x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]), device)

    def unpack(self, buf: torch.Tensor) -> Any:
        tensors = iter(_unpack(buf, [self.leaves[i] for i in self.tensors]))  # type: ignore[misc]
        flat = [next(tensors) if isinstance(x, Leaf) else x.value for x in self.leaves]
        return pytree.tree_unflatten(flat, self.tree)

    # ---- its gradient's message ----------------------------------------------------------
    def grad_spec(self) -> Spec:
        return _spec([self.leaves[i] for i in self.grads])  # type: ignore[misc]

    def grad_nbytes(self) -> int:
        """Bytes of its gradient's message."""
        return spec_bytes(self.grad_spec())

    def grad_leaves(self, value: Any) -> list[torch.Tensor]:
        """The differentiable leaves of ``value`` (a value of this signature)."""
        flat = pytree.tree_leaves(value)
        return [flat[i] for i in self.grads]

    def pack_grads(self, grads: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        return _pack(self._cast(list(grads)), device)

    def unpack_grads(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return _unpack(buf, [self.leaves[i] for i in self.grads])  # type: ignore[misc]

    def zeros(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.zeros(x.shape, dtype=x.dtype, device=device) for x in (self.leaves[i] for i in self.grads)]  # type: ignore[union-attr]


def detach_inputs(value: Any, sig: Signature) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with each differentiable leaf (per ``sig``) a fresh leaf requiring grad, so a
    stage's backward stops at its inputs; and those leaves, in order."""
    flat, tree = pytree.tree_flatten(value)
    want = set(sig.grads)
    leaves: list[torch.Tensor] = []
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if i in want:
                x.requires_grad_(True)
                leaves.append(x)
        out.append(x)
    return pytree.tree_unflatten(out, tree), leaves


def item_leaves(value: Any) -> list[range]:
    """For a tuple value, the range of flat leaf indices each item covers (what :func:`pick`
    selects, in leaves)."""
    out, start = [], 0
    for item in value:
        n = len(pytree.tree_leaves(item))
        out.append(range(start, start + n))
        start += n
    return out


def nbytes(value: Any) -> int:
    return sum(x.numel() * x.element_size() for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor))


def describe(value: Any) -> str:
    """``a tuple of 2``, ``a NoneType``: what a value is, for a sentence."""
    n = f" of {len(value)}" if isinstance(value, (tuple, list, dict)) else ""
    return f"a {type(value).__name__}{n}"


def unsupported(value: Any) -> str | None:
    """What in ``value`` a stage cannot pass on (an object other than a tensor or a constant), or None."""
    for x in pytree.tree_leaves(value):
        if not isinstance(x, (torch.Tensor, type(None), bool, int, float, str)):
            return type(x).__name__
    return None


def as_tree(value: Any) -> Any:
    """``value`` with mappings that are not dicts (``transformers.BatchEncoding``) turned into
    dicts, so they split and flatten like dicts."""
    if isinstance(value, Mapping) and not isinstance(value, dict):
        return {k: as_tree(v) for k, v in value.items()}
    if isinstance(value, dict):
        return {k: as_tree(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(as_tree(v) for v in value)
    return value


def chunk(value: Any, pieces: int, equal: bool = True) -> list[Any]:
    """``value`` cut into ``pieces`` micro-batches along the first dimension of every tensor leaf
    (constants are the same in each), as ``torch.distributed.pipelining`` splits a batch; raises
    ``ValueError`` when the tensors disagree on the batch size, or when it does not divide into
    ``pieces`` equal parts (``equal``) or has fewer samples than ``pieces``."""
    flat, tree = pytree.tree_flatten(as_tree(value))
    sizes = {x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"the batch's tensors have different first dimensions {sorted(sizes)}; every tensor of a "
                         f"batch must hold the same number of samples")
    if not sizes:
        raise ValueError("the batch holds no tensor with a batch dimension to cut into micro-batches")
    n = sizes.pop()
    if (n % pieces if equal else n < pieces):
        raise ValueError(f"a batch of {n} samples cannot be cut into microbatches={pieces} equal micro-batches; "
                         f"use a batch size divisible by {pieces}.")
    cut = [x.tensor_split(pieces) if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in flat]
    return [pytree.tree_unflatten([c[i] if c is not None else x for c, x in zip(cut, flat)], tree)
            for i in range(pieces)]


def joined(pieces: Sequence[Any], device: torch.device) -> Any:
    """Micro-batch outputs put back together along the first dimension (the inverse of :func:`chunk`)."""
    flat = [pytree.tree_flatten(p) for p in pieces]
    tree = flat[0][1]
    out = [torch.cat([f[0][i] for f in flat]).to(device) if isinstance(flat[0][0][i], torch.Tensor) else flat[0][0][i]
           for i in range(len(flat[0][0]))]
    return pytree.tree_unflatten(out, tree)


# ---- packing ----------------------------------------------------------------------------------


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@functools.lru_cache(maxsize=64)  # a pure function of the dtype; torch has a few dozen
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


#: every packed leaf starts at a multiple of this many bytes, so its bytes view back as its dtype
ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def spec_bytes(spec: Spec) -> int:
    """Bytes of a message of this shape and dtype."""
    return _numel(spec[0]) * _itemsize(spec[1])


def _spec(leaves: Sequence[Leaf]) -> Spec:
    if len(leaves) == 1:
        return leaves[0].shape, leaves[0].dtype
    return (sum(_padded(x.nbytes) for x in leaves),), torch.uint8


def _pack(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].detach()
    if not tensors:  # an edge whose values need no gradient still has its (empty) message
        return torch.empty(0, dtype=torch.uint8, device=device)
    parts = []
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(b)
        pad = _padded(b.numel()) - b.numel()
        if pad:
            parts.append(b.new_zeros(pad))
    return torch.cat(parts)


def _unpack(buf: torch.Tensor, leaves: Sequence[Leaf]) -> list[torch.Tensor]:
    if len(leaves) == 1:
        return [buf]
    out, at = [], 0
    for x in leaves:
        n = x.nbytes
        out.append(buf[at : at + n].view(x.dtype).view(x.shape))
        at += _padded(n)
    return out
