"""Losses that average over a data-dependent count (labelled tokens, masked positions, rows of a
last batch that does not divide): a step under a scheme equals one device's step on the whole
batch (float64, within 1e-10), not a mean of the micro-batches' means.

- the engine (Python API) with counts it is given, counts of rows, and a micro-batch with none;
- ``model=hf`` on right-padded batches (labels -100 on the padding) through the command line;
- a BERT masked LM in a user's LightningModule, traced (``split=auto``), on dict batches.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import launcher.config  # noqa: F401  (registers the schema and the resolver)
from helpers.cli import run_launcher
from helpers.training import last_state, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.item_counts import loss_items
from launcher.runtime import Engine, launch
from launcher.runtime.items import shares
from launcher.runtime.oracle import flat_params, staged_mlp
from launcher.schedule import make_schedule
from launcher.torch_support.init import empty_init, init_units
from launcher.torch_support.staged import StagedModel

ATOL = 1e-10


# ---- the engine -----------------------------------------------------------------------------


def masked_mse(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean squared error over the rows ``mask`` keeps: a mean over a count the data decides."""
    y, mask = target
    return (((out - y) ** 2).sum(-1) * mask).sum() / mask.sum()


def _batch(rows: int, step: int, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=gen, dtype=torch.float64)
    mask = torch.zeros(rows, dtype=torch.float64)
    mask[keep] = 1.0
    return x, y, mask


def _forward(model: StagedModel, x: torch.Tensor) -> torch.Tensor:
    for m in model.stages:
        x = m(x)
    return x


def _one_device(model: StagedModel, opt: torch.optim.Optimizer, x: torch.Tensor, target: object,
                loss_fn) -> tuple[list[torch.Tensor], float]:
    """The oracle: one forward and backward over the whole batch, then the optimizer step."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(_forward(model, x), target)
    loss.backward()
    grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in model.stages]
    opt.step()
    return grads, float(loss.detach())


#: (scheme, G, R, options): every path a loss stage's loss takes (a kept graph, a forward
#: recomputed on freshly fetched weights under weight_cache=job, the split backward's I and W)
CASES = [("ddp", 4, 1, {}), ("fsdp", 4, 1, {"weight_cache": "job"}), ("gpipe", 1, 4, {"split_backward": True}),
         ("lpp", 2, 2, {}), ("fslpp", 2, 2, {"split_backward": True})]
#: per step: the batch's rows, the rows the mask keeps (micro-batches of 4, 4, 3, 3 rows hold
#: 3, 1, 2 and 0 kept rows in step 0: one has nothing to average over, so its mean is NaN)
STEPS = [(14, [0, 1, 3, 6, 9, 10]), (14, [0, 2, 4, 5, 7, 8, 9, 11, 12, 13]), (13, [1, 2, 3, 4, 5, 6, 7, 8, 12])]


def _weighted_case(scheme: str, G: int, R: int, options: dict) -> dict[str, float]:
    """This rank's largest differences from one device, per kind of count."""
    S = B = 4
    step = make_schedule(scheme, S, B, G=G, R=R, split_backward=options.get("split_backward", False))
    errors: dict[str, float] = {}
    for kind in ("mask", "rows"):
        loss_fn = masked_mse if kind == "mask" else nn.functional.mse_loss
        model = StagedModel(staged_mlp(S, seed=3).stages, loss_fn)
        ref = copy.deepcopy(model)
        engine = Engine(model, step, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                        weight_cache=options.get("weight_cache", "step"))
        ref_opt = torch.optim.SGD([p for m in ref.stages for p in m.parameters()], lr=0.1, momentum=0.9)
        diffs = [0.0]
        for i, (rows, keep) in enumerate(STEPS):
            x, y, mask = _batch(rows, i, keep)
            xs, ys, ms = x.tensor_split(B), y.tensor_split(B), mask.tensor_split(B)
            if kind == "mask":  # the counts given; the mean over kept rows, each micro-batch's by its own
                mbs = [(a, (b, m)) for a, b, m in zip(xs, ys, ms)]
                items = [m.sum() for m in ms]
                target = (y, mask)
            else:  # no counts: the engine counts rows (13 rows: 4, 3, 3, 3)
                mbs, items, target = list(zip(xs, ys)), None, y
            record = engine.train_step(mbs, items)
            grads, loss = _one_device(ref, ref_opt, x, target, loss_fn)
            if engine.worker is None:
                continue
            for s in engine.owned:
                diffs += [(engine.last_grads[s] - grads[s]).abs().max().item(),
                          (flat_params(engine.modules[s]) - flat_params(ref.stages[s])).abs().max().item()]
            errors[f"{kind}-loss-share-{i}"] = record["measured_only"]["loss"]
            errors[f"{kind}-loss-{i}"] = loss
            # evaluation weighs micro-batches alike: on the updated weights, against one device's loss
            errors[f"{kind}-eval-share-{i}"], _ = engine.evaluate(mbs, items)
            with torch.no_grad():
                errors[f"{kind}-eval-{i}"] = float(loss_fn(_forward(ref, x), target))
        errors[f"{kind}-err"] = torch.tensor(diffs).max().item()  # NaN if any is
    return errors


