"""The collectives a training step makes through Lightning beyond the gradient reduction
(docs/performance.md, "Collectives per step"), at the defaults (clipping by norm at 1.0, non-finite
check on):

- ddp: every worker holds every gradient, so the clipping norm is each worker's own (no collective),
  and the loss and the non-finite flag share one all-reduce launched beside the last gradient
  bucket's (asynchronous), a hook or not;
- a scheme whose workers hold different stages (lpp, two workers): the loss, the flag and the norm
  share one all-reduce; a hook that may change gradients between the step and the clipping puts the
  norm back in its own all-reduce.

Each pair of runs gives the same parameters, bit for bit (W = 2: a sum of two terms has one order)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.training import char_data, quiet_trainer, tiny_gpt
from launcher.lightning import UnifiedStrategy
from launcher.models import GPT

pytestmark = pytest.mark.timeout(240)


class CountSmallAllReduces(L.Callback):
    """Records, per training batch, the all-reduces of at most 3 elements (the step's scalars; the
    gradient buckets are larger), each as ``"async"`` or ``"sync"``, and writes them to
    ``out/rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        self.out, self.calls, self.real = out, [], dist.all_reduce

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.calls.append([])

        def counting(t, *a, **kw):
            if t.numel() <= 3:
                self.calls[-1].append("async" if kw.get("async_op") else "sync")
            return self.real(t, *a, **kw)

        dist.all_reduce = counting

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dist.all_reduce = self.real

    def on_train_end(self, trainer, pl_module) -> None:
        (self.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(self.calls))


class Hooked(GPT):
    def on_after_backward(self) -> None:  # may change gradients: the norm is taken after it, apart
        pass


def _fit(tmp_path: Path, cls: type[GPT], scheme: str) -> tuple[GPT, list[list[list[str]]]]:
    tmp_path.mkdir()
    torch.manual_seed(0)
    model = cls(seq_len=8, d_model=16, n_head=2, n_layer=2, max_steps=2)  # tiny_gpt's, as a subclass may be
    st = UnifiedStrategy(scheme, stages=4, microbatches=2, **({"G": 1, "R": 2} if scheme == "lpp" else {}))
    assert st.workers == 2
    # gradient_clip_val=1.0: the launcher's default
    tr = quiet_trainer(st, st.workers, max_steps=2, precision="64-true", gradient_clip_val=1.0,
                       callbacks=[CountSmallAllReduces(tmp_path)])
    tr.fit(model, datamodule=char_data())
    return model, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(st.workers)]


@pytest.mark.parametrize("scheme,fused,apart", [
    ("ddp", ["async"], ["async"]),  # loss + flag beside the last bucket; the norm local, hook or not
    ("lpp", ["sync"], ["sync", "sync"]),  # loss + flag + norm together; the norm apart after a hook
])
def test_small_all_reduces_per_step(tmp_path, scheme, fused, apart):
    together, calls = _fit(tmp_path / "fused", GPT, scheme)
    assert calls == [[fused, fused], [fused, fused]]
    hooked, calls = _fit(tmp_path / "apart", Hooked, scheme)
    assert calls == [[apart, apart], [apart, apart]]
    assert tiny_gpt().state_dict().keys() == together.state_dict().keys()
    for k, v in together.state_dict().items():
        assert torch.equal(v, hooked.state_dict()[k]), k
