"""Train a staged model with any schedule, under torchrun or on local forked workers.

    torchrun --nproc-per-node 4 -m launcher.runtime --strategy lpp --G 2 --R 2 --stages 4 --microbatches 4
    python -m launcher.runtime --strategy fslpp --G 2 --R 2 --stages 8 --microbatches 4   # forks W = G*R workers

Rank 0 prints one line per step and, with ``--out``, writes every step's merged record (predicted
beside measured, per worker) as JSON. ``--model pkg.mod:factory`` names a function returning a
:class:`~launcher.runtime.model.StagedModel` with ``--stages`` stages; ``--data pkg.mod:fn`` a
function ``fn(step, microbatches) -> [(input, target), ...]``. Both default to the staged MLP.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from launcher.config import LauncherConf, step_errors, to_step
from launcher.config.step import one_line
from launcher.schedule.simulate import ScheduleError, simulate

from .failure import DEFAULT_TIMEOUT, WorkerFailed
from .measure import merge, mismatches
from .model import mlp_batches, staged_mlp
from .plan import PlanError, lower
from .processes import auto_backend, init_from_env, launch
from .worker import Engine


def _load(spec: str) -> Callable:
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


#: --backend: auto is gloo on CPU, nccl when CUDA is available
BACKENDS = ("auto", "gloo", "nccl")
#: what --model and --data must name
SPECS = {"--model": "a factory() returning a StagedModel", "--data": "a function fn(step, microbatches) returning micro-batches"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launcher.runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="lpp", help="ddp, fsdp, gpipe, lpp or fslpp")
    p.add_argument("--G", type=int, default=2)
    p.add_argument("--R", type=int, default=2)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--order", default="1f1b", help="1f1b, breadth_first or depth_first")
    p.add_argument("--split-backward", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--weight-cache", default="step", choices=("step", "job"))
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds for every worker to stop after one fails")
    p.add_argument("--backend", default="auto", help=f"{', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--model", default=None, help="pkg.mod:factory returning a StagedModel")
    p.add_argument("--data", default=None, help="pkg.mod:fn(step, microbatches) returning micro-batches")
    p.add_argument("--out", default=None, help="write the merged per-step records here (JSON)")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """This rank's share of ``args.steps`` steps; returns its per-step records."""
    step = to_step(config_of(args), check=False)  # main() validated it before any worker started
    model = _load(args.model)() if args.model else staged_mlp(args.stages)
    data = _load(args.data) if args.data else (lambda i, B: mlp_batches(B, seed=i))
    opt = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adam
    engine = Engine(model, step, lambda ps: opt(ps, lr=args.lr), prefetch=args.prefetch, weight_cache=args.weight_cache)
    return [engine.train_step(data(i, args.microbatches)) for i in range(args.steps)]


def config_of(args: argparse.Namespace) -> DictConfig:
    """The launcher config (:mod:`launcher.config.schema`) these flags describe."""
    cfg = OmegaConf.structured(LauncherConf)
    cfg.strategy.name = args.strategy
    cfg.order.name = args.order
    for key in ("G", "R", "stages", "microbatches", "split_backward", "weight_cache", "prefetch"):
        cfg[key] = getattr(args, key)
    return cfg


def _custom(flag: str, what: str, make_step_arg: str) -> str:
    return (
        f"{flag}=custom is not available from python -m launcher.runtime: it has no flag for a custom {what}; "
        f"use the Python API instead, Engine(model, make_step({make_step_arg}), optimizer) on every rank "
        f"(README, Train on real workers)."
    )


def _spec_error(flag: str, spec: str) -> str | None:
    """Why ``--model``/``--data`` ``spec`` (``pkg.mod:name``) names no callable; ``None`` if it does."""
    mod, sep, name = spec.partition(":")
    if not (mod and sep and name):
        return f"{flag}={spec} is invalid: it must be pkg.mod:name, naming {SPECS[flag]}."
    try:
        module = importlib.import_module(mod)
    except BaseException as e:  # noqa: BLE001 - a user's module may raise anything, SystemExit too
        return f"{flag}={spec} is invalid: module {mod} cannot be imported ({one_line(e)})."
    if not hasattr(module, name):
        return f"{flag}={spec} is invalid: module {mod} has no {name}; it must name {SPECS[flag]}."
    fn = getattr(module, name)
    if not callable(fn):
        return f"{flag}={spec} is invalid: {mod}.{name} is a {type(fn).__name__}, not a callable; it must name {SPECS[flag]}."
    call = {"--model": (), "--data": (0, 1)}[flag]  # train() calls factory() and fn(step, microbatches)
    try:
        inspect.signature(fn).bind(*call)
    except TypeError:
        return (f"{flag}={spec} is invalid: {mod}.{name}{inspect.signature(fn)} cannot be called with "
                f"{len(call) or 'no'} argument{'s' if len(call) != 1 else ''}; it must name {SPECS[flag]}.")
    except ValueError:  # no signature to inspect (some builtins): let the call decide
        pass
    return None


