"""Cut a traced forward into stage modules that follow the engine's stage contract.

Stage ``c`` is called as ``stage(*args)``. A source stage (stage 0, the only one without
predecessors) takes the module's own inputs, keywords included. Every other stage takes, for each
``p`` in ``graph.preds[c]`` in order, ``out_p[i] for i in picks[(p, c)]``, ``out_p`` being the
tuple stage ``p`` returned. Every stage but the last returns a tuple of the values later stages
need; the last returns the module's output, structure kept.

The stage graph's edges are the dataflow: a value made in stage 0 and used in stage 3 goes along
the edge ``0 -> 3``, not through stages 1 and 2, and an input a later stage needs goes from stage
0 straight to it. A value computed from constants alone (a causal mask) is computed again by each
stage that uses it instead, so what crosses stages is activations and inputs. A stage is cut where
a module's first node runs (``points``), so a stage holds the nodes from one module boundary to the
next in execution order.

A stage is a ``torch.fx.GraphModule`` over the module's own parameters and buffers. Its dropout
follows its own ``training`` flag; tensors that forward creates on the traced device follow the
device of its parameters; stage 0 checks that a micro-batch has the example's shapes and dtypes.
A stage seeds each random-stream unit (a segment from one module boundary to the next) before the
unit's first random op (:func:`launcher.torch_support.streams.seed_unit`, nothing outside a job).
"""

from __future__ import annotations

import bisect
import difflib
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx, nn

from launcher.schedule.graph import StageGraph
from launcher.split.capture import SplitError, alias_base, export_graph, module_stack, node_path, written_args
from launcher.split.cut_points import least_largest_stage
from launcher.split.same_output import check_same, kept, seeded
from launcher.split.stage_rewrites import InputCheck, follow_device, follow_mode
from launcher.torch_support.streams import seed_unit
from launcher.torch_support.torch_private import (
    is_op_overload,
    non_persistent_buffers,
    pytree,
    pytree_codegen_info,
    set_pytree_codegen,
)


@dataclass
class Split:
    """A module cut into stages; see the module docstring for the contract the stages follow."""

    stages: list[nn.Module]  # in topological order
    graph: StageGraph  # preds[s]: the stages whose outputs stage s takes
    picks: dict[tuple[int, int], tuple[int, ...]]  # edge (p, c): the items of stage p's output tuple c takes
    starts: list[str]  # the module path where each stage begins
    # random streams (:mod:`launcher.torch_support.streams`): the module path that begins each unit
    # holding a random op ("": the forward's head, before any submodule), and the unit's index
    units: dict[str, int] = field(default_factory=dict)

    def inputs(self, stage: int, outs: Sequence[tuple]) -> list[Any]:
        """What stage ``stage`` (not 0) is called with, from the outputs of the stages before it."""
        return [outs[p][i] for p in self.graph.preds[stage] for i in self.picks[(p, stage)]]

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """All stages in order on one batch, as the engine would run them in one process."""
        outs: list[Any] = []
        for s, stage in enumerate(self.stages):
            outs.append(stage(*args, **kwargs) if s == 0 else stage(*self.inputs(s, outs)))
        return outs[-1]

    def train(self, mode: bool = True) -> "Split":
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> "Split":
        return self.train(False)


def split_module(module: nn.Module, example_args: tuple, stages: int, points: Sequence[str] | str = "auto",
                 example_kwargs: dict[str, Any] | None = None) -> Split:
    """Trace ``module`` on one micro-batch and cut it into ``stages`` stages: ``trace_module``
    then :meth:`Traced.split`, which say what the arguments mean and what is checked."""
    return trace_module(module, example_args, example_kwargs).split(stages, points)


