"""A weight tied across stages (GPT-2's ``lm_head`` is its token embedding: one parameter of the first
and the last stage) under the launcher's defaults, gradient clipping on: every scheme, order and
precision clips by the norm one device computes, counting and scaling the tied weight once.

- through the command line, at the defaults (``trainer.gradient_clip_val`` as in
  ``conf/trainer/default.yaml``, GPT-2's own dropout, ``G``/``R`` as the config gives them), all
  five schemes as one Hydra multirun: each ``last.ckpt`` equals one device's training as
  ``strategy=single`` runs it (float64, within 1e-10);
- through the Python API, orders and placements that put the tie's uses elsewhere (both on one
  worker, on replicated owners, a split backward with deferred weight gradients, a custom order),
  with weight decay on, so an update of the tied weight applied twice would show;
- under bf16-mixed and 16-mixed, where no float64 oracle exists: the gradients each worker steps
  with are the unclipped ones times ``clip / (norm + 1e-6)``, with ``norm`` the 2-norm over the
  model's parameters, each counted once.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.cli import run_launcher
from helpers.oracle import composed, single_device
from helpers.training import char_data, last_state, load_checkpoint, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import HFCausalLM

pytestmark = pytest.mark.timeout(400)

TOL = 1e-10
STEPS = 3
#: the launcher's default clipping threshold (the Python API's tests use it too)
CLIP = float(composed([]).trainer.gradient_clip_val)
GPT2 = dict(n_layer=2, n_embd=32, n_head=4)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
COMMAND = ["stages=4", "microbatches=4", f"trainer.max_steps={STEPS}", "trainer.precision=64-true",
           f"trainer.val_check_interval={STEPS}", "logger=none", "model=hf", "model.arch=gpt2",
           *(f"model.config.{k}={v}" for k, v in GPT2.items()),
           "data.batch_size=8", "data.seq_len=8", "data.chars=20000"]
SCHEMES = ["ddp", "fsdp", "gpipe", "lpp", "fslpp"]


class GradNorms(L.Callback):
    """One device: the 2-norm of the whole module's gradient before clipping, per step, and the
    bytes of its training state at the end (parameters, gradients, optimizer state)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.state_bytes = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = sum(p.numel() * p.element_size() for p in pl_module.parameters())  # a tied one once
        opt = sum(v.numel() * v.element_size() for st in trainer.optimizers[0].state.values() for v in st.values()
                  if torch.is_tensor(v))
        self.state_bytes = 2 * params + opt


