"""Models this project did not write, under every scheme, against the oracle: the same module,
unchanged, on one device as ``strategy=single`` trains it (Lightning's single-device strategy,
each step's micro-batches through the random streams: :mod:`launcher.lightning.single`; float64,
3 steps, parameters and validation loss within 1e-10).

- Hugging Face GPT-2 (``lm_head`` tied to the input embedding, its dropout 0.1), Llama (rotary
  embeddings, grouped-query attention) and Qwen2 (tied, rotary), built by name with ``HFCausalLM``;
- a timm ResNet with BatchNorm: in training mode it normalises each micro-batch by its own
  statistics, on one device as under every scheme (its running statistics included: one process
  running the micro-batches in order);
- Lightning's own ``demos.LightningTransformer``, with no ``self.stages``: traced and cut
  (``split=auto``), no wrapper, its dropout (0.2) on.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.training import char_data, load_checkpoint, max_diff, quiet_trainer, tiny_gpt
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import CharCorpus, HFCausalLM, ShapesImages, TimmClassifier

pytestmark = pytest.mark.timeout(600)

STEPS = 3
TOL = 1e-10
SCHEMES = {"ddp": (None, None), "fsdp": (None, None), "gpipe": (None, None), "lpp": (2, 2), "fslpp": (2, 2)}


def images() -> ShapesImages:
    return ShapesImages(batch_size=16, size=64, n=128, num_classes=4, val_fraction=0.25, seed=3)


B = 4  # micro-batches


def trainer(strategy, devices: int) -> L.Trainer:
    return quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, limit_val_batches=2,
                         val_check_interval=STEPS)


def demo() -> L.LightningModule:
    from lightning.pytorch.demos import LightningTransformer

    model = LightningTransformer(vocab_size=128)  # its dropout, 0.2, fixed in its constructor
    model.prepare_data = lambda: None  # it downloads WikiText-2; the character corpus feeds it here
    return model


def sgd(model: L.LightningModule) -> L.LightningModule:
    """SGD with momentum for the ResNet: a convolution followed by BatchNorm has gradients at the
    rounding level in the directions BatchNorm ignores, which Adam's normalisation would blow up
    to 1e-5 differences between two summation orders of the same gradient."""
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model


MODELS = {
    # name: (build, data, extra strategy keywords)
    "gpt2-tied": (lambda: HFCausalLM(arch="gpt2", config=dict(n_layer=2, n_embd=32, n_head=4), max_steps=STEPS),
                  char_data, {}),
    "llama": (lambda: HFCausalLM(arch="llama", config=dict(num_hidden_layers=2, hidden_size=32,
                                                          intermediate_size=64, num_attention_heads=4,
                                                          num_key_value_heads=2), max_steps=STEPS),
              char_data, {}),
    "qwen2-tied": (lambda: HFCausalLM(arch="qwen2", config=dict(num_hidden_layers=2, hidden_size=32,
                                                               intermediate_size=64, num_attention_heads=4,
                                                               num_key_value_heads=2, tie_word_embeddings=True),
                                      max_steps=STEPS),
                   char_data, {}),
    "resnet-bn": (lambda: sgd(TimmClassifier(name="resnet10t", num_classes=4, max_steps=STEPS)), images, {}),
    "lightning-demo": (demo, char_data, {"split": "auto"}),
}


def build(name: str) -> L.LightningModule:
    torch.manual_seed(0)
    return MODELS[name][0]()


@pytest.fixture(scope="module")
def references() -> dict:
    """Each model trained on one device as strategy=single trains it: parameters, buffers, val_loss."""
    out = {}
    for name, (_, data, extra) in MODELS.items():
        model = build(name)
        tr = trainer(StreamedSingleDevice(microbatches=B, split=extra.get("split")), 1)
        tr.fit(model, datamodule=data())
        val = tr.callback_metrics.get("val_loss")  # the demo has no validation_step
        out[name] = (model.state_dict(), None if val is None else float(val))
    return out


@pytest.mark.slow  # the references: five models trained on one device first
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_equals_single_device(name: str, scheme: str, references: dict) -> None:
    _, data, extra = MODELS[name]
    G, R = SCHEMES[scheme]
    model = build(name)
    tr = trainer(UnifiedStrategy(scheme, G=G, R=R, stages=4, microbatches=4, **extra), 4)
    tr.fit(model, datamodule=data())
    want, val = references[name]
    assert max_diff(want, model.state_dict()) < TOL  # BatchNorm's running statistics included
    if val is not None:
        assert abs(float(tr.callback_metrics["val_loss"]) - val) < TOL


def test_tied_embedding_stays_one_parameter_in_the_checkpoint(tmp_path) -> None:
    """GPT-2 under FSDP: the checkpoint is the single-device one, with the tie under both names,
    and it loads into one process and resumes under another scheme."""
    model = build("gpt2-tied")
    tr = L.Trainer(strategy=UnifiedStrategy("fsdp", stages=4, microbatches=4), devices=4, accelerator="cpu",
                   precision="64-true", max_steps=2, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)])
    tr.fit(model, datamodule=char_data())
    ckpt = tmp_path / "last.ckpt"
    state = load_checkpoint(ckpt)["state_dict"]
    single = build("gpt2-tied").double()
    assert state.keys() == single.state_dict().keys()
    tied = [k for k in state if k.endswith("lm_head.weight")]
    assert tied and torch.equal(state[tied[0]], state["stages.0.tokens.weight"])
    single.load_state_dict(state)
    assert single.stages[0].tokens.weight is single.stages[-1].lm_head.weight


def test_trainer_fit_names_a_broken_stage_before_any_worker_starts() -> None:
    """From the Python API as from the command line: one sentence naming the stage and its class,
    raised in this process (no worker was forked, so no worker's traceback precedes it)."""
    from torch import nn

    from launcher.torch_support.checks import ModelError

    model = tiny_gpt()
    model.stages[1] = nn.Sequential(nn.Linear(16, 16), nn.Flatten(0), nn.Linear(3, 3))
    tr = L.Trainer(strategy=UnifiedStrategy("gpipe", stages=4, microbatches=4), devices=4, accelerator="cpu",
                   max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ModelError, match=r"^stage 1 \(Sequential\) raised RuntimeError on an input of shape \(2, 8\)"):
        tr.fit(model, datamodule=char_data())


class EncodedChars(CharCorpus):
    """The character corpus as Hugging Face tokenizers give batches: a ``BatchEncoding`` of
    ``input_ids``, ``attention_mask`` and (unshifted) ``labels``."""

    def train_dataloader(self):
        from transformers import BatchEncoding

        def encode(batch):
            x = torch.stack([s[0] for s in batch])
            return BatchEncoding({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})

        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=self.batch_size, sampler=self.sampler,
                                           drop_last=True, collate_fn=encode)


def test_batch_encoding_batches_split_into_microbatches() -> None:
    """Dict batches (a ``BatchEncoding``) are cut into micro-batches along the batch dimension and
    reach the first stage as keywords; the result equals one device's."""
    ref = build("llama")
    L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0).fit(ref, datamodule=EncodedChars(batch_size=8, seq_len=8, chars=20_000, seed=3))
    model = build("llama")
    L.Trainer(strategy=UnifiedStrategy("lpp", G=2, R=2, stages=4, microbatches=4), devices=4, accelerator="cpu",
              precision="64-true", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0,
              ).fit(model, datamodule=EncodedChars(batch_size=8, seq_len=8, chars=20_000, seed=3))
    assert max_diff(ref.state_dict(), model.state_dict()) < TOL
