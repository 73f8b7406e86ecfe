"""A checkpoint to resume from (``ckpt_path=...``), checked in the launching process before any
worker starts, each problem one sentence naming the key to change:

- the file must load (a truncated or foreign file is named, not a traceback from every rank);
- its entries and their shapes must be the model's (a checkpoint of another ``model.d_model`` is
  named with the hyperparameters that differ);
- it must not have reached ``trainer.max_steps`` (or ``trainer.max_epochs``) already;
- its learning-rate schedule's length (``model.max_steps`` of the built-in models, saved with its
  hyperparameters) must be this run's, unless the command line sets ``model.max_steps`` itself:
  by default ``model.max_steps`` follows ``trainer.max_steps``, and extending a finished run would
  otherwise stretch its schedule silently.

The file is loaded as Lightning's workers load it (``torch.load(weights_only=True)``: a checkpoint
holding other Python objects is named here, not in every worker) and memory-mapped, so even a large
checkpoint costs the launching process little.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from ..config import ConfigError
from ..config.sentences import one_line
from .lightning_private import save_last_checkpoint, skips_saving

#: the hyperparameter holding the length of the built-in models' learning-rate schedule
SCHEDULE_KEY = "max_steps"


def load_checkpoint(path: str) -> Any:
    """The checkpoint at ``path`` as Lightning's workers load it to resume (``weights_only=True``:
    tensors and plain values only), memory-mapped where its format allows (nothing is read until used)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - an old (non-zip) file cannot be mapped, a damaged one says why below
        if _refused_global(e) is not None:  # a value the safe load refuses: said by resume_errors
            raise
    return torch.load(path, map_location="cpu", weights_only=True)


def _refused_global(e: BaseException) -> str | None:
    """The class a ``weights_only`` load refused (``omegaconf.dictconfig.DictConfig``), if that is why it failed."""
    import re

    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    return found.group(1) if found else None


def _shape(t: Any) -> list[int] | None:
    return list(t.shape) if isinstance(t, torch.Tensor) else None


def _hparams(model: Any) -> dict[str, Any]:
    hp = getattr(model, "hparams", None)
    try:
        return dict(hp) if hp is not None else {}
    except Exception:  # noqa: BLE001 - a module's own hparams object: nothing to compare
        return {}


def _model_errors(key: str, ckpt: dict[str, Any], model: Any) -> list[str]:
    """The checkpoint's entries against the model's: names and shapes."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    state = ckpt["state_dict"]
    have = {k: _shape(v) for k, v in state.items()}
    want = {k: _shape(v) for k, v in model.state_dict().items() if not k.startswith("_launcher")}
    saved_hp = ckpt.get("hyper_parameters") or {}
    mine = _hparams(model)
    differ = [k for k in saved_hp if k in mine and k != SCHEDULE_KEY and saved_hp[k] != mine[k]]
    named = ", ".join(f"model.{k}={saved_hp[k]!r} there and {mine[k]!r} here" for k in differ[:3])
    because = f" (it was saved with {named})" if named else ""
    bad = [k for k in want if k in have and have[k] is not None and want[k] is not None and have[k] != want[k]]
    if bad:
        k = bad[0]
        more = f", and {len(bad) - 1} more entries differ" if len(bad) > 1 else ""
        return [f"{key} holds another model{because}: its {k} has shape {have[k]} where this model's has "
                f"{want[k]}{more}; resume with the model settings it was trained with, or start without ckpt_path."]
    # layers a module makes in configure_model are not there yet when strategy=single is prepared
    if is_overridden("configure_model", model) or not getattr(model, "strict_loading", True):
        return []
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    if missing or extra:
        what = (f"lacks {missing[0]}"
                + (f" (and {len(missing) - 1} more of the model's entries)" if len(missing) > 1 else "")
                if missing else
                f"has {extra[0]}, which the model lacks" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        return [f"{key} holds another model{because}: it {what}; resume with the model it was trained with, "
                f"or start without ckpt_path."]
    return []


def _schedule_errors(key: str, ckpt: dict[str, Any], cfg: DictConfig, model: Any) -> list[str]:
    """The learning-rate schedule's length: the checkpoint's unless the command line sets it."""
    saved = (ckpt.get("hyper_parameters") or {}).get(SCHEDULE_KEY)
    node = cfg.get("model")
    if saved is None or not isinstance(node, DictConfig) or SCHEDULE_KEY not in node:
        return []
    now = _hparams(model).get(SCHEDULE_KEY, OmegaConf.select(cfg, f"model.{SCHEDULE_KEY}"))
    if now == saved or not OmegaConf.is_interpolation(node, SCHEDULE_KEY):
        return []  # the same schedule, or one the command line asks for
    raw: Any = OmegaConf.to_container(node, resolve=False)  # the interpolation as written: ${...}
    follows = str(raw[SCHEDULE_KEY]).strip("${}")
    return [f"{key} was trained on a learning-rate schedule of model.{SCHEDULE_KEY}={saved} steps, but here "
            f"model.{SCHEDULE_KEY} follows {follows}={now}, which would change its learning rate: set "
            f"model.{SCHEDULE_KEY}={saved} to keep its schedule, or model.{SCHEDULE_KEY}={now} to change it."]


def _done_errors(key: str, ckpt: dict[str, Any], cfg: DictConfig) -> list[str]:
    """A checkpoint that has reached the run's end already: nothing would train."""
    step, epoch = ckpt.get("global_step"), ckpt.get("epoch")
    max_steps = OmegaConf.select(cfg, "trainer.max_steps", default=-1)
    max_epochs = OmegaConf.select(cfg, "trainer.max_epochs", default=None)
    if isinstance(step, int) and isinstance(max_steps, int) and 0 < max_steps <= step:
        return [f"{key} has trained {step} steps already, and trainer.max_steps={max_steps} asks for no more: "
                f"raise trainer.max_steps above {step} to train on from it."]
    if (isinstance(epoch, int) and isinstance(max_epochs, int) and 0 < max_epochs <= epoch
            and not (isinstance(max_steps, int) and max_steps > 0)):
        return [f"{key} has trained {epoch} epochs already, and trainer.max_epochs={max_epochs} asks for no more: "
                f"raise trainer.max_epochs above {epoch} to train on from it."]
    return []