def _all_cases() -> list[dict[str, float]]:
    return [_weighted_case(*case) for case in CASES]


@pytest.fixture(scope="module")
def engine_results() -> list[list[dict[str, float]]]:
    return launch(_all_cases, 4, timeout=30, deadline=240)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_engine_weighs_microbatches_by_their_items(engine_results, case: int) -> None:
    per_rank = [r[case] for r in engine_results]
    for kind in ("mask", "rows"):
        assert max(r[f"{kind}-err"] for r in per_rank) < ATOL
        for i in range(len(STEPS)):
            want = per_rank[0][f"{kind}-loss-{i}"]
            # the step's loss: each worker's share of it (its loss stages' weighted losses), summed
            assert abs(sum(r[f"{kind}-loss-share-{i}"] for r in per_rank) - want) < ATOL
            # evaluation after the step: the same weighting, on the updated weights
            want = per_rank[0][f"{kind}-eval-{i}"]
            assert abs(sum(r[f"{kind}-eval-share-{i}"] for r in per_rank) - want) < ATOL


def test_equal_counts_keep_the_plain_mean() -> None:
    """Equal counts (or rows) weigh each micro-batch 1 / B exactly: the engine divides by B as it
    always did, so runs on equal micro-batches stay bit for bit."""
    mbs = [(torch.zeros(3, 2), None)] * 4
    assert shares(mbs) is None
    assert shares(mbs, [5, 5, 5, 5]) is None
    assert shares(mbs, [torch.tensor(2), 2, 2.0, torch.tensor(2.0)]) is None
    assert shares(mbs, [1, 3, 0, 4]) == [1 / 8, 3 / 8, 0.0, 4 / 8]
    assert shares([(torch.zeros(n, 2), None) for n in (4, 4, 3, 3)]) == [4 / 14, 4 / 14, 3 / 14, 3 / 14]
    with pytest.raises(ValueError, match="count is -1.0; counts must be finite and >= 0"):
        shares(mbs, [1, -1, 2, 2])
    with pytest.raises(ValueError, match="items has 3 counts for 4 micro-batches"):
        shares(mbs, [1, 2, 2])


# ---- model=hf on right-padded batches, through the command line -------------------------------

PADDED = '''
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from launcher.models.data import stdlib_text


class Padded(LightningDataModule):
    """Standard-library text in rows of 2 to seq_len characters, right-padded to seq_len as a
    tokenizer pads a batch: attention_mask 0 and labels -100 on the padding."""

    def __init__(self, batch_size: int = 8, seq_len: int = 12, n: int = 64) -> None:
        super().__init__()
        self.batch_size, self.seq_len, self.n = batch_size, seq_len, n

    def setup(self, stage=None) -> None:
        n, t = self.n, self.seq_len
        ids = torch.tensor(list(stdlib_text(n * t).encode("ascii", "replace"))).view(n, t)
        lengths = torch.randint(2, t + 1, (n,), generator=torch.Generator().manual_seed(5))
        mask = (torch.arange(t) < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        self.rows = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]

    # not shuffled: the order of the user's data under a scheme is tests/lightning/test_user_data.py's subject
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows[16:], batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.rows[:16], batch_size=self.batch_size)
'''

