"""Trace a module's forward into one ATen graph, for :mod:`launcher.split.cut` to cut into stages.

``torch.export`` (non-strict, as ``torch.distributed.pipelining`` uses it) runs ``forward`` as
Python on fake tensors, so a branch on shapes (``nn.Transformer``'s checks) is simply taken,
where FX symbolic tracing fails. A branch on tensor *data* stops it. Such a forward is traced
again with real values alongside the fake ones (what ``torch.export.draft_export`` does), which
takes the branch the example takes and records it as a runtime assertion. An assertion on a
tensor that depends on no input and no parameter (a causal mask built inside forward, which
``nn.Transformer`` compares with its own) always holds: it is dropped. Any other assertion is a
branch on data that the next batch or the next step may take the other way: refused.

The first (batch) dimension of every input tensor is traced as a symbol (``Dim.AUTO``), so one
graph takes micro-batches of any size, such as those of a last, smaller batch. Where the module's
code fixes that size (a ``view(8, -1)``, an example of one sample, which export specialises), the
graph keeps the example's size, and stage 0's input check says so.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import sys
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from launcher.torch_support.torch_private import (
    buffer_dict,
    is_op_overload,
    non_persistent_buffers,
    op_schema,
    parameter_dict,
    propagate_real_tensors,
    pytree,
    runtime_assert_ops,
)


class SplitError(ValueError):
    """A module that cannot be split as asked; the message is one sentence naming the construct and
    the module path, and the original exception, if any, is the ``__cause__``."""


_ASSERTS = runtime_assert_ops()
# Their schemas do not mark the running statistics they update in train mode (argument 5 true).
_STAT_UPDATES = {torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default}
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


def export_graph(module: nn.Module, args: tuple, kwargs: dict[str, Any], rows: bool = True) -> fx.GraphModule:
    """``module``'s forward on ``(args, kwargs)`` as an unlifted graph module.

    Parameters and buffers are ``get_attr`` nodes that resolve to ``module``'s own tensors (export
    never copies them), placeholders are the flattened inputs, and every node carries the
    ``nn_module_stack`` of the modules it ran in. Shapes are those of the example, except the first
    dimension of each input tensor when ``rows``: a symbol wherever the code lets it be one, within
    the guards export found (``_guards_fn``, which stage 0's input check runs).
    """
    logs = [logging.getLogger(name) for name in ("torch.fx.experimental.symbolic_shapes",
                                                 "torch._export.non_strict_utils")]
    levels = [log.level for log in logs]
    for log in logs:  # the partial graph at a data branch, each branch taken, a size of 1 kept fixed
        log.setLevel(logging.ERROR)
    dynamic = _row_dims((args, kwargs)) if rows else None
    try:
        try:
            ep, data_branches = _export(module, args, kwargs, dynamic), False
        except Exception as e:
            if not _branches_on_data(e):
                raise
            with propagate_real_tensors():
                ep, data_branches = _export(module, args, kwargs, dynamic), True
    except Exception as e:  # an op export cannot trace, a Python construct it rejects
        if dynamic is not None:  # a symbolic batch size the code cannot follow: the example's, fixed
            return export_graph(module, args, kwargs, rows=False)
        raise SplitError(_failure(module, e)) from e
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    gm = ep.module()
    _refuse_state_updates(module, gm)
    if data_branches:
        try:
            _drop_constant_asserts(module, gm)
        except SplitError:
            if dynamic is None:
                raise
            # a branch on a tensor made from the batch size (a mask of x.shape[0] rows): at the
            # example's size, fixed, that tensor is a constant again
            return export_graph(module, args, kwargs, rows=False)
    return gm


def _branches_on_data(e: BaseException | None) -> bool:
    """Whether export stopped at a branch on tensor data (the error itself, or what caused it)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _row_dims(inputs: Any) -> Any:
    """``dynamic_shapes`` for ``(args, kwargs)``: the first dimension of every tensor of at least
    one dimension is a symbol (``Dim.AUTO``: export keeps it fixed where the code needs that)."""
    args, kwargs = inputs
    return pytree.tree_map(lambda x: {0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() else None,
                           (tuple(args), dict(kwargs)), is_leaf=lambda x: x is None)


def _export(module: nn.Module, args: tuple, kwargs: dict[str, Any],
            dynamic: Any = None) -> torch.export.ExportedProgram:
    """``torch.export.export``, less the partial graph it prints to stderr when it fails (the
    SplitError says what failed); anything else it prints goes through. ``dynamic``: the
    ``(args, kwargs)`` of :func:`_row_dims`."""
    err = io.StringIO()
    partial = ""
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            # nn.LSTM/GRU/RNN refresh their list of weights in forward: export warns that a module
            # attribute changed, though the weights are the module's registered parameters
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights\[")
            if dynamic is None:
                return torch.export.export(module, args, kwargs, strict=False)
            return torch.export.export(module, args, kwargs, strict=False,
                                       dynamic_shapes=_named(module, args, kwargs, dynamic))
    except Exception as e:
        partial = str(getattr(e, "partial_fx_graph", "") or "")
        raise
    finally:
        text = err.getvalue().replace(partial, "") if partial else err.getvalue()
        if text.strip():
            sys.stderr.write(text)


def _named(module: nn.Module, args: tuple, kwargs: dict[str, Any], dynamic: Any) -> dict[str, Any]:
    """``dynamic``'s specs by the name of the forward parameter each input binds to."""
    bound = inspect.signature(module.forward).bind(*range(len(args)), **{k: k for k in kwargs})
    spec_args, spec_kwargs = dynamic
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if isinstance(value, tuple):  # *args
            out[name] = tuple(spec_args[i] for i in value)
        elif isinstance(value, dict):  # **kwargs
            out[name] = {k: spec_kwargs[k] for k in value}
        else:
            out[name] = spec_args[value] if isinstance(value, int) else spec_kwargs[value]
    return out


def _refuse_state_updates(module: nn.Module, gm: fx.GraphModule) -> None:
    """A forward that updates a buffer or parameter (BatchNorm's running statistics) is refused:
    each stage would update its own copy on its own worker, and nothing would bring them back."""
    for node in gm.graph.nodes:
        targets = [alias_base(a) for a in written_args(node)]
        if node.op == "call_function" and node.target in _STAT_UPDATES and node.args[5] is True:
            targets += [a for a in node.args[3:5] if isinstance(a, fx.Node)]  # running_mean, running_var
        for t in targets:
            if t.op == "get_attr":
                path = node_path(node)
                where = f"{_stack_type(node)} {path!r}" if path else type(module).__name__
                raise SplitError(f"{where} updates {t.target!r} in place during forward (as BatchNorm updates its "
                                 f"running statistics in train mode), which stages traced from one graph cannot keep "
                                 f"in step; give the model as a list of stage modules (self.stages) instead.")


def written_args(node: fx.Node) -> list[fx.Node]:
    """The arguments an in-place op modifies."""
    t = node.target
    if node.op != "call_function" or not is_op_overload(t):
        return []
    out = []
    for i, arg in enumerate(op_schema(t).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            v = node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(arg.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def alias_base(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node``'s result is a view of (itself if none)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        t = node.target
        aliases = t is operator.getitem or (is_op_overload(t) and bool(op_schema(t).returns)
                                            and op_schema(t).returns[0].alias_info is not None)
        if not aliases:
            break
        node = node.args[0]
    return node


def _drop_constant_asserts(module: nn.Module, gm: fx.GraphModule) -> None:
    """Remove the runtime assertions that record a data branch on a constant; refuse the others."""
    graph = gm.graph
    params = {id(p) for p in module.parameters()}
    asserts = [n for n in graph.nodes if n.op == "call_function" and n.target in _ASSERTS]
    for node in asserts:
        ancestors = _ancestors(node)
        if any(a.op == "placeholder" for a in ancestors):
            raise SplitError(_data_branch(module, node, "the input"))
        for a in ancestors:
            if a.op == "get_attr" and id(_attr(gm, a.target)) in params:
                raise SplitError(_data_branch(module, node, f"the parameter {a.target!r}"))
    # Erase the assertions, then whatever only they used (the comparison and its `.item()`).
    doomed = set()
    for node in asserts:
        doomed |= _ancestors(node)
        graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node in doomed and node.op == "call_function" and not node.users:
            graph.erase_node(node)
    gm.recompile()


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _attr(root: nn.Module, target: fx.node.Target) -> Any:
    assert isinstance(target, str)  # a get_attr node's target: the attribute's dotted name
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _data_branch(module: nn.Module, node: fx.Node, on: str) -> str:
    """The sentence for a branch on tensor data: what the code says, where, and in which module."""
    path = node_path(node)
    where = f"{path!r} ({_stack_type(node)})" if path else type(module).__name__
    line = _user_line(node.meta.get("stack_trace", ""))
    code = f" at {line}" if line else ""
    return (f"{where} branches on tensor data that depends on {on}{code}, which a traced split cannot follow "
            f"from one batch to the next; make the branch independent of the data or give the model as a list of "
            f"stage modules (self.stages).")


#: the ``nn_module_stack`` key torch.export's metadata hook gives a node one of its passes adds outside
#: any module (a symbolic size's computation under dynamic shapes): no module path
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


def module_stack(node: fx.Node) -> list[tuple[str, Any]]:
    """``(path, type)`` of each module a node ran in, outermost first (none for the root's own code)."""
    return [v for k, v in (node.meta.get("nn_module_stack") or {}).items() if k != _NO_MODULE]


def node_path(node: fx.Node) -> str:
    """The innermost module a node ran in (``""`` for the root module's own code)."""
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def _stack_type(node: fx.Node) -> str:
    stack = module_stack(node)
    if not stack:
        return ""
    kind = stack[-1][1]
    return (kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))).rpartition(".")[2]


def _user_line(stack_trace: str) -> str:
    """``file.py:12 `if x.sum() > 0:``` from a node's recorded stack: its last frame."""
    lines = [s.strip() for s in stack_trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            try:
                file = lines[i].split('"')[1]
                lineno = lines[i].split("line ")[1].split(",")[0]
            except IndexError:
                return ""
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{os.path.basename(file)}:{lineno}" + (f" `{code}`" if code else "")
    return ""


def _failure(module: nn.Module, e: BaseException) -> str:
    """One sentence for an export failure: the error's first line, and where in the user's code."""
    first = next((s.strip() for s in str(e).splitlines() if s.strip()), type(e).__name__)
    if len(first) > 200:
        first = first[:197] + "..."
    first = first.rstrip(".")
    frame, path = _user_frame(module, e)
    where = f" in {path!r}" if path else ""
    at = f" at {frame}" if frame else ""
    return (f"torch.export cannot trace {type(module).__name__}'s forward{where}{at} ({type(e).__name__}: {first}); "
            f"change that code or give the model as a list of stage modules (self.stages).")


def _user_frame(module: nn.Module, e: BaseException) -> tuple[str, str]:
    """The deepest frame of ``e`` outside torch, and the module path of the deepest module whose
    ``forward`` is on the stack."""
    paths = {id(m): p for p, m in module.named_modules()}
    frame_text, path = "", ""
    tb = e.__traceback__
    while tb is not None:
        f = tb.tb_frame
        file = f.f_code.co_filename
        if not file.startswith((_TORCH_DIR, _HERE, "<")):  # "<string>": code that torch generated
            summary = traceback.extract_tb(tb, limit=1)[0]
            frame_text = f"{os.path.basename(file)}:{summary.lineno}" + (f" `{summary.line}`" if summary.line else "")
            owner = f.f_locals.get("self")
            if id(owner) in paths and paths[id(owner)]:
                path = paths[id(owner)]
        tb = tb.tb_next
    return frame_text, path


class LossModule(nn.Module):
    """A LightningModule's training step as a module: ``forward(batch)`` returns the loss of
    ``training_step(batch, 0)`` (its ``"loss"`` when it returns a dict). The batch is passed whole,
    as the DataLoader made it (a tensor, a tuple, a dict), so the step sees what it sees on one
    device; ``batch_type``, a mapping class other than ``dict`` (``transformers.BatchEncoding``),
    is rebuilt from the dict a traced graph takes (torch.export flattens dicts, not such classes).

    The LightningModule's children, parameters and buffers are this module's own under the same
    names, so module paths read as in the LightningModule (``model.encoder.layers.0``) and a split
    trains its parameters. ``self.log``/``self.log_dict`` do nothing while it runs: a value being
    traced cannot be logged, and a stage has no trainer to log to.
    """

    # any module with a training_step (a LightningModule); its log methods are swapped while it runs
    lightning_module: Any

    def __init__(self, lightning_module: nn.Module, batch_type: type | None = None) -> None:
        super().__init__()
        self.batch_type = batch_type
        if not callable(getattr(lightning_module, "training_step", None)):
            raise SplitError(f"loss_module needs a LightningModule with a training_step; "
                             f"{type(lightning_module).__name__} has none.")
        object.__setattr__(self, "lightning_module", lightning_module)  # not a child: its children are ours
        for name, child in lightning_module.named_children():
            self.add_module(name, child)
        for name, p in lightning_module.named_parameters(recurse=False, remove_duplicate=False):
            self.register_parameter(name, p)
        transient = non_persistent_buffers(lightning_module)
        for name, b in lightning_module.named_buffers(recurse=False, remove_duplicate=False):
            self.register_buffer(name, b, persistent=name not in transient)

    @property
    def training(self) -> bool:
        """The LightningModule's own mode: a training_step may read ``self.training``, and whatever
        puts this module's mode back (a check run in eval mode) puts the LightningModule's back too."""
        lm = self.__dict__.get("lightning_module")
        return lm.training if lm is not None else self.__dict__.get("_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        lm = self.__dict__.get("lightning_module")
        if lm is not None:
            lm.training = mode
        else:  # nn.Module.__init__, before the LightningModule is attached
            self.__dict__["_training"] = mode

    def forward(self, batch: Any) -> torch.Tensor:
        lm = self.lightning_module
        if self.batch_type is not None and isinstance(batch, dict):
            batch = self.batch_type(batch)
        saved = {k: lm.__dict__[k] for k in ("log", "log_dict") if k in lm.__dict__}
        params, buffers = parameter_dict(lm), buffer_dict(lm)
        state = dict(params), dict(buffers)
        lm.log = lm.log_dict = _ignore
        # The LightningModule reads its own parameters and buffers from its own dicts: hand it ours,
        # which torch.export swaps for the traced ones (it would take the LightningModule's for
        # constants). Outside tracing they are the same tensors.
        ours, our_buffers = parameter_dict(self), buffer_dict(self)
        params.update({k: ours[k] for k in state[0] if k in ours})
        buffers.update({k: our_buffers[k] for k in state[1] if k in our_buffers})
        try:
            out = lm.training_step(batch, 0)
        finally:
            del lm.log, lm.log_dict
            lm.__dict__.update(saved)
            params.update(state[0])
            buffers.update(state[1])
        if isinstance(out, Mapping):
            out = out.get("loss")
        if not isinstance(out, torch.Tensor):
            raise SplitError(f"{type(lm).__name__}.training_step returned {type(out).__name__}, not a loss tensor "
                             f"(or a dict with one under 'loss'), so it cannot be split as a batch -> loss function.")
        return out


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def loss_module(lightning_module: nn.Module, batch_type: type | None = None) -> LossModule:
    """``lightning_module``'s ``training_step`` as a ``batch -> loss`` module, to split whole: it
    is traced as ``module(batch)``, on one micro-batch (see :class:`LossModule`)."""
    return LossModule(lightning_module, batch_type)
