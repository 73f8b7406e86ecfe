"""The rules of ``mode=train`` on top of the step's (:mod:`.validate`): the data's batch size, the
Trainer's keys, the model/data/logger nodes, a checkpoint to resume, and the run's settings
(:func:`run_settings_of`: checkpoint format, non-finite values, failure timeout, transport). Each
failure is one sentence naming the key, the value and the rule; nothing is instantiated here
(:func:`launcher.modes.train.prepare` builds the objects and reports what fails there)."""

from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any, Mapping, cast

from omegaconf import DictConfig, OmegaConf

from ..schedule.rules import StepError, overlap_training_errors
from ..schedule.rules import is_size as _is_size
from ..schedule.run_settings import CheckpointSettings, FaultSettings, RunSettings
from ..schedule.schemes import SCHEMES
from ..schedule.settings import DEFAULT
from .validate import _get, png_errors, step_errors

#: Trainer arguments the launcher sets itself, and from what
RESERVED = {
    "strategy": f"strategy=... ({', '.join([*SCHEMES, 'custom', 'single'])})",
    "devices": "W = G*R",
    "num_nodes": "the cluster environment (torchrun or Slurm)",
    "logger": "logger=wandb|none",
    "callbacks": "the launcher (checkpoints and metrics)",
    "default_root_dir": "hydra.run.dir",
}
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
MAX_SEED = 2**32 - 1  # numpy's seeds: 0 .. 2**32 - 1


