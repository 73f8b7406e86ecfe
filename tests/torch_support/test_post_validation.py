"""The provisional optimizer step and its in-place rollback (launcher.torch_support.post_validation)
against the optimizer's own step, in float64: a step taken with one clipping coefficient and
validated with another ends where a direct step with the second would; a non-finite validation
restores the state before the step; a confirmed step changes nothing; and 20 steps of a staged
model with clipping at 1.0 equal the plain loop with ``clip_grad_norm_``."""

from __future__ import annotations

import copy
import importlib
from typing import Any, Callable

import pytest
import torch
from torch import nn

from launcher.torch_support.post_validation import ProvisionalStep, rollback_support

#: each optimizer and setting inverted, as a user writes it
OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_dampening_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "sgd_nesterov_wd_max": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.05,
                                                      maximize=True),
    "sgd_wd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_wd_max": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, maximize=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), foreach=True),
}

STATE_RTOL = 1e-14


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative distance of ``a`` from ``b`` (absolute where ``b`` is zero)."""
    d = (a.double() - b.double()).norm().item()
    n = b.double().norm().item()
    return d / n if n > 0 else d


def state_err(a: torch.optim.Optimizer, pa: list[torch.Tensor],
              b: torch.optim.Optimizer, pb: list[torch.Tensor]) -> float:
    """The largest relative distance between two optimizers' parameters and state, which must hold
    the same keys (a rolled-back first step leaves no state, as before it)."""
    err = max(rel_err(x, y) for x, y in zip(pa, pb))
    for x, y in zip(pa, pb):
        sa, sb = a.state.get(x, {}), b.state.get(y, {})
        assert sorted(sa) == sorted(sb)
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                err = max(err, rel_err(sa[k], sb[k]))
    return err


def make(name: str, seed: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer, Any]:
    """Parameters of random shapes, the optimizer, and a learning-rate schedule stepped after each
    optimizer step (as Lightning does with ``interval="step"``), which changes ``lr`` every step."""
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(int(d) for d in torch.randint(1, 9, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g))
              for _ in range(4)]
    ps = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    opt = OPTIMIZERS[name](ps)
    return ps, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.8**t)


# the reference skips the first step (non-finite) but still steps its schedule, as the launcher does
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("name, keep_copy", [(n, False) for n in sorted(OPTIMIZERS)] +
                         [("sgd_momentum", True), ("adamw", True)])
def test_a_step_validated_with_another_coefficient_ends_as_a_direct_step(name, keep_copy):
    ps, opt, sched = make(name, 0)
    rps, ropt, rsched = make(name, 0)
    step = ProvisionalStep(opt, keep_copy=keep_copy)
    g = torch.Generator().manual_seed(1)
    # (provisional, true): a rollback and redo, a confirmed step, the non-finite skip (also on the
    # first step, whose state the step creates), and a smaller coefficient after a larger one
    plan = [(1.0, None), (1.0, 0.4), (0.7, 0.7), (0.9, 0.25), (1.0, None), (0.3, 0.6), (1.0, 1.0)]
    worst, rollbacks = 0.0, 0
    for c1, c2 in plan:
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ps]
        for p, rp, gr in zip(ps, rps, grads):
            p.grad, rp.grad = gr.clone(), gr.clone()
        before = copy.deepcopy((ps, opt.state_dict()))
        step.take(c1)
        after = copy.deepcopy((ps, opt.state_dict()))
        sched.step()  # the scheduler changes lr before the validation arrives
        rolled = step.validate(c2)
        rollbacks += rolled
        assert rolled == (c2 != c1)
        if c2 is not None:
            for rp in rps:
                rp.grad.mul_(c2)
            ropt.step()
        rsched.step()
        err = state_err(opt, ps, ropt, rps)
        worst = max(worst, err)
        assert err <= STATE_RTOL, f"{name}: {err:.2e} after take({c1}) validate({c2})"
        if c2 is None:  # (b) the state before the step, to the same tolerance
            bp, bstate = before
            assert max(rel_err(x, y) for x, y in zip(ps, bp)) <= STATE_RTOL
            assert len(opt.state_dict()["state"]) == len(bstate["state"])
        if c2 == c1:  # (c) bit-equal to the state the step left
            ap, astate = after
            assert all(torch.equal(x, y) for x, y in zip(ps, ap))
            assert all(torch.equal(v, astate["state"][i][k]) for i, s in opt.state_dict()["state"].items()
                       for k, v in s.items())
        assert opt.param_groups[0]["lr"] == rsched.get_last_lr()[0]  # the scheduler's value is put back
    assert step.rollbacks == rollbacks == 5 and step.skipped == 2
    assert step.redo_s > 0  # the rollbacks' CPU, which metrics.json's prediction charges
    print(f"\n{name}{' keep_copy' if keep_copy else ''}: largest relative error {worst:.2e}")


class Staged(nn.Module):
    """Three stages of a small MLP with dropout, as a pipeline holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1)),
                                     nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1)),
                                     nn.Linear(16, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return x


def clip_coef(norm: float, max_norm: float = 1.0) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


@pytest.mark.parametrize("name", ["sgd_momentum", "sgd_nesterov_wd_max", "adam", "adamw"])
def test_twenty_pipelined_steps_with_clipping_equal_the_plain_loop(name):
    torch.manual_seed(0)
    model = Staged().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(36, 6, dtype=torch.float64), torch.randint(0, 3, (36,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))  # drop_last=False: a batch of 4
    batches = [b for _ in range(4) for b in loader][:20]

    def optimizers(m: Staged) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        opts = [OPTIMIZERS[name](list(s.parameters())) for s in m.stages]
        return opts, [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + 0.05 * t)) for o in opts]

    opts, scheds = optimizers(model)
    ropts, rscheds = optimizers(ref)
    steps = [ProvisionalStep(o) for o in opts]
    differ, clipped = 0, 0
    for t, (xb, yb) in enumerate(batches):
        for m in (model, ref):
            torch.manual_seed(t)  # the same dropout masks in both
            # the mean loss times 1.5: the global norm crosses clipping's 1.0 on some steps, not all
            (nn.functional.cross_entropy(m(xb), yb) * 1.5).backward()
            if t == 7:  # a non-finite gradient on the last stage: every stage's step is skipped
                m.stages[2].bias.grad[0] = float("inf")
        # reference: the global norm, clipping, every optimizer's own step (none when non-finite)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        if torch.isfinite(norm):
            clipped += bool(norm > 1.0)
            for o in ropts:
                o.step()
        # post-validation: stage s steps with the norm of stages 0..s, the true state comes back after
        sq = [sum(p.grad.pow(2).sum().item() for p in s.parameters()) for s in model.stages]
        partial = [sum(sq[:s + 1]) for s in range(3)]
        coefs = [clip_coef(n**0.5) if n < float("inf") else None for n in partial]
        for s, c in zip(steps, coefs):
            s.take(c)
        for o in [*opts, *ropts]:
            o.zero_grad()
        for sch in [*scheds, *rscheds]:
            sch.step()
        for s, c in zip(steps, coefs):
            differ += c != coefs[-1]
            s.validate(coefs[-1])
    errs = [rel_err(p, r) for p, r in zip(model.parameters(), ref.parameters())]
    print(f"\n{name}: parameters after 20 steps, largest relative error {max(errs):.2e}; "
          f"{clipped} clipped steps, {sum(s.rollbacks for s in steps)} rollbacks")
    assert max(errs) <= 1e-12
    assert 0 < clipped < 19  # clipping binds on some steps, not all
    assert sum(s.rollbacks for s in steps) == differ > 0
    assert steps[-1].rollbacks == 0  # the last stage's partial state is the full one
    assert [s.skipped for s in steps] == [1, 1, 0]  # the non-finite step, rolled back where it was taken


