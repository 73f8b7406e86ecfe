"""Any ``transformers`` causal LM cut into stages at its decoder layers, with no per-family code:
``stages = [embeddings, decoder layer x L, lm_head]``.

Every stage runs the library's own code. The *body* is the module whose ``forward`` calls the
decoder layers (``model.model``, ``model.transformer``, OPT's ``model.model.decoder``): what it
computes before the first layer (token and position embeddings, OPT's offset positions and
projection, dropout, the masks, ALiBi, the rotary ``(cos, sin)``), how it calls each layer, and
what it does after the last one (the final norm, OPT's ``project_out``) are whatever that forward
does. Each stage calls the forward of a *twin* of the body, a copy of the object that shares its
modules except those the stage does not hold:

- the first stage runs the body's forward up to the first layer and returns the hidden state the
  layer would receive;
- decoder layer ``i`` runs the body's forward with the modules it does not hold replaced by
  stand-ins (modules with weights, and dropout, return zeros of their output's shape, found on the
  meta device: the masks, positions and rotary embeddings the forward builds from them depend on
  their shapes alone), and calls layer ``i`` with the arguments the forward built for it, on the
  hidden state it received; the last layer's stage runs the rest of the forward (the final norm);
- the last stage runs the causal LM's own forward on that hidden state (``lm_head``, and any logit
  scaling or soft-capping the family applies).

Between stages travel the hidden state and the batch's ``input_ids``, ``attention_mask`` and
``position_ids`` (``None`` when not given): each stage rebuilds from them what its layer takes, as
the model's forward does. A probe at build time (a forward with every weight on the meta device,
the random state untouched) finds which modules the body calls before the first layer and after
the last, and refuses, in one sentence, a model that does not fit this shape.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from .twins import Reached as _Reached
from .twins import twin as _twin

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: the way out a refusal names: the same model, kept whole, traced and cut (:mod:`.hf_traced`)
ROUTE = "train it with model=hf_traced and the same model.* keys (traced and cut at any module)"


class CutError(ValueError):
    """A model these stages cannot reproduce: one sentence."""


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _first_tensor(out: Any) -> torch.Tensor:
    """A layer's or a body's hidden state: the output itself, or its first item (a tuple, a
    ``ModelOutput``)."""
    return out if isinstance(out, torch.Tensor) else out[0]


class _Skip(nn.Module):
    """A decoder layer the stage does not run: the body's loop sees the layer's own attributes
    (``attention_type``, ``layer_idx``, ...) and gets its hidden state back unchanged."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and key != "training":
                object.__setattr__(self, key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _hidden_of(args, kwargs)


class _Stop(_Skip):
    """The first layer, in the first stage: the hidden state it would receive ends the forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Reached(_hidden_of(args, kwargs))


class _Run(_Skip):
    """The layer a stage runs: called with the arguments the body's forward built for it, on the
    hidden state the stage received (``hidden``, set for the call). Ends the forward there, unless
    it is the last layer (then the body's forward goes on to its final norm)."""

    layer: nn.Module  # a plain attribute: the stage holds the layer

    def __init__(self, layer: nn.Module, last: bool) -> None:
        super().__init__(layer)
        object.__setattr__(self, "layer", layer)  # held by the stage, not registered twice
        self.last = last
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = self.hidden
        assert hidden is not None  # the stage sets it for the call
        device = hidden.device  # meta in a shape-only run, whose masks were built on the CPU

        def follow(t: Any) -> Any:
            return t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t

        args, kwargs = _with_hidden(tree_map(follow, args), tree_map(follow, kwargs), hidden)
        out = self.layer(*args, **kwargs)
        if self.last:
            return out
        raise _Reached(out)


class _Record(_Skip):
    """The probe's stand-in for layer ``index``: notes the call and what the layer was given."""

    log: list[Any]  # a plain attribute: the probe's, shared by every layer's stand-in

    def __init__(self, layer: nn.Module, index: int, log: list[Any]) -> None:
        super().__init__(layer)
        object.__setattr__(self, "log", log)
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append(("layer", self.index, args, kwargs))
        return _hidden_of(args, kwargs)


def _meta_copy(module: nn.Module) -> nn.Module:
    memo: dict[int, Any] = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False)
                            for t in module.parameters()}
    memo.update({id(t): torch.empty_like(t, device="meta") for t in module.buffers()})
    return copy.deepcopy(module, memo)