#: the annotations :func:`argument_errors` checks, and how a sentence says them
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _fits(value: Any, t: Any) -> bool | None:
    """Whether ``value`` fits annotation ``t``; ``None`` when ``t`` is not one this checks."""
    import types
    import typing

    if t in (int, float):
        return isinstance(value, (int, float) if t is float else int) and not isinstance(value, bool)
    if t in (bool, str):
        return isinstance(value, t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        answers = [True if a is type(None) and value is None else _fits(value, a) for a in typing.get_args(t)]
        if any(a is True for a in answers):
            return True
        return None if any(a is None for a in answers) else False
    return None


def _what(t: Any) -> str:
    import typing

    args = typing.get_args(t)
    if args:
        return " or ".join("null" if a is type(None) else _KINDS.get(a, getattr(a, "__name__", str(a))) for a in args)
    return _KINDS[t]


def argument_errors(node: Any, key: str) -> list[str]:
    """One sentence per value of ``node`` (a ``_target_`` node: ``model``, ``data``) of the wrong type
    for the argument of its target it is passed to, by the target's annotations (int, float, bool,
    str, and unions of them with None): ``model.lr=fast`` is refused before anything is built, not
    by the optimizer in every worker. Arguments without such an annotation are not checked here.
    A key the target takes no argument for (``model.foo=1``, where it has no ``**kwargs``) is named
    with the closest argument it has."""
    import typing

    from .hydra_private import locate  # get_object's lookup, without its error log line

    try:
        fn = locate(str(node.get("_target_")))
        # a class: its __init__'s hints (read by name: mypy refuses __init__ on a class object)
        hints = typing.get_type_hints(getattr(fn, "__init__") if isinstance(fn, type) else fn)
    except Exception:  # noqa: BLE001 - a target that cannot be found or read: building it says why
        return []
    try:
        params = inspect.signature(fn).parameters
        takes = None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set(params)
    except (TypeError, ValueError):  # no signature to read
        takes = None
    name = getattr(fn, "__name__", str(node.get("_target_")))
    out: list[str] = []
    for k in node.keys():
        k = str(k)
        if not k.startswith("_") and takes is not None and k not in takes:
            close = " or ".join(f"{key}.{c}" for c in closest(k, takes))
            out.append(f"{key}.{k}={_shown(node, k)} is invalid: {name} takes no argument {k}"
                       f"{f'; did you mean {close}?' if close else '.'}")
            continue
        if k.startswith("_") or k not in hints:
            continue
        try:
            value = node.get(k)
        except Exception:  # noqa: BLE001 - an interpolation that cannot resolve: Hydra reports it
            continue
        if _fits(value, hints[k]) is False:
            out.append(f"{key}.{k}={value} is invalid: {name} takes {_what(hints[k])} for {k}.")
    return out


def _shown(node: Any, k: str) -> Any:
    """``node[k]`` as a sentence shows it (as written when it cannot resolve)."""
    try:
        return _container(node.get(k))
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve
        if not isinstance(node, DictConfig):
            return "???"
        return cast(dict, OmegaConf.to_container(node, resolve=False)).get(k)  # a DictConfig's container is a dict


def _trainer_params() -> set[str]:
    from lightning.pytorch import Trainer

    return set(inspect.signature(Trainer.__init__).parameters) - {"self"}


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node


def is_single(cfg: Any) -> bool:
    """``strategy=single``: Lightning's default strategy on one device, no schedule."""
    return _get(cfg, "strategy.name") == "single" and _get(cfg, "strategy.placement") is None


#: the config key of each field of :class:`RunSettings` (the checkpoint node is read whole)
RUN_KEYS = {"checkpoint": "checkpoint", "nonfinite": "nonfinite", "timeout": "timeout",
            "transport": "runtime.transport", "fault": "fault"}
_MISSING = object()


def run_settings_of(cfg: DictConfig | Mapping[str, Any]) -> RunSettings:
    """The run's settings of a config (``checkpoint.*``, ``nonfinite``, ``timeout``,
    ``runtime.transport``); a key the config lacks keeps :data:`DEFAULT_RUN`'s value. Raises
    :class:`~launcher.schedule.rules.StepError` with one sentence per broken rule."""
    given = {f: _container(v) for f, k in RUN_KEYS.items() if (v := _get(cfg, k, _MISSING)) is not _MISSING}
    return RunSettings(**given)


def _fault_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """``fault.restarts`` on a scheme it cannot recover (:meth:`FaultSettings.scheme_errors`); a
    ``fault`` node that is itself invalid is :func:`run_settings_of`'s to refuse."""
    try:
        fault = FaultSettings.of(_container(_get(cfg, "fault", None)))
        checkpoint = CheckpointSettings.of(_container(_get(cfg, "checkpoint", None)))
    except StepError:
        return []
    return fault.scheme_errors(str(_get(cfg, "strategy.name", "")), _get(cfg, "G", 1), _get(cfg, "R", 1), checkpoint)


def train_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """One sentence per rule a ``mode=train`` config breaks (the step's rules included)."""
    out: list[str] = png_errors(cfg)
    single = is_single(cfg)
    if not single:
        out += step_errors(cfg)
        out += _fault_errors(cfg)
    B = _get(cfg, "microbatches")

    data = _container(_get(cfg, "data"))
    if not isinstance(data, Mapping) or not isinstance(data.get("_target_"), str) or data.get("_target_") == "???":
        out.append(f"data._target_={None if not isinstance(data, Mapping) else data.get('_target_')} is invalid: "
                   f"data needs _target_ naming a LightningDataModule class, e.g. data=chars or data=custom "
                   f"data._target_=mymodule.MyData.")
    else:
        bs = _get(cfg, "data.batch_size")
        if not _is_size(bs):
            out.append(f"data.batch_size={bs} is invalid: the batch size must be a positive integer.")
        elif not single and _is_size(B) and bs % B:
            out.append(f"data.batch_size={bs} is invalid: each batch is cut into microbatches={B} equal "
                       f"micro-batches, so the batch size must be a multiple of {B} (e.g. {B * max(1, bs // B)}).")

    model = _container(_get(cfg, "model"))
    if not isinstance(model, Mapping) or not isinstance(model.get("_target_"), str) or model.get("_target_") == "???":
        out.append(f"model._target_={None if not isinstance(model, Mapping) else model.get('_target_')} is invalid: "
                   f"model needs _target_ naming a LightningModule class, e.g. model=gpt, model=mlp, or model=custom "
                   f"model._target_=mymodule.MyModel.")

    logger = _container(_get(cfg, "logger"))
    if logger not in (None, {}) and not (isinstance(logger, Mapping) and isinstance(logger.get("_target_"), str)):
        out.append(f"logger={logger} is invalid: use logger=wandb, logger=none, or a node with _target_ naming a "
                   f"Lightning logger class.")
    elif isinstance(logger, Mapping) and str(logger.get("_target_")).endswith("WandbLogger") \
            and importlib.util.find_spec("wandb") is None:  # Lightning's own error comes late and names no key
        out.append("logger=wandb is invalid here: the wandb package is not installed; install it (pip install "
                   "wandb) or use logger=none.")

    out += _trainer_errors(cfg, single)
    out += _split_errors(cfg)
    out += overlap_training_errors(_get(cfg, "step_overlap", DEFAULT.step_overlap), _get(cfg, "strategy.name", None),
                                  _get(cfg, "G", None), _get(cfg, "R", None), _get(cfg, "stages", None))

    seed = _get(cfg, "seed")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED):
        out.append(f"seed={seed} is invalid: the seed must be an integer from 0 to {MAX_SEED} (numpy's range, which "
                   f"seed_everything seeds too).")
    seq = _get(cfg, "data.seq_len", None)  # zero positions: the loss is an empty mean, nan from the first step
    if seq is not None and not (isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1):
        out.append(f"data.seq_len={seq} is invalid: a sample needs at least one position to predict (with none the "
                   f"loss is nan); use a positive integer.")
    ckpt = _get(cfg, "ckpt_path")
    if ckpt is not None and not os.path.exists(str(ckpt)):
        out.append(f"ckpt_path={ckpt} is invalid: no such checkpoint file or directory.")
    try:
        run_settings_of(cfg)
    except StepError as e:
        out += e.sentences
    return out


