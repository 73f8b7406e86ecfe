"""The GPU check: one command that exercises the CUDA and NCCL path and writes what it found.

    scripts/gpu_check.sh                              # on a CUDA machine: at most 8 minutes, one GPU is enough
    python benchmarks/gpu_check.py --out DIR          # the same; DIR/gpu_check.json and DIR/gpu_check.txt
    python benchmarks/gpu_check.py --dry-run          # every part on CPU at tiny sizes, in seconds (the tests)

Parts, in order; each has its own time budget and starts only if that budget fits in what is left
of ``--budget`` (else it is skipped, with the reason in the JSON); a launch that overruns its
budget is stopped and the part fails:

1. ``nccl``: NCCL at world size 1 (set-up, an all-reduce, a broadcast, an all-gather, a barrier)
   and the engine under it (``ddp``, W=1) against one device, float32;
2. ``oracle``: every scheme (ddp, fsdp, gpipe, lpp, fslpp, interleaved 1F1B, ZB-H1 with the split
   backward, ``recompute=full``) in float32 and bf16-mixed, on the built-in GPT's stages (S=4,
   B=4, SGD with momentum, 3 steps), against plain training with gradient accumulation on the
   same device and the same micro-batches. float32 passes when the largest gradient difference
   is under ``FP32_TOL`` of the largest gradient, and the same for the parameters (summation
   order is all that differs). bf16-mixed passes when the engine's parameter update is within
   ``BF16_FACTOR`` times the single-device bf16-vs-fp32 gap of single-device bf16's update (the
   yardstick of ``tests/lightning/test_precision.py``: the engine casts stage outputs to bf16 at every
   boundary, which single-device autocast does not);
3. ``overhead``: the engine on one worker against plain PyTorch on the same stages, a Llama of
   about 1 B parameters under bf16 autocast (fp32 master weights, AdamW): step time, tokens/s and
   MFU against the card's dense bf16 peak (H100 and H200 SXM 989 TFLOP/s, H100 PCIe 756), model FLOPs
   ``6 N + 12 L d T`` per token; beside it the step time the simulator predicts from what the
   worker measured (``vs_torch_native.replayed``) and the peak memory the planner's memory model
   predicts (``launcher.plan.memory``) against ``torch.cuda.max_memory_allocated``;
4. ``native``: ``vs_native_transformer.py --backend nccl --quick`` when there are 4 GPUs (one
   NCCL rank per GPU); on fewer, its DDP pair at W=1 under NCCL (the same harness and fingerprints).

Several workers on one GPU: gloo. NCCL refuses two ranks on one device ("Duplicate GPU
detected"). gloo's collectives take CUDA tensors (they copy through pinned host memory), but its
``send``/``recv`` read the tensor's pointer as host memory, so the engine's point-to-point
messages go through pinned host buffers whenever the backend is gloo and the tensor is on a GPU
(:func:`launcher.runtime.comm.isend`). The workers share the one GPU (their kernels interleave).

CUDA is initialised only in the forked workers: this process asks NVML for the device count
(``torch.cuda.device_count``), since a child of a process that initialised CUDA cannot use it.
Exit status 1 when a part failed.
"""

from __future__ import annotations

import os

# before torch is imported: torch.cuda.is_available() asks NVML, so nothing here initialises CUDA before a fork
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vs_native_transformer as vt  # noqa: E402 - the benchmarks' own directory, put on the path above
import vs_torch_native as vn  # noqa: E402
from scale_memory import descendants  # noqa: E402

from launcher.report.measured_costs import stage_job_seconds  # noqa: E402
from launcher.runtime import Engine, StagedModel, launch  # noqa: E402
from launcher.runtime.oracle import flat_params, reference_step  # noqa: E402
from launcher.schedule import make_step, simulate  # noqa: E402