#: a tiny Llama on padded batches of 8 rows, 4 micro-batches of 2 rows with unequal label counts;
#: the launcher's defaults otherwise (gradient clipping on), float64, a validation after step 3
HF_PADDED = ["stages=4", "microbatches=4", "trainer.max_steps=3", "trainer.precision=64-true",
             "trainer.val_check_interval=3", "logger=none", "model=hf", "model.arch=llama",
             "model.config.num_hidden_layers=2", "model.config.hidden_size=32", "model.config.intermediate_size=64",
             "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data=custom",
             "data._target_=padded.Padded", "data.batch_size=8"]


class _Losses(L.Callback):
    """The training loss of every step, as the module logged it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _single_device(overrides: list[str]) -> tuple[dict[str, torch.Tensor], list[float], float]:
    """The oracle: the config's model and data built after ``seed_everything(seed)`` as the command
    builds them (a model with ``reset_stage`` on the meta device, started by the launcher's rule),
    trained by Lightning's default strategy with the config's trainer settings; its parameters, its
    step losses and its last ``val_loss``."""
    with initialize_config_module("launcher.conf", version_base=None):
        cfg = compose("config", overrides=[o for o in overrides if not o.startswith(("G=", "R="))])
    L.seed_everything(int(cfg.seed), verbose=False)
    data = instantiate(cfg.data)
    with empty_init():
        model = instantiate(cfg.model)
    model.double()
    init_units(list(model.stages), torch.initial_seed(), reset=model.reset_stage)
    t, losses = cfg.trainer, _Losses()
    tr = quiet_trainer(precision=t.precision, max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val,
                       limit_val_batches=t.limit_val_batches, val_check_interval=t.val_check_interval,
                       callbacks=[losses])
    tr.fit(model, datamodule=data)
    return model.state_dict(), losses.losses, float(tr.callback_metrics["val_loss"])


@pytest.fixture(scope="module")
def hf_padded_oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[float], float]:
    where = tmp_path_factory.mktemp("oracle")
    (where / "padded.py").write_text(PADDED)
    sys.path.insert(0, str(where))
    try:
        return _single_device(HF_PADDED)
    finally:
        sys.path.remove(str(where))
        sys.modules.pop("padded", None)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", [["strategy=fsdp"], ["strategy=lpp", "G=2", "R=2"]], ids=["fsdp", "lpp"])
def test_hf_on_padded_batches_equals_one_device(scheme: list[str], hf_padded_oracle, tmp_path: Path) -> None:
    (tmp_path / "padded.py").write_text(PADDED)
    run = tmp_path / "run"
    p = run_launcher(*scheme, *HF_PADDED, f"hydra.run.dir={run}", cwd=tmp_path, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    want, want_losses, want_val = hf_padded_oracle
    assert max_diff(last_state(run), want) < ATOL
    metrics = json.loads((run / "metrics.json").read_text())
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == len(want_losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) < ATOL
    assert abs(metrics["val"][-1]["val_loss"] - want_val) < ATOL


# ---- a BERT masked LM in a user's LightningModule, traced, on dict batches ------------------

#: the gradient clipping a user of the launcher gets
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)


class MaskedLM(L.LightningModule):
    """A user's module around ``transformers``' BERT masked LM: the model's own loss, a mean over
    the masked positions of the batch."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        # dropout 0: a scheme draws each micro-batch's mask where one device draws the batch's, so
        # the two would train on different masks (dropout under a scheme is not this file's subject)
        config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        self.model = BertForMaskedLM(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Rows(Dataset):
    """A list of dict samples as a data set."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def masked_rows(n: int, seed: int, seq_len: int = 10, vocab: int = 32, mask_id: int = 3) -> Rows:
    """Right-padded rows (pad id 0) with about a quarter of their tokens masked: labels hold the
    original token there and -100 everywhere else (padding included), as a data collator makes them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, seq_len), generator=g)
    lengths = torch.randint(3, seq_len + 1, (n,), generator=g)
    attention = (torch.arange(seq_len) < lengths[:, None]).long()
    masked = (torch.rand(n, seq_len, generator=g) < 0.25) & (attention == 1)
    labels = ids.masked_fill(~masked, -100)
    ids = ids.masked_fill(masked, mask_id).masked_fill(attention == 0, 0)
    return Rows([{"input_ids": i, "attention_mask": a, "labels": y} for i, a, y in zip(ids, attention, labels)])


