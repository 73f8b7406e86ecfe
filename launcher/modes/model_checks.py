"""What ``mode=train`` checks of the model and its data before any worker starts: the data's first
batch, the module staged and one micro-batch run through its stages, its embeddings against the
data's symbols and positions, and a class's refusal of one of its arguments said as the config key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ..config import ConfigError
from ..config.sentences import one_line


def keyed(e: BaseException, node: Any, key: str) -> str | None:
    """A class's own refusal of one of its arguments as the sentence about the config key: a
    ``ValueError`` (or ``TypeError``) whose text starts with ``name=value`` for an argument ``name``
    of the node, as the built-in models and data say it, gets ``key.`` before every argument it
    names (``n_head=5 is invalid: it must divide d_model=16`` under ``model`` becomes
    ``model.n_head=5 is invalid: it must divide model.d_model=16.``), and one that names the key in
    full already (``model.lora.r=0 is invalid: ...``) is said as it is; ``None`` for anything else."""
    import re

    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    text = " ".join(str(root).split())
    names = [str(k) for k in node.keys() if not str(k).startswith("_")] if hasattr(node, "keys") else []
    if not isinstance(root, (ValueError, TypeError)) or not names:
        return None
    if re.match(rf"{re.escape(key)}\.({'|'.join(map(re.escape, names))})[.=]", text):
        return text.rstrip(".") + "."  # names its key in full already (model.lora.r=0 is invalid: ...)
    head = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=", text)
    if head is None or head.group(1) not in names:
        return None
    pattern = r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")="
    return re.sub(pattern, lambda m: f"{key}.{m.group(1)}=", text).rstrip(".") + "."


def first_training_batch(data: Any, cfg: DictConfig) -> Any:
    """The data module set up for fitting and its first training batch, before any worker starts
    (its refusal of one of its keys names the key), with every random state and the loader left as
    the trainer will find them (:func:`~launcher.lightning.staging.first_batch`)."""
    from ..lightning.staging import first_batch, training_loaders

    try:
        return first_batch(training_loaders(None, datamodule=data))
    except StopIteration as e:
        raise ConfigError([f"data._target_={cfg.data.get('_target_')} gave no training batch: its training set "
                           f"is smaller than one batch of data.batch_size={cfg.data.get('batch_size')}."]) from e
    except Exception as e:  # noqa: BLE001 - the user's data module: one sentence
        raise ConfigError([keyed(e, cfg.data, "data") or f"data._target_={cfg.data.get('_target_')} could not give a "
                           f"first training batch: {one_line(e)}."]) from e


def check_model(strategy: Any, model: Any, data: Any, cfg: DictConfig) -> None:
    """The module staged as the workers will (its self.stages cut, or its training step traced and
    cut) and one micro-batch of the data's first batch through the stages, before any worker
    starts; the workers inherit the staging."""
    from ..lightning.single import StreamedSingleDevice
    from ..torch_support.checks import ModelError

    target = cfg.model.get("_target_")
    by = ("strategy=single (which traces it as every scheme does, for the random streams)"
          if isinstance(strategy, StreamedSingleDevice) else "the schedule")
    try:
        strategy.check_before_fork(model, data)
    except ModelError as e:
        # a sentence about a key of the run (stages=9) names it already; the others are the model's
        raise ConfigError([s if s.startswith(("stages=", "split=")) else
                           f"model._target_={target} cannot be trained by {by}: {s}"
                           for s in e.sentences]) from e
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code raised while it was staged: one sentence, as on one device
        where = user_frame(e)
        raise ConfigError([f"model._target_={target} failed before training started, while the launcher cut it into "
                           f"stages and ran one micro-batch of the data's first batch through them: {one_line(e)}"
                           + (f" ({where})" if where else "") + "."]) from e


def user_frame(e: BaseException) -> str | None:
    """``file.py, line N`` of the innermost frame of ``e``'s root cause in the user's code (not in
    the launcher, the standard library or an installed package), if any."""
    import sysconfig
    import traceback

    while e.__cause__ is not None:
        e = e.__cause__
    skip = (str(Path(__file__).resolve().parents[1]),
            *{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<") and not str(Path(f.filename).resolve()).startswith(skip)]
    return f"{Path(frames[-1].filename).name}, line {frames[-1].lineno}" if frames else None


#: argument names that say what an embedding is indexed by: the data's symbols, or positions
_VOCAB_NAMES = ("vocab", "token", "classes", "alphabet")
_POSITION_NAMES = ("seq", "len", "pos", "block", "context", "ctx")


def check_inputs(model: Any, data_module: Any, batch: Any, cfg: DictConfig) -> None:
    """The data's output against the model: every embedding of the model's first stage (its
    ``self.stages[0]``; a traced model is left to the staging check) must have a row for each index
    the first batch gives it: the data's symbols (and at least the ``vocab_size`` a data module
    declares) and the positions of its sequences (:func:`~launcher.torch_support.checks.embedding_miss`)."""
    from ..lightning.staging import split_batch
    from ..torch_support.checks import embedding_miss

    try:
        x, _ = split_batch(model, batch)
    except Exception:  # noqa: BLE001 - the staging check reports a batch it cannot split
        return
    miss = embedding_miss(model, x, getattr(data_module, "vocab_size", None))
    if miss is not None:
        raise ConfigError([_embedding_sentence(cfg, *miss)])


def _leaves(node: Any, prefix: str, depth: int = 2) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of ``node``'s values, and of its nested nodes' (``model.config.*``)."""
    out: list[tuple[str, Any]] = []
    try:
        keys = [str(k) for k in node.keys() if not str(k).startswith("_")]
    except Exception:  # noqa: BLE001 - not a mapping
        return out
    for k in keys:
        try:
            v = node.get(k)
        except Exception:  # noqa: BLE001 - an interpolation that cannot resolve: not named
            continue
        if hasattr(v, "keys") and depth > 1:
            out += _leaves(v, f"{prefix}.{k}", depth - 1)
        else:
            out.append((f"{prefix}.{k}", v))
    return out


