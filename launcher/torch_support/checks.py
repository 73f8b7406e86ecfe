"""Model checks: everything that would stop a model from being built or trained, found before any
worker starts, one sentence per problem.

- the built-in models' and data's checks of their own arguments (:func:`positive_ints`, ...): a
  ``ValueError`` whose text starts with ``name=value is invalid:``; the launcher turns it into the
  sentence about the config key (``model.n_head=5 is invalid: ...``, see
  :func:`launcher.modes.model_checks.keyed`), and a Python caller reads the same sentence;
- a staged model's (:func:`~.stage_errors.staged_errors`, :func:`model_errors`: its stages, loss and graph, and
  one micro-batch through its stages on the meta device), raised as :class:`ModelError`;
- the data against the model: an embedding of the first stage with no row for an index the data
  gives it (:func:`embedding_miss`).

The staged model (:mod:`.staged`) and the signatures (:mod:`.signatures`) raise
:class:`~.stage_errors.ModelError` and check themselves there (:mod:`.stage_errors`), below this
module, which runs them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from .signatures import NoMeta, real_signatures, signatures
from .stage_errors import ModelError, staged_errors
from .staged import StagedModel, as_meta
from .values import describe

__all__ = ["ModelError", "embedding_miss", "fraction", "model_errors", "non_negative_ints", "positive_ints",
           "positive_number"]

_what = describe


# ---- the built-in models' arguments -----------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_ints(**values: Any) -> None:
    """Each of ``values`` must be a positive integer."""
    for name, v in values.items():
        if not (_is_int(v) and v > 0):
            raise ValueError(f"{name}={v} is invalid: it must be a positive integer.")


def non_negative_ints(**values: Any) -> None:
    for name, v in values.items():
        if not (_is_int(v) and v >= 0):
            raise ValueError(f"{name}={v} is invalid: it must be an integer of at least 0.")


def positive_number(name: str, v: Any, what: str = "it") -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={v} is invalid: {what} must be a positive number.")


def fraction(name: str, v: Any) -> None:
    """``v`` in ``[0, 1)``: a share of something that leaves some of it."""
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1):
        raise ValueError(f"{name}={v} is invalid: it is the share of the windows held out for validation, from 0 "
                         f"up to (not including) 1.")


# ---- staged models -------------------------------------------------------------------------------


def model_errors(model: object, stages: int, example: Any = None) -> list[str]:
    """Everything that would stop the runtime from training ``model`` as a step of ``stages``
    stages, one sentence per problem, found before any worker starts.

    With ``example`` (one micro-batch's input) the stages also run on the meta device, which
    costs no memory or compute, to find a stage that fails or returns something it cannot pass
    on. A stage that cannot run on meta only for want of a meta kernel is not reported here: it
    fails on real data with its own error.
    """
    if not isinstance(model, StagedModel):
        return [f"the model is {_what(model)}, not a StagedModel; build one with StagedModel(stages, loss), "
                f"stages being a list of torch.nn.Module."]
    out = staged_errors(model)
    if out:
        return out
    if len(model.stages) != stages:
        out.append(f"the model has {len(model.stages)} stages but the step has stages={stages}; "
                   f"cut the model into {stages} stages or set stages={len(model.stages)}.")
        return out
    if example is not None:
        e = meta_errors(model, example)
        if e:
            out.append(e)
    return out


def meta_errors(model: StagedModel, example: Any) -> str | None:
    """Run ``model``'s stages on meta-device copies of themselves and of ``example``; the sentence
    for the first stage that raises or returns something it cannot pass on."""
    try:
        signatures(model, [as_meta(example)])
    except NoMeta:  # an op without a meta kernel, or one that reads values: run the stages for real
        try:
            real_signatures(model, example)
        except ModelError as e:
            return e.sentences[0]
    except ModelError as e:
        return e.sentences[0]
    return None


# ---- the data against the model ------------------------------------------------------------------


class EmbeddingMiss(NamedTuple):
    """An embedding (at ``path``, with ``rows`` rows) given index ``top``, so it needs ``need``
    rows: fed the data's symbols (``fed``, the data declaring ``declared`` of them) or the
    positions ``0 .. T-1`` of its sequences (``positions``)."""

    path: str
    rows: int
    need: int
    top: int
    fed: bool
    positions: bool
    T: int
    declared: int | None


def embedding_miss(model: Any, x: Any, vocab_size: Any = None) -> EmbeddingMiss | None:
    """The first embedding of ``model``'s first stage (its ``self.stages[0]``) without a row for an
    index the input ``x`` gives it (the data's symbols, at least ``vocab_size`` of them when the
    data declares it, and the positions of its sequences); None when every one has. The stage
    runs on ``x`` with each embedding replaced by a check that returns a meta tensor of the right
    shape, so nothing is computed (the weights may be on the meta device); a model this cannot
    run is not checked."""
    stages = getattr(model, "stages", None)
    first = stages[0] if isinstance(stages, nn.ModuleList) and len(stages) else None
    if first is None:
        return None
    tokens = x.detach().cpu().long() if isinstance(x, torch.Tensor) and not x.is_floating_point() else None
    found: list[EmbeddingMiss] = []

    def look(path: str, m: nn.Embedding, idx: torch.Tensor) -> list[EmbeddingMiss]:
        """The miss when embedding ``m`` (at ``path``) has no row for an index it is given."""
        rows, T = int(m.num_embeddings), idx.shape[-1]
        fed = tokens is not None and idx.shape == tokens.shape and torch.equal(idx, tokens)  # the data's symbols
        positions = not fed and torch.equal(idx.reshape(-1, T)[0], torch.arange(T))  # 0 .. T-1 along a sequence
        declared = vocab_size if fed else None
        declared = declared if isinstance(declared, int) and not isinstance(declared, bool) else None
        top = int(idx.max())
        need = max(top + 1, declared or 0)
        if need <= rows:
            return []
        return [EmbeddingMiss(path, rows, need, top, fed, positions, T, declared)]

    def checker(path: str, m: nn.Embedding) -> Any:
        def forward(idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if isinstance(idx, torch.Tensor) and not idx.is_meta and idx.dim() >= 1 and idx.numel() and not found:
                try:
                    found.extend(look(path, m, idx.detach().cpu().long()))
                except Exception:  # noqa: BLE001 - an index this cannot read: not checked
                    pass
            shape = (*idx.shape, m.embedding_dim)
            return torch.empty(shape, dtype=m.weight.dtype, device="meta")
        return forward

    patched = [(m, checker(f"stages.0.{name}" if name else "stages.0", m))
               for name, m in first.named_modules() if isinstance(m, nn.Embedding)]
    if not patched:
        return None
    try:
        for m, fn in patched:
            vars(m)["forward"] = fn  # the instance's own forward, popped below
        with torch.no_grad():
            first(**x) if isinstance(x, dict) else first(x)
    except Exception:  # noqa: BLE001 - what follows the embeddings may not run on meta: checked as far as it got
        pass
    finally:
        for m, _ in patched:
            vars(m).pop("forward", None)
    return found[0] if found else None