FP32_TOL = 1e-5  # float32: largest difference over the largest value (gradients; parameters)
HARD_GRACE = 30.0  # seconds past a part's budget before the check calls it hung and stops
BF16_FACTOR = 3.0  # bf16-mixed: times single-device bf16's own distance from float32
#: dense bf16 FLOP/s by a part of the card's name, first match: the SXM cards (H200 has H100's compute), PCIe
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12}
S, B = 4, 4  # the oracle's stages and micro-batches


@dataclass(frozen=True)
class Scheme:
    """One oracle case's schedule (``W = G * R`` workers)."""

    name: str
    scheme: str
    G: int
    R: int
    order: str = "1f1b"
    split: bool = False
    recompute: bool = False

    def step(self, S: int, B: int) -> Any:
        return make_step(self.scheme, S, B, G=self.G, R=self.R, order=self.order, split_backward=self.split,
                         recompute="full" if self.recompute else None)


SCHEMES = [
    Scheme("ddp", "ddp", 4, 1), Scheme("fsdp", "fsdp", 4, 1), Scheme("gpipe", "gpipe", 1, 4, "breadth_first"),
    Scheme("lpp", "lpp", 2, 2), Scheme("fslpp", "fslpp", 2, 2),
    Scheme("interleaved-1f1b", "lpp", 1, 2, "interleaved_1f1b"),  # looped: stages {0, 2} and {1, 3}
    Scheme("zb_h1", "gpipe", 1, 4, "zb_h1", split=True),
    Scheme("recompute-full", "gpipe", 1, 4, "1f1b", recompute=True),
]
PRECISIONS = ("32-true", "bf16-mixed")


@dataclass(frozen=True)
class Sizes:
    """What each part runs: the oracle's GPT, the overhead's Llama (S stages, B micro-batches),
    timed steps after warm-up, the native pair's GPT, and each part's budget in seconds."""

    oracle: vt.Size
    oracle_steps: int
    llama: vt.Size
    llama_S: int
    llama_B: int
    steps: int
    warmup: int
    native: vt.Size
    budgets: dict[str, float] = field(default_factory=dict)


# Llama 1 B: d 2048, 22 layers, 16 heads of 128 (8 KV heads), MLP 5504; vocabulary 128 (the benchmark's)
GPU = Sizes(oracle=vt.Size("gpt", 128, 2, 64, 2), oracle_steps=3, llama=vt.Size("llama", 2048, 22, 1024, 2),
            llama_S=4, llama_B=4, steps=10, warmup=3, native=vt.Size("gpt", 256, 6, 128, 2),
            budgets={"nccl": 60, "oracle": 150, "overhead": 180, "native": 60})
DRY = Sizes(oracle=vt.Size("gpt", 32, 2, 8, 2), oracle_steps=2, llama=vt.Size("llama", 64, 2, 16, 1),
            llama_S=2, llama_B=2, steps=2, warmup=1, native=vt.Size("gpt", 32, 2, 8, 1),
            # the CPU's parts take seconds; generous bounds, so that a loaded machine skips nothing
            budgets={"nccl": 150, "oracle": 500, "overhead": 200, "native": 150})


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


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


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


