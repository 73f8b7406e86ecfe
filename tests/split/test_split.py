"""launcher.split: stage modules traced from one module reproduce it and follow the stage contract.

Every stage holds the module's own parameters (the same objects), values go straight from the stage
that makes them to each stage that uses them, and the split's outputs and gradients equal the
module's in float64, in train mode (the same dropout masks) and in eval mode.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from launcher.split import Split, SplitError, loss_module, split_module, trace_module

pytestmark = pytest.mark.timeout(120)

F64 = torch.float64


def stage_outputs(split: Split, *args, **kwargs) -> list:
    """Each stage's output, running the stages by the contract (as Split.run does, kept here so
    the test does not trust it)."""
    outs: list = []
    for s, stage in enumerate(split.stages):
        if s == 0:
            outs.append(stage(*args, **kwargs))
        else:
            outs.append(stage(*[outs[p][i] for p in split.graph.preds[s] for i in split.picks[(p, s)]]))
    return outs


def assert_shares_parameters(split: Split, module: nn.Module) -> None:
    own = {id(p) for p in module.parameters()}
    held = {id(p) for stage in split.stages for p in stage.parameters()}
    assert held == own, "the stages must hold exactly the module's parameter objects"


def one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("."), msg
    return msg


# ---- (1) a chain ---------------------------------------------------------------------------------


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def test_chain_at_points_and_auto():
    torch.manual_seed(0)
    m = Chain().to(F64)
    x = torch.randn(5, 8, dtype=F64)
    split = split_module(m, (x,), 3, ["blocks.1", "blocks.3"])
    assert split.graph.preds == ((), (0,), (1,))
    assert split.starts == ["blocks", "blocks.1", "blocks.3"]
    assert torch.equal(stage_outputs(split, x)[-1], m(x))
    assert [n for n, _ in split.stages[1].named_parameters()] == [
        "blocks.1.0.weight", "blocks.1.0.bias", "blocks.2.0.weight", "blocks.2.0.bias"]
    assert split.stages[1].get_parameter("blocks.1.0.weight") is m.blocks[1][0].weight
    assert_shares_parameters(split, m)
    for out in stage_outputs(split, x)[:-1]:
        assert isinstance(out, tuple) and len(out) == 1

    auto = split_module(m, (x,), 2)
    assert auto.starts[1] == "blocks.2"  # 2 blocks (144 parameters) against 2 blocks and the head (162)
    assert torch.equal(auto.run(x), m(x))
    sizes = [sum(p.numel() for p in s.parameters()) for s in split_module(m, (x,), 3).stages]
    assert sorted(sizes) == [72, 72 + 18, 144]  # the largest stage as small as it can be, then the rest even


def test_auto_minimises_the_largest_stage():
    import itertools

    torch.manual_seed(0)
    widths = [3, 9, 4, 12, 5, 7, 6, 10, 2]
    m = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])]).to(F64)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in m]
    x = torch.randn(2, 3, dtype=F64)
    traced = trace_module(m, (x,))
    for stages in (2, 3, 4):
        split = traced.split(stages)
        got = max(sum(p.numel() for p in s.parameters()) for s in split.stages)
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cut), (*cut, len(sizes))))
                   for cut in itertools.combinations(range(1, len(sizes)), stages - 1))
        assert got == best, (stages, split.starts)
        assert torch.equal(split.run(x), m(x))


# ---- (2) a skip connection makes a DAG -----------------------------------------------------------


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.embed(x)
        h = self.blocks[2](self.blocks[1](self.blocks[0](x0)))
        return self.blocks[3](h) + x0  # x0 comes back three blocks later


def test_skip_connection_goes_straight_to_its_stage():
    torch.manual_seed(0)
    m = Skip().to(F64)
    x = torch.randn(3, 4, dtype=F64)
    split = split_module(m, (x,), 3, ["blocks.1", "blocks.3"])
    assert split.graph.preds == ((), (0,), (0, 1))
    outs = stage_outputs(split, x)
    stage0 = outs[0]
    skipped = next(i for i, v in enumerate(stage0) if torch.equal(v, m.embed(x)))
    assert split.picks[(0, 2)] == (skipped,)
    assert skipped not in split.picks[(0, 1)]
    assert len(outs[1]) == 1  # stage 1 does not carry x0 along
    assert torch.equal(outs[-1], m(x))


# ---- (3) tuples, dicts, keywords and an integer input used by several stages ----------------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.pos = nn.Embedding(16, d)
        self.gate = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, extra: dict, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        h = torch.tanh(self.lin(h) + self.pos(pos) + extra["bias"])
        return h, {"bias": torch.sigmoid(self.gate(h)), "count": extra["count"] + 1}


class Structured(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, *, mask: torch.Tensor) -> dict:
        h = self.emb(ids) * mask[..., None]
        extra = {"bias": torch.zeros_like(h), "count": 0}
        for block in self.blocks:
            h, extra = block(h, extra, pos)
        return {"out": h, "aux": (extra["bias"].sum(), extra["count"])}


def test_tuple_dict_keyword_and_integer_input():
    torch.manual_seed(0)
    m = Structured().to(F64)
    ids = torch.randint(0, 20, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    mask = torch.rand(2, 5, dtype=F64)
    split = split_module(m, (ids, pos), 3, ["blocks.1", "blocks.2"], {"mask": mask})
    outs = stage_outputs(split, ids, pos, mask=mask)
    want = m(ids, pos, mask=mask)
    got = outs[-1]
    assert set(got) == {"out", "aux"} and torch.equal(got["out"], want["out"])
    assert torch.equal(got["aux"][0], want["aux"][0]) and got["aux"][1] == 3
    # the position ids go from stage 0 to stages 1 and 2 directly, as an integer tensor
    at = next(i for i, v in enumerate(outs[0]) if v.dtype == torch.int64 and torch.equal(v, pos))
    assert at in split.picks[(0, 1)] and at in split.picks[(0, 2)]
    assert split.graph.preds[2] == (0, 1)
    assert_shares_parameters(split, m)


# ---- (4) a tied parameter ------------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids))).logsumexp(-1).mean()


def test_tied_parameter_is_one_object_in_first_and_last_stage():
    torch.manual_seed(0)
    m = Tied().to(F64)
    ids = torch.randint(0, 11, (3, 4))
    split = split_module(m, (ids,), 3, ["blocks.1", "blocks.2"])
    first, last = split.stages[0], split.stages[-1]
    assert dict(first.named_parameters())["emb.weight"] is m.emb.weight
    assert dict(last.named_parameters())["head.weight"] is m.emb.weight
    m(ids).backward()
    want = m.emb.weight.grad.clone()
    m.zero_grad()
    split.run(ids).backward()
    assert torch.equal(m.emb.weight.grad, want)  # both stages' uses add into the one gradient


# ---- (5) Lightning's demo transformer, batch -> loss ----------------------------------------------


def _lightning_transformer():
    from lightning.pytorch.demos import LightningTransformer

    torch.manual_seed(0)
    lm = LightningTransformer(vocab_size=50).to(F64)
    inputs, target = torch.randint(0, 50, (2, 6)), torch.randint(0, 50, (2, 6))
    return lm, inputs, target


def _seeded(fn, seed: int = 7):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def test_lightning_transformer_loss_and_gradients():
    lm, inputs, target = _lightning_transformer()
    t = time.perf_counter()
    traced = trace_module(loss_module(lm), ((inputs, target),))
    traced_s = time.perf_counter() - t
    params = dict(lm.named_parameters())

    def grads_of(run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm.zero_grad(set_to_none=True)
        loss = _seeded(run)  # the same dropout masks for the module and the split
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in params.items()}

    lm.train()
    want_loss, want_grads = grads_of(lambda: lm.training_step((inputs, target), 0))
    layers = "model.transformer"
    for stages, points in [(2, [f"{layers}.decoder"]),
                           (4, [f"{layers}.encoder.layers.1", f"{layers}.decoder", f"{layers}.decoder.layers.1"]),
                           (2, "auto"), (4, "auto")]:
        t = time.perf_counter()
        split = traced.split(stages, points)
        cut_s = time.perf_counter() - t
        assert len(split.stages) == stages and split.graph.sinks == (stages - 1,)
        assert_shares_parameters(split, loss_module(lm))
        names = {n for s in split.stages for n, _ in s.named_parameters()}
        assert names == set(params)  # the LightningModule's own names
        loss, grads = grads_of(lambda: split.run((inputs, target)))
        assert loss.dim() == 0 and torch.equal(loss, want_loss), (stages, points)
        for n in params:
            assert torch.equal(grads[n], want_grads[n]), (stages, points, n)
        print(f"demo transformer: traced in {traced_s:.2f}s, cut into {stages} at {split.starts[1:]} in {cut_s:.2f}s")

    # dropout follows the stages' mode, through a parent module too
    parent = nn.ModuleList(split.stages)
    parent.train()
    batch = (inputs, target)
    assert not torch.equal(_seeded(lambda: split.run(batch), 1), _seeded(lambda: split.run(batch), 2))
    parent.eval()
    lm.eval()
    a, b = _seeded(lambda: split.run((inputs, target)), 1), _seeded(lambda: split.run((inputs, target)), 2)
    assert torch.equal(a, b)
    assert torch.equal(a, lm.training_step((inputs, target), 0))


def test_loss_module_silences_logging_and_takes_the_loss_key():
    from lightning.pytorch import LightningModule

    logged: list[str] = []

    class Logs(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
            self.scale = nn.Parameter(torch.ones(()))  # the LightningModule's own parameter

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.body(x).squeeze(-1) * self.scale - y) ** 2).mean()
            self.log("loss", loss)
            self.log_dict({"twice": 2 * loss})
            return {"loss": loss, "other": loss.detach()}

        def log(self, name, value, **kwargs) -> None:
            logged.append(name)

        def log_dict(self, values, **kwargs) -> None:
            logged.extend(values)

    torch.manual_seed(0)
    lm = Logs().to(F64)
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, dtype=F64)
    split = split_module(loss_module(lm), ((x, y),), 2, ["body.2"])
    loss = split.run((x, y))
    assert logged == []
    assert dict(split.stages[1].named_parameters())["scale"] is lm.scale
    assert torch.equal(loss, lm.training_step((x, y), 0)["loss"])
    assert logged == ["loss", "twice"]  # the LightningModule's own logging is back


def test_dropout_switches_with_train_and_eval():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 6), nn.Dropout(0.5)).to(F64)
    x = torch.randn(4, 6, dtype=F64)
    split = split_module(m.eval(), (x,), 2, ["2"])
    assert not split.stages[0].training  # left in the module's mode
    assert torch.equal(split.run(x), m(x))
    split.train()
    m.train()
    assert torch.equal(_seeded(lambda: split.run(x)), _seeded(lambda: m(x)))
    assert not torch.equal(_seeded(lambda: split.run(x), 1), _seeded(lambda: split.run(x), 2))


class Recurrent(nn.Module):
    """A linear layer, a two-layer recurrent layer with dropout between its layers, a head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.rnn = getattr(nn, kind)(8, 8, num_layers=2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.inp(x))[0])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_recurrent_dropout_follows_train_and_eval(kind: str):
    """``aten.lstm``/``gru``/``rnn_tanh`` hold their train flag as a constant of the trace: each
    stage passes its own mode, so dropout between the layers is on in train mode (the module's
    masks, under the same seed) and off in eval mode, as ``module.eval()`` has it; and the op
    draws in a random-stream unit of its own."""
    torch.manual_seed(0)
    m = Recurrent(kind).to(F64)
    x = torch.randn(3, 5, 4, dtype=F64)
    split = split_module(m, (x,), 3)
    assert "rnn" in split.units  # the unit that begins at the recurrent layer draws
    assert torch.equal(_seeded(lambda: split.train().run(x)), _seeded(lambda: m.train()(x)))
    assert not torch.equal(_seeded(lambda: split.run(x), 1), _seeded(lambda: split.run(x), 2))  # dropout is on
    assert torch.equal(_seeded(lambda: split.eval().run(x), 1), m.eval()(x))
    assert torch.equal(_seeded(lambda: split.run(x), 1), _seeded(lambda: split.run(x), 2))  # and off


