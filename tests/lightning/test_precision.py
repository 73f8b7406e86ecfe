"""Mixed precision under UnifiedStrategy against Lightning's single-device strategy in the same
precision: bf16-mixed under every scheme, bf16-true under two, and the traffic it saves (weights,
activations and their gradients cross in bf16: exactly half the bytes of 32-true; weight-gradient
sums stay fp32). 16-mixed and unknown precisions are refused before any worker starts on CPU.

Tolerance. bf16 keeps 8 significant bits, so nothing here is bit-exact: the engine casts stage
inputs to bf16 at every stage boundary (single-device keeps the residual stream in fp32 there),
fetchers compute on a bf16 copy of the weights (layer norms and embeddings included, as FSDP's
``MixedPrecision(param_dtype=bf16)`` does) and micro-batches sum in another order. The yardstick is
what bf16 itself does to the same single-device run: ``GAP`` = relative distance between the
parameter updates of single-device bf16-mixed and 32-true (about 0.07 for this model). A scheme
passes when its update is within ``FACTOR * GAP`` of single-device bf16 (measured: 0.08 to 0.10,
about 1.5 GAP; a lost or doubled gradient would be about 1), and its loss curve within
``LOSS_TOL`` of single-device bf16's at every step (measured: under 1e-3 on a loss of 4.9).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.training import Keep, char_data, quiet_trainer, tiny_gpt
from launcher.lightning import UnifiedStrategy
from launcher.models import GPT

pytestmark = pytest.mark.timeout(240)

STEPS = 3
FACTOR = 3.0  # times the single-device bf16-vs-fp32 gap (see the module doc)
LOSS_TOL = 5e-3  # absolute, per step, on a cross-entropy of about 4.9

# (scheme, G, R, stages, microbatches): W = 2 (4 for fslpp), 4 modules (embedding, 2 blocks, head)
SCHEMES = {
    "ddp": ("ddp", None, None, 4, 2),
    "fsdp": ("fsdp", None, None, 4, 2),
    "gpipe": ("gpipe", None, None, 2, 2),
    "lpp": ("lpp", 1, 2, 4, 2),
    "fslpp": ("fslpp", 2, 2, 4, 4),
}


def fit(base: GPT, strategy, devices: int, precision: str, out: Path | None = None) -> tuple[GPT, Keep]:
    model, keep = copy.deepcopy(base), Keep(out)
    quiet_trainer(strategy, devices, precision=precision, max_steps=STEPS, limit_val_batches=0, gradient_clip_val=0.05,
                  callbacks=[keep]).fit(model, datamodule=char_data())
    return model, keep


@pytest.fixture(scope="module")
def base() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(max_steps=STEPS)


def update(base: GPT, model: GPT) -> torch.Tensor:
    """What training changed, flat, in float64."""
    a, b = base.state_dict(), model.state_dict()
    return torch.cat([(b[k].double() - a[k].double()).reshape(-1) for k in a])


def rel(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u - v).norm() / v.norm())


@pytest.fixture(scope="module")
def single(base):
    """Single-device runs (Lightning's default strategy), by precision: (update, losses)."""
    out = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        model, keep = fit(base, "auto", 1, precision)
        out[precision] = (update(base, model), keep.losses)
    return out


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    """UnifiedStrategy runs, made once each: (scheme, precision) -> (update, losses, per-rank dumps)."""
    cache: dict = {}

    def get(scheme: str, precision: str):
        if (scheme, precision) not in cache:
            name, G, R, S, B = SCHEMES[scheme]
            out = tmp_path_factory.mktemp(f"{scheme}-{precision}")
            st = UnifiedStrategy(name, G=G, R=R, stages=S, microbatches=B)
            model, _ = fit(base, st, st.workers, precision, out)
            ranks = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))]
            cache[(scheme, precision)] = (update(base, model), ranks[0]["losses"], ranks)
        return cache[(scheme, precision)]

    return get