@pytest.mark.timeout(300)
def _fit_traced(make: Callable[[], L.LightningModule], train: Any, val: Any, strategy: Any,
                devices: int) -> tuple[dict[str, torch.Tensor], float]:
    """Three float64 steps of ``make()`` (built after ``seed_everything(0)``) on batches of 8 rows of
    ``train``, validated on ``val``: the trained state and ``val_loss``."""
    L.seed_everything(0, verbose=False)
    model = make()
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=3, gradient_clip_val=CLIP,
                       val_check_interval=3, limit_val_batches=2)
    tr.fit(model, datamodule=L.LightningDataModule.from_datasets(train, val, batch_size=8))
    return model.state_dict(), float(tr.callback_metrics["val_loss"])


@pytest.mark.parametrize("scheme", [("ddp", 4, 1), ("fslpp", 2, 2)], ids=["ddp", "fslpp"])
def test_bert_masked_lm_traced_on_dict_batches_equals_one_device(scheme: tuple[str, int, int]) -> None:
    """``self.model(**batch).loss`` of a BERT masked LM under ``split=auto``: each micro-batch
    weighs by its masked positions (found from the model's ``loss_type``, no user code), so the
    parameters and ``val_loss`` equal one device's on the whole batch."""

    def run(strategy: Any, devices: int) -> tuple[dict[str, torch.Tensor], float]:
        return _fit_traced(MaskedLM, masked_rows(48, 1), masked_rows(16, 2), strategy, devices)

    want, want_val = run("auto", 1)
    name, G, R = scheme
    got, got_val = run(UnifiedStrategy(name, G=G, R=R, stages=4, microbatches=4, split="auto"), 4)
    assert max_diff(want, got) < ATOL
    assert abs(got_val - want_val) < ATOL


# ---- a user's own count, and a last batch that does not divide --------------------------------


class MaskedRegression(L.LightningModule):
    """A user's regression whose loss is a mean over the rows a mask keeps, and that says so
    through the ``loss_items`` hook."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8),
                                     nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.stages:
            x = m(x)
        return x

    def split_batch(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x, y, mask = batch
        return x, (y, mask)

    def loss(self, out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return masked_mse(out, target)

    def loss_items(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return batch[2].sum()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = self.split_batch(batch)
        return self.loss(self(x), target)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, target = self.split_batch(batch)
        self.log("val_loss", self.loss(self(x), target))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def masked_set(n: int, seed: int) -> TensorDataset:
    """``n`` rows ``(x, y, mask)``; the last row's mask is 0, so the last micro-batch of a last
    batch of 6 rows (cut 2, 2, 1, 1) has nothing to average over."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n, generator=g) < 0.6).double()
    mask[-1] = 0.0
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64),
                         torch.randn(n, 3, generator=g, dtype=torch.float64), mask)


@pytest.mark.timeout(300)
def test_loss_items_hook_and_a_last_batch_that_does_not_divide() -> None:
    """The module's own count (``loss_items``) weighs its micro-batches, on batches of 8, 8, 8 and 6
    rows (the last cut 2, 2, 1, 1, its last micro-batch empty) and validation batches of 8 and 6:
    parameters and ``val_loss`` equal one device's under GPipe."""

    def run(strategy: Any, devices: int) -> tuple[dict[str, torch.Tensor], float]:
        L.seed_everything(0, verbose=False)
        model = MaskedRegression().double()
        tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=4, gradient_clip_val=CLIP,
                           val_check_interval=4, limit_val_batches=2)
        tr.fit(model, datamodule=L.LightningDataModule.from_datasets(masked_set(30, 1), masked_set(14, 2),
                                                                     batch_size=8))
        return model.state_dict(), float(tr.callback_metrics["val_loss"])

    want, want_val = run("auto", 1)
    got, got_val = run(UnifiedStrategy("gpipe", stages=4, microbatches=4), 4)
    assert max_diff(want, got) < ATOL
    assert abs(got_val - want_val) < ATOL


