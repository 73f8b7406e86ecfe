"""The error a model the runtime cannot train raises (:class:`ModelError`, one sentence per
problem), and the checks the staged model and the stage signatures make of themselves. Below
:mod:`.staged` and :mod:`.signatures`, which raise it; the checks that run the stages are
:mod:`.checks`, above both."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from .values import describe, unsupported

if TYPE_CHECKING:
    from .staged import StagedModel


class ModelError(ValueError):
    """A model the runtime cannot train; ``sentences`` holds one sentence per problem."""

    def __init__(self, sentences: Sequence[str]):
        self.sentences = list(sentences)
        super().__init__("\n".join(self.sentences))



_what = describe


def staged_errors(model: StagedModel) -> list[str]:
    """What :class:`StagedModel` checks at construction (and the engine again, since the stages
    may have changed since), one sentence per problem, naming the stage."""
    stages = model.stages
    if not isinstance(stages, (list, tuple, nn.ModuleList)):
        return [f"the model's stages are {_what(stages)}; give a list of torch.nn.Module, one per stage."]
    out: list[str] = []
    if not callable(model.loss):
        out.append(f"the model's loss is {_what(model.loss)}, not a callable loss(output, target).")
    if model.graph is not None and model.graph.stages != len(stages):
        out.append(f"the stage graph has {model.graph.stages} stages but the model has {len(stages)}.")
    preds = model.graph.preds if model.graph is not None else ()
    for (p, c) in model.picks or {}:
        if not (0 <= c < len(preds) and p in preds[c]):
            out.append(f"picks names the edge {p}->{c}, which is not an edge of the stage graph.")
    for s, m in enumerate(stages):
        if not isinstance(m, nn.Module):
            out.append(f"stage {s} is {_what(m)}, not a torch.nn.Module.")
            continue
        dtypes = {p.dtype for p in m.parameters()}
        if len(dtypes) > 1:
            out.append(f"stage {s} ({type(m).__name__}) mixes parameter dtypes {sorted(map(str, dtypes))}; use one "
                       f"dtype per stage.")
    return out


def returns_error(s: int, out: object, where: str, module: nn.Module | None = None) -> str | None:
    """The sentence for a stage whose output cannot be passed on; ``None`` when it can."""
    bad = unsupported(out)
    if bad is None:
        return None
    name = f" ({type(module).__name__})" if module is not None else ""
    return (f"stage {s}{name} returned {_what(out)} holding a {bad} {where}; a stage returns tensors, or tuples, "
            f"lists and dicts of tensors and constants.")