def _oracle_case(sc: Scheme, precision: str, size: vt.Size, steps: int, device: torch.device,
                 B: int = B) -> dict[str, Any]:
    """This rank's side of one case: the engine beside plain training (float32, and bf16-mixed
    when asked) on the same device; errors on the stages it owns."""
    bf16 = precision == "bf16-mixed"
    stages, loss, _ = vt.build(size, S, device)
    engine = Engine(StagedModel(stages, loss), sc.step(S, B), _sgd, device=device,
                    compute_dtype=torch.bfloat16 if bf16 else None)
    refs = {}
    for kind in ("32-true", "bf16-mixed") if bf16 else ("32-true",):
        ref = StagedModel(vt.build(size, S, device)[0], loss)
        refs[kind] = (ref, _sgd([p for m in ref.stages for p in m.parameters()]))
    x, y = vt.build_batch(size, B, device)
    mbs = list(zip(x.chunk(B), y.chunk(B)))
    start = {s: flat_params(m).clone() for s, m in engine.modules.items()}
    out: dict[str, Any] = {"owned": list(engine.owned), "grad_abs": 0.0, "grad_ref": 0.0, "param_abs": 0.0,
                           "param_ref": 0.0, "loss": [], "ref_loss": []}
    for _ in range(steps):
        with _autocast(device, bf16):
            rec = engine.train_step(mbs)
        out["loss"].append(rec.get("measured_only", {}).get("loss", 0.0) if rec else 0.0)
        for kind, (ref, opt) in refs.items():
            with _autocast(device, kind == "bf16-mixed"):
                grads, ref_loss = reference_step(ref, opt, mbs)
            if kind != precision:
                continue
            out["ref_loss"].append(ref_loss)
            for s in engine.owned:
                g = grads[s].to(device)
                out["grad_abs"] = max(out["grad_abs"], float((engine.last_grads[s] - g).abs().max()))
                out["grad_ref"] = max(out["grad_ref"], float(g.abs().max()))
    per_stage = {}
    for s in engine.owned:
        mine = flat_params(engine.modules[s])
        want = flat_params(refs[precision][0].stages[s])
        out["param_abs"] = max(out["param_abs"], float((mine - want).abs().max()))
        out["param_ref"] = max(out["param_ref"], float(want.abs().max()))
        if bf16:  # updates, in float64: the engine's, single-device bf16's, single-device float32's
            u = (mine.double() - start[s].double())
            u16 = want.double() - start[s].double()
            u32 = flat_params(refs["32-true"][0].stages[s]).double() - start[s].double()
            per_stage[s] = [float((u - u16).square().sum()), float((u16 - u32).square().sum()),
                            float(u16.square().sum())]
    out["per_stage"] = per_stage
    return out


def oracle_worker(size: vt.Size, steps: int, deadline: float, on_gpu: bool) -> dict[str, Any]:
    """Every case on this rank (ranks at or above a case's W sit it out, as in
    :mod:`launcher.runtime.oracle`); rank 0 decides, for all, whether time is left for the next."""
    device = _device(on_gpu)
    out: dict[str, Any] = {"card": _card(device), "cases": []}
    for sc in SCHEMES:
        for precision in PRECISIONS:
            go = torch.tensor([1 if time.time() < deadline else 0])
            dist.broadcast(go, 0)  # the same decision on every rank, or the ranks would wait on each other
            if not int(go):
                out["cases"].append(None)
                continue
            t = time.perf_counter()
            case = _oracle_case(sc, precision, size, steps, device)
            case["seconds"] = time.perf_counter() - t
            out["cases"].append(case)
    return out