class Noised(nn.Module):
    """A step that draws in either mode, as a diffusion model's training step draws its noise and
    timesteps: ``randn_like`` and ``randint`` before the network, not dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.scale = nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn_like(x)
        t = torch.randint(0, 10, (x.shape[0],))
        return ((self.net(x + noise * self.scale(t)) - noise) ** 2).mean()


def test_a_step_that_draws_is_checked_under_the_same_seeds():
    """The eval-mode check seeds both runs as the train-mode one does: a step that draws its own
    noise is split (it was refused as a forward the graph does not capture), and the stages draw
    the module's numbers in both modes."""
    torch.manual_seed(0)
    m = Noised().to(F64)
    x = torch.randn(6, 4, dtype=F64)
    split = split_module(m, (x,), 2)
    for mode in (True, False):
        m.train(mode)
        split.train(mode)
        assert torch.equal(_seeded(lambda: split.run(x)), _seeded(lambda: m(x)))
    assert not torch.equal(_seeded(lambda: split.run(x), 1), _seeded(lambda: split.run(x), 2))


class Counter(nn.Module):
    """Scales by how often it has been called: a Python value the trace takes as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_real_mismatch_names_the_first_op_that_differs():
    """Seeding both runs alike hides nothing: a forward that does what the graph does not capture
    is still refused, and the sentence names the first op whose result differs, and its module."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Counter(), nn.Linear(4, 2)).to(F64)
    with pytest.raises(SplitError) as e:
        split_module(m, (torch.randn(2, 4, dtype=F64),), 2)
    msg = one_sentence(e)
    assert "differ from its output" in msg and "first at aten.mul in '2' (Counter)" in msg