def test_single_device_gap_is_bf16_sized(single):
    """The yardstick itself: bf16 moves the single-device result, but not wildly."""
    gap = rel(single["bf16-mixed"][0], single["32-true"][0])
    assert 1e-3 < gap < 0.3, gap


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_bf16_mixed_matches_single_device(single, runs, scheme):
    gap = rel(single["bf16-mixed"][0], single["32-true"][0])
    got, losses, ranks = runs(scheme, "bf16-mixed")
    want, want_losses = single["bf16-mixed"]
    assert rel(got, want) < FACTOR * gap, (rel(got, want), gap)
    assert len(losses) == len(want_losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) < LOSS_TOL, (losses, want_losses)


@pytest.mark.parametrize("scheme", ["fsdp", "gpipe"])
def test_bf16_true_matches_single_device(single, runs, scheme):
    """bf16-true: the module itself is bf16 (weights, gradients and optimizer state); the same
    yardstick, against single-device bf16-true."""
    gap = rel(single["bf16-mixed"][0], single["32-true"][0])
    got, losses, _ = runs(scheme, "bf16-true")
    want, want_losses = single["bf16-true"]
    assert rel(got, want) < FACTOR * gap, (rel(got, want), gap)
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) < LOSS_TOL, (losses, want_losses)


def _recv_bytes(ranks: list[dict]) -> dict[str, int]:
    """Bytes received over the whole run, by message kind, summed over workers (measured)."""
    total: dict[str, int] = defaultdict(int)
    for r in ranks:
        for rec in r["records"]:
            for kind, n in rec.get("measured_only", {}).get("recv_bytes", {}).items():
                total[kind] += n
    return dict(total)


def test_bf16_mixed_halves_the_traffic(runs):
    """FSLPP moves every kind of message. Under bf16-mixed the weights fetched, the activations and
    their gradients are bf16: exactly half the bytes of 32-true in the same run; the weight-gradient
    sums stay fp32 (the same bytes). The engine's prediction (``Engine.sizes``) says the same."""
    half, full = _recv_bytes(runs("fslpp", "bf16-mixed")[2]), _recv_bytes(runs("fslpp", "32-true")[2])
    for kind in ("weights", "act", "grad"):
        assert full[kind] > 0 and 2 * half[kind] == full[kind], (kind, half, full)
    assert half["wgrad"] == full["wgrad"] > 0
    for precision in ("bf16-mixed", "32-true"):
        ranks = runs("fslpp", precision)[2]
        for r in ranks:
            predicted: dict[str, int] = defaultdict(int)
            for kind, dst, n in r["predicted"]:
                if dst == r["worker"]:
                    predicted[kind] += n * STEPS
            measured = _recv_bytes([r])
            assert {k: v for k, v in predicted.items() if v} == {k: v for k, v in measured.items() if v}


def test_fetched_weights_are_bf16_and_masters_fp32(runs):
    """FSDP under bf16-mixed: every weight message is half the fp32 size of its stage."""
    half, full = _recv_bytes(runs("fsdp", "bf16-mixed")[2]), _recv_bytes(runs("fsdp", "32-true")[2])
    assert 2 * half["weights"] == full["weights"] > 0


def test_refused_before_any_worker():
    from launcher.preflight import preflight as _preflight

    for overrides, sentence in ((["trainer.precision=16-mixed"], "trainer.precision=16-mixed is invalid with "
                                 "trainer.accelerator=cpu: fp16 mixed precision needs a GPU"),
                                (["trainer.precision=fp8"], "trainer.precision=fp8 is invalid: use one of "
                                 "lightning's precisions")):
        _, found = _preflight(overrides)
        assert len(found.fatal) == 1 and sentence in found.fatal[0], found.fatal
    for ok in ("bf16-mixed", "bf16-true", "32-true", "64-true"):
        assert not _preflight([f"trainer.precision={ok}"])[1].fatal