def _split_errors(cfg: Any) -> list[str]:
    """``split``: null (the model's self.stages), ``auto``, or the stages - 1 module paths where
    stages 1, 2, ... begin."""
    split, S = _container(_get(cfg, "split")), _get(cfg, "stages")
    if split is None or split == "auto":
        return []
    if not (isinstance(split, list) and all(isinstance(p, str) and p for p in split)):
        return [f"split={split} is invalid: use null (the model's self.stages), auto, or a list of module paths "
                f"where stages begin, e.g. split=[model.encoder.layers.1,model.decoder]."]
    if _is_size(S) and len(split) != S - 1:
        return [f"split={split} is invalid: stages={S} needs {S - 1} module paths where stages 1 to {S - 1} begin, "
                f"not {len(split)}."]
    return []


def closest(name: str, known: Any) -> list[str]:
    """The names in ``known`` closest to a misspelt ``name`` (``max_step``: ``max_steps``), best
    first; only those nearly as close as the best, so a suggestion is not a list to pick from."""
    import difflib

    scored = sorted(((difflib.SequenceMatcher(None, name, k).ratio(), k) for k in known), reverse=True)
    scored = [(r, k) for r, k in scored if r >= 0.6]
    return [k for r, k in scored if r >= scored[0][0] - 0.1][:3] if scored else []