def test_default_cpu_implementation_is_the_single_tensor_one_inverted(monkeypatch):
    # the default (foreach=None, fused=None) on CPU tensors is the single-tensor loop
    called = []
    for module, fn in (("torch.optim.adam", "_single_tensor_adam"), ("torch.optim.sgd", "_single_tensor_sgd")):
        mod = importlib.import_module(module)
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _real=real, _fn=fn, **k: (called.append(_fn), _real(*a, **k))[1])
    for make_opt in (lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        p.grad = torch.ones(3, dtype=torch.float64)
        step = ProvisionalStep(make_opt([p]))
        step.take(0.5)
        step.validate(0.25)
    assert called == ["_single_tensor_adam"] * 2 + ["_single_tensor_sgd"] * 2


@pytest.mark.parametrize("make_opt, reason", [
    (lambda ps: torch.optim.LBFGS(ps), "it keeps a history"),
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), "param group 0 has amsgrad=True"),
    (lambda ps: torch.optim.AdamW(ps, fused=True), "param group 0 has fused=True"),
    (lambda ps: torch.optim.Adam(ps, capturable=True), "param group 0 has capturable"),
    (lambda ps: torch.optim.Adam(ps, betas=(0.0, 0.99)), "param group 0 has betas=(0.0"),
    (lambda ps: torch.optim.RMSprop(ps), "its update has no inverse"),
])
def test_an_optimizer_that_cannot_roll_back_is_named_in_one_sentence(make_opt, reason):
    opt = make_opt([torch.zeros(2, requires_grad=True)])
    why = rollback_support(opt)
    assert why is not None and why.startswith(f"{type(opt).__name__} cannot be rolled back in place: {reason}")
    assert why.endswith(".") and why.count(". ") == 0  # one sentence
    with pytest.raises(ValueError, match="cannot be rolled back in place"):
        ProvisionalStep(opt)
    assert rollback_support(torch.optim.AdamW([torch.zeros(2, requires_grad=True)])) is None