def trace_module(module: nn.Module, example_args: tuple, example_kwargs: dict[str, Any] | None = None,
                 rows: bool = True) -> "Traced":
    """Trace ``module``'s forward on one micro-batch (``example_args``, ``example_kwargs``), to
    split as often as wanted: tracing costs seconds, cutting milliseconds. ``rows``: the inputs'
    first dimension is traced as a symbol where the code allows (:func:`export_graph`), so the
    stages take micro-batches of any size (a last, smaller batch's).

    The module runs once first, in train mode with the RNG state kept, so a tensor it caches on
    its first call (a positional table) is in the graph as a constant. Its modes and buffers are
    left as they were.
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    if not isinstance(module, nn.Module):
        raise SplitError(f"split_module needs a torch.nn.Module, not {type(module).__name__}.")
    with kept(module):
        module.train()  # traced in train mode, so dropout is in the graph; stages switch it with their mode
        seeded(lambda: module(*args, **kwargs), args, module, grad=False)
        gm = export_graph(module, args, kwargs, rows)
    return Traced(module, args, kwargs, _ExportedGraph(gm, module))


class Traced:
    """A module's forward traced on one example, ready to cut."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], exported: "_ExportedGraph") -> None:
        self.module, self.args, self.kwargs, self.exported = module, args, kwargs, exported

    def split(self, stages: int, points: Sequence[str] | str = "auto") -> Split:
        """Cut into ``stages`` stage modules.

        ``points`` are the module paths where stages 1.. begin (``"encoder.layers.2"``), in the
        order forward calls them; ``"auto"`` picks module boundaries that minimise the largest
        stage's parameter count (a parameter counts toward the stage that uses it first), then
        balance the rest, then send the fewest bytes between stages. The stages hold the module's
        own parameters and buffers (the same tensor objects, under their names in the module) and
        are specialised to the example's shapes: every micro-batch must have them (stage 0 checks).

        Before returning, the stages run on the example in train mode and in eval mode, each run
        seeded as the module's is (the same dropout masks, the same noise a step draws), and must
        reproduce the module's output bit for bit, or within 16 ulps of the output's scale where a
        kernel is not deterministic (some GPU kernels); otherwise :class:`SplitError`, naming the
        first op whose result differs. The stages are left in the module's mode.
        """
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise SplitError(f"stages={stages!r}: a split needs a whole number of stages, at least 1.")
        try:
            return self._split(stages, points)
        except SplitError:
            if not self.exported.rows:
                raise
        # a graph of any batch size that cannot be cut or does not compute what the module does on
        # another size: the example's size, fixed (stage 0's check then names drop_last=True)
        return trace_module(self.module, self.args, self.kwargs, rows=False).split(stages, points)

    def _split(self, stages: int, points: Sequence[str] | str) -> Split:
        module, args, kwargs = self.module, self.args, self.kwargs
        cuts, starts = self.exported.cuts(points, stages)
        split = self.exported.build(cuts, starts)
        with kept(module):
            for mode in (True, False):
                # each mode's two runs seeded alike: dropout draws the same masks, and a step that
                # draws in eval mode too (a diffusion step's noise and timesteps) the same numbers;
                # with grad, as in training (under no_grad, eval-mode nn.Transformer takes a fused path)
                module.train(mode)
                runs = (lambda: seeded(lambda: module(*args, **kwargs), args, module),
                        lambda: seeded(lambda: split.train(mode).run(*args, **kwargs), args, module))
                check_same(runs[0](), runs[1](), "train" if mode else "eval", module, len(split.stages), runs)
            if self.exported.rows:
                self._check_one_row(split)
        return split.train(module.training)

    def _check_one_row(self, split: Split) -> None:
        """The stages of a graph traced with a symbolic batch size compute what the module
        computes on a micro-batch of one sample too (the smallest a last batch gives), in train
        mode; a module that cannot run on one sample is not asked."""
        module = self.module
        n = next((x.shape[0] for x in pytree.tree_leaves((self.args, self.kwargs))
                  if isinstance(x, torch.Tensor) and x.dim()), 1)
        if n < 2:
            return
        args, kwargs = pytree.tree_map(lambda x: x[:1] if isinstance(x, torch.Tensor) and x.dim() else x,
                                       (self.args, self.kwargs))
        module.train()
        try:
            want = seeded(lambda: module(*args, **kwargs), args, module)
        except Exception:  # noqa: BLE001 - nothing to compare with
            return
        try:
            got = seeded(lambda: split.train().run(*args, **kwargs), args, module)
        except Exception as e:  # noqa: BLE001 - the graph does not take this size
            raise SplitError(f"the stages of {type(module).__name__} do not run on one sample ({e})") from e
        check_same(want, got, "train", module, len(split.stages))