class _Shadow(nn.Module):
    """Stands in for a module of the body that the stage does not hold (it has weights, or draws
    random numbers): returns zeros of the shape the module would return (a meta-device copy of it
    computes the shape), floating-point ones in the stage's dtype (``dtype``, set for the call).
    The body builds its masks, positions and rotary embeddings from such values' shapes and dtype
    alone (the probe checks that no layer argument depends on them)."""

    meta: nn.Module

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "meta", _meta_copy(module))  # no storage, not a submodule
        self.dtype: torch.dtype = torch.float32
        self.device: torch.device = torch.device("cpu")
        self.grad = False  # the probe's: outputs that require grad, to find what depends on them

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # every tensor of the meta run made afresh on the meta device: real meta tensors, or fake
        # ones when the engine runs the stage under a fake-tensor mode (which refuses others)
        def meta(t: Any) -> Any:
            return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

        state = {k: meta(t) for k, t in [*self.meta.named_parameters(), *self.meta.named_buffers()]}
        with torch.no_grad():
            out = functional_call(self.meta, state, tree_map(meta, args), tree_map(meta, kwargs))

        def zeros(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            floating = t.is_floating_point()
            z = torch.zeros(t.shape, dtype=self.dtype if floating else t.dtype, device=self.device)
            return z.requires_grad_() if floating and self.grad else z

        return tree_map(zeros, out)


class _BodyOutput(dict):
    """What the body returns, as the causal LM's forward reads it (``out.last_hidden_state``,
    ``out[0]``, ``out.get(...)``): the hidden state, and ``None`` for anything else it asks for
    (caches, attentions, router logits: none are kept)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return (self["last_hidden_state"],)[key]
        return self.get(key)


class _Hidden(nn.Module):
    """The body, in the last stage: its output is the hidden state the stage received."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _BodyOutput(last_hidden_state=self.hidden)


def _draws(module: nn.Module) -> bool:
    """Whether the module draws random numbers (dropout of any kind)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules())


def _has_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass(frozen=True)
class _BodyKwargs:
    """``input_ids`` and, where the body's forward takes them (``accepted``), the batch's
    ``attention_mask`` and ``position_ids`` and ``use_cache=False``; a value given for a keyword the
    forward does not take is refused in one sentence."""

    accepted: frozenset[str]
    body: str  # the body's class name, for the sentence
    arch: str

    def __call__(self, input_ids: torch.Tensor, attention_mask: Any, position_ids: Any) -> dict[str, Any]:
        kw: dict[str, Any] = {"input_ids": input_ids}
        for key, value in (("attention_mask", attention_mask), ("position_ids", position_ids), ("use_cache", False)):
            if key in self.accepted:
                kw[key] = value
            elif value is not None and value is not False:
                raise CutError(f"model.arch={self.arch} cannot be cut into stages at its decoder layers: "
                               f"{self.body}.forward takes no {key}; {ROUTE}.")
        return kw


class _Plan:
    """What the probe found: the body, its path in the causal LM and its layer list, and which of
    its other children the forward calls before the first layer (``before``) and after the last
    one (``after``); any other child is ``unused``."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.arch = getattr(model.config, "model_type", type(model).__name__)
        self.path, self.body, self.list_name = self._find_body()
        self.kwargs = self._body_kwargs()
        self.layers: nn.ModuleList = getattr(self.body, self.list_name)
        self.embedding = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        if self.head is None:
            self.refuse("it has no output embedding (get_output_embeddings() is None)")
        names = {id(m): n for n, m in self.body.named_children()}
        self.embedding_name = names.get(id(self.embedding))
        if self.embedding_name is None:
            self.refuse(f"its input embedding is not a child of {type(self.body).__name__}, the module that runs "
                        f"the layers")
        if self.body._parameters or any(b is not None for b in self.body._buffers.values()):
            self.refuse(f"{type(self.body).__name__} holds tensors of its own, outside its submodules")
        self.others = {n: m for n, m in self.body.named_children() if n != self.list_name and m is not None}
        self.before, self.after = self._probe()
        self.unused = [n for n in self.others if n not in self.before and n not in self.after]

    def refuse(self, why: str) -> NoReturn:
        raise CutError(f"model.arch={self.arch} cannot be cut into stages at its decoder layers: {why}; {ROUTE}.")

    def _find_body(self) -> tuple[str, nn.Module, str]:
        n = getattr(self.model.config, "num_hidden_layers", None)
        found = [(path, module, name) for path, module in self.model.named_modules()
                 for name, child in module.named_children()
                 if isinstance(child, nn.ModuleList) and n is not None and len(child) == n]
        if not found:
            self.refuse(f"no list of {n} decoder layers (config.num_hidden_layers) was found in it")
        found.sort(key=lambda f: f[0].count(".") + bool(f[0]))
        return found[0]

    def _body_kwargs(self) -> _BodyKwargs:
        """The keyword arguments of the body's forward for a batch, as a small callable of its own:
        a stage keeps it as a plain attribute, and a bound method of this plan would make every
        deep copy of the stage (the engine's skeletons) copy the whole model along with it."""
        forward = self.body.forward
        accepted = frozenset(k for k in ("attention_mask", "position_ids", "use_cache") if _accepts(forward, k))
        return _BodyKwargs(accepted, type(self.body).__name__, self.arch)

    def _probe(self) -> tuple[list[str], list[str]]:
        """One forward of a twin of the body with every child that has weights (or draws random
        numbers) replaced by a :class:`_Shadow` whose outputs require grad, and every layer by a
        :class:`_Record`: the order of the calls, and whether any layer argument but the hidden
        state depends on those outputs (then a stage could not rebuild it without their weights)."""
        log: list[Any] = []

        def noted(name: str, module: nn.Module) -> nn.Module:
            def hook(*_: Any) -> None:
                log.append(("child", name))
            module.register_forward_pre_hook(hook)
            return module

        children: dict[str, nn.Module | None] = {}
        for name, child in self.others.items():
            if _has_weights(child) or _draws(child):
                shadow = _Shadow(child)
                shadow.grad = True
                children[name] = noted(name, shadow)
            else:
                children[name] = noted(name, _twin(child, {}))
        children[self.list_name] = nn.ModuleList(_Record(layer, i, log) for i, layer in enumerate(self.layers))
        twin = _twin(self.body, children)
        ids = 1 + torch.arange(3).unsqueeze(0) % max(1, getattr(self.model.config, "vocab_size", 2) - 1)
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                twin(**self.kwargs(ids, None, None))
        except CutError:
            raise
        except Exception:  # noqa: BLE001 - any failure of the library's forward is the model's
            # what failed inside the library's code (RWKV: "not enough values to unpack", its loop
            # takes three values from each layer) says nothing the user can act on
            self.refuse(f"its {type(self.body).__name__}.forward does not run with only one decoder layer present "
                        f"and the others passed over, as a stage runs it")
        calls = [entry[1] for entry in log if entry[0] == "layer"]
        if calls != list(range(len(self.layers))):
            self.refuse(f"its forward calls the decoder layers in the order {calls}, not each once in turn")
        first = next(i for i, entry in enumerate(log) if entry[0] == "layer")
        last = max(i for i, entry in enumerate(log) if entry[0] == "layer")
        for _, index, args, kwargs in (e for e in log if e[0] == "layer"):
            rest = [*args[1:], *(v for k, v in kwargs.items() if k != "hidden_states")] if args else \
                [v for k, v in kwargs.items() if k != "hidden_states"]
            leaves, _ = tree_flatten(rest)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
                self.refuse(f"decoder layer {index} takes, besides the hidden state, a value computed from weights "
                            f"outside the layer")
        before = [e[1] for e in log[:first] if e[0] == "child"]
        after = [e[1] for e in log[last:] if e[0] == "child"]
        inside = [e[1] for e in log[first:last] if e[0] == "child"]
        if inside or set(before) & set(after):
            both = sorted(set(inside) | (set(before) & set(after)))
            self.refuse(f"its forward calls {', '.join(both)} between or around the decoder layers")
        return list(dict.fromkeys(before)), list(dict.fromkeys(after))

    def lm_twin(self, hidden: _Hidden) -> nn.Module:
        """A twin of the causal LM whose body is ``hidden``; modules on the way (OPT's
        ``model``) are twins whose other children are shadows."""
        parts = self.path.split(".")
        owners = [self.model]
        for part in parts[:-1]:
            owners.append(getattr(owners[-1], part))
        inner: nn.Module = hidden
        for depth in range(len(parts) - 1, -1, -1):
            owner, part = owners[depth], parts[depth]
            others = {} if depth == 0 else {n: _Shadow(c) for n, c in owner.named_children()
                                            if n != part and c is not None}
            inner = _twin(owner, {**others, part: inner})
        return inner

    def check_lm(self) -> None:
        """The causal LM's forward on a stand-in body returns logits (else one sentence)."""
        hidden = _Hidden()
        lm = self.lm_twin(hidden)
        weight = getattr(self.head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            self.refuse("its output embedding has no weight matrix")
        hidden.hidden = torch.zeros(1, 3, weight.shape[1], dtype=weight.dtype, device=weight.device)
        try:
            with torch.no_grad():
                out = lm(use_cache=False)
        except Exception as e:  # noqa: BLE001 - any failure of the library's forward is the model's
            self.refuse(f"its {type(self.model).__name__}.forward failed on a stand-in body "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape[:2]) != (1, 3):
            self.refuse(f"its {type(self.model).__name__}.forward does not return logits per position")


def _on_cpu(input_ids: torch.Tensor, attention_mask: Any, position_ids: Any) -> tuple[Any, Any, Any]:
    """The batch's integer inputs for a shape-only run of meta tensors: CPU tensors of the same
    shapes (token 0, no padding, positions 0..T-1), for the mask builders, which read values."""
    def cpu(t: Any, fill: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> Any:
        return fill(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) and t.is_meta else t

    return (cpu(input_ids, lambda shape, dt: torch.zeros(shape, dtype=dt)),
            cpu(attention_mask, lambda shape, dt: torch.ones(shape, dtype=dt)),
            cpu(position_ids, lambda shape, dt: torch.arange(shape[-1], dtype=dt).expand(shape)))


class _Stage(nn.Module):
    """A stage: the modules it holds (registered under their names in the body), and a twin of the
    body that calls them (a plain attribute: deep copies of the stage copy it along)."""

    twin: nn.Module
    shadows: list[_Shadow]  # the stand-ins in the twin, given the stage's dtype and device for a call
    plan_kwargs: Callable[..., dict[str, Any]]  # the body's keyword arguments for a batch

    def _hold(self, named: dict[str, nn.Module]) -> None:
        for name, module in named.items():
            if hasattr(self, name):
                raise CutError(f"a module of the model is named {name}, which the stage uses itself; {ROUTE}.")
            self.add_module(name, module)

    def train(self, mode: bool = True) -> _Stage:
        super().train(mode)
        twin = self.__dict__.get("twin")
        if twin is not None:
            twin.train(mode)  # the twin's own flag (the body's forward reads self.training)
        return self


class Embeddings(_Stage):
    """The body's forward up to the first decoder layer: the token embedding (``tokens``) and the
    other modules it calls there. Returns the hidden state the first layer would receive, and the
    batch's ``input_ids``, ``attention_mask`` and ``position_ids`` for the later stages."""

    shape_twin: nn.Module

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        held = {n: plan.others[n] for n in [*plan.before, *plan.unused] if _has_weights(plan.others[n])
                or n in plan.before}
        self.tokens = plan.embedding
        self._hold({n: m for n, m in held.items() if n != plan.embedding_name})
        children: dict[str, nn.Module | None] = {n: _Shadow(plan.others[n]) for n in plan.after}
        children[plan.list_name] = nn.ModuleList(
            [_Stop(plan.layers[0]), *(_Skip(layer) for layer in plan.layers[1:])])
        object.__setattr__(self, "twin", _twin(plan.body, children))
        # for a shape-only run on the meta device (the engine's memory estimate of a stage it does
        # not hold): every module with weights stood in for, as in a decoder layer's stage
        shadows = {n: _Shadow(plan.others[n]) for n in plan.before if _has_weights(plan.others[n])
                   or _draws(plan.others[n])}
        object.__setattr__(self, "shape_twin", _twin(self.twin, shadows))
        object.__setattr__(self, "shadows", list(shadows.values()))
        object.__setattr__(self, "plan_kwargs", plan.kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[Any, ...]:
        weight = self.tokens.weight
        assert isinstance(weight, torch.Tensor)  # the token embedding's matrix
        twin, inputs = self.twin, (input_ids, attention_mask, position_ids)
        if weight.is_meta:
            for shadow in self.shadows:
                shadow.dtype, shadow.device = weight.dtype, torch.device("cpu")
            twin, inputs = self.shape_twin, _on_cpu(*inputs)
        try:
            twin(**self.plan_kwargs(*inputs))
        except _Reached as reached:
            hidden = reached.value
            if weight.is_meta:
                # requiring grad as the real run's output does: the engine learns from this run
                # which of a stage's outputs carry a gradient back (without it, stage 0 got none)
                grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
                hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device="meta", requires_grad=grad)
            return hidden, input_ids, attention_mask, position_ids
        raise RuntimeError("the body's forward never reached its first decoder layer")


class DecoderLayer(_Stage):
    """Decoder layer ``index`` (``layer``), called by the body's own forward with the arguments it
    builds for that layer; the last layer's stage also runs what the forward does after the layers
    (the final norm), and returns the hidden state alone."""

    run: _Run

    def __init__(self, plan: _Plan, index: int) -> None:
        super().__init__()
        self.index = index
        self.last = index == len(plan.layers) - 1
        self.layer = plan.layers[index]
        children: dict[str, nn.Module | None] = {}
        held: dict[str, nn.Module] = {}
        for name in plan.before:
            module = plan.others[name]
            if _has_weights(module) or _draws(module):
                children[name] = _Shadow(module)
            else:
                held[name] = module  # a rotary embedding: constant buffers, no weights
        for name in plan.unused:
            children[name] = _Shadow(plan.others[name])  # never called: no copy of its weights in the twin
        for name in plan.after:
            if self.last:
                held[name] = plan.others[name]
            else:
                children[name] = _Shadow(plan.others[name])
        self._hold(held)
        run = _Run(self.layer, self.last)
        layers = [_Skip(layer) for layer in plan.layers]
        layers[index] = run
        children[plan.list_name] = nn.ModuleList(layers)
        object.__setattr__(self, "twin", _twin(plan.body, children))
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "shadows", [c for c in children.values() if isinstance(c, _Shadow)])
        object.__setattr__(self, "plan_kwargs", plan.kwargs)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Any:
        dtype = next((p.dtype for p in self.layer.parameters() if p.is_floating_point()), hidden.dtype)
        inputs = (input_ids, attention_mask, position_ids)
        device = hidden.device
        if hidden.is_meta:  # a shape-only run: the forward builds the layer's arguments on the CPU
            inputs, device = _on_cpu(*inputs), torch.device("cpu")
        for shadow in self.shadows:
            shadow.dtype, shadow.device = dtype, device
        self.run.hidden = hidden
        try:
            out = self.twin(**self.plan_kwargs(*inputs))
        except _Reached as reached:
            return _first_tensor(reached.value), input_ids, attention_mask, position_ids
        finally:
            self.run.hidden = None
        if not self.last:
            raise RuntimeError(f"the body's forward did not call decoder layer {self.index}")
        return _first_tensor(out)


class Head(_Stage):
    """The causal LM's own forward on the hidden state it receives: ``lm_head`` (and whatever the
    family does to the logits)."""

    hidden: _Hidden

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        self.lm_head = plan.head
        top = plan.path.split(".")[0]
        self._hold({n: m for n, m in plan.model.named_children() if n != top and m is not plan.head})
        hidden = _Hidden()
        object.__setattr__(self, "twin", plan.lm_twin(hidden))
        object.__setattr__(self, "hidden", hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden.hidden = hidden
        try:
            out = self.twin(use_cache=False)
        finally:
            self.hidden.hidden = None
        return out.logits if hasattr(out, "logits") else out[0]


def cut(model: PreTrainedModel) -> list[nn.Module]:
    """``model``'s own submodules as stages (no copies): the embeddings, one stage per decoder
    layer (the last with the final norm), the head. One sentence (:class:`CutError`) for a model
    whose forward does not fit."""
    plan = _Plan(model)
    plan.check_lm()
    return [Embeddings(plan), *(DecoderLayer(plan, i) for i in range(len(plan.layers))), Head(plan)]