# ---- (5b) micro-batches of another size ------------------------------------------------------------


class Reshapes(nn.Module):
    """Reads the batch size in its first module and uses it in its last (``view(n, ...)``), as
    Hugging Face models build a mask of the batch's size once and pass it to every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = self.body(torch.tanh(self.embed(x)))
        return self.head(h.view(n, 2, 4)).sum(1)


def test_stages_take_micro_batches_of_any_size_and_read_sizes_off_their_inputs():
    m = Reshapes().to(F64)
    split = split_module(m, (torch.randn(4, 6, dtype=F64),), 3, ["body", "head"])
    sizes = [n for st in split.stages[:-1] for n in st.graph.nodes if n.op == "output"
             for v in n.args[0] if isinstance(v.meta.get("val"), torch.SymInt)]
    assert sizes == [], "a size crosses stages: it is read off the stage's own input instead"
    for rows in (1, 3, 7):
        x = torch.randn(rows, 6, dtype=F64)
        assert torch.equal(split.run(x), m(x))
    with pytest.raises(ValueError, match=r"of shape \(n, 6\) and dtype torch.float64, and got one of shape \(n, 5\)"):
        split.run(torch.randn(3, 5, dtype=F64))


# ---- (6) what is refused -------------------------------------------------------------------------


def test_bad_split_points():
    m = Chain().to(F64)
    x = torch.randn(2, 8, dtype=F64)
    with pytest.raises(SplitError) as e:
        split_module(m, (x,), 2, ["blocks.9"])
    msg = one_sentence(e)
    assert "'blocks.9'" in msg and "not a submodule" in msg and "'blocks.1'" in msg
    with pytest.raises(SplitError) as e:
        split_module(m, (x,), 3, ["blocks.3", "blocks.1"])
    assert "'blocks.1'" in one_sentence(e) and "order" in str(e.value)
    with pytest.raises(SplitError) as e:
        split_module(m, (x,), 3, ["blocks.1"])
    assert "needs 2 split points" in one_sentence(e)
    with pytest.raises(SplitError) as e:
        split_module(m, (x,), 2, ["blocks"])
    assert "stage 0 empty" in one_sentence(e)
    m.unused = nn.Linear(2, 2)
    with pytest.raises(SplitError) as e:
        split_module(m, (x,), 2, ["unused"])
    assert "never called" in one_sentence(e)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_data_dependent_branch_is_refused():
    m = nn.Sequential(nn.Linear(4, 4), Gate()).to(F64)
    with pytest.raises(SplitError) as e:
        split_module(m, (torch.randn(2, 4, dtype=F64),), 2, ["1"])
    msg = one_sentence(e)
    assert "'1' (Gate)" in msg and "x.sum() > 0" in msg and "tensor data" in msg


class MaskCheck(nn.Module):
    """Branches on a mask it builds from constants, as nn.Transformer does on its tgt_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[0], x.shape[0], dtype=x.dtype), 1)
        if (mask == 0).any():
            x = mask @ x
        return self.lin(x)