def test_validate_after_a_skipped_step_needs_a_non_finite_state():
    p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    p.grad = torch.full((2,), float("nan"), dtype=torch.float64)
    step = ProvisionalStep(torch.optim.SGD([p], lr=0.1))
    step.take(None)
    with pytest.raises(ValueError, match="true_coef=0.5 is finite, but the provisional step saw a non-finite value"):
        step.validate(0.5)
    step.take(None)
    assert not step.validate(None) and step.rollbacks == 0 and torch.equal(p, torch.zeros(2, dtype=torch.float64))
    assert step.redo_s == 0.0  # nothing rolled back, nothing redone


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_a_gradient_spike_costs_precision_in_place_and_none_with_the_copy(name):
    # ten steps on gradients of one size, then one 10^4 times larger, undone (the non-finite skip):
    # in place, the recovered moment cancels (v' - (1 - b2) g^2); the copy comes back bit-equal
    errs = {}
    for keep_copy in (False, True):
        ps, opt, _ = make(name, 3)
        g = torch.Generator().manual_seed(4)
        for _ in range(10):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e-2
            opt.step()
        before = copy.deepcopy((ps, opt.state_dict()["state"]))
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e2
        step = ProvisionalStep(opt, keep_copy=keep_copy)
        step.take(1.0)
        assert step.validate(None)
        bp, bstate = before
        errs[keep_copy] = max([rel_err(x, y) for x, y in zip(ps, bp)] +
                              [rel_err(v, bstate[i][k]) for i, st in opt.state_dict()["state"].items()
                               for k, v in st.items()])
    print(f"\n{name}: a 10^4x gradient undone in place: {errs[False]:.1e}; with keep_copy: {errs[True]:.1e}")
    assert 1e-14 < errs[False] < 1e-6 and errs[True] == 0.0