def resume_errors(cfg: DictConfig, model: Any) -> list[str]:
    """One sentence per problem with ``cfg.ckpt_path`` for ``model`` (built as the run builds it);
    nothing when there is no checkpoint to resume from (a missing file is the config's rule)."""
    path = cfg.get("ckpt_path")
    if path is not None and os.path.isdir(str(path)):
        return _sharded_errors(f"ckpt_path={path}", str(path), cfg, model)
    if path is None or not os.path.isfile(str(path)):
        return []
    key = f"ckpt_path={path}"
    try:
        ckpt = load_checkpoint(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one sentence
        import zipfile

        refused = _refused_global(e)
        if refused is not None:
            return [f"{key} holds {refused}, which Lightning's safe load (torch.load with weights_only=True) "
                    f"refuses, so no worker could resume from it: resume from a checkpoint whose saved values are "
                    f"tensors and plain Python values (hyperparameters as dicts and lists, e.g. through "
                    f"OmegaConf.to_container), or start without ckpt_path."]

        size = os.path.getsize(str(path))
        if not zipfile.is_zipfile(str(path)):  # torch.save writes a zip archive, its directory at the end
            return [f"{key} is not a whole checkpoint: its {size:,} bytes end without the archive directory "
                    f"torch.save writes last, so it was cut short (or is no checkpoint); resume from another one "
                    f"(the run's checkpoints/ keeps one per validation)."]
        return [f"{key} cannot be read as a checkpoint ({one_line(e)}); it may be damaged: resume from another "
                f"one (the run's checkpoints/ keeps one per validation)."]
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        return [f"{key} is not a Lightning checkpoint (it has no state_dict): resume from a file the run's "
                f"checkpoints/ holds."]
    try:
        found = _model_errors(key, ckpt, model)
    except Exception as e:  # noqa: BLE001 - an entry that cannot be read: the file is damaged
        return [f"{key} cannot be read as a checkpoint ({one_line(e)}); it may be truncated or damaged: "
                f"resume from another one (the run's checkpoints/ keeps one per validation)."]
    # a finished checkpoint first: raising trainer.max_steps is what to do, the schedule comes next
    return found or _done_errors(key, ckpt, cfg) or _schedule_errors(key, ckpt, cfg, model)


def _sharded_errors(key: str, path: str, cfg: DictConfig, model: Any) -> list[str]:
    """A sharded checkpoint (a directory, :mod:`.sharded`): whole (every shard there, none cut
    short), and of this model; read from its metadata only, no tensor is loaded."""
    from . import sharded

    why = sharded.problems(path)
    if why is not None:
        return [f"{key} {why}: resume from another checkpoint (a save interrupted midway leaves the previous "
                f"last.ckpt whole), or start without ckpt_path."]
    meta = sharded.read_meta(path)
    ckpt = dict(meta, state_dict={k: torch.empty(v, device="meta") if v is not None else None
                                  for k, v in sharded.shapes(path, meta).items()})
    found = _model_errors(key, ckpt, model)
    return found or _done_errors(key, ckpt, cfg) or _schedule_errors(key, ckpt, cfg, model)


def check_resume(cfg: DictConfig, model: Any) -> None:
    """Raise :class:`ConfigError` with :func:`resume_errors`' sentences, if any."""
    found = resume_errors(cfg, model)
    if found:
        raise ConfigError(found)



class LastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(save_last=True)`` whose ``last.ckpt`` is always where training ended.
    Lightning writes it at the end of training only if nothing wrote it before: a run of 6 steps
    validated at step 4 would leave it at step 4, and a resume from it would train steps 5 and 6
    again. Here the end of training writes it whenever that step is not saved yet. Its state in a
    checkpoint keeps ``ModelCheckpoint``'s key, so checkpoints of either resume under the other."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(save_last=True, **kwargs)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_last and not skips_saving(self, trainer):
            save_last_checkpoint(self, trainer)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A run resumed with ``ckpt_path=<other run>/checkpoints/last.ckpt`` writes into its own run
        directory: the checkpoint's directory differs by design, and Lightning's warning about it
        (once per worker) says nothing the user did not ask for. As Lightning does then, only
        ``best_model_path`` is taken over; the same directory (a requeued run) restores it all."""
        if state_dict.get("dirpath", self.dirpath) != self.dirpath:
            self.best_model_path = state_dict["best_model_path"]
            return
        super().load_state_dict(state_dict)


LastCheckpoint.__qualname__ = "ModelCheckpoint"  # the key of its state in a checkpoint (Callback.state_key)
