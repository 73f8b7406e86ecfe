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
import json
import os
import sys
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from launcher.config import LauncherConf, step_errors, to_step
from launcher.schedule.simulate import ScheduleError, simulate

from .failure import DEFAULT_TIMEOUT, WorkerFailed
from .measure import merge, mismatches
from .model import mlp_batches, staged_mlp
from .plan import PlanError, lower
from .processes import init_from_env, launch
from .worker import Engine


def _load(spec: str) -> Callable:
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


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
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--weight-cache", default="step", choices=("step", "job"))
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds for every worker to stop after one fails")
    p.add_argument("--backend", default="auto", help="auto (gloo on CPU, nccl on GPUs), gloo or nccl")
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


def check(args: argparse.Namespace) -> list[str]:
    """Every rule the flags break, one sentence each, as the Hydra front end words them; the
    schedule is simulated too, so a step that cannot finish is refused before any worker starts."""
    cfg = config_of(args)
    found = step_errors(cfg)
    if args.steps < 1:
        found.append(f"--steps={args.steps} is invalid: the number of steps must be a positive integer.")
    if args.timeout <= 0:
        found.append(f"--timeout={args.timeout} is invalid: the failure timeout must be a positive number of seconds.")
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