def test_branch_on_a_constant_is_taken():
    m = nn.Sequential(nn.Linear(4, 4), MaskCheck(), nn.Linear(4, 4)).to(F64)
    x = torch.randn(3, 4, dtype=F64)
    split = split_module(m, (x,), 2, ["1"])
    assert torch.equal(split.run(x), m(x))
    assert "triu" in split.stages[1].code and "item" not in split.stages[1].code.replace("getitem", "")


def test_untraceable_op_is_one_sentence():
    class Numpy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.detach().numpy() * 2)

    with pytest.raises(SplitError) as e:
        split_module(nn.Sequential(nn.Linear(4, 4), Numpy()), (torch.randn(2, 4),), 2, ["1"])
    msg = one_sentence(e)
    assert "'1'" in msg and "x.detach().numpy()" in msg and e.value.__cause__ is not None


def test_batchnorm_in_train_mode_is_refused_and_left_untouched():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(F64)
    before = m[1].running_mean.clone()
    with pytest.raises(SplitError) as e:
        split_module(m, (torch.randn(8, 4, dtype=F64),), 2, ["2"])
    assert "BatchNorm1d '1'" in one_sentence(e) and "self.stages" in str(e.value)
    assert torch.equal(m[1].running_mean, before) and m.training


def test_cut_before_an_in_place_op_is_refused_and_auto_avoids_it():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 4)).to(F64)
    x = torch.randn(3, 4, dtype=F64)
    with pytest.raises(SplitError) as e:
        split_module(m, (x,), 2, ["1"])
    assert "in-place relu_" in one_sentence(e) and "'1'" in str(e.value)
    split = split_module(m, (x,), 3)
    assert "1" not in split.starts and torch.equal(split.run(x), m(x))


# ---- stages follow the device they are moved to --------------------------------------------------


class MakesTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + torch.arange(5, device=x.device, dtype=x.dtype)


def test_tensors_made_in_forward_follow_the_stage_device():
    m = MakesTensors().to(F64)
    x = torch.randn(2, 5, dtype=F64)
    split = split_module(m, (x,), 2, ["b"])
    last = copy.deepcopy(split.stages[1]).to("meta")  # as the runtime's skeleton copies do
    out = last(*[torch.empty(2, 5, dtype=F64, device="meta")])
    assert out.device.type == "meta"
