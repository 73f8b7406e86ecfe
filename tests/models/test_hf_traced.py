"""``model=hf_traced`` (:class:`~launcher.models.HFTraced`): Hugging Face LMs that ``model=hf``
cannot cut at their decoder layers, built by name, kept whole, traced and cut. Encoder-decoders by
name (T5, BART, mBART through ``AutoModelForSeq2SeqLM``) and RWKV (its layers return a recurrent
state with the hidden state) train under several schemes to the parameters of ``strategy=single``
(float64, 3 steps, within 1e-10, clipping 1.0, the families' own dropout, the character corpus
shuffled), from Python and from the command line; ``model=hf`` refuses them in one sentence that
names ``model=hf_traced``, with no message of the library's inside."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from helpers.oracle import assert_scheme_equals_single_device
from helpers.training import char_data, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import HFCausalLM, HFTraced

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")]

TOL = 1e-10
STEPS = 3
B = 4
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)
#: tiny, with the common keys only (an encoder-decoder's second stack and T5's d_ff follow them)
TINY = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
RWKV = {k: v for k, v in TINY.items() if k != "num_attention_heads"}  # its heads are not a config field
CONFIGS = {"t5": TINY, "bart": TINY, "mbart": TINY, "rwkv": RWKV}


def build(arch: str) -> HFTraced:
    return HFTraced(arch, config=CONFIGS[arch], max_steps=STEPS)


def test_encoder_decoders_by_name_and_their_small_defaults() -> None:
    """``head`` null: the encoder-decoder where the family has one; the second stack and the
    family's own width follow the common keys; the dropout is the family's own."""
    t5, bart, rwkv = build("t5"), build("bart"), build("rwkv")
    assert type(t5.model).__name__ == "T5ForConditionalGeneration" and t5.seq2seq
    assert (t5.model.config.num_layers, t5.model.config.num_decoder_layers, t5.model.config.d_ff,
            t5.model.config.d_kv) == (2, 2, 32, 8)
    assert t5.model.config.dropout_rate > 0
    assert type(bart.model).__name__ == "BartForConditionalGeneration"
    assert (bart.model.config.decoder_layers, bart.model.config.decoder_ffn_dim) == (2, 32)
    assert type(rwkv.model).__name__ == "RwkvForCausalLM" and not rwkv.seq2seq
    assert type(HFTraced("bart", config=TINY, head="causal_lm").model).__name__ == "BartForCausalLM"
    with pytest.raises(ValueError, match=r"^head=lm is invalid: use causal_lm or seq2seq_lm"):
        HFTraced("t5", head="lm")


def test_model_hf_names_the_way_that_works() -> None:
    """``model=hf`` (a cut at the decoder layers) refuses them in one sentence, with no message of
    the library's (RWKV's was "not enough values to unpack"), naming ``model=hf_traced``, which the
    other tests here train."""
    route = "train it with model=hf_traced and the same model.* keys (traced and cut at any module)."
    with pytest.raises(ValueError) as e:
        HFCausalLM("t5")
    assert str(e.value) == ("model.arch=t5 is not supported by model=hf: t5 is an encoder-decoder "
                            "(AutoModelForSeq2SeqLM), and model=hf cuts causal LMs at their decoder layers; " + route)
    with pytest.raises(ValueError) as e:
        HFCausalLM("rwkv", config=CONFIGS["rwkv"])
    assert str(e.value) == ("model.arch=rwkv cannot be cut into stages at its decoder layers: its RwkvModel.forward "
                            "does not run with only one decoder layer present and the others passed over, as a stage "
                            "runs it; " + route)


def fit(arch: str, strategy, devices: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = build(arch)
    quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP,
                  limit_val_batches=0).fit(model, datamodule=char_data())
    return model.state_dict()


@pytest.mark.slow  # a forked run of 4 workers and a one-device run, each
@pytest.mark.parametrize("arch, scheme, kw", [("t5", "gpipe", {}), ("bart", "lpp", {"G": 2, "R": 2}),
                                              ("mbart", "fsdp", {}), ("rwkv", "gpipe", {})])
def test_traced_equals_strategy_single(arch: str, scheme: str, kw: dict) -> None:
    want = fit(arch, StreamedSingleDevice(microbatches=B), 1)
    got = fit(arch, UnifiedStrategy(scheme, stages=4, microbatches=B, **kw), 4)
    diff = max_diff(want, got)
    print(f"{arch}, {scheme}: parameters within {diff:.1e} of strategy=single")
    assert diff < TOL


SMALL = ["stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000",
         "trainer.max_steps=3", "trainer.precision=64-true", "logger=none", "model=hf_traced",
         "model.config.hidden_size=16", "model.config.num_hidden_layers=2", "model.config.intermediate_size=32"]


@pytest.mark.slow
@pytest.mark.parametrize("arch, scheme", [("rwkv", ["strategy=lpp", "G=2", "R=2"]),
                                          ("t5", ["strategy=gpipe", "G=1", "R=4"])])
def test_the_way_out_from_the_command_line(arch: str, scheme: list[str], tmp_path: Path) -> None:
    """The command the refusal names, as typed: trains, and its ``last.ckpt`` equals strategy=single."""
    heads = [] if arch == "rwkv" else ["model.config.num_attention_heads=2"]
    name, *layout = scheme
    assert_scheme_equals_single_device(name.split("=")[1], [*layout, *SMALL, f"model.arch={arch}", *heads], tmp_path)


def test_dict_batches_and_item_counts() -> None:
    """A dict batch's labels: a causal LM shifts them, an encoder-decoder takes them; the loss is a
    mean over the positions with a target, which ``loss_items`` counts."""
    ids = torch.randint(3, 128, (2, 5))
    labels = ids.clone()
    labels[0, 3:] = -100
    rwkv, t5 = build("rwkv"), build("t5")
    _, causal = rwkv.split_batch({"input_ids": ids, "labels": labels})
    assert torch.equal(causal[:, :-1], labels[:, 1:]) and (causal[:, -1] == -100).all()
    _, s2s = t5.split_batch({"input_ids": ids, "labels": labels})
    assert torch.equal(s2s, labels)
    assert int(t5.loss_items({"input_ids": ids, "labels": labels})) == 8
    assert int(rwkv.loss_items({"input_ids": ids, "labels": labels})) == 6