def _key_with(node: Any, value: int, names: tuple[str, ...], prefix: str) -> str | None:
    """The key of ``node`` holding ``value``: the only one, or the only one whose name says what it is."""
    hits = [k for k, v in _leaves(node, prefix) if isinstance(v, int) and not isinstance(v, bool) and v == value]
    if len(hits) > 1:
        hits = [k for k in hits if any(n in k.rsplit(".", 1)[-1].lower() for n in names)]
    return hits[0] if len(hits) == 1 else None


def _embedding_sentence(cfg: DictConfig, path: str, rows: int, need: int, top: int, fed: bool, positions: bool,
                        T: int, declared: int | None) -> str:
    mkey = _key_with(cfg.model, rows, _POSITION_NAMES if positions else _VOCAB_NAMES, "model")
    if positions:
        dkey = _key_with(cfg.data, T, _POSITION_NAMES, "data")
        said = f" ({dkey}={T})" if dkey else ""
        why = (f"the data's sequences are {T} long{said}, but the model's position embedding {path} has only "
               f"{rows} rows")
        fix = f"set {mkey} to at least {T}" + (f" or {dkey} to at most {rows}" if dkey else "")
    else:
        what = (f"an alphabet of {declared} symbols" if declared is not None and declared >= top + 1
                else f"token id {top} in its first batch")
        why = f"the data ({cfg.data.get('_target_')}) has {what}, but the model's embedding {path} has only {rows} rows"
        fix = f"set {mkey} to at least {need}"
    if mkey is None:
        return f"model._target_={cfg.model.get('_target_')} cannot take the data: {why}."
    return f"{mkey}={rows} is invalid: {why}; {fix}."


def check_data_hooks(model: Any) -> None:
    """The configured data module feeds the run: a module's own data hooks (Lightning's demo
    downloads WikiText-2 in ``prepare_data``) are not called."""
    from lightning.pytorch import LightningModule

    if type(model).prepare_data is not LightningModule.prepare_data:
        model.prepare_data = lambda: None
