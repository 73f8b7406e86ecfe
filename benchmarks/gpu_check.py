"""The GPU check: the CUDA and NCCL path, in parts that each fit one short call and write their own file.

    scripts/gpu_check.sh --parts env                  # on a CUDA machine; one part per call (docs/performance.md)
    scripts/gpu_check.sh --dry-run --parts env,flagship   # the same code on CPU (gloo), tiny sizes (the tests)
    python benchmarks/gpu_check.py --parts overhead --out DIR   # DIR/overhead.json

Parts; each has its own time budget (at most 4 minutes on a GPU) and writes ``<out>/<part>.json``
when it starts, as it goes (partial results) and when it ends, also when it fails or is stopped:

1. ``env``: where each package the launcher imports comes from (the image's or the carried wheels,
   ``scripts/gpu_wheels.sh``) and the seconds each import takes; ``python -m launcher --help``;
   the card, CUDA and NCCL versions; NCCL at world size 1 (set-up, all-reduce, broadcast,
   all-gather, barrier);
2. ``flagship``: ``python -m launcher`` itself, as users run it (Hydra, Lightning, the launcher's
   strategy, ``logger=none``), on CUDA under NCCL at W=1: ddp, fsdp, gpipe, lpp with ``order=1f1b``
   and fslpp, each in float32 and bf16-mixed, against ``strategy=single`` (Lightning's
   single-device strategy) on the same config, with the time and memory the run predicted beside
   what it measured (its ``metrics.json``). The command needs one GPU per worker, so W>1 on one
   GPU runs the engine alone: :func:`launcher.runtime.oracle.run_cases` on 4 workers sharing the
   GPU over gloo (CUDA tensors staged through host memory), float64, against the oracle;
3. ``overhead``: the engine on one worker against plain PyTorch on the same stages, a Llama of
   about 1 B parameters under bf16 autocast (fp32 master weights, AdamW): step time, tokens/s and
   MFU against the card's dense bf16 peak (H100 and H200 SXM 989 TFLOP/s, H100 PCIe 756), model FLOPs
   ``6 N + 12 L d T`` per token; beside it the step time the simulator predicts from what the
   worker measured (``vs_torch_native.replayed``) and the peak memory the planner's memory model
   predicts (``launcher.plan.memory``) against ``torch.cuda.max_memory_allocated``;
4. ``benchmark``: ``vs_native_transformer.py --backend nccl --quick`` when there are 4 GPUs (one
   NCCL rank per GPU); on fewer, its DDP pair at W=1 under NCCL (the same harness and fingerprints).

CUDA is initialised only in the forked workers and the launcher's own processes: this process asks
NVML for the device count (``torch.cuda.device_count``), since a child of a process that
initialised CUDA cannot use it. Exit status 1 when a part failed, 2 when no GPU is visible
(without ``--dry-run``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import gc
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

# first, before torch: torch.cuda.is_available() asks NVML, so nothing here initialises CUDA before a fork
import nvml_first  # noqa: F401
import torch
import torch.distributed as dist
import vs_native_transformer as vt
import vs_torch_native as vn
from scale_memory import descendants

from launcher.report.measured_costs import stage_job_seconds
from launcher.runtime import Engine, launch
from launcher.runtime.oracle import Case, run_cases
from launcher.schedule import make_schedule, simulate
from launcher.torch_support.staged import StagedModel

PARTS = ("env", "flagship", "overhead", "benchmark")
#: flagship: a run's distance (L2 over every parameter) to strategy=single in the same precision, in units
#: of the gap between strategy=single in bf16-mixed and in float32 (what bf16 rounding alone moves). In
#: float32 only the order of sums differs, which AdamW's normalised steps still carry into the parameters:
#: 0.004 gaps on CPU; bf16-mixed casts at the stages' boundaries, which single-device autocast does not.
FP32_FACTOR = 0.05
BF16_FACTOR = 3.0
ENGINE_TOL = 1e-10  # the engine's W>1 cases: float64, as the test suite's oracle
HARD_GRACE = 30.0  # seconds past a part's budget before the check calls it hung and stops
#: dense bf16 FLOP/s by a part of the card's name, first match: the SXM cards (H200 has H100's compute), PCIe
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12}
#: what `python -m launcher` imports from outside the standard library (env: where each comes from)
IMPORTS = ("torch", "lightning", "hydra", "omegaconf", "antlr4", "numpy", "matplotlib", "rich", "jinja2", "yaml",
           "typing_extensions", "launcher")

#: flagship: three sweeps (``python -m launcher -m``), every scheme at W=1 (the command needs one GPU
#: per worker) beside strategy=single on the same settings, each in both precisions. DDP and FSDP have
#: W = microbatches and GPipe W = stages, hence their sizes; lpp at G=1 R=1 is one worker looping over
#: 4 stages in the 1F1B order. strategy=single comes last in each sweep: it trains in the launching
#: process, which then holds CUDA, and a worker forked from it afterwards could not use the GPU.
SWEEPS: dict[str, tuple[str, ...]] = {
    "B1": ("strategy=ddp,fsdp,single", "stages=4", "microbatches=1"),
    "pipelines": ("strategy=lpp,fslpp,single", "G=1", "R=1", "stages=4", "microbatches=4", "order=1f1b"),
    "gpipe": ("strategy=gpipe,single", "stages=1", "microbatches=4", "order=breadth_first"),
}
PRECISIONS = ("32-true", "bf16-mixed")
#: flagship's W>1 on one GPU: the engine alone, 4 workers over gloo (float64 MLP, SGD with momentum)
ENGINE_CASES = [Case("ddp", 4, 1, 4, 4), Case("fsdp", 4, 1, 4, 4), Case("gpipe", 1, 4, 4, 4, order="breadth_first"),
                Case("lpp", 2, 2, 4, 4), Case("fslpp", 2, 2, 4, 4),
                Case("gpipe", 1, 4, 4, 8, order="zb_h1", split=True), Case("lpp", 1, 2, 4, 4, order="interleaved_1f1b")]


@dataclass(frozen=True)
class Sizes:
    """What each part runs: the flagship's overrides (model and data sizes, steps) and how many
    commands run at once, the overhead's Llama (S stages, B micro-batches), timed steps after
    warm-up, the benchmark's GPT, and each part's budget in seconds."""

    flagship: tuple[str, ...]
    jobs: int
    llama: vt.Size
    llama_S: int
    llama_B: int
    steps: int
    warmup: int
    native: vt.Size
    budgets: dict[str, float] = field(default_factory=dict)


# the flagship at the launcher's defaults (GPT d=64, 6 blocks, batches of 32 x 64 characters, gradient
# clipping 1.0, dropout, shuffled data), 4 steps with validation after 2 and 4.
# Llama 1 B: d 2048, 22 layers, 16 heads of 128 (8 KV heads), MLP 5504; vocabulary 128 (the benchmark's)
GPU = Sizes(flagship=("trainer.max_steps=4", "trainer.val_check_interval=2"), jobs=3,
            llama=vt.Size("llama", 2048, 22, 1024, 2), llama_S=4, llama_B=4, steps=10, warmup=3,
            native=vt.Size("gpt", 256, 6, 128, 2),
            budgets={"env": 90, "flagship": 240, "overhead": 210, "benchmark": 90})
# the same commands, tiny: the CPU's parts take seconds; generous bounds, so that a loaded machine skips nothing
DRY = Sizes(flagship=("trainer.max_steps=2", "trainer.val_check_interval=2", "data.batch_size=8", "data.seq_len=8",
                      "data.chars=20000", "model.d_model=16", "model.n_head=2", "model.n_layer=2"), jobs=2,
            llama=vt.Size("llama", 64, 2, 16, 1), llama_S=2, llama_B=2, steps=2, warmup=1,
            native=vt.Size("gpt", 32, 2, 8, 1),
            budgets={"env": 150, "flagship": 500, "overhead": 200, "benchmark": 150})


# ---- in the workers ----------------------------------------------------------------------------
def _device(on_gpu: bool) -> torch.device:
    """This worker's device: the one GPU every worker shares (gloo or NCCL at W=1), else the CPU.
    float32 means float32 here: no TF32 in matrix products."""
    torch.set_num_threads(1)
    if not on_gpu:
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, on: bool) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _card(device: torch.device) -> dict[str, Any]:
    """What this worker runs on."""
    out: dict[str, Any] = {"torch": torch.__version__, "backend": dist.get_backend(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(name=torch.cuda.get_device_name(device), memory_bytes=p.total_memory,
                   capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
                   nccl=_nccl_version() if dist.get_backend() == "nccl" else None)
    else:
        out["name"] = "CPU"
    return out


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def collectives_worker(on_gpu: bool) -> dict[str, Any]:
    """World size 1 (NCCL on a GPU): set-up, then each collective the engine uses, timed."""
    t = time.perf_counter()
    device = _device(on_gpu)
    x = torch.arange(4, dtype=torch.float32, device=device)
    _sync(device)
    first = time.perf_counter() - t
    t = time.perf_counter()
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    gathered = [torch.empty_like(x)]
    dist.all_gather(gathered, x)
    dist.barrier()
    _sync(device)
    ok = bool(torch.equal(gathered[0].cpu(), torch.arange(4, dtype=torch.float32)))
    return {"card": _card(device), "collectives_ok": ok, "device_setup_s": first,
            "collectives_s": time.perf_counter() - t}


def engine_worker(cases: list[Case], deadline: float, on_gpu: bool) -> dict[str, Any]:
    """The runtime oracle's cases on this rank's device (every rank the same list; ranks at or
    above a case's W sit it out); rank 0 decides, for all, whether time is left for the next."""
    device = _device(on_gpu)
    out: dict[str, Any] = {"card": _card(device), "cases": []}
    for case in cases:
        go = torch.tensor([1 if time.time() < deadline else 0])
        dist.broadcast(go, 0)  # the same decision on every rank, or the ranks would wait on each other
        if not int(go):
            out["cases"].append(None)
            continue
        t = time.perf_counter()
        r = run_cases([case], device=device)[0]
        out["cases"].append({"case": r["case"], "grad_err": r["grad_err"], "param_err": r["param_err"],
                             "owned": r["owned"], "seconds": time.perf_counter() - t})
    return out


def _flops_per_token(size: vt.Size, params: int) -> float:
    """Model FLOPs of a training step per token: ``6 N`` for the weights, ``12 L d T`` for attention."""
    return 6.0 * params + 12.0 * size.layers * size.d * size.T


def _timed(step: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t


class _ForwardClock:
    """Each stage's forward time as the device saw it (CUDA events recorded by the module's forward
    hooks, read after the step's synchronisation; the host clock on a CPU), to set beside the
    forward jobs' times that the engine measures with the host clock."""

    def __init__(self, stages: list, device: torch.device) -> None:
        self.cuda, self.on = device.type == "cuda", False
        self.marks: dict[int, list[list[Any]]] = {s: [] for s in range(len(stages))}
        for s, m in enumerate(stages):
            m.register_forward_pre_hook(lambda mod, args, s=s: self._mark(s, False))
            m.register_forward_hook(lambda mod, args, out, s=s: self._mark(s, True))

    def _mark(self, s: int, end: bool) -> None:
        if not self.on:
            return
        if self.cuda:
            at: Any = torch.cuda.Event(enable_timing=True)
            at.record()
        else:
            at = time.perf_counter()
        if end:
            self.marks[s][-1][1] = at
        else:
            self.marks[s].append([at, None])

    def seconds(self) -> list[float]:
        """Per stage, the mean forward seconds (call after the device has finished)."""
        return [statistics.mean((a.elapsed_time(b) / 1e3) if self.cuda else b - a for a, b in marks) if marks else 0.0
                for marks in self.marks.values()]


def _ours(size: vt.Size, stages: list, loss: Any, mbs: list, S: int, steps: int, warmup: int,
          device: torch.device) -> dict[str, Any]:
    """The engine at its defaults (a world of one: every job of the step on this worker): its step
    times, losses and peak memory, and what the simulator and the memory model predict for them."""
    from launcher.plan import memory
    from launcher.plan.profile import Profile

    Bm = len(mbs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # what the device held before the step's state, beside the stages' weights (the batch)
    base = torch.cuda.memory_allocated(device) - sum(vt.stage_bytes(stages)) if device.type == "cuda" else 0
    engine = Engine(StagedModel(stages, loss), simulate(make_schedule("lpp", S, Bm, G=1, R=1)), vt.adamw,
                    device=device, compute_dtype=torch.bfloat16)
    records, opt_s = [], []

    def step() -> None:
        with _autocast(device, True):
            records.append(engine.compute_step(mbs))
        _sync(device)
        t = time.perf_counter()
        engine.install_grads()
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        _sync(device)
        opt_s.append(time.perf_counter() - t)

    times = [_timed(step, device) for _ in range(warmup)]
    clock = _ForwardClock(stages, device)  # after the warm-up: the engine's copies of the stages have no hooks
    clock.on = True
    times += [_timed(step, device) for _ in range(steps)]
    clock.on = False
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    with _autocast(device, True):  # the sizes the step had (activations in bf16)
        act = engine.activation_peaks(mbs)
        _, act_in, params = engine.sizes(mbs)
        saved = engine.saved_sizes(mbs)
    opt_bytes = {s: sum(v.numel() * v.element_size() for p in engine.modules[s].parameters()
                        for v in engine.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
                 for s in engine.owned}
    prof = Profile({}, 0.0, bytes={"params": tuple(params), "grads": tuple(params),
                                   "optimizer": tuple(opt_bytes.get(s, 0) for s in range(S)),
                                   "activation": tuple(max(a) for a in act_in), "saved": tuple(max(g) for g in saved)})
    tl = engine.lowered.timeline
    owned, fetched = memory.owned_and_fetched(tl)
    model_bytes = memory.worker_bytes(tl, prof, "step", list(engine.lowered.predicted["weights_peak_resident"]), owned,
                                      fetched, act)
    per_rank = [{"records": records[warmup:], "optimizer_s": opt_s[warmup:], "optimizer_cpu_s": opt_s[warmup:]}]
    pair = vn.Pair("one-worker", "lpp", 1, 1, S, Bm, "1f1b", False, "none")
    predicted = vt.predicted(pair, size, vt.stage_bytes(stages), {"per_rank": per_rank, "link": None,
                                                                  "barrier_s": 0.0})
    host_f = [d["F"] for d in stage_job_seconds(per_rank, ("F", "B"), S)]
    return {"step_s": statistics.median(times[warmup:]), "steps_s": times,
            "forward_s": {"engine_host_clock": host_f, "device": clock.seconds()},
            "losses": [r["measured_only"]["loss"] for r in records], "peak_memory_bytes": peak,
            "predicted_step_s": predicted, "predicted_memory_bytes": base + model_bytes[0],
            "predicted_activation_bytes": act[0],
            "measured_activation_bytes": records[-1]["measured_only"]["peak_activation_bytes"]}


def _plain(stages: list, loss: Any, mbs: list, steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Plain PyTorch on the same stages: in sequence, gradient accumulation under bf16 autocast, AdamW."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = torch.nn.Sequential(*stages).to(device)
    opt = vt.adamw(model.parameters())
    losses: list[float] = []

    def step() -> None:
        total = torch.zeros((), device=device)
        for xb, yb in mbs:
            with _autocast(device, True):
                part = loss(model(xb), yb) / len(mbs)
            part.backward()
            total += part.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))

    times = [_timed(step, device) for _ in range(warmup + steps)]
    return {"step_s": statistics.median(times[warmup:]), "steps_s": times, "losses": losses,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def overhead_worker(size: vt.Size, S: int, Bm: int, steps: int, warmup: int, on_gpu: bool) -> dict[str, Any]:
    """One worker: the engine and plain PyTorch on the same stages, one after the other (each side
    alone on the device, so each one's peak memory is its own), under bf16 autocast."""
    device = _device(on_gpu)
    with torch.device(device):  # built where it trains (a 1 B model's initialisation on a CPU is slow)
        stages, loss, _ = vt.build(size, S, device)
    spare = [m.to("cpu") for m in copy.deepcopy(stages)]  # the plain side's copy waits on the host
    x, y = vt.build_batch(size, Bm, device)
    mbs = list(zip(x.chunk(Bm), y.chunk(Bm)))
    n_params = sum(p.numel() for m in stages for p in m.parameters())
    out: dict[str, Any] = {"card": _card(device), "params": n_params, "tokens_per_step": x.numel(),
                           "flops_per_step": _flops_per_token(size, n_params) * x.numel()}
    out["ours"] = _ours(size, stages, loss, mbs, S, steps, warmup, device)
    del stages  # the engine held the only other reference
    gc.collect()  # whatever of the engine's state a cycle still holds goes before the plain side's peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["plain"] = _plain(spare, loss, mbs, steps, warmup, device)
    return out


def _kill_descendants() -> None:
    """SIGKILL every process descended from this one (``scale_memory.descendants``: from ``/proc``)."""
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- in this process ----------------------------------------------------------------------------
class Run:
    """The parts' results and the clock of the whole check. Each part's file ``<part>.json`` is
    written when the part starts, whenever it reports progress (:meth:`progress`) and when it
    ends, and each step goes to ``gpu_check.log``, so that a check cut short (by a hung part or the
    machine's limit) still leaves what it found."""

    def __init__(self, budget: float, dry: bool, out: Path, info: dict[str, Any] | None = None) -> None:
        self.budget, self.dry, self.out = budget, dry, out
        self.t0 = time.perf_counter()
        self.info = info or {}  # what each part's JSON says beside its result (sizes, tolerances, GPUs)
        self.card: dict[str, Any] = {}
        self.parts: dict[str, dict[str, Any]] = {}
        self.rows: list[tuple[str, str, str, str, str]] = []  # part, check, measured, bound, result
        self.lock = threading.Lock()  # the flagship's commands report from several threads

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def log(self, message: str) -> None:
        """One line, with the seconds since the start, to standard error and ``gpu_check.log``."""
        line = f"[{time.perf_counter() - self.t0:6.1f} s] {message}"
        print(line, file=sys.stderr, flush=True)
        with open(self.out / "gpu_check.log", "a") as f:
            f.write(line + "\n")

    def save(self, name: str) -> dict[str, Any]:
        """Write ``<name>.json`` with what is known of that part now (written whole, then renamed)."""
        with self.lock:
            result = {"part": name, "dry_run": self.dry, "card": self.card, **self.info, **self.parts[name]}
            tmp = self.out / f"{name}.json.tmp"
            tmp.write_text(json.dumps(result, indent=1, default=str))
            tmp.replace(self.out / f"{name}.json")
        return result

    def progress(self, name: str, **partial: Any) -> None:
        """A part's results so far (the part is still running): into its file now."""
        with self.lock:
            self.parts[name].update(partial)
        self.save(name)

    def part(self, name: str, budget: float, fn: Callable[[float], dict[str, Any]]) -> None:
        """Run one part if its budget fits in what is left; record passed, failed or skipped. A part
        still running ``HARD_GRACE`` seconds after its budget (a hang that its own bounds did not
        catch) fails, and the check stops there: :meth:`_hung`."""
        if self.left() < budget:
            self.parts[name] = {"status": "skipped", "budget_s": budget,
                                "reason": f"its budget of {budget:g} s does not fit in the {self.left():.0f} s left"}
            self.rows.append((name, "-", "-", "-", "skipped"))
            self.log(f"{name}: skipped ({self.parts[name]['reason']})")
            self.save(name)
            return
        self.log(f"{name}: started (budget {budget:g} s)")
        self.parts[name] = {"status": "running", "budget_s": budget}
        self.save(name)
        t = time.perf_counter()
        guard = threading.Timer(budget + HARD_GRACE, self._hung, args=(name, budget, t))
        guard.daemon = True
        guard.start()
        try:
            res = fn(budget)
            res.setdefault("status", "passed")
        except Exception as e:  # noqa: BLE001 - a part's failure is its result; the others still run
            res = {**self.parts[name], "status": "failed", "reason": f"{type(e).__name__}: {e}"}
            self.rows.append((name, "error", str(e).splitlines()[0][:80] if str(e) else type(e).__name__, "-",
                              "FAILED"))
        finally:
            guard.cancel()
        res.update(seconds=time.perf_counter() - t, budget_s=budget)
        self.parts[name] = res = {**self.parts[name], **res}  # what it reported on the way, and its result
        self.log(f"{name}: {res['status']} ({res['seconds']:.0f} s)" +
                 (f": {res['reason']}" if res.get("reason") else ""))
        self.save(name)

    def _hung(self, name: str, budget: float, t: float) -> None:
        """The part ``name`` overran its budget by ``HARD_GRACE`` s: record it as failed (with what it
        reported so far), write its JSON and the table, stop every process this one started, and
        exit with status 1."""
        reason = (f"still running {HARD_GRACE:g} s after its budget of {budget:g} s (a hang); the check was "
                  "stopped here, and the parts after it did not run")
        self.parts[name] = {**self.parts.get(name, {}), "status": "failed", "reason": reason,
                            "seconds": time.perf_counter() - t, "budget_s": budget}
        self.rows.append((name, "hang", reason[:80], "-", "FAILED"))
        self.log(f"{name}: FAILED: {reason}")
        try:
            self.save(name)
            _table(self)
        finally:
            _kill_descendants()
            os._exit(1)

    def row(self, part: str, check: str, measured: str, bound: str, ok: bool | None) -> bool:
        with self.lock:
            self.rows.append((part, check, measured, bound, "-" if ok is None else "pass" if ok else "FAILED"))
        return ok is not False


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _where(module: str) -> dict[str, Any]:
    """One import, timed: its version and the folder it came from (the image's site-packages, or the
    carried wheels' ``--target``), or the error."""
    t = time.perf_counter()
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a missing package is the finding
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t}
    seconds = time.perf_counter() - t
    top = sys.modules[module.split(".")[0]]
    f = Path(top.__file__) if getattr(top, "__file__", None) else None
    return {"ok": True, "version": getattr(top, "__version__", None), "seconds": seconds,
            "from": None if f is None else str(f.parent.parent if f.name == "__init__.py" else f.parent)}


def part_env(run: Run, on_gpu: bool, backend: str) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        imports = {m: _where(m) for m in IMPORTS}
        for m in ("launcher.cli", "launcher.modes.train", "launcher.lightning", "wandb", "transformers"):
            imports[m] = _where(m)  # the command's own modules; wandb and transformers are optional
        run.progress("env", imports=imports, pythonpath=os.environ.get("PYTHONPATH", ""), python=sys.executable,
                     installed=os.environ.get("GPU_CHECK_INSTALLED"))  # by scripts/gpu_check.sh, if it had to
        ok = True
        for m in (*IMPORTS, "launcher.cli", "launcher.modes.train", "launcher.lightning"):
            r = imports[m]
            ok &= run.row("env", f"import {m}", f"{r.get('version') or ''} from {r.get('from')} "
                          f"({r['seconds']:.2f} s)" if r["ok"] else r["error"][:80], "imports", r["ok"])
        for m in ("wandb", "transformers"):
            run.row("env", f"import {m} (optional)", "yes" if imports[m]["ok"] else "no (logger=none)"
                    if m == "wandb" else "no", "-", None)
        t = time.perf_counter()
        # run where the flagship runs (not in the checkout's root, whose launcher/ lacks launcher.conf)
        p = subprocess.run([sys.executable, "-m", "launcher", "--help"], capture_output=True, text=True,
                           timeout=min(60.0, budget / 2), cwd=run.out)
        help_s = time.perf_counter() - t
        helped = p.returncode == 0 and "strategy" in p.stdout
        ok &= run.row("env", "python -m launcher --help", f"exit {p.returncode} ({help_s:.1f} s)", "exit 0", helped)
        run.progress("env", help={"returncode": p.returncode, "seconds": help_s, "stderr": p.stderr[-2000:]})
        t = time.perf_counter()
        r = launch(collectives_worker, 1, on_gpu, backend=backend, timeout=budget, deadline=budget)[0]
        r["launch_s"] = time.perf_counter() - t
        run.card = r["card"]
        ok &= run.row("env", f"{backend} W=1: all_reduce, broadcast, all_gather, barrier", "equal" if
                      r["collectives_ok"] else "differ", "exact", r["collectives_ok"])
        run.row("env", f"seconds: {backend} W=1 up, device set-up, collectives",
                f"{r['launch_s']:.1f}, {r['device_setup_s']:.2f}, {r['collectives_s']:.3f}", "-", None)
        if on_gpu:
            c = r["card"]
            ok &= run.row("env", "card", f"{c.get('name')}, {c.get('memory_bytes', 0) / 2**30:.0f} GiB, "
                          f"CUDA {c.get('cuda')}, NCCL {c.get('nccl')}", "a CUDA device",
                          c["device"].startswith("cuda"))
        return {"status": "passed" if ok else "failed", "imports": imports, "help_s": help_s, **r}
    return go


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a run's ``last.ckpt`` (a file or a sharded directory), in float64
    on the CPU (nothing here initialises CUDA)."""
    from launcher.checkpoint import load

    sd = load(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    return {k: v.double() for k, v in sd.items() if torch.is_floating_point(v)}


def _points(sweep_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The points of a sweep that have ended, by (scheme, precision): status, directory, and the
    step time and peak memory their metrics.json predicted beside what it measured."""
    found = {}
    for path in sorted(sweep_dir.glob("*/metrics.json")):
        try:
            m = json.loads(path.read_text())
        except ValueError:  # still being written
            continue
        run_ = m.get("run") or {}
        precision = str(((m.get("config") or {}).get("trainer") or {}).get("precision"))
        pw = m.get("per_worker") or {}
        found[str(run_.get("scheme")), precision] = {
            "scheme": run_.get("scheme"), "precision": precision, "status": m.get("status"), "dir": str(path.parent),
            "point": run_.get("point"), "latency_s": m.get("latency_s"), "memory_kind": m.get("memory_kind"),
            "peak_memory_bytes": pw.get("peak_memory_bytes"),
            "loss": m["steps"][-1]["loss"] if m.get("steps") else None}
    return found


def _sweep(name: str, on_gpu: bool, sizes: Sizes, root: Path, deadline: float,
           report: Callable[[str, dict[str, Any]], None]) -> dict[str, Any]:
    """One sweep of ``python -m launcher -m`` to its end (stopped at ``deadline``), its points
    reported as they end: exit code, seconds, each point's result."""
    d = root / name
    cmd = [sys.executable, "-m", "launcher", "-m", *SWEEPS[name], f"trainer.precision={','.join(PRECISIONS)}",
           *sizes.flagship, f"trainer.accelerator={'gpu' if on_gpu else 'cpu'}", "logger=none",
           f"hydra.sweep.dir={d}"]
    out: dict[str, Any] = {"sweep": name, "command": "python -m launcher " + " ".join(cmd[3:]), "dir": str(d)}
    t = time.perf_counter()
    with open(root / f"{name}.stdout", "w") as so, open(root / f"{name}.stderr", "w") as se:
        p = subprocess.Popen(cmd, cwd=root, stdout=so, stderr=se,
                             start_new_session=True)  # its own group: a stop reaches the launcher's workers too
        seen = 0
        while p.poll() is None:
            if time.time() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                out["reason"] = "stopped: the flagship's budget ran out"
                break
            time.sleep(1.0)
            points = _points(d)
            if len(points) > seen:
                seen = len(points)
                report(name, {**out, "points": list(points.values())})
    out.update(returncode=p.returncode, seconds=time.perf_counter() - t, points=list(_points(d).values()))
    if p.returncode != 0:
        out["stderr"] = (root / f"{name}.stderr").read_text()[-3000:]
    return out


def _compare(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Each scheme's point against strategy=single's in the same sweep and precision: the distance
    between their parameters in units of strategy=single's own bf16-mixed-to-float32 gap (and the
    largest difference, reported)."""
    points = {(p["scheme"], p["precision"]): p for p in sweep["points"]}
    states: dict[tuple[str, str], dict[str, torch.Tensor] | None] = {}

    def state(key: tuple[str, str]) -> dict[str, torch.Tensor] | None:
        if key not in states:
            p = points.get(key)
            states[key] = _state(Path(p["dir"])) if p is not None and p["status"] == "ok" else None
        return states[key]

    rows = []
    for scheme in [s.split("=")[1] for s in SWEEPS[sweep["sweep"]] if s.startswith("strategy=")][0].split(","):
        if scheme == "single":
            continue
        for precision in PRECISIONS:
            p = points.get((scheme, precision), {})
            row = {"scheme": scheme, "precision": precision, "sweep": sweep["sweep"],
                   **{k: p.get(k) for k in ("status", "latency_s", "peak_memory_bytes", "memory_kind", "loss")}}
            mine, ref = state((scheme, precision)), state(("single", precision))
            ref32, ref16 = state(("single", "32-true")), state(("single", "bf16-mixed"))
            if mine is None or ref is None:
                row.update(result="failed", reason="this point or its strategy=single did not end with a checkpoint")
            elif mine.keys() != ref.keys():
                row.update(result="failed", reason=f"parameters differ from strategy=single's: "
                           f"{sorted(set(mine) ^ set(ref))[:4]}")
            elif ref32 is None or ref16 is None:
                row.update(result="failed", reason="strategy=single did not end in both precisions (the yardstick)")
            else:
                far = sum((mine[k] - ref[k]).square().sum().item() for k in ref) ** 0.5
                gap = sum((ref16[k] - ref32[k]).square().sum().item() for k in ref) ** 0.5
                diff = max((mine[k] - ref[k]).abs().max().item() for k in ref)
                factor = FP32_FACTOR if precision == "32-true" else BF16_FACTOR
                row.update(distance=far, bf16_gap=gap, param_max_abs=diff, bound=f"< {factor:g} x gap",
                           result="passed" if 0 < gap and far < factor * gap else "failed")
            rows.append(row)
    return rows


def part_flagship(run: Run, on_gpu: bool, sizes: Sizes) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        root = run.out / "flagship"
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        deadline = t0 + budget * 2 / 3  # the sweeps; the engine's W>1 cases get what is left
        sweeps: dict[str, dict[str, Any]] = {}

        def report(name: str, partial: dict[str, Any]) -> None:
            sweeps[name] = partial
            run.progress("flagship", sweeps=dict(sweeps))

        with concurrent.futures.ThreadPoolExecutor(sizes.jobs) as pool:
            futures = {pool.submit(_sweep, n, on_gpu, sizes, root, deadline, report): n for n in SWEEPS}
            for f in concurrent.futures.as_completed(futures):
                r = f.result()
                sweeps[futures[f]] = r
                run.log(f"flagship: sweep {r['sweep']}: exit {r['returncode']} in {r['seconds']:.1f} s, "
                        f"{len(r['points'])} points{': ' + r['reason'] if r.get('reason') else ''}")
                run.progress("flagship", sweeps=dict(sweeps))
        sweeps = {n: sweeps[n] for n in SWEEPS}
        ok = all(s["returncode"] == 0 for s in sweeps.values())
        rows = [row for s in sweeps.values() for row in _compare(s)]
        for r in rows:
            name = f"{r['scheme']}{' (1f1b)' if r['scheme'] == 'lpp' else ''} {r['precision']} W=1"
            if "distance" in r:
                measured = (f"distance {r['distance']:.1e} = {r['distance'] / r['bf16_gap']:.3f} gap; "
                            f"max {r['param_max_abs']:.0e}")
            else:
                measured = r.get("reason", "-")[:80]
            ok &= run.row("flagship", f"python -m launcher {name} vs strategy=single", measured,
                          r.get("bound", "-"), r["result"] == "passed")
            lat, mem = r.get("latency_s") or {}, r.get("peak_memory_bytes") or {}
            if lat.get("predicted") is not None:
                pm, mm = (mem.get("predicted") or [0])[0], (mem.get("measured") or [0])[0]
                run.row("prediction", f"{name}: step ms; peak MiB ({r.get('memory_kind')}), predicted / measured",
                        f"{lat['predicted'] * 1e3:.1f} / {lat['measured'] * 1e3:.1f}; "
                        f"{(pm or 0) / 2**20:.0f} / {(mm or 0) / 2**20:.0f}", "-", None)
        run.progress("flagship", sweeps=sweeps, oracle=rows)
        # W>1 on the one GPU: the engine alone, its workers sharing the device over gloo
        left = budget - (time.time() - t0) - 10
        engine: dict[str, Any] = {"status": "skipped", "reason": "no time left in the flagship's budget"}
        if torch.cuda.is_initialized():  # reading the checkpoints must not have: the workers are forked
            engine = {"status": "failed", "reason": "CUDA was initialised in the checking process; forked "
                      "workers could not use it"}
            ok &= run.row("flagship", "engine W=4 gloo", "-", engine["reason"], False)
        elif left > 20:
            W = max(c.G * c.R for c in ENGINE_CASES)
            ranks = launch(engine_worker, W, ENGINE_CASES, time.time() + left - 10, on_gpu, backend="gloo",
                           timeout=left, deadline=left)
            cases = []
            for i, c in enumerate(ENGINE_CASES):
                got = [r["cases"][i] for r in ranks[:c.G * c.R]]
                if any(g is None for g in got):
                    cases.append({"case": c.name, "status": "skipped", "reason": "the budget ran out"})
                    run.row("flagship", f"engine {c.name} W={c.G * c.R} gloo", "-", "-", None)
                    continue
                g_err, p_err = max(g["grad_err"] for g in got), max(g["param_err"] for g in got)
                owned = sorted({s for g in got for s in g["owned"]})
                passed = owned == list(range(c.S)) and g_err < ENGINE_TOL and p_err < ENGINE_TOL
                cases.append({"case": c.name, "W": c.G * c.R, "grad_err": g_err, "param_err": p_err,
                              "status": "passed" if passed else "failed"})
                ok &= run.row("flagship", f"engine {c.name} W={c.G * c.R} gloo, float64 vs oracle",
                              f"grad {g_err:.1e}, param {p_err:.1e}", f"< {ENGINE_TOL:g}", passed)
            engine = {"status": "passed" if all(c["status"] != "failed" for c in cases) else "failed",
                      "backend": "gloo", "card": ranks[0]["card"], "cases": cases}
            run.card = run.card or ranks[0]["card"]
        else:
            run.row("flagship", "engine W=4 gloo", "-", engine["reason"], None)
        return {"status": "passed" if ok else "failed", "sweeps": sweeps, "oracle": rows, "engine_w4": engine}
    return go


def part_overhead(run: Run, on_gpu: bool, backend: str, sizes: Sizes) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        r = launch(overhead_worker, 1, sizes.llama, sizes.llama_S, sizes.llama_B, sizes.steps, sizes.warmup,
                   on_gpu, backend=backend, timeout=budget, deadline=budget)[0]
        ours, plain, card = r["ours"], r["plain"], r["card"]
        run.card = run.card or card
        ratio = ours["step_s"] / plain["step_s"]
        peak = next((v for k, v in PEAK_BF16.items() if k in card.get("name", "")), None)
        mfu = {k: r["flops_per_step"] / side["step_s"] / peak if peak else None
               for k, side in (("ours", ours), ("plain", plain))}
        r.update(ratio=ratio, peak_bf16_flops=peak, mfu=mfu,
                 tokens_per_s={"ours": r["tokens_per_step"] / ours["step_s"],
                               "plain": r["tokens_per_step"] / plain["step_s"]})
        name = f"Llama {r['params'] / 1e9:.2f} B, bf16-mixed, S={sizes.llama_S} B={sizes.llama_B}"
        agree = _rel(ours["losses"][0], plain["losses"][0]) < 1e-2  # bf16: the same step, not the same bits
        ok = run.row("overhead", f"{name}: first-step loss ours / plain",
                     f"{ours['losses'][0]:.4f} / {plain['losses'][0]:.4f}", "1e-2 rel", agree)
        run.row("overhead", "step ms ours / plain (ratio)",
                f"{ours['step_s'] * 1e3:.1f} / {plain['step_s'] * 1e3:.1f} ({ratio:.3f})", "-", None)
        run.row("overhead", "tokens/s ours / plain",
                f"{r['tokens_per_s']['ours']:.0f} / {r['tokens_per_s']['plain']:.0f}", "-", None)
        run.row("overhead", "MFU ours / plain", f"{mfu['ours']:.3f} / {mfu['plain']:.3f}" if peak else "n/a",
                f"peak {peak / 1e12:.0f} TFLOP/s bf16" if peak else f"no peak known for {card.get('name')}", None)
        run.row("prediction", "step ms predicted / measured (ours, W=1)",
                f"{ours['predicted_step_s'] * 1e3:.1f} / {ours['step_s'] * 1e3:.1f} "
                f"({ours['predicted_step_s'] / ours['step_s']:.2f})", "-", None)
        mem = ours["peak_memory_bytes"]
        run.row("prediction", "peak memory GB predicted / measured (ours)",
                f"{ours['predicted_memory_bytes'] / 1e9:.2f} / " +
                (f"{mem / 1e9:.2f} ({ours['predicted_memory_bytes'] / mem:.2f})" if mem else "n/a on CPU"),
                "max_memory_allocated", None)
        fw = ours["forward_s"]
        run.row("prediction", "forward ms per stage: engine's job clock (host) / device",
                ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in zip(fw["engine_host_clock"], fw["device"])),
                "-", None)
        run.row("prediction", "activation bytes predicted / measured (the engine's meter)",
                f"{ours['predicted_activation_bytes']} / {ours['measured_activation_bytes']}", "-", None)
        return {"status": "passed" if ok else "failed", **r}
    return go


def part_benchmark(run: Run, on_gpu: bool, backend: str, sizes: Sizes, gpus: int) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        if on_gpu and gpus >= 4:  # one NCCL rank per GPU: the benchmark itself
            path = run.out / "vs_native_transformer.json"
            rc = vt.main(["--backend", "nccl", "--quick", "--json", str(path)])
            rows = json.loads(path.read_text())["rows"]
            for r in rows:
                run.row("benchmark", f"{r['pair']} nccl W={r['W']}: ours/native", f"{r['ratio']:.2f}",
                        "fingerprints 1e-6", r["agree"])
            return {"status": "passed" if rc == 0 else "failed", "rows": rows}
        p = vn.Pair("ddp-w1", "ddp", 1, 1, 4, 1, "1f1b", False, "ddp")
        size = sizes.native
        result = launch(vt.run_pair, 1, p, size, sizes.steps, 1, sizes.warmup, backend=backend, timeout=budget,
                        deadline=budget)[0]
        ours, native = statistics.median(result["times"]["ours"]), statistics.median(result["times"]["native"])
        (lo, go_), (ln, gn) = result["fingerprints"]["ours"], result["fingerprints"]["native"]
        agree = vn._rel(lo, ln) <= vt.TOLERANCE and vn._rel(go_, gn) <= vt.TOLERANCE
        pred = vt.predicted(p, size, vt.stage_bytes(vt.build(size, p.S, torch.device("cpu"))[0]), result)
        run.row("benchmark", f"ddp-w1 {backend} (DistributedDataParallel, GPT d={size.d}): fingerprints",
                f"loss {lo:.6f} / {ln:.6f}", f"{vt.TOLERANCE:g} rel", agree)
        run.row("benchmark", "step ms ours / native (ratio)", f"{ours * 1e3:.2f} / {native * 1e3:.2f} "
                f"({ours / native:.2f})", "-", None)
        run.row("prediction", "step ms predicted / measured (ddp-w1)", f"{pred * 1e3:.2f} / {ours * 1e3:.2f}", "-",
                None)
        why = None if gpus >= 4 else f"{gpus} GPU(s): the benchmark's pairs need 4 NCCL ranks, one per GPU"
        return {"status": "passed" if agree else "failed", "pair": asdict(p), "ours_s": ours, "native_s": native,
                "ratio": ours / native, "predicted_s": pred, "fingerprints": result["fingerprints"],
                "why_w1": why}
    return go


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every part on CPU (gloo), tiny sizes, in seconds")
    ap.add_argument("--out", default="gpu_check", help="folder for <part>.json, gpu_check.log and gpu_check.txt")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts to run, in order, of "
                    f"{', '.join(PARTS)}; on a GPU one part per call (docs/performance.md)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole check; a part whose budget "
                    "does not fit in what is left is skipped (default: the sum of the parts' budgets, and 10 s)")
    args = ap.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown or not wanted:
        print(f"gpu_check: --parts={args.parts} is invalid: use a comma-separated list of {', '.join(PARTS)}.",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()  # NVML: no CUDA initialisation here
    if not args.dry_run and gpus == 0:
        print("gpu_check: no CUDA GPU is visible; use --dry-run to run the parts on CPU", file=sys.stderr)
        return 2
    on_gpu, sizes = not args.dry_run, DRY if args.dry_run else GPU
    backend = "nccl" if on_gpu else "gloo"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = {"gpus": gpus, "tolerances": {"flagship_fp32_factor_of_gap": FP32_FACTOR,
                                         "flagship_bf16_factor_of_gap": BF16_FACTOR, "engine_float64": ENGINE_TOL},
            "sizes": {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in asdict(sizes).items()}}
    budget = args.budget if args.budget is not None else sum(sizes.budgets[p] for p in wanted) + 10
    run = Run(budget, args.dry_run, out, info)
    with open(out / "gpu_check.log", "a") as f:
        f.write("")
    run.log(f"gpu_check: torch {torch.__version__}, {gpus} GPU(s) visible, backend {backend}, parts "
            f"{','.join(wanted)}, budget {run.budget:g} s")
    parts = {"env": part_env(run, on_gpu, backend), "flagship": part_flagship(run, on_gpu, sizes),
             "overhead": part_overhead(run, on_gpu, backend, sizes),
             "benchmark": part_benchmark(run, on_gpu, backend, sizes, gpus)}
    for name in wanted:
        run.part(name, sizes.budgets[name], parts[name])
    _table(run)
    return 1 if any(v["status"] == "failed" for v in run.parts.values()) else 0


def _table(run: Run) -> None:
    """The readable table of this call's parts, printed and written to ``gpu_check.txt``."""
    from rich.console import Console
    from rich.table import Table

    card = run.card
    where = f"{card.get('name', '?')}, torch {card.get('torch', torch.__version__)}" + \
        (f", CUDA {card['cuda']}, NCCL {card.get('nccl')}" if card.get("cuda") else "")
    table = Table(title=f"GPU check{' (dry run on CPU)' if run.dry else ''}: {where}; "
                        f"{time.perf_counter() - run.t0:.0f} s of {run.budget:.0f}")
    for col in ("part", "check", "measured", "bound", "result"):
        table.add_column(col)
    for r in run.rows:
        table.add_row(*r)
    for name, part in run.parts.items():
        table.add_row(name, "part", f"{part['status']} in {part.get('seconds', 0):.0f} s (budget "
                      f"{part['budget_s']:g} s)", part.get("reason", "") or "", part["status"])
    console = Console(width=200, record=True)
    console.print(table)
    (run.out / "gpu_check.txt").write_text(console.export_text())


if __name__ == "__main__":
    sys.exit(main())