def test_engine_compute_dtype_from_the_plugin():
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    from launcher.lightning.precision import compute_dtype

    assert compute_dtype(MixedPrecision("bf16-mixed", "cpu")) is torch.bfloat16
    assert compute_dtype(HalfPrecision("bf16-true")) is None  # the module itself is bf16
    assert compute_dtype(DoublePrecision()) is None


def _loss_scale_and_scaler() -> dict:
    """One rank of :func:`test_loss_scale_and_synced_scaler` (16-mixed's machinery, on CPU)."""
    from launcher.lightning.precision import _SyncedScaler
    from launcher.runtime import Engine
    from launcher.runtime.oracle import mlp_batches, staged_mlp
    from launcher.schedule import make_schedule

    # the engine's backward on a scaled loss: fetched weights and weight-gradient sums (FSDP), float64
    engine = Engine(staged_mlp(2), make_schedule("fsdp", 2, 2, G=2, R=1))
    mbs = mlp_batches(2)
    engine.compute_step(mbs)
    plain = {s: g.clone() for s, g in engine.last_grads.items()}
    engine.loss_scale = 8.0
    engine.compute_step(mbs)
    exact = all(torch.equal(engine.last_grads[s], 8 * plain[s]) for s in plain)
    # the scaler: rank 0 overflows, rank 1 holds no gradient at all; both must skip and back off
    p = torch.nn.Parameter(torch.ones(3))
    if dist.get_rank() == 0:
        p.grad = torch.tensor([1.0, float("inf"), 1.0])
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = _SyncedScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # what the strategy's backward does (the precision plugin's pre_backward)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return {"exact": exact, "stepped": not torch.equal(p.detach(), torch.ones(3)), "scale": float(scaler.get_scale())}


def test_loss_scale_and_synced_scaler():
    """16-mixed needs a GPU here, but its two pieces run anywhere: the engine's backward on the
    GradScaler's scale gives exactly ``scale`` times the gradients (a power of two, float64), and
    the scaler skips the step on every worker when any worker's gradients overflow."""
    from launcher.runtime import launch

    for r in launch(_loss_scale_and_scaler, 2, timeout=20, deadline=120):
        assert r == {"exact": True, "stepped": False, "scale": 4.0}, r


@pytest.mark.slow
def test_metrics_losses_keep_the_loss_precision_of_one_device(tmp_path: Path) -> None:
    """A model whose weights are float64 under the default 32-true (``model.dtype=float64``) has a
    float64 loss on one device; ``metrics.json`` reports it at that precision under a scheme too,
    not cast to the trainer's nominal float32."""
    import json

    from helpers.cli import run_launcher

    common = ["model=hf", "model.config.num_hidden_layers=2", "model.config.hidden_size=16",
              "model.config.intermediate_size=32", "model.config.num_attention_heads=2",
              "model.config.num_key_value_heads=1", "model.dtype=float64", "stages=2", "microbatches=2",
              "data.batch_size=4", "data.seq_len=8", "data.chars=2000", "trainer.max_steps=2",
              "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.enable_checkpointing=false",
              "logger=none"]
    got = {}
    for name, scheme in {"single": ["strategy=single"], "gpipe": ["strategy=gpipe", "G=1", "R=2"]}.items():
        run = tmp_path / name
        p = run_launcher(*scheme, *common, f"hydra.run.dir={run}", cwd=tmp_path, timeout=200)
        assert p.returncode == 0, p.stderr[-3000:]
        metrics = json.loads((run / "metrics.json").read_text())
        got[name] = [s["loss"] for s in metrics["steps"]] + [v["val_loss"] for v in metrics["val"]]
    one, scheme = got["single"], got["gpipe"]
    assert len(one) == 3 and any(x != float(torch.tensor(x, dtype=torch.float32)) for x in one)  # float64 values
    assert max(abs(a - b) for a, b in zip(one, scheme)) < 1e-12, (one, scheme)