# ---- the Hugging Face count, without user code -------------------------------------------------


def test_hf_counts_are_what_the_model_losses_average_over() -> None:
    """For each loss type, the count :func:`loss_items` finds in a module holding the model is the
    divisor of the library's own loss: its sum over ``num_items_in_batch`` equals its mean
    (padding and masked labels -100, some rows with none)."""
    from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, BertForMaskedLM
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    causal = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", vocab_size=16, n_layer=1, n_embd=8, n_head=2, bos_token_id=None, eos_token_id=None))
    assert causal.loss_type is None  # GPT2LMHeadModel: the library falls back to ForCausalLM
    masked = BertForMaskedLM(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=8))
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 16, (4, 6), generator=g).masked_fill(torch.rand(4, 6, generator=g) < 0.5, -100)
    labels[1, 0], labels[1, 1:] = 5, -100  # one label, at the first position: none once shifted
    logits = torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
    for model, loss in ((causal, ForCausalLMLoss), (masked, ForMaskedLMLoss)):
        holder = nn.ModuleDict({"model": model})  # a user's module around the model
        counts = loss_items(holder, {"input_ids": labels.clamp(min=0), "labels": labels}, 4)
        n = sum(counts)
        assert abs(loss(logits, labels, 16, num_items_in_batch=n) - loss(logits, labels, 16)) < 1e-6  # float32 losses
        shifted = model is causal
        assert [int(c) for c in counts] == [int(((row[1:] if shifted else row) != -100).sum()) for row in labels]
        assert int(counts[1]) == (0 if shifted else 1)
    assert loss_items(nn.Linear(2, 2), {"labels": labels}, 4) is None  # no Hugging Face model: rows


#: a user's GPT-2 (tied embeddings, dropout 0 as in the rest of this file) on right-padded batches
class PaddedCausalLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("gpt2", vocab_size=32, n_layer=2, n_embd=16, n_head=2, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                      eos_token_id=None)
        self.model = AutoModelForCausalLM.from_config(config)

    def _loss(self, batch: dict) -> torch.Tensor:
        # the shifted cross-entropy the model's own loss computes, but in float64: the library's
        # (ForCausalLMLoss) casts the logits to float32, so one device's loss is itself rounded there
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def padded_rows(n: int, seed: int, seq_len: int = 10, vocab: int = 32) -> Rows:
    """Right-padded rows of 2 to ``seq_len`` tokens: labels are the tokens, -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq_len), generator=g)
    attention = (torch.arange(seq_len) < torch.randint(2, seq_len + 1, (n, 1), generator=g)).long()
    ids = ids.masked_fill(attention == 0, 0)
    labels = ids.masked_fill(attention == 0, -100)
    return Rows([{"input_ids": i, "attention_mask": a, "labels": y} for i, a, y in zip(ids, attention, labels)])


@pytest.mark.timeout(300)
def test_traced_causal_lm_on_padded_batches_equals_one_device() -> None:
    """A GPT-2's shifted loss under ``split=auto`` on right-padded dict batches: each micro-batch
    weighs by its labels after the shift (found from the model, no user code), under LPP."""

    def run(strategy: Any, devices: int) -> tuple[dict[str, torch.Tensor], float]:
        return _fit_traced(PaddedCausalLM, padded_rows(48, 3), padded_rows(16, 4), strategy, devices)

    want, want_val = run("auto", 1)
    got, got_val = run(UnifiedStrategy("lpp", G=2, R=2, stages=4, microbatches=4, split="auto"), 4)
    assert max_diff(want, got) < ATOL
    assert abs(got_val - want_val) < ATOL
