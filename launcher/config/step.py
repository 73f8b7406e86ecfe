"""Config -> :class:`launcher.schedule.Step`: the one place a launcher config becomes a schedule.

The simulator (``mode=simulate``) and the runtime entry (``python -m launcher.runtime``) both start
from :func:`to_step`, so they plan the same step from the same config.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from ..schedule import Step, make_step
from .validate import ConfigError, validate


def _instantiate(node: Any, key: str, what: str) -> Callable:
    from hydra.utils import instantiate

    target = node.get("_target_")
    missing = target_error(str(target))
    if missing:
        raise ConfigError([f"{key}._target_={target} could not be built: {missing}."])
    try:
        obj = instantiate(node)
    except Exception as e:  # import errors, bad arguments: one sentence, the cause's first line
        raise ConfigError([f"{key}._target_={target} could not be built: {one_line(e)}."]) from e
    if not callable(obj):
        raise ConfigError([f"{key}._target_={target} is invalid: it built {obj!r}, which is not a callable {what}."])
    return obj


def target_error(target: str) -> str | None:
    """Why the dotted path ``target`` names nothing, said as a user would look for it (``module
    mymodule has no attribute nope``, not Python's "'mymodule' is not a package"; a module that is
    nowhere to import: where Python looked, the working directory and ``PYTHONPATH``); ``None``
    when it resolves, or when importing fails inside the module (Hydra's own error says more then)."""
    import importlib
    import os

    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name != e.name and not name.startswith(e.name + "."):
                return None  # the module exists but one of its own imports is missing
            continue
        except Exception:
            return None
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:j])
                kind = "module" if j == i else "object"
                return f"{kind} {owner} has no attribute {attr}"
            obj = getattr(obj, attr)
        return None
    # not even the first name imports: the module is neither where the command runs nor on the path
    top = parts[0]
    return (f"there is no module {top} in the working directory ({os.getcwd()}) or on PYTHONPATH; run from the "
            f"directory that holds {top}.py (or the package {top}/), or add that directory to PYTHONPATH")


def one_line(e: BaseException, limit: int = 300) -> str:
    """The root cause of an exception as ``Type: message`` on one line, without a final period."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return (text if len(text) <= limit else text[: limit - 3] + "...").rstrip(".")


def to_step(cfg: DictConfig | Mapping[str, Any], check: bool = True, graph: Any = None) -> Step:
    """The step a (composed) config describes; validated first unless ``check`` is false.
    ``graph``: the model's stage graph, when it is not a chain (a traced model's)."""
    if check:
        validate(cfg)
    c = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    if c.strategy.name == "auto" and c.strategy.get("placement") is None:
        raise ConfigError(["strategy=auto is chosen by the planner: apply launcher.plan.choose(cfg)'s overrides first."])
    placement = c.strategy.get("placement")
    strategy: Any = c.strategy.name
    if placement is not None:
        place = _instantiate(placement, "strategy.placement", "(s, b, d) -> (w_weights, w_compute)")
        strategy = _guarded(place, "strategy.placement", placement.get("_target_"), c.strategy.name, pair=True)
    n = c.order.get("n")
    order: Any = c.order.name
    if n is not None:
        order = _guarded(_instantiate(n, "order.n", "n(s, b, d)"), "order.n", n.get("_target_"), c.order.name)
    memory_limit = OmegaConf.to_container(c.memory_limit) if OmegaConf.is_list(c.memory_limit) else c.memory_limit
    return make_step(
        strategy,
        stages=c.stages,
        microbatches=c.microbatches,
        G=c.G,
        R=c.R,
        order=order,
        warmup=c.warmup,
        durations=dict(c.durations),
        comm=float(c.comm),
        memory_limit=memory_limit,
        split_backward=bool(c.split_backward),
        ownership=c.strategy.get("ownership") or "seed",
        recompute=_plain_recompute(c),
        graph=graph,
    )


def _guarded(fn: Callable, key: str, target: str, name: str, pair: bool = False) -> Callable:
    """``fn`` under the config's label, turning its failures (and, for a placement, a result that
    is not a pair of ints) into one sentence naming the job."""

    def call(s: int, b: int, d: str) -> Any:
        try:
            out = fn(s, b, d)
        except Exception as e:
            raise ConfigError([f"{key}._target_={target} failed on job ({s}, {b}, {d}): {one_line(e)}."]) from e
        if pair and not (
            isinstance(out, tuple) and len(out) == 2 and all(isinstance(w, int) and not isinstance(w, bool) for w in out)
        ):
            raise ConfigError(
                [f"{key}._target_={target} returned {out!r} for job ({s}, {b}, {d}); it must return (w_weights, w_compute), two ints."]
            )
        return out

    call.__name__ = name
    return call


def _plain_recompute(c: DictConfig) -> Any:
    """``recompute`` as plain Python (a list node becomes a list); ``none`` when the key is absent."""
    v = c.get("recompute", "none")
    return OmegaConf.to_container(v) if OmegaConf.is_list(v) else v