def _flag_errors(args: argparse.Namespace) -> list[str]:
    """The runtime's own flags (those the launcher config does not have)."""
    found: list[str] = []
    if args.steps < 1:
        found.append(f"--steps={args.steps} is invalid: the number of steps must be a positive integer.")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        found.append(f"--timeout={args.timeout} is invalid: the failure timeout must be a positive number of seconds.")
    if not (math.isfinite(args.lr) and args.lr > 0):
        found.append(f"--lr={args.lr} is invalid: the learning rate must be a positive finite number.")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    W = args.G * args.R
    if args.backend not in BACKENDS:
        found.append(f"--backend={args.backend} is not a known backend; use {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}.")
    elif auto_backend(args.backend) == "nccl":
        if not torch.cuda.is_available():
            found.append(f"--backend={args.backend} is invalid here: NCCL needs CUDA GPUs and none is available; "
                         f"use --backend gloo (or auto, which picks gloo on CPU).")
        elif not torchrun and W > torch.cuda.device_count():
            found.append(f"--backend={args.backend} is invalid here: NCCL needs one GPU per worker, but W=G*R={W} "
                         f"and there are {torch.cuda.device_count()} GPUs; use --backend gloo or fewer workers.")
    if torchrun:
        world = os.environ["WORLD_SIZE"]
        if not world.isdigit():
            found.append(f"WORLD_SIZE={world} is invalid: the launcher's world size must be a positive integer.")
        elif int(world) < W:
            found.append(f"WORLD_SIZE={world} is too small: the step needs W=G*R={args.G}*{args.R}={W} workers; "
                         f"start {W} processes (e.g. torchrun --nproc-per-node {W}) or lower --G/--R.")
    if args.out is not None:
        parent = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out):
            found.append(f"--out={args.out} is invalid: it is a directory; name the JSON file to write.")
        elif not os.path.isdir(parent):
            found.append(f"--out={args.out} is invalid: its directory {parent} does not exist.")
    for flag in SPECS:
        spec = getattr(args, flag[2:])
        if spec is not None:
            error = _spec_error(flag, spec)
            if error:
                found.append(error)
    return found


def check(args: argparse.Namespace) -> list[str]:
    """Every rule the flags break, one sentence each, as the Hydra front end words them; the
    schedule is simulated too, so a step that cannot finish is refused before any worker starts."""
    cfg = config_of(args)
    found = step_errors(cfg)
    # the front end's hint (strategy.placement._target_, order.n._target_) has no flag here
    for flag, what, arg in (("strategy", "placement", "my_placement, stages, microbatches, G=.., R=.."),
                            ("order", "order", "strategy, stages, microbatches, order=Order('custom', my_order)")):
        if getattr(args, flag) == "custom":
            found = [_custom(f"--{flag}", what, arg) if s.startswith(f"{flag}=custom ") else s for s in found]
    found += _flag_errors(args)
    if found:
        return found
    try:
        lower(simulate(to_step(cfg, check=False)), args.weight_cache)
    except (ScheduleError, PlanError) as e:
        return [str(e).rstrip(".") + "."]
    return []


def report(per_rank: list[list[dict[str, Any]]], out: str | None) -> list[dict[str, Any]]:
    steps = [merge([r[i] for r in per_rank if r]) for i in range(max(len(r) for r in per_rank))]
    for rec in steps:
        bad = mismatches(rec)
        print(f"step {rec['step']}: loss {rec['loss']:.6f}  wall {rec['step_s'] * 1e3:.1f} ms  "
              f"counts {'match the simulator' if not bad else 'DIFFER: ' + json.dumps(bad)}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(steps, f, indent=1)
    return steps


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    problems = check(args)
    if problems:
        for sentence in problems:
            print(f"error: {sentence}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, Slurm with env://, ...
        import torch.distributed as dist

        wd = init_from_env(args.backend, args.timeout)
        try:
            mine = train(args)
            gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if dist.get_rank() == 0:
                report(gathered, args.out)
        except BaseException as e:
            print(wd.fail(e), file=sys.stderr, flush=True)
            raise
        wd.stop()
        dist.destroy_process_group()
        return 0
    try:
        per_rank = launch(train, args.G * args.R, args, backend=args.backend, timeout=args.timeout)
    except WorkerFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report(per_rank, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
