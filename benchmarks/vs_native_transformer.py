"""Our engine against PyTorch's own schemes on transformers, GPT and Llama, pair by pair (a benchmark).

The built-in GPT and Hugging Face's Llama, on the same stage modules on both sides.

    python benchmarks/vs_native_transformer.py               # GPT and Llama, d_model 128 and 256, W = 4 and 8
    python benchmarks/vs_native_transformer.py --quick       # a smoke run (tiny, W = 4, the test suite runs it)
    python benchmarks/vs_native_transformer.py --models llama --sizes 256 --pairs ddp-w4,1f1b-w4 --json out.json
    python benchmarks/vs_native_transformer.py --backend nccl  # one GPU per rank
    python benchmarks/vs_native_transformer.py --schedules sched --pairs torch-csv-w4,ours-csv-w4  # schedules as files
    python benchmarks/vs_native_transformer.py --pool a.json,b.json  # earlier runs' --json, pooled

Workload, per model and size: the model's own modules ``[embedding, block x L, head]``
(:class:`launcher.models.GPT`'s ``stages``; :class:`launcher.models.HFCausalLM`'s cut of
``LlamaForCausalLM``) built after ``torch.manual_seed(0)``, cut into S contiguous stages of equal
module count (S = 8 with L = 6: a module each; S = 4: two each). Between stages only the hidden
state travels (a Llama stage rebuilds the positions, ``arange(T)``, and the causal mask, as the
model's forward does without an attention mask), so the same modules run under
``torch.distributed.pipelining``. The batch: ``torch.manual_seed(1)``, tokens ``randint(128,
(B*mb, T+1))``, input the first T, target the last T; micro-batch b = ``chunk(B)[b]``, the same
batch every step; loss the model's own cross-entropy, the mean over micro-batches; AdamW lr 3e-3
(the models' optimizer); one intra-op thread per process.

Native sides: ``DistributedDataParallel`` over the stages in sequence; FSDP2, ``fully_shard`` on
every transformer block and then the root; ``PipelineStage`` over the same stage modules (stage s
on rank s mod W) with ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleLoopedBFS``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``; and on the V (S = 2W, rank r holds
stages r and 2W - 1 - r, torch's ``style="v"`` mapping) ``ScheduleZBVZeroBubble`` against our
``strategy=vshape order=zbv`` and ``ScheduleDualPipeV`` against ``order=dualpipev``. ``auto-zb-w4`` runs our
``order=auto`` (the searched schedule) against ``ScheduleInterleavedZeroBubble``. Ours: the engine
at its defaults, as ``vs_torch_native.py`` runs it.

Measured as in ``vs_torch_native.py`` (its harness is imported): one set of W forked workers per
pair builds both sides and alternates them (ours, native, ours, ...); a step is timed from a barrier
to a barrier around the whole step with its optimizer, the slowest rank's; CPU seconds are every
process's (its threads too). Also printed: the ratio's 95% interval (a paired bootstrap over the
alternated steps), our predicted step (the simulator replaying what our workers measured, per
stage) and the first step's fingerprints, the loss and the sum of |gradient|
of stage 0, on both sides. Exit status 1 when a pair's fingerprints differ by more than 1e-6
relative.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from vs_torch_native import (
    NATIVE,
    Native,
    Ours,
    Pair,
    _rel,
    alternate,
    interval_text,
    pair_device,
    pair_link,
    ratio_interval,
    replayed,
)

from launcher.report.measured_costs import stage_job_seconds
from launcher.runtime import Engine, launch
from launcher.runtime.engine import TRANSPORTS
from launcher.schedule import make_schedule, simulate
from launcher.torch_support.staged import StagedModel

#: as vs_torch_native's: the losses come out bit for bit equal; the stage-0 gradient sums differ by
#: at most about 1e-9 relative (DDP's buckets and FSDP's reduce-scatter add in another order)
TOLERANCE = 1e-6
VOCAB = 128

#: ``order="default"``: the scheme's own default order (docs/configuration.md, "Default orders"), as
#: a user who names none gets it; the ``*-default-*`` pairs are one per pipeline scheme at that order
PAIRS = [
    Pair("ddp-w4", "ddp", 4, 1, 4, 4, "default", False, "ddp"),
    Pair("fsdp-w4", "fsdp", 4, 1, 4, 4, "default", False, "fsdp"),
    Pair("gpipe-default-w4", "gpipe", 1, 4, 4, 8, "default", False, "1f1b"),
    Pair("lpp-default-w2", "lpp", 1, 2, 4, 8, "default", False, "interleaved_1f1b"),  # the pair
    Pair("lpp-default-w4", "lpp", 1, 4, 8, 8, "default", False, "interleaved_1f1b"),
    Pair("fslpp-default-w4", "fslpp", 2, 2, 4, 8, "default", False, "fsdp_interleaved_1f1b"),
    Pair("gpipe-w4", "gpipe", 1, 4, 4, 8, "breadth_first", False, "gpipe"),
    Pair("1f1b-w4", "gpipe", 1, 4, 4, 8, "1f1b", False, "1f1b"),
    Pair("looped-bfs-w4", "lpp", 1, 4, 8, 8, "breadth_first", False, "looped_bfs"),
    Pair("interleaved-1f1b-w4", "lpp", 1, 4, 8, 8, "interleaved_1f1b", False, "interleaved_1f1b"),
    Pair("interleaved-zb-w4", "lpp", 1, 4, 8, 8, "1f1b", True, "interleaved_zb"),
    Pair("interleaved-1f1b-w2", "lpp", 1, 2, 4, 8, "interleaved_1f1b", False, "interleaved_1f1b"),
    # the V shape (S = 2W, rank r holds stages r and 2W - 1 - r, torch's style="v"): our ZB-V order
    # is ScheduleZBVZeroBubble's, job for job
    Pair("zbv-w4", "vshape", 1, 4, 8, 8, "zbv", True, "zbv"),
    Pair("zbv-w2", "vshape", 1, 2, 4, 8, "zbv", True, "zbv"),
    # order=auto: the schedule our search finds (no memory limit), on interleaved-zb-w4's placement
    Pair("auto-zb-w4", "lpp", 1, 4, 8, 8, "auto", True, "interleaved_zb"),
    # order=dualpipev: ScheduleDualPipeV's order on the V shape
    Pair("dualpipev-w4", "vshape", 1, 4, 8, 8, "dualpipev", True, "dualpipev"),
    Pair("dualpipev-w2", "vshape", 1, 2, 4, 8, "dualpipev", True, "dualpipev"),
    Pair("ddp-w8", "ddp", 8, 1, 4, 8, "default", False, "ddp"),
    Pair("fsdp-w8", "fsdp", 8, 1, 4, 8, "default", False, "fsdp"),
    Pair("gpipe-w8", "gpipe", 1, 8, 8, 8, "breadth_first", False, "gpipe"),
    Pair("1f1b-w8", "gpipe", 1, 8, 8, 8, "1f1b", False, "1f1b"),
]
QUICK_PAIRS = "fsdp-w4,interleaved-zb-w4"
#: schedules as data (``--schedules``): both sides run one CSV file, torch's own interleaved 1F1B
#: (ours reads it with ``order=file``) and our 1F1B tie-break on the looped pipeline (torch reads
#: it with ``_PipelineScheduleRuntime._load_csv``)
FILE_PAIRS = "torch-csv-w4,ours-csv-w4"
NATIVE_NAMES = {**NATIVE, "csv": "_load_csv"}


def file_pairs(folder: str) -> list[Pair]:
    """The two schedule-file pairs, their CSV files written under ``folder``."""
    import types
    from pathlib import Path

    from torch.distributed.pipelining import schedules as pps

    from launcher.schedule.order_file import FileOrder, write_schedule

    R, per, B = 4, 2, 8
    theirs = {}
    for r in range(R):  # torch's own interleaved 1F1B, computed without a process group
        sched = types.SimpleNamespace(n_local_stages=per, microbatches_per_round=R, pp_group_size=R, _n_microbatches=B)
        theirs[r] = pps.ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, r)
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch_csv = str(Path(folder) / "torch_interleaved_1f1b.csv")
    pps.PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=theirs), torch_csv)
    tl = simulate(make_schedule("lpp", R * per, B, G=1, R=R, order="1f1b"))
    ours_csv = str(write_schedule(tl.schedule.space, tl.sequences, Path(folder) / "ours_lpp_1f1b.csv"))
    return [Pair("torch-csv-w4", "lpp", 1, R, R * per, B, FileOrder(path=torch_csv), False,  # type: ignore[arg-type]
                 "interleaved_1f1b"),
            Pair("ours-csv-w4", "lpp", 1, R, R * per, B, FileOrder(path=ours_csv), False, "csv")]  # type: ignore[arg-type]
MODELS = {"gpt": "GPT", "llama": "Llama"}


def runnable(p: Pair) -> str | None:
    """Why our side cannot run ``p`` in this checkout (an order our registry lacks), else ``None``."""
    from launcher.schedule.order import ORDERS, SCHEME_DEFAULT

    if isinstance(p.order, str) and p.order not in (*ORDERS, SCHEME_DEFAULT):
        return f"order={p.order} is not in our order registry yet"
    return None


@dataclass(frozen=True)
class Size:
    """One transformer: ``model`` (gpt or llama), width ``d``, ``layers`` blocks, sequence length
    ``T``, ``mb`` sequences per micro-batch."""

    model: str
    d: int
    layers: int
    T: int
    mb: int

    @property
    def heads(self) -> int:
        return max(1, self.d // 64)


# ---- the workload ----------------------------------------------------------------------------
class GPTStage(nn.Module):
    """Modules of the built-in GPT's ``stages``, applied in order."""

    def __init__(self, pieces: list[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.pieces:
            x = m(x)
        return x


class LlamaStage(GPTStage):
    """Modules of ``HFCausalLM``'s cut, applied in order; takes and returns the hidden state alone
    (the first stage takes the token ids, the last returns the logits): no mask and default
    positions, from which each decoder layer's stage builds the causal mask and the rotary
    embedding with the model's own forward (it reads only the shape of the token ids)."""

    def __init__(self, pieces: list[nn.Module], first: bool) -> None:
        from launcher.models.hf_stages import DecoderLayer

        super().__init__(pieces)
        self.first = first
        self.layer_first = isinstance(pieces[0], DecoderLayer)  # else the head alone: the hidden state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            args: tuple[Any, ...] = (x,)
        else:
            B, T = x.shape[:2]
            args = (x, torch.zeros(B, T, dtype=torch.long, device=x.device), None, None) if self.layer_first else (x,)
        out: Any = None
        for m in self.pieces:
            out = m(*args)
            args = out if isinstance(out, tuple) else (out,)
        return out[0] if isinstance(out, tuple) else out


def _cut(modules: list[nn.Module], S: int) -> list[list[nn.Module]]:
    if not 1 <= S <= len(modules):
        raise ValueError(f"{len(modules)} modules cannot make {S} stages")
    bounds = [round(i * len(modules) / S) for i in range(S + 1)]
    return [modules[a:b] for a, b in itertools.pairwise(bounds)]


def build(size: Size, S: int, device: torch.device) -> tuple[list[nn.Module], Any, tuple[type, ...]]:
    """The stages (after ``torch.manual_seed(0)``), the loss and the block types (FSDP's units)."""
    torch.manual_seed(0)
    if size.model == "gpt":
        from launcher.models import GPT
        from launcher.models.gpt import Block
        lm = GPT(vocab_size=VOCAB, seq_len=size.T, d_model=size.d, n_head=size.heads, n_layer=size.layers)
        stages: list[nn.Module] = [GPTStage(g) for g in _cut(list(lm.stages), S)]
        blocks: tuple[type, ...] = (Block,)
    elif size.model == "llama":
        from launcher.models import HFCausalLM
        from launcher.models.hf_stages import DecoderLayer
        ff = -(-8 * size.d // 3 // 64) * 64  # Llama's 8/3 d, rounded up to a multiple of 64
        lm = HFCausalLM("llama", config={"vocab_size": VOCAB, "hidden_size": size.d, "num_hidden_layers": size.layers,
                                         "num_attention_heads": size.heads,
                                         "num_key_value_heads": max(1, size.heads // 2), "intermediate_size": ff,
                                         "max_position_embeddings": max(size.T, 128)})
        stages = [LlamaStage(g, i == 0) for i, g in enumerate(_cut(list(lm.stages), S))]
        blocks = (DecoderLayer,)
    else:
        raise ValueError(f"unknown model {size.model}; use one of {', '.join(MODELS)}")
    return [s.to(device) for s in stages], lm.loss, blocks


def build_batch(size: Size, B: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    seq = torch.randint(VOCAB, (B * size.mb, size.T + 1))
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def stage_bytes(stages: list[nn.Module]) -> list[int]:
    return [sum(q.numel() * q.element_size() for q in s.parameters()) for s in stages]


# ---- our side: vs_torch_native's, on these stages ---------------------------------------------
class OursT(Ours):
    """``vs_torch_native.Ours`` (its step and fingerprint) on a transformer's stages."""

    def __init__(self, p: Pair, size: Size, device: torch.device, transport: str = "auto") -> None:
        self.p, self.device = p, device
        stages, loss, _ = build(size, p.S, device)
        # the engine's defaults (the batch check runs on step 1, a warm-up step, then every 50th)
        self.engine = Engine(StagedModel(stages, loss), make_schedule(p.scheme, p.S, p.B, G=p.G, R=p.R, order=p.order,
                                                                  split_backward=p.split), adamw, transport=transport)
        x, t = build_batch(size, p.B, device)
        self.mbs = list(zip(x.chunk(p.B), t.chunk(p.B)))
        self.records: list[dict] = []
        self.optimizer_s: list[float] = []
        self.optimizer_cpu_s: list[float] = []


# ---- the native side -------------------------------------------------------------------------
class NativeT(Native):
    """PyTorch native on the transformer stages: `Native`'s step and fingerprint, the model's own loss."""

    def __init__(self, p: Pair, size: Size, device: torch.device) -> None:
        self.p, self.device, self.rank = p, device, dist.get_rank()
        stages, self.loss_fn, blocks = build(size, p.S, device)
        x, t = build_batch(size, p.B, device)
        self.sched = None
        if p.native in ("ddp", "fsdp"):  # FSDP: fully_shard per transformer block, then the root
            self._data_parallel(stages, x, t, device,
                                units=[m for s in stages for m in s.modules() if isinstance(m, blocks)])
        elif p.native == "csv":  # a runtime schedule whose actions are replaced by the file's
            self._pipeline(replace(p, native="interleaved_1f1b"), stages, x, t, device)
            self.sched._load_csv(p.order.path)  # type: ignore[attr-defined]
        else:  # stage s on rank s mod W, torch.distributed.pipelining's schedule
            self._pipeline(p, stages, x, t, device)
        self.optimizer = adamw(self.params)


# ---- one pair on its workers -----------------------------------------------------------------
def run_pair(p: Pair, size: Size, reps: int, steps: int, warmup: int,
             transport: str = "auto") -> dict[str, Any] | None:
    """On each of W ranks: both sides, alternated (``vs_torch_native.alternate``); rank 0 returns
    the measurements. ``transport``: how our side's activations and gradients travel."""
    device = pair_device()
    link = pair_link(p, device)
    out = alternate({"ours": OursT(p, size, device, transport), "native": NativeT(p, size, device)}, device, reps,
                    steps, warmup)
    return None if out is None else {"pair": asdict(p), "size": asdict(size), "link": link, **out}


def predicted(p: Pair, size: Size, grads: list[int], result: dict[str, Any]) -> float:
    """Our step as the simulator predicts it from what our workers measured, as
    ``vs_torch_native.predicted`` does, with each stage's own job times (a stage holding the
    embedding alone is lighter than a block) and this workload's message and gradient sizes."""
    ranks = result["per_rank"][: p.W]
    tl = simulate(make_schedule(p.scheme, p.S, p.B, G=p.G, R=p.R, order=p.order, split_backward=p.split))  # what ran
    per_stage = stage_job_seconds(ranks, tl.schedule.space.kinds, p.S)
    tl = replace(tl, schedule=replace(tl.schedule, stage_durations=per_stage))
    return replayed(p, tl, ranks, result, size.mb * size.T * size.d * 4, grads,
                    {k: 1.0 for k in tl.schedule.space.kinds})  # the stages' own times, over these


def pool(paths: list[str]) -> int:
    """Each pair of several runs' ``--json`` files: its ratio in each run, and the ratio of the
    medians of every timed step of the runs together (each over its run's native median) with its
    95% interval (each run's steps stay paired with the other side's of the same repetition)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f)["rows"])
    table = Table(title=f"ours vs PyTorch native, {len(runs)} runs pooled ({', '.join(paths)})")
    for col in ("model", "d", "pair", "W", "ours/native per run", "CPU ours/native per run", "pooled", "95% interval"):
        table.add_column(col, justify="left" if col in ("model", "pair") else "right")
    keys = list(dict.fromkeys((r["model"], r["d"], r["pair"], r["W"]) for rows in runs for r in rows))
    for key in keys:
        found = [r for rows in runs for r in rows if (r["model"], r["d"], r["pair"], r["W"]) == key]
        # each run's steps over its own native median: the machine's speed drifts between runs,
        # and mixing raw times would weigh the slower runs' steps as if they were the pair's
        ours = [t / statistics.median(r["native_s"]) for r in found for t in r["ours_s"]]
        native = [t / statistics.median(r["native_s"]) for r in found for t in r["native_s"]]
        table.add_row(key[0], str(key[1]), key[2], str(key[3]), ", ".join(f"{r['ratio']:.2f}" for r in found),
                      ", ".join(f"{r['ours_cpu_s'] / r['native_cpu_s']:.2f}" for r in found),
                      f"{statistics.median(ours) / statistics.median(native):.3f}",
                      interval_text(ratio_interval(ours, native)))
    Console(width=200).print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    ap.add_argument("--sizes", default="128,256", help="d_model values (heads of 64)")
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks (with embedding and head: 8 modules)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length T")
    ap.add_argument("--mb", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--pairs", default="", help="comma-separated pair names (default: all)")
    ap.add_argument("--reps", type=int, default=5, help="alternated repetitions per side")
    ap.add_argument("--steps", type=int, default=1, help="steps per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="steps per side before timing (the first: the fingerprints)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                    help="how our side's activations and gradients travel (the engine's default: auto, shared "
                         "memory on one host)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke run: d_model 64, T=16, W=4, pairs {QUICK_PAIRS}, 1 repetition")
    ap.add_argument("--json", default="", help="write every measurement here")
    ap.add_argument("--schedules", default="", help=f"write schedule CSVs here and add the pairs {FILE_PAIRS}")
    ap.add_argument("--pool", default="", help="comma-separated --json files of earlier runs: print each pair's "
                                               "ratio per run and over all their steps pooled, then exit")
    args = ap.parse_args(argv)
    if args.pool:
        return pool(args.pool.split(","))
    # the root's output (the logits) is a view; nothing writes into it (inherited by the workers)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if args.quick:
        args.sizes, args.seq, args.mb, args.reps, args.steps, args.warmup = "64", 16, 1, 1, 1, 1
        args.pairs = args.pairs or QUICK_PAIRS
    every = PAIRS + (file_pairs(args.schedules) if args.schedules else [])
    pairs = [p for p in every if not args.pairs or p.name in args.pairs.split(",")]
    if args.quick:
        pairs = [p for p in pairs if p.W <= 4]
    for p in [p for p in pairs if runnable(p)]:
        print(f"{p.name} skipped: {runnable(p)}", flush=True)
    pairs = [p for p in pairs if not runnable(p)]
    sizes = [Size(m, int(d), args.layers, args.seq, args.mb)
             for m in args.models.split(",") for d in args.sizes.split(",")]
    console = Console(width=260)
    table = Table(title=f"ours vs PyTorch native on transformers ({args.backend}, ours over {args.transport}, "
                        f"{os.cpu_count()} cores, "
                        f"one thread per process; median of {args.reps} x {args.steps} steps; L={args.layers}, "
                        f"T={args.seq}, mb={args.mb})")
    for col in ("model", "d", "pair", "native", "W", "ours ms (med / min)", "native ms (med / min)", "ours/native",
                "95% interval", "CPU ms ours / native", "predicted ms", "pred/meas", "loss ours / native",
                "|g0| ours / native", "agree"):
        table.add_column(col, justify="left" if col in ("model", "pair", "native") else "right")
    rows, failed, started = [], False, time.perf_counter()
    for size in sizes:
        grads = {S: stage_bytes(build(size, S, torch.device("cpu"))[0]) for S in {p.S for p in pairs}}
        for p in pairs:
            result = launch(run_pair, p.W, p, size, args.reps, args.steps, args.warmup, args.transport,
                            backend=args.backend,
                            timeout=120, deadline=900)[0]
            ours, native = result["times"]["ours"], result["times"]["native"]
            (lo, go), (ln, gn) = result["fingerprints"]["ours"], result["fingerprints"]["native"]
            agree = _rel(lo, ln) <= TOLERANCE and _rel(go, gn) <= TOLERANCE
            failed |= not agree
            pred = predicted(p, size, grads[p.S], result)
            row = {"model": MODELS[size.model], "d": size.d, "layers": size.layers, "T": size.T, "mb": size.mb,
                   "pair": p.name, "native": NATIVE_NAMES[p.native], "W": p.W, "S": p.S, "B": p.B,
                   "ours_median_s": statistics.median(ours), "ours_min_s": min(ours),
                   "native_median_s": statistics.median(native), "native_min_s": min(native),
                   "ratio": statistics.median(ours) / statistics.median(native), "predicted_s": pred,
                   "ours_cpu_s": statistics.median(result["cpus"]["ours"]),
                   "native_cpu_s": statistics.median(result["cpus"]["native"]),
                   "predicted_over_measured": pred / statistics.median(ours), "loss": [lo, ln], "g0": [go, gn],
                   "loss_rel_diff": _rel(lo, ln), "g0_rel_diff": _rel(go, gn), "agree": agree, "link": result["link"]}
            row["cpu_ratio"] = row["ours_cpu_s"] / row["native_cpu_s"]
            row["ours_s"], row["native_s"] = ours, native  # every timed step, for medians pooled over runs
            row["ratio_interval"] = ratio_interval(ours, native)
            rows.append(row)
            table.add_row(row["model"], str(size.d), p.name, NATIVE_NAMES[p.native], str(p.W),
                          f"{row['ours_median_s'] * 1e3:.1f} / {row['ours_min_s'] * 1e3:.1f}",
                          f"{row['native_median_s'] * 1e3:.1f} / {row['native_min_s'] * 1e3:.1f}",
                          f"{row['ratio']:.2f}", interval_text(row["ratio_interval"]),
                          f"{row['ours_cpu_s'] * 1e3:.0f} / {row['native_cpu_s'] * 1e3:.0f}",
                          f"{pred * 1e3:.1f}", f"{row['predicted_over_measured']:.2f}",
                          f"{lo:.6f} / {ln:.6f}", f"{go:.6g} / {gn:.6g}",
                          "yes" if agree else f"NO ({max(row['loss_rel_diff'], row['g0_rel_diff']):.1e})")
            print(f"{row['model']} d={size.d} {p.name}: ours/native {row['ratio']:.2f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    console.print(table)
    wall = time.perf_counter() - started
    print(f"wall time {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "transport": args.transport, "cores": os.cpu_count(),
                       "torch": torch.__version__, "reps": args.reps, "steps": args.steps, "warmup": args.warmup,
                       "wall_s": wall, "rows": rows}, f, indent=1)
    if failed:
        print(f"fingerprints disagree by more than {TOLERANCE:g} relative on some pair", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