@pytest.mark.slow
def test_tied_gpt2_every_scheme_at_the_defaults_equals_single_device(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    p = run_launcher("-m", f"strategy={','.join(SCHEMES)}", *COMMAND, f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                     timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    norms = GradNorms()
    want = single_device([*COMMAND, "strategy=single"], callbacks=[norms])
    # the launcher clips by default, and the clipping bites at every step: a tied weight counted
    # twice would clip by another norm
    assert CLIP > 0 and len(norms.norms) == STEPS and min(norms.norms) > CLIP, norms.norms
    for i, scheme in enumerate(SCHEMES):
        got = last_state(sweep / str(i))
        assert got.keys() == want.keys(), scheme
        assert max((got[k].double() - want[k].double()).abs().max().item() for k in want) < TOL, scheme
        # the model's training state in metrics.json holds the tied weight once, as one device does
        metrics = json.loads((sweep / str(i) / "metrics.json").read_text())
        assert metrics["per_worker"]["owned_state_bytes"]["total"] == norms.state_bytes, scheme


def reverse_stages(s: int, b: int, d: str) -> tuple[int, int]:
    """A custom order: the higher stage first, then the older micro-batch."""
    return (-s, b)


def gpt2(weight_decay: float = 0.0) -> HFCausalLM:
    """Tied GPT-2 for the Python API's cases, its dropout off: they isolate clipping and weight
    decay over orders and placements (dropout stays on in the command-line test above, and every
    scheme's draws are tests/runtime/test_random_streams.py's)."""
    torch.manual_seed(0)
    return HFCausalLM(arch="gpt2", config={**GPT2, **NO_DROPOUT}, max_steps=STEPS, weight_decay=weight_decay)


def trainer(strategy="auto", devices: int = 1, precision: str | None = "64-true", max_steps: int = STEPS,
            **kw) -> L.Trainer:
    """3 steps, clipped at the launcher's default threshold, no validation."""
    return quiet_trainer(strategy, devices, max_steps=max_steps, limit_val_batches=0, gradient_clip_val=CLIP,
                         **({"precision": precision} if precision else {}), **kw)


# weight decay on: AdamW decays each owner's copy of the tied weight, once per step
DECAY = 0.1


def fit_and_save(strategy, devices: int, out: Path, callbacks=()) -> dict:
    """Tied GPT-2 with weight decay trained 3 steps; its ``last.ckpt``."""
    checkpoint = ModelCheckpoint(dirpath=out, save_last=True)
    trainer(strategy, devices, enable_checkpointing=True, callbacks=[checkpoint, *callbacks]).fit(
        gpt2(DECAY), datamodule=char_data())
    return load_checkpoint(out / "last.ckpt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[float]]:
    norms, single = GradNorms(), StreamedSingleDevice(microbatches=4)  # as strategy=single trains
    return fit_and_save(single, 1, tmp_path_factory.mktemp("single"), [norms]), norms.norms


CASES = {
    # name: (scheme, G, R, keywords): where the tied weight's two uses (stages 0 and 3) live
    "ddp": ("ddp", None, None, {}),  # one parameter of two stages on every worker
    "fsdp-depth_first": ("fsdp", None, None, {"order": "depth_first"}),  # two owners, fetched by all
    "gpipe-zb_h1": ("gpipe", None, None, {"order": "zb_h1", "split_backward": True}),  # deferred W jobs
    "lpp-one-worker": ("lpp", 1, 3, {}),  # stages 0 and 3 both on worker 0
    "lpp-custom-order": ("lpp", 2, 2, {"order": reverse_stages}),  # replicated owners, a custom order
    "fslpp-breadth_first": ("fslpp", 2, 2, {"order": "breadth_first"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tied_gpt2_with_clipping_and_decay_equals_single_device(name: str, reference, tmp_path: Path) -> None:
    """The parameters and the optimizer state in ``last.ckpt``: the tied weight's AdamW state once,
    in the single-device layout, as one device has it."""
    want, norms = reference
    assert min(norms) > CLIP, norms  # the clipping bites at every step
    scheme, G, R, kw = CASES[name]
    st = UnifiedStrategy(scheme, G=G, R=R, stages=4, microbatches=4, **kw)
    got = fit_and_save(st, st.workers, tmp_path)
    assert max_diff(want["state_dict"], got["state_dict"]) < TOL
    a, b = want["optimizer_states"][0], got["optimizer_states"][0]
    assert a["param_groups"] == b["param_groups"]  # numbered as one device numbers them, the tie once
    assert a["state"].keys() == b["state"].keys()
    assert max((a["state"][i][k].double() - b["state"][i][k].double()).abs().max().item()
               for i in a["state"] for k in a["state"][i]) < TOL


def test_metrics_count_a_tied_parameter_once(reference, tmp_path: Path) -> None:
    """``metrics.json``'s training state per worker and in total: worker 0 holds both uses of the
    tied weight (stages 0 and 3 under LPP G=1, R=3), its value and optimizer state once but each
    stage's gradient sum apart; the model's total holds it once, as one device does."""
    from launcher.lightning.metrics_callback import RunMetrics

    st = UnifiedStrategy("lpp", G=1, R=3, stages=4, microbatches=4)
    metrics = RunMetrics(tmp_path, {}, {"scheme": "lpp"})
    trainer(st, st.workers, callbacks=[metrics]).fit(gpt2(DECAY), datamodule=char_data())
    got = json.loads((tmp_path / "metrics.json").read_text())["per_worker"]["owned_state_bytes"]
    model = gpt2(DECAY).double()  # float64 as trained; a stage per module of model.stages
    params = list(model.parameters())  # the optimizer's numbering: the tied weight once
    state = reference[0]["optimizer_states"][0]["state"]
    opt = {id(p): sum(v.numel() * v.element_size() for v in state[i].values() if torch.is_tensor(v))
           for i, p in enumerate(params)}

    def nbytes(ps) -> int:
        return sum(p.numel() * p.element_size() for p in ps)

    def held(stages: list[int]) -> int:
        once = {id(p): p for s in stages for p in model.stages[s].parameters()}
        return (nbytes(once.values()) + sum(nbytes(model.stages[s].parameters()) for s in stages)
                + sum(opt[k] for k in once))

    assert len(state) == len(params) and got["predicted"] == [held([0, 3]), held([1]), held([2])]
    assert got["total"] == 2 * nbytes(params) + sum(opt.values())


class ClipRecord(L.Callback):
    """Each worker's gradients before clipping and as the optimizer stepped with them (read after
    its step: the optimizer's own step runs the closure that computes and clips them), by the full
    module's parameter names, saved to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps, self.before = out, [], {}

    def _grads(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
        layout = trainer.strategy.layout
        return {layout.canonical(n): p.grad.detach().double().clone() for n, p in module.named_parameters()
                if p.grad is not None and not n.startswith("_launcher")}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def after(*_) -> None:
            self.steps.append((self.before, self._grads(trainer, pl_module)))

        trainer.optimizers[0].register_step_post_hook(after)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self.before = self._grads(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.steps, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("scheme", ["ddp", "gpipe"])
def test_mixed_precision_clips_each_parameter_once(scheme: str, precision: str, tmp_path: Path) -> None:
    """DDP holds the tied weight once per worker (one parameter of two stages), GPipe on two
    workers (one copy each): every copy is scaled once, by the coefficient of the model's norm.
    16-mixed clips what its GradScaler has unscaled."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    st = UnifiedStrategy(scheme, stages=4, microbatches=4)
    # the plugin itself: Lightning's "16-mixed" on a CPU accelerator falls back to bf16-mixed
    plugin = MixedPrecision(precision, "cpu")
    assert (plugin.scaler is not None) == (precision == "16-mixed")
    trainer(st, st.workers, precision=None, max_steps=2, plugins=[plugin], callbacks=[ClipRecord(tmp_path)]).fit(
        gpt2(), datamodule=char_data())
    ranks = [torch.load(f, weights_only=False) for f in sorted(tmp_path.glob("rank*.pt"))]
    assert len(ranks) == st.workers
    tied = "stages.0.tokens.weight"  # also stages.3.lm_head.weight
    for step in range(2):
        before: dict[str, torch.Tensor] = {}
        after: dict[str, torch.Tensor] = {}
        for r in ranks:
            b, a = r[step]
            for n in b:  # every copy of a parameter (replicas, a tie's owners) holds the same gradient
                assert torch.equal(before.setdefault(n, b[n]), b[n]) and torch.equal(after.setdefault(n, a[n]), a[n])
        assert tied in before
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before.values()]))
        assert norm > CLIP, (step, float(norm))  # the clipping bites
        coef = CLIP / (float(norm) + 1e-6)
        for n in before:
            ratio = float((after[n].norm() / before[n].norm()))
            torch.testing.assert_close(after[n], before[n] * coef, rtol=1e-6, atol=0,
                                       msg=f"{n} at step {step + 1}: scaled by {ratio}, not {coef}")