def _trainer_errors(cfg: Any, single: bool) -> list[str]:
    out: list[str] = []
    trainer = _container(_get(cfg, "trainer"))
    if trainer is None:
        return out
    if not isinstance(trainer, Mapping):
        return [f"trainer={trainer} is invalid: trainer must be a mapping of lightning Trainer arguments."]
    known = _trainer_params()
    for key in trainer:
        if key in RESERVED:
            out.append(f"trainer.{key}={trainer[key]} is invalid: the launcher sets {key} from {RESERVED[key]}; "
                       f"remove trainer.{key}.")
        elif key not in known:
            close = closest(str(key), known - set(RESERVED))  # never one the launcher sets itself
            out.append(f"trainer.{key}={trainer[key]} is invalid: {key} is not an argument of lightning's Trainer"
                       f"{'; did you mean ' + ' or '.join('trainer.' + k for k in close) + '?' if close else '.'}")
    steps, epochs = _get(cfg, "trainer.max_steps", -1), _get(cfg, "trainer.max_epochs", None)
    if not (isinstance(steps, int) and not isinstance(steps, bool) and (steps >= 1 or steps == -1)):
        out.append(f"trainer.max_steps={steps} is invalid: it must be a positive integer, or -1 with "
                   f"trainer.max_epochs set.")
    elif steps == -1 and not (isinstance(epochs, int) and epochs >= 1):
        out.append(f"trainer.max_steps=-1 with trainer.max_epochs={epochs} never ends: set trainer.max_steps to a "
                   f"positive integer or trainer.max_epochs to one.")
    acc = _get(cfg, "trainer.accumulate_grad_batches", 1)
    if not (isinstance(acc, int) and not isinstance(acc, bool) and acc >= 1):
        out.append(f"trainer.accumulate_grad_batches={acc} is invalid: it must be a positive integer, the number "
                   f"of batches one optimizer step accumulates (each batch still runs as microbatches "
                   f"micro-batches).")
    accel = _get(cfg, "trainer.accelerator", "cpu")
    if accel not in ACCELERATORS:
        out.append(f"trainer.accelerator={accel} is invalid: use {', '.join(ACCELERATORS)}.")
    elif accel in ("gpu", "cuda"):
        import torch

        W = 1 if single else _get(cfg, "W")
        if torch.cuda.device_count() == 0:  # NVML: is_available() would initialise CUDA before the fork
            out.append(f"trainer.accelerator={accel} is invalid here: no CUDA GPU is available; use "
                       f"trainer.accelerator=cpu.")
        elif isinstance(W, int) and W > torch.cuda.device_count() and "RANK" not in os.environ:
            out.append(f"trainer.accelerator={accel} needs one GPU per worker, but W={W} and this machine has "
                       f"{torch.cuda.device_count()}; use fewer workers or trainer.accelerator=cpu.")
    out += precision_errors(_get(cfg, "trainer.precision", "32-true"), accel)
    return out


def _precisions() -> tuple[Any, ...]:
    """Every ``precision`` lightning's Trainer takes (its own list, legacy spellings included): the
    literals of the annotation of ``Trainer(precision=...)``, read from its public signature."""
    import typing

    from lightning.pytorch import Trainer

    def literals(t: Any) -> list[Any]:
        args = typing.get_args(t)
        return list(args) if typing.get_origin(t) is typing.Literal else [v for a in args for v in literals(a)]

    return tuple(literals(inspect.signature(Trainer.__init__).parameters["precision"].annotation))


def precision_errors(precision: Any, accel: Any) -> list[str]:
    """``trainer.precision``: one of lightning's; fp16 mixed precision only on a GPU (it needs a
    GradScaler, and CPU autocast in float16 is not supported well)."""
    known = _precisions()
    if precision not in known:
        names = ", ".join(str(v) for v in known if isinstance(v, str) and "-" in v)
        return [f"trainer.precision={precision} is invalid: use one of lightning's precisions ({names})."]
    if str(precision) in ("16-mixed", "16"):
        import torch

        on_gpu = accel in ("gpu", "cuda") or (accel == "auto" and torch.cuda.device_count() > 0)
        if not on_gpu:
            return [f"trainer.precision={precision} is invalid with trainer.accelerator={accel}: fp16 mixed "
                    f"precision needs a GPU (a GradScaler; CPU autocast in float16 is not supported well); use "
                    f"trainer.precision=bf16-mixed on CPU."]
    return []