class _ExportedGraph:
    """The module's graph as ``torch.export`` traced it (``gm``): its nodes in execution order, and
    what cutting needs to know about them (not the stage graph, :class:`StageGraph`, nor a
    worker's program of the schedule, :class:`launcher.schedule.program.Program`)."""

    def __init__(self, gm: fx.GraphModule, module: nn.Module) -> None:
        self.gm, self.module, self.name = gm, module, type(module).__name__
        nodes = list(gm.graph.nodes)
        self.inputs = [n for n in nodes if n.op == "placeholder"]
        self.out = nodes[-1]
        # export's check of the inputs; stage 0 gets an InputCheck instead (which pickles, and says
        # what a micro-batch must look like)
        self.guards = [n for n in nodes if n.op == "call_module" and n.target == "_guards_fn"]
        self.order = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")
                      and n not in self.guards]
        self.pos = {n: i for i, n in enumerate(self.order)}
        # whether some input's first dimension is a symbol: the graph takes micro-batches of other sizes
        self.rows = any(_symbolic_rows(n.meta.get("val")) for n in self.inputs)
        self.first: dict[str, int] = {}  # module path -> position of the first node that runs in it
        for i, n in enumerate(self.order):
            for path, _ in module_stack(n):
                if path:
                    self.first.setdefault(path, i)
        self.outermost: dict[int, str] = {}
        for path, i in self.first.items():
            if i not in self.outermost or path.count(".") < self.outermost[i].count("."):
                self.outermost[i] = path
        self.pinned = self._pinned()
        # random-stream units: segments from one module's first node to the next (cuts fall on
        # such positions only, so a unit never spans stages); those with a random op, by position
        self.unit_starts = sorted({0, *self.first.values()})
        self.random_unit: dict[fx.Node, int] = {
            n: bisect.bisect_right(self.unit_starts, i) - 1 for i, n in enumerate(self.order)
            if is_op_overload(n.target) and torch.Tag.nondeterministic_seeded in n.target.tags}
        own = {id(p) for p in module.parameters()}
        for n in nodes:
            if n.op == "get_attr" and isinstance(v := _attr(gm, n.target), nn.Parameter) and id(v) not in own:
                raise SplitError(f"{self.name}'s forward uses a parameter of shape {tuple(v.shape)} that is not "
                                 f"registered under it (held in a plain list, or by another object), so no stage "
                                 f"could name or train it; register it in a submodule.")
        self.aliases: dict[int, list[str]] = {}  # a tied weight has a name under each module that holds it
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, t in named:
            self.aliases.setdefault(id(t), []).append(name)
        self.persistent = {id(b) for m in module.modules()
                           for k, b in m.named_buffers(recurse=False, remove_duplicate=False)
                           if k not in non_persistent_buffers(m)}
        self.const = self._constants()

    def _constants(self) -> set[fx.Node]:
        """Nodes computed from constants alone (a causal mask, RoPE's tables from its buffer): each
        stage that uses one computes it itself rather than receiving it, so only activations cross
        stages. Random ops and tensors that an in-place op modifies are not constants."""
        mutated = {alias_base(a) for n in self.order for a in written_args(n)}
        out: set[fx.Node] = set()
        for n in self.order:
            t = n.target
            if n.op != "call_function" or n in mutated or alias_base(n) in mutated or written_args(n):
                continue
            if not (t is operator.getitem or (is_op_overload(t)
                                              and torch.Tag.nondeterministic_seeded not in t.tags)):
                continue
            if all(a in out or (a.op == "get_attr" and not isinstance(_attr(self.gm, a.target), nn.Parameter))
                   for a in n.all_input_nodes):
                out.add(n)
        return out

    # ---- where a stage may begin -----------------------------------------------------------------
    def _pinned(self) -> dict[int, fx.Node]:
        """Positions a cut may not take: between a tensor and an in-place op that modifies it.

        The engine hands a stage its inputs as autograd leaves, which no in-place op may modify,
        and a stage on another worker would not see the change anyway.
        """
        out: dict[int, fx.Node] = {}
        for n in self.order:
            for a in written_args(n):
                start = self.pos.get(alias_base(a), -1)  # inputs and attributes exist before any node
                for c in range(start + 1, self.pos[n] + 1):
                    out.setdefault(c, n)
        return out

    def _boundaries(self) -> list[int]:
        return sorted({p for p in self.first.values() if p > 0 and p not in self.pinned})

    def _outermost(self, position: int) -> str:
        """The outermost module that begins at ``position``: how a report names a stage's start."""
        return self.outermost.get(position, "")

    def cuts(self, points: Sequence[str] | str, stages: int) -> tuple[list[int], list[str]]:
        """Positions where stages 1.. begin, and each stage's starting module path."""
        head = ""
        if self.order:
            head = next((p for p, _ in module_stack(self.order[0]) if p), "")
        if isinstance(points, str) and points == "auto":
            cuts = self._auto(stages - 1)
            return cuts, [head] + [self._outermost(c) for c in cuts]
        points = [points] if isinstance(points, str) else list(points)
        if len(points) != stages - 1:
            raise SplitError(f"stages={stages} needs {stages - 1} split point{'s' * (stages != 2)} (where stages 1.. "
                             f"begin), got {len(points)}: {', '.join(map(repr, points)) or 'none'}.")
        return self._explicit(points), [head] + points

    def _explicit(self, points: list[str]) -> list[int]:
        named = dict(self.module.named_modules())
        cuts: list[int] = []
        for k, path in enumerate(points):
            if not isinstance(path, str) or not path or path not in named:
                raise SplitError(f"split point {path!r} is not a submodule of {self.name}; stages can begin at "
                                 f"{self._few(path)}.")
            if path not in self.first:
                raise SplitError(f"split point {path!r} ({type(named[path]).__name__}) is never called by "
                                 f"{self.name}'s forward, so no stage can begin there; stages can begin at "
                                 f"{self._few(path)}.")
            c = self.first[path]
            if c == 0:
                raise SplitError(f"split point {path!r} is where {self.name}'s forward begins, which would leave "
                                 f"stage 0 empty; stages can begin at {self._few(path)}.")
            if cuts and c <= cuts[-1]:
                raise SplitError(f"split point {path!r} is called before split point {points[k - 1]!r}, so its "
                                 f"stage would be out of order; give the points in the order forward calls them, "
                                 f"e.g. {self._few(path)}.")
            if c in self.pinned:
                op = self.pinned[c]
                raise SplitError(f"split point {path!r} would put the in-place {_op_name(op)} in "
                                 f"{node_path(op)!r} in a later stage than the tensor it modifies, which a stage "
                                 f"cannot do to its inputs; stages can begin at {self._few(path)}.")
            cuts.append(c)
        return cuts

    def _few(self, near: object, n: int = 5) -> str:
        """A few module paths where a stage can begin, those most like ``near`` first, in call order."""
        ok = {p: i for p, i in self.first.items() if i > 0 and i not in self.pinned}
        close = difflib.get_close_matches(str(near), list(ok), n=n, cutoff=0.0)
        return ", ".join(repr(p) for p in sorted(close, key=lambda p: (ok[p], p.count(".")))) or "no module"

    def _auto(self, k: int) -> list[int]:
        """``k`` cut positions among module boundaries: least largest stage (in parameters), then
        least sum of squared stage sizes, then fewest bytes crossing the cuts, then outermost
        modules (a stage that begins at block ``2`` rather than inside block 1); measured here,
        chosen by :func:`~launcher.split.cut_points.least_largest_stage`."""
        if k == 0:
            return []
        cands = self._boundaries()
        m, N = len(cands), len(self.order)
        if m < k:
            raise SplitError(f"{self.name}'s forward has {m} module boundar{'y' if m == 1 else 'ies'} where a stage "
                             f"can begin, fewer than the {k} that {k + 1} stages need.")
        W = [0] * (N + 1)  # W[i]: parameters first used before position i
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and isinstance(value := _attr(self.gm, node.target), nn.Parameter):
                uses = [self.pos[u] for u in node.users if u in self.pos]
                if uses:
                    W[min(uses) + 1] += value.numel()
        for i in range(N):
            W[i + 1] += W[i]
        live = self._live()
        depth = {c: self._outermost(c).count(".") for c in cands}
        return least_largest_stage(W, cands, live, depth, k)

    def _live(self) -> list[int]:
        """Bytes of the values a cut at each position would send between stages."""
        N = len(self.order)
        diff = [0] * (N + 2)
        for v in self.inputs + [n for n in self.order if n not in self.const]:
            uses = [N if u.op == "output" else self.pos.get(u, 0) for u in v.users]
            d = self.pos.get(v, -1)
            if uses and max(uses) > d:
                b = _nbytes(v.meta.get("val"))
                diff[d + 1] += b
                diff[max(uses) + 1] -= b
        live, run = [0] * (N + 1), 0
        for c in range(N + 1):
            run += diff[c]
            live[c] = run
        return live

    # ---- building the stages ---------------------------------------------------------------------
    def _name(self, attr: fx.Node, user: fx.Node) -> str:
        """The name a stage gives a parameter or buffer: of its names in the module, the one under
        the innermost module of the node that uses it (a tied embedding reads ``head.weight`` in
        the last stage), else the name the trace gave it."""
        assert isinstance(attr.target, str)  # a get_attr node's target: the attribute's dotted name
        names = self.aliases.get(id(_attr(self.gm, attr.target)), [])
        for path, _ in reversed(module_stack(user)):
            for name in names:
                if name.rpartition(".")[0] == path:
                    return name
        return attr.target

    def _size(self, a: fx.Node, g: fx.Graph, env: dict[fx.Node, fx.Node], feeds: list[fx.Node],
              lookup: Any) -> fx.Node:
        """A size made in another stage, in this one: read off an input of this stage with a
        dimension of that size, else computed again from sizes of its own (``s0 * 8``)."""
        expr = a.meta["val"].node.expr
        for v in feeds:
            val = v.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        node = g.call_function(torch.ops.aten.sym_size.int, (env[v], d))
                        node.meta = dict(a.meta)
                        return node
        if a.op == "call_function" and all(_is_size(x) for x in a.all_input_nodes):
            return g.node_copy(a, lookup)
        raise SplitError(f"{self.name}'s graph needs the size {expr} in a stage that has no input of that size.")

    def build(self, cuts: list[int], starts: list[str]) -> Split:
        S = len(cuts) + 1
        stage_of: dict[fx.Node, int] = {n: 0 for n in self.inputs + self.guards}
        for i, n in enumerate(self.order):
            # a tuple's items go with the op that made it, so only tensors cross stages
            stage = bisect.bisect_right(cuts, i)
            stage_of[n] = stage_of.get(n.args[0], stage) if n.target is operator.getitem else stage
        needs: list[set[fx.Node]] = [set() for _ in range(S)]
        for n, c in list(stage_of.items()) + [(self.out, S - 1)]:
            for a in n.all_input_nodes:
                # a size (the batch's) is read off the stage's own inputs (:meth:`_size`), not sent
                if a.op != "get_attr" and a not in self.const and stage_of[a] != c and not _is_size(a):
                    needs[c].add(a)
        index = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        exports = [sorted((a for c in range(S) for a in needs[c] if stage_of[a] == p), key=index.__getitem__)
                   for p in range(S)]
        exports = [list(dict.fromkeys(e)) for e in exports]
        preds: list[list[int]] = [sorted({stage_of[a] for a in needs[c]}) for c in range(S)]
        picks = {(p, c): tuple(sorted(exports[p].index(a) for a in needs[c] if stage_of[a] == p))
                 for c in range(S) for p in preds[c]}
        # Stage 0 is the only source and the last stage the only sink (a sink computes the loss):
        # a stage that takes nothing from, or gives nothing to, its neighbours gets an empty edge.
        for c in range(1, S):
            if not preds[c]:
                preds[c], picks[(c - 1, c)] = [c - 1], ()
        for p in range(S - 1):
            if not any(p in ps for ps in preds):
                preds[p + 1] = sorted(preds[p + 1] + [p])
                picks[(p, p + 1)] = ()
        modules: list[nn.Module] = []
        for s in range(S):
            feeds = self.inputs if s == 0 else [exports[p][i] for p in preds[s] for i in picks[(p, s)]]
            modules.append(self._stage(s, S, stage_of, feeds, exports[s]))
        starts_at = [self.outermost.get(p, "") for p in self.unit_starts]  # "": no module begins at 0
        units = {starts_at[u]: u for u in sorted(set(self.random_unit.values()))}
        return Split(modules, StageGraph(tuple(tuple(p) for p in preds)), picks, starts, units)

    def _stage(self, s: int, S: int, stage_of: dict[fx.Node, int], feeds: list[fx.Node],
               exports: list[fx.Node]) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        attrs: dict[str, Any] = {}
        info = pytree_codegen_info(self.gm.graph)
        flat_in = info is None or (len(info.orig_args) == len(self.inputs) and all(
            info.in_spec.child(k).child(i).is_leaf() for k in range(info.in_spec.num_children)
            for i in range(info.in_spec.child(k).num_children)))
        flat_out = info is None or _plain(info.out_spec)
        # Stage 0 takes forward's own parameters: positional inputs, keywords by name.
        names = info.orig_args if s == 0 and info is not None and flat_in else [v.name for v in feeds]
        for v, name in zip(feeds, names):
            env[v] = g.placeholder(name)
            env[v].meta = dict(v.meta)

        user = [self.out]

        def lookup(a: fx.Node) -> fx.Node:
            if a.op == "get_attr" and a not in env:
                name = self._name(a, user[0])
                env[a] = g.get_attr(name)
                env[a].meta = dict(a.meta)
                attrs[name] = _attr(self.gm, a.target)
            elif a in self.const and a not in env:  # computed where it is used
                env[a] = g.node_copy(a, lookup)
            elif a not in env and _is_size(a) and stage_of.get(a) != s:
                env[a] = self._size(a, g, env, feeds, lookup)
            return env[a]

        seeded: set[int] = set()
        if s == 0:
            guards = self.guards[0] if self.guards and self.rows else None
            attrs["_input_check"] = InputCheck(
                [(name, v.meta.get("val")) for name, v in zip(names, feeds)],
                _attr(self.gm, guards.target) if guards is not None else None,
                [feeds.index(a) for a in guards.args] if guards is not None else ())
            g.call_module("_input_check", tuple(env[v] for v in feeds))
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr", "output") or n in self.guards or n in self.const or stage_of[n] != s:
                continue
            if n.op == "call_module":
                attrs[n.target] = _attr(self.gm, n.target)
            u = self.random_unit.get(n)
            if u is not None and u not in seeded:  # the unit's stream, whichever stage holds it
                seeded.add(u)
                g.call_function(seed_unit, (u,))
            user[0] = n
            env[n] = g.node_copy(n, lookup)
        user[0] = self.out
        if s < S - 1:
            g.output(tuple(env[v] for v in exports))
        else:
            flat = fx.map_arg(self.out.args[0], lookup)
            g.output(pytree.tree_unflatten(list(flat), info.out_spec) if info is not None and flat_out else flat)
        follow_mode(g, attrs)
        follow_device(g, attrs)
        # Nested inputs (a dict argument), or an output of another class (a dataclass), need pytree
        # code: flattening on the way in, rebuilding on the way out.
        if info is not None and ((s == 0 and not flat_in) or (s == S - 1 and not flat_out)):
            if s == 0:
                in_names, in_spec = info.orig_args, info.in_spec
            else:
                in_names, in_spec = names, pytree.tree_structure((tuple(range(len(names))), {}))
            set_pytree_codegen(g, in_names, in_spec, info.out_spec if s == S - 1 and not flat_out else None)
        stage = fx.GraphModule(attrs, g, class_name=f"Stage{s}")
        for target, value in attrs.items():
            constant = id(value) not in self.persistent
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and constant:
                owner, _, field = target.rpartition(".")
                non_persistent_buffers(stage.get_submodule(owner)).add(field)  # a constant, not state
        return stage


def _is_size(node: fx.Node) -> bool:
    """Whether a node's value is a symbolic size (an int the graph computes from a batch's shape)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _plain(spec: pytree.TreeSpec) -> bool:
    """Whether an output structure is tensors and constants in tuples, lists and dicts, which a
    graph can return as they are."""
    return spec.is_leaf() or (spec.type in (tuple, list, dict)
                              and all(_plain(spec.child(i)) for i in range(spec.num_children)))


def _attr(root: nn.Module, target: fx.node.Target) -> Any:
    assert isinstance(target, str)  # a get_attr node's target: the attribute's dotted name
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _op_name(node: fx.Node) -> str:
    """``add_`` for ``aten.add_.Tensor``."""
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _nbytes(val: object) -> int:
    """Bytes of a traced value, at the example's sizes where a size is a symbol."""
    if isinstance(val, torch.Tensor):
        n = 1
        for d in val.shape:
            n *= _hint(d)
        return n * val.element_size()
    return 8


def _hint(d: Any) -> int:
    """A size as an int: a symbol's value in the example."""
    return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)


def _symbolic_rows(val: object) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() > 0 and isinstance(val.shape[0], torch.SymInt)
