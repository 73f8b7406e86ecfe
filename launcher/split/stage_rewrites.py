"""What a cut stage's graph is made to follow at run time rather than at trace time: its own
``training`` flag (dropout, recurrent layers' dropout, RReLU) and the device of its own tensors;
and stage 0's check that a micro-batch has the shapes and dtypes the graph was specialised to."""

from __future__ import annotations

import builtins
import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn

from launcher.torch_support.torch_private import is_op_overload, op_schema

aten = torch.ops.aten
# nn.MultiheadAttention passes dropout_p=0 to it in eval mode: a stage passes p * training.
_SDPA = aten.scaled_dot_product_attention.default


class InputCheck(nn.Module):
    """Stage 0's check that a micro-batch has the example's shapes and dtypes (and its constants),
    which the traced graph is specialised to, except a first dimension traced as a symbol (any
    number of samples, within what the module's code allows: export's ``guards``, run here)."""

    def __init__(self, example: Sequence[tuple[str, Any]], guards: Callable[..., Any] | None = None,
                 guarded: Sequence[int] = ()) -> None:
        super().__init__()
        self.example = [(name, _spec(v)) for name, v in example]
        self.guards, self.guarded = guards, list(guarded)  # guarded: the inputs the guards take, by position

    def forward(self, *inputs: Any) -> None:
        for (name, want), x in zip(self.example, inputs):
            got = _spec(x)
            if isinstance(want, tuple) and len(want) == 2 and isinstance(want[1], torch.dtype) and want[0] \
                    and want[0][0] is None and isinstance(got, tuple) and len(got) == 2 and got[0]:
                got = ((None, *got[0][1:]), got[1])  # any number of samples
            if got != want and _only_rows_differ(want, got):
                raise ValueError(f"stage 0 takes micro-batches of {want[0][0]} samples, a size the model's code fixes, "
                                 f"not one of {got[0][0]} (input {name!r}), so give its DataLoaders drop_last=True (a "
                                 f"last, smaller batch is of another size).")
            if got != want:
                raise ValueError(f"stage 0 was traced on an input {name!r} of {_describe(want)}, and got one of "
                                 f"{_describe(got)}; every micro-batch must match the example the model was split on.")
        if self.guards is not None:
            try:
                self.guards(*(inputs[i] for i in self.guarded))
            except AssertionError as e:  # a branch in the code on the number of samples
                rows = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim()), None)
                rule = str(e).removeprefix("Guard failed: ")
                raise ValueError(f"stage 0 takes micro-batches of the sizes the model's code allows ({rule}), not one "
                                 f"of {rows}, so give its DataLoaders drop_last=True (a last, smaller batch is of "
                                 f"another size).") from None


def _spec(v: Any) -> Any:
    """``(shape, dtype)`` of a tensor (a symbolic first dimension as None), else the value."""
    if not isinstance(v, torch.Tensor):
        return v
    return tuple(None if isinstance(d, torch.SymInt) else int(d) for d in v.shape), v.dtype


def _only_rows_differ(want: Any, got: Any) -> bool:
    """Whether two ``(shape, dtype)`` differ in the first (batch) dimension alone."""
    shapes = [v[0] if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], torch.dtype) else None
              for v in (want, got)]
    a, b = shapes
    return (a is not None and b is not None and len(a) == len(b) >= 1 and a[1:] == b[1:] and want[1] == got[1]
            and a[0] != b[0] and a[0] is not None)


def _describe(v: Any) -> str:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], torch.dtype):
        shape = "(" + ", ".join("n" if d is None else str(d) for d in v[0]) + ("," if len(v[0]) == 1 else "") + ")"
        return f"shape {shape} and dtype {v[1]}"
    return f"value {v!r}"


def _train_flag(op: Any) -> int | None:
    """The position of the mode flag that export fixed at trace time in ``op``'s arguments, if it
    has one: ``train`` (the dropouts; ``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu``, whose
    dropout between layers it switches), or ``training`` on an op that draws (RReLU). BatchNorm's
    ``training`` is not a mode flag: without running statistics it is true in eval mode too."""
    if not is_op_overload(op):
        return None
    draws = torch.Tag.nondeterministic_seeded in op.tags
    for i, arg in enumerate(op_schema(op).arguments):
        if str(arg.type) == "bool" and not arg.kwarg_only and (arg.name == "train" or
                                                                 (draws and arg.name == "training")):
            return i
    return None


def follow_mode(g: fx.Graph, attrs: dict[str, Any]) -> None:
    """Make the ops that behave differently in train and eval mode (dropout, recurrent layers'
    dropout, attention's dropout) read the stage's ``training`` flag instead of the mode it was
    traced in, so ``stage.eval()`` turns them off as ``module.eval()`` does."""
    mode: list[fx.Node] = []

    def training() -> fx.Node:
        if not mode:
            with g.inserting_before(_first_body_node(g)):
                mode.append(g.get_attr("training"))
            attrs["training"] = True
        return mode[0]

    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        flag = _train_flag(n.target)
        if flag is not None and len(n.args) > flag and n.args[flag] is True:
            n.update_arg(flag, training())
        elif n.target is _SDPA:
            named = "dropout_p" in n.kwargs
            p = n.kwargs["dropout_p"] if named else (n.args[4] if len(n.args) > 4 else 0.0)
            if isinstance(p, float) and p > 0:
                with g.inserting_before(n):
                    q = g.call_function(operator.mul, (p, training()))  # p in train mode, 0.0 in eval mode
                n.update_kwarg("dropout_p", q) if named else n.update_arg(4, q)


def follow_device(g: fx.Graph, attrs: dict[str, Any]) -> None:
    """Make ops that create tensors on the traced device (``torch.ones(..)``, ``.to(x.device)``)
    create them on the device of the stage's own tensors at run time, so that ``stage.to(device)``
    or the engine's fetched weights carry them along."""
    anchor, device = None, None
    for n in g.nodes:  # a parameter says where the stage computes; failing that an input
        value = attrs.get(n.target) if n.op == "get_attr" else None
        if isinstance(value, nn.Parameter):
            anchor, device = n, value.device
            break
    if anchor is None:
        for n in g.nodes:
            val = n.meta.get("val")
            if n.op == "placeholder" and isinstance(val, torch.Tensor):
                anchor, device = n, val.device
                break
    if anchor is None:
        return
    here: list[fx.Node] = []

    def runtime_device() -> fx.Node:
        if not here:
            with g.inserting_before(_first_body_node(g)):
                src = g.get_attr(anchor.target) if anchor.op == "get_attr" else anchor
                here.append(g.call_function(builtins.getattr, (src, "device")))
        return here[0]

    for n in list(g.nodes):
        if n.op != "call_function" or not is_op_overload(n.target):
            continue
        for i, arg in enumerate(op_schema(n.target).arguments):
            if str(arg.type) not in ("Device", "Device?", "Optional[Device]"):
                continue
            positional = not arg.kwarg_only and i < len(n.args)
            value = n.args[i] if positional else n.kwargs.get(arg.name)
            if isinstance(value, torch.device) and value == device:
                n.update_arg(i, runtime_device()) if positional else n.update_kwarg(arg.name, runtime_device())


def _first_body_node(g: fx.Graph) -> fx.Node:
    return next(n for n in g.nodes if n.op != "placeholder")