def nccl_worker(size: vt.Size, on_gpu: bool) -> dict[str, Any]:
    """World size 1: the backend's collectives, then the engine (ddp, W=1) against one device."""
    device = _device(on_gpu)
    t = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    gathered = [torch.empty_like(t)]
    dist.all_gather(gathered, t)
    dist.barrier()
    _sync(device)
    collectives_ok = bool(torch.equal(gathered[0].cpu(), torch.arange(4, dtype=torch.float32)))
    case = _oracle_case(Scheme("ddp-w1", "ddp", 1, 1), "32-true", size, 2, device, B=1)  # DDP: W = B
    return {"card": _card(device), "collectives_ok": collectives_ok, **case}


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
    engine = Engine(StagedModel(stages, loss), simulate(make_step("lpp", S, Bm, G=1, R=1)), vt.adamw,
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
    """The parts' results and the clock of the whole check. Every part's result is written to
    ``gpu_check.json`` as soon as it ends, and each step to ``gpu_check.log``, so that a check cut
    short (by a hung part or the machine's limit) still leaves what it found."""

    def __init__(self, budget: float, dry: bool, out: Path, info: dict[str, Any] | None = None) -> None:
        self.budget, self.dry, self.out = budget, dry, out
        self.t0 = time.perf_counter()
        self.info = info or {}  # what the JSON says beside the parts (sizes, tolerances, GPUs)
        self.card: dict[str, Any] = {}
        self.parts: dict[str, dict[str, Any]] = {}
        self.rows: list[tuple[str, str, str, str, str]] = []  # part, check, measured, bound, result

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def log(self, message: str) -> None:
        """One line, with the seconds since the start, to standard error and ``gpu_check.log``."""
        line = f"[{time.perf_counter() - self.t0:6.1f} s] {message}"
        print(line, file=sys.stderr, flush=True)
        with open(self.out / "gpu_check.log", "a") as f:
            f.write(line + "\n")

    def result(self) -> dict[str, Any]:
        return {"dry_run": self.dry, "card": self.card, "budget_s": self.budget,
                "wall_s": time.perf_counter() - self.t0, **self.info,
                "summary": {k: v["status"] for k, v in self.parts.items()}, "parts": self.parts}

    def save(self) -> dict[str, Any]:
        """Write ``gpu_check.json`` with what is known now (written whole, then renamed)."""
        result = self.result()
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")
        return result

    def part(self, name: str, budget: float, fn: Callable[[float], dict[str, Any]]) -> None:
        """Run one part if its budget fits in what is left; record passed, failed or skipped. A part
        still running ``HARD_GRACE`` seconds after its budget (a hang that its own bounds did not
        catch) fails, and the check stops there: :meth:`_hung`."""
        if self.left() < budget:
            self.parts[name] = {"status": "skipped", "budget_s": budget,
                                "reason": f"its budget of {budget:g} s does not fit in the {self.left():.0f} s left"}
            self.rows.append((name, "-", "-", "-", "skipped"))
            self.log(f"{name}: skipped ({self.parts[name]['reason']})")
            self.save()
            return
        self.log(f"{name}: started (budget {budget:g} s)")
        t = time.perf_counter()
        guard = threading.Timer(budget + HARD_GRACE, self._hung, args=(name, budget, t))
        guard.daemon = True
        guard.start()
        try:
            res = fn(budget)
            res.setdefault("status", "passed")
        except Exception as e:  # noqa: BLE001 - a part's failure is its result; the others still run
            res = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            self.rows.append((name, "error", str(e).splitlines()[0][:80] if str(e) else type(e).__name__, "-",
                              "FAILED"))
        finally:
            guard.cancel()
        res.update(seconds=time.perf_counter() - t, budget_s=budget)
        self.parts[name] = res
        self.log(f"{name}: {res['status']} ({res['seconds']:.0f} s)" +
                 (f": {res['reason']}" if res["status"] == "failed" else ""))
        self.save()

    def _hung(self, name: str, budget: float, t: float) -> None:
        """The part ``name`` overran its budget by ``HARD_GRACE`` s: record it as failed, write the
        JSON and the table, stop every process this one started, and exit with status 1."""
        reason = (f"still running {HARD_GRACE:g} s after its budget of {budget:g} s (a hang); the check was "
                  "stopped here, and the parts after it did not run")
        self.parts[name] = {"status": "failed", "reason": reason, "seconds": time.perf_counter() - t,
                            "budget_s": budget}
        self.rows.append((name, "hang", reason[:80], "-", "FAILED"))
        self.log(f"{name}: FAILED: {reason}")
        try:
            _table(self, self.save(), self.out)
        finally:
            _kill_descendants()
            os._exit(1)

    def row(self, part: str, check: str, measured: str, bound: str, ok: bool | None) -> bool:
        self.rows.append((part, check, measured, bound, "-" if ok is None else "pass" if ok else "FAILED"))
        return ok is not False


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def part_nccl(run: Run, on_gpu: bool, backend: str, sizes: Sizes) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        r = launch(nccl_worker, 1, sizes.oracle, on_gpu, backend=backend, timeout=budget, deadline=budget)[0]
        run.card = r["card"]
        ok = run.row("nccl", f"{backend} W=1: all_reduce, broadcast, all_gather, barrier", "equal" if
                     r["collectives_ok"] else "differ", "exact", r["collectives_ok"])
        g, p = r["grad_abs"] / max(r["grad_ref"], 1e-30), r["param_abs"] / max(r["param_ref"], 1e-30)
        ok &= run.row("nccl", "engine ddp W=1, fp32, vs one device", f"grad {g:.1e}, param {p:.1e} (rel)",
                      f"< {FP32_TOL:g}", g < FP32_TOL and p < FP32_TOL)
        return {"status": "passed" if ok else "failed", **r}
    return go


def part_oracle(run: Run, on_gpu: bool, sizes: Sizes) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        W = max(sc.G * sc.R for sc in SCHEMES)
        deadline = time.time() + budget - 20  # the last case starts with time to finish
        ranks = launch(oracle_worker, W, sizes.oracle, sizes.oracle_steps, deadline, on_gpu, backend="gloo",
                       timeout=budget, deadline=budget)
        rows, ok, i = [], True, 0
        for sc in SCHEMES:
            for precision in PRECISIONS:
                w = sc.G * sc.R
                got = [r["cases"][i] for r in ranks[:w]]
                i += 1
                row: dict[str, Any] = {**asdict(sc), "scheme": sc.name, "strategy": sc.scheme, "precision": precision,
                                       "W": w}
                if any(g is None for g in got):
                    row.update(status="skipped", reason="the oracle part's budget ran out before this case")
                    run.row("oracle", f"{sc.name} {precision} W={w}", "-", "-", None)
                    rows.append(row)
                    continue
                owned = sorted({s for g in got for s in g["owned"]})
                loss, ref = sum(g["loss"][-1] for g in got), got[0]["ref_loss"][-1]
                row.update(owned=owned, loss=loss, ref_loss=ref, loss_rel=_rel(loss, ref),
                           seconds=max(g["seconds"] for g in got))
                if precision == "32-true":
                    gabs, pabs = max(g["grad_abs"] for g in got), max(g["param_abs"] for g in got)
                    grel = gabs / max(max(g["grad_ref"] for g in got), 1e-30)
                    prel = pabs / max(max(g["param_ref"] for g in got), 1e-30)
                    passed = owned == list(range(S)) and grel < FP32_TOL and prel < FP32_TOL
                    row.update(grad_max_abs=gabs, grad_rel=grel, param_max_abs=pabs, param_rel=prel,
                               bound=f"rel < {FP32_TOL:g}")
                    measured, bound = f"grad {gabs:.1e} ({grel:.1e} rel), param {pabs:.1e} ({prel:.1e} rel)", \
                        f"rel < {FP32_TOL:g}"
                else:
                    stages: dict[int, list[float]] = {}
                    for g in got:
                        for s, v in g["per_stage"].items():
                            stages.setdefault(int(s), v)
                    d2, g2, n2 = (sum(v[k] for v in stages.values()) for k in range(3))
                    rel, gap = (d2 / n2) ** 0.5 if n2 else float("inf"), (g2 / n2) ** 0.5 if n2 else float("inf")
                    passed = owned == list(range(S)) and rel < BF16_FACTOR * gap
                    row.update(update_rel=rel, bf16_gap=gap, bound=f"< {BF16_FACTOR:g} x gap")
                    measured, bound = f"update {rel:.3f} rel (gap {gap:.3f})", f"< {BF16_FACTOR:g} x gap"
                row["status"] = "passed" if passed else "failed"
                ok &= run.row("oracle", f"{sc.name} {precision} W={w}", measured, bound, passed)
                rows.append(row)
        run.card = run.card or ranks[0]["card"]
        return {"status": "passed" if ok else "failed", "backend": "gloo", "card": ranks[0]["card"], "cases": rows}
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


def part_native(run: Run, on_gpu: bool, backend: str, sizes: Sizes, gpus: int) -> Callable[[float], dict[str, Any]]:
    def go(budget: float) -> dict[str, Any]:
        if on_gpu and gpus >= 4:  # one NCCL rank per GPU: the benchmark itself
            path = run.out / "vs_native_transformer.json"
            rc = vt.main(["--backend", "nccl", "--quick", "--json", str(path)])
            rows = json.loads(path.read_text())["rows"]
            for r in rows:
                run.row("native", f"{r['pair']} nccl W={r['W']}: ours/native", f"{r['ratio']:.2f}",
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
        run.row("native", f"ddp-w1 {backend} (DistributedDataParallel, GPT d={size.d}): fingerprints",
                f"loss {lo:.6f} / {ln:.6f}", f"{vt.TOLERANCE:g} rel", agree)
        run.row("native", "step ms ours / native (ratio)", f"{ours * 1e3:.2f} / {native * 1e3:.2f} "
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
    ap.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.txt")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole check, parts that do "
                    "not fit are skipped (default: 480 on a GPU, 1000 for the dry run)")
    ap.add_argument("--parts", default="nccl,oracle,overhead,native", help="comma-separated parts to run")
    args = ap.parse_args(argv)
    gpus = torch.cuda.device_count()  # NVML: no CUDA initialisation here
    if not args.dry_run and gpus == 0:
        print("gpu_check: no CUDA GPU is visible; use --dry-run to run every part on CPU", file=sys.stderr)
        return 2
    on_gpu, sizes = not args.dry_run, DRY if args.dry_run else GPU
    backend = "nccl" if on_gpu else "gloo"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"gpus": gpus, "tolerances": {"fp32_rel": FP32_TOL, "bf16_factor_of_gap": BF16_FACTOR},
            "sizes": {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in asdict(sizes).items()}}
    run = Run(args.budget if args.budget is not None else 1000.0 if args.dry_run else 480.0, args.dry_run, out, info)
    (out / "gpu_check.log").write_text("")
    run.log(f"gpu_check: torch {torch.__version__}, {gpus} GPU(s) visible, backend {backend}, budget {run.budget:g} s")
    wanted = args.parts.split(",")
    parts = {"nccl": part_nccl(run, on_gpu, backend, sizes), "oracle": part_oracle(run, on_gpu, sizes),
             "overhead": part_overhead(run, on_gpu, backend, sizes),
             "native": part_native(run, on_gpu, backend, sizes, gpus)}
    for name, fn in parts.items():
        if name in wanted:
            run.part(name, sizes.budgets[name], fn)
    result = run.save()
    _table(run, result, out)
    return 1 if any(v["status"] == "failed" for v in run.parts.values()) else 0


def _table(run: Run, result: dict[str, Any], out: Path) -> None:
    """The readable table, printed and written to ``gpu_check.txt``."""
    from rich.console import Console
    from rich.table import Table

    card = result["card"]
    where = f"{card.get('name', '?')}, torch {card.get('torch', torch.__version__)}" + \
        (f", CUDA {card['cuda']}, NCCL {card.get('nccl')}" if card.get("cuda") else "")
    table = Table(title=f"GPU check{' (dry run on CPU)' if run.dry else ''}: {where}; "
                        f"{result['wall_s']:.0f} s of {result['budget_s']:.0f}")
    for col in ("part", "check", "measured", "bound", "result"):
        table.add_column(col)
    for r in run.rows:
        table.add_row(*r)
    for name, part in run.parts.items():
        table.add_row(name, "part", f"{part['status']} in {part.get('seconds', 0):.0f} s (budget "
                      f"{part['budget_s']:g} s)", part.get("reason", "") or "", part["status"])
    console = Console(width=200, record=True)
    console.print(table)
    (out / "gpu_check.txt").write_text(console.export_text())


if __name__ == "__main__":
    sys.exit(main())
