"""SkewAdam's math against the float64 reference, and the torch optimizer contract over `optim_db.CASES` x dtype, each
on every kernel available here (`optim_db.every_impl`)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import reference
from optim_db import CASES, DTYPES, Case, case_id, every_impl, make_grads, make_params  # noqa: F401 (fixture)
from reference import RefParam
from torch.optim.optimizer import register_optimizer_step_pre_hook
from skewadam import SkewAdam
from skewadam.state import is_bank

CASE_PARAMS = [pytest.param(c, id=case_id(c)) for c in CASES]
DTYPE_PARAMS = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in DTYPES]


def _snapshot(opt: SkewAdam, params) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _assert_same(a, b) -> None:
    """Bitwise equality of two `_snapshot`s (weights and every state tensor, dtype included)."""
    for x, y in zip(a[0], b[0], strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    for sx, sy in zip(a[1], b[1], strict=True):
        assert sx.keys() == sy.keys()
        for k in sx:
            assert sx[k].dtype == sy[k].dtype and torch.equal(sx[k], sy[k]), k


# ---------------------------------------------------------------------------------------------- reference equivalence
class _BranchProbe:
    """Stands in for ``torch`` (and the builtin ``max``) inside tests/reference.py and counts the branches it takes:
    calls of the ``eps`` floor that changed some entry, and RMS clips with ``rms(u) > 1`` vs ``<= 1``."""

    def __init__(self, eps: float):
        self.eps = eps
        self.floored = 0
        self.clipped = 0
        self.unclipped = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def clamp(self, x, *, min):
        if min == self.eps and bool((x < min).any()):
            self.floored += 1
        return torch.clamp(x, min=min)

    def max(self, one, rms):
        if rms > one:
            self.clipped += 1
        else:
            self.unclipped += 1
        return max(one, rms)


# Tiny gradients (the eps floor binds), a jump of 9 decades (the RMS clip binds), then moderate ones.
_SCALES = [1e-7] * 8 + [1e2] * 10 + [1e-3] * 6
_LR, _BETAS = 1e-2, (0.5, 0.999)
RANKS = {"0d": (), "1d": (5,), "2d": (6, 7), "3d": (3, 6, 7), "4d_conv": (4, 3, 5, 6)}


def _check_against_reference(monkeypatch, shape, tier, flags, weight_decay, eps_mode) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 7 + len(tier))
    p0 = torch.randn(shape, dtype=torch.float64, generator=gen)
    p = torch.nn.Parameter(p0.clone())
    opt = SkewAdam(
        [{"params": [p], "tier": tier, **flags}], lr=_LR, betas=_BETAS, weight_decay=weight_decay, eps_mode=eps_mode
    )
    group = opt.param_groups[0]
    bank = is_bank(p.ndim, tier, group["bank"])
    ref = RefParam(p0, momentum=group["use_momentum"], factored=group["use_factored"], bank=bank)
    probe = _BranchProbe(group["eps"])
    monkeypatch.setattr(reference, "torch", probe)
    monkeypatch.setattr(reference, "max", probe.max, raising=False)

    # A consistent direction (momentum accumulates), noise, and rows 6 decades apart (the row-ratio floor binds).
    direction = torch.randn(shape, dtype=torch.float64, generator=gen)
    rows = torch.logspace(-6, 0, shape[-2], dtype=torch.float64).view(-1, 1) if len(shape) >= 2 else 1.0
    for t, scale in enumerate(_SCALES):
        grad = scale * rows * (direction + 0.3 * torch.randn(shape, dtype=torch.float64, generator=gen))
        if bank and t % 3 == 1:
            grad[(t // 3) % shape[0]] = 0.0  # an expert that received no token this step
        p.grad = grad
        opt.step()
        ref.step(grad, lr=_LR, betas=_BETAS, eps=group["eps"], eps_mode=eps_mode, weight_decay=weight_decay)
        torch.testing.assert_close(p.detach(), ref.value, rtol=0, atol=1e-12, msg=lambda m: f"step {t + 1}: {m}")

    state = opt.state[p]
    units = ref.units
    expect = {"step": torch.tensor([float(u.t) for u in units], dtype=torch.float64).view(-1 if bank else ())}
    if group["use_momentum"]:
        expect["exp_avg"] = torch.stack([u.m for u in units]) if bank else units[0].m
    if any(u.factored for u in units):
        expect["row_var"] = torch.stack([u.row for u in units]) if bank else units[0].row
        expect["col_var"] = torch.stack([u.col for u in units]) if bank else units[0].col
    else:
        expect["exp_avg_sq"] = torch.stack([u.v for u in units]) if bank else units[0].v
    assert state.keys() == expect.keys()
    for key, want in expect.items():
        got = state[key].to(torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()), msg=key)

    # The comparison is not vacuous: both sides of the clip, and (eps_mode="floor") the floor, were exercised.
    assert probe.clipped > 0 and probe.unclipped > 0, (probe.clipped, probe.unclipped)
    if eps_mode == "floor":
        assert probe.floored > 0
    if bank:
        assert (state["step"] < len(_SCALES)).all()  # every slice sat out some steps


@pytest.mark.parametrize("eps_mode", ["floor", "add"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["wd0", "wd"])
@pytest.mark.parametrize("tier", ["backbone", "expert", "router"])
@pytest.mark.parametrize("shape", list(RANKS.values()), ids=list(RANKS))
def test_every_tier_and_rank_matches_float64_reference(monkeypatch, shape, tier, weight_decay, eps_mode):
    _check_against_reference(monkeypatch, shape, tier, {}, weight_decay, eps_mode)


OVERRIDES = {
    "backbone_no_momentum": ("backbone", (6, 7), {"use_momentum": False}),
    "backbone_full_4d": ("backbone", (4, 3, 5, 6), {"use_factored": False}),
    "expert_with_momentum": ("expert", (3, 6, 7), {"use_momentum": True}),
    "router_factored_with_momentum": ("router", (6, 7), {"use_factored": True, "use_momentum": True}),
    "expert_bank_off": ("expert", (3, 6, 7), {"bank": False}),
    "expert_bank_of_vectors": ("expert", (4, 7), {"bank": True}),
    "backbone_bank_forced": ("backbone", (3, 6, 7), {"bank": True}),
}


@pytest.mark.parametrize("eps_mode", ["floor", "add"])
@pytest.mark.parametrize("override", list(OVERRIDES.values()), ids=list(OVERRIDES))
def test_explicit_state_flags_match_float64_reference(monkeypatch, override, eps_mode):
    tier, shape, flags = override
    _check_against_reference(monkeypatch, shape, tier, flags, 0.05, eps_mode)


def test_tier_sets_state_flags_and_explicit_flags_win():
    ps = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(4)]
    opt = SkewAdam([
        {"params": [ps[0]]},
        {"params": [ps[1]], "tier": "expert"},
        {"params": [ps[2]], "tier": "router"},
        {"params": [ps[3]], "tier": "router", "use_momentum": True, "use_factored": True},
    ])
    flags = [(g["tier"], g["use_momentum"], g["use_factored"]) for g in opt.param_groups]
    assert flags == [
        ("backbone", True, True), ("expert", False, True), ("router", False, False), ("router", True, True)
    ]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    keys = [set(opt.state[p]) - {"step"} for p in ps]
    assert keys == [{"exp_avg", "row_var", "col_var"}, {"row_var", "col_var"}, {"exp_avg_sq"},
                    {"exp_avg", "row_var", "col_var"}]


# ------------------------------------------------------------------------------------- cross-check: torch.optim.Adam
@pytest.mark.parametrize("eps_mode", ["floor", "add"])
def test_router_second_moment_equals_torch_adam_exp_avg_sq(eps_mode):
    """Router tier = Adam with beta1 = 0 and eps = 0 while neither the floor nor the clip binds (gradients of order
    one that shrink keep v > eps and rms(u) < 1; ``add`` adds only 1e-30)."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(8, 16, dtype=torch.float64, generator=gen)
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    betas = (0.9, 0.95)
    opt = SkewAdam([{"params": [ours], "tier": "router"}], lr=1e-2, betas=betas, eps_mode=eps_mode)
    adam = torch.optim.Adam([theirs], lr=1e-2, betas=(0.0, betas[1]), eps=0.0)
    for t in range(25):
        grad = 0.8**t * torch.randn(8, 16, dtype=torch.float64, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        before = theirs.detach().clone()
        opt.step()
        adam.step()
        assert (before - theirs.detach()).div(1e-2).square().mean().sqrt() < 1  # the clip is inactive
        assert (opt.state[ours]["exp_avg_sq"] > opt.param_groups[0]["eps"]).all()  # so is the floor
        torch.testing.assert_close(opt.state[ours]["exp_avg_sq"], adam.state[theirs]["exp_avg_sq"], rtol=1e-12, atol=0)
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-12)
    assert opt.state[ours]["step"].item() == adam.state[theirs]["step"].item() == 25


# ------------------------------------------------------------------------------------------- generic contract (db)
def _steps(opt, params, n, *, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        make_grads(params, gen, scale)
        opt.step()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_zero_grads_are_a_noop_without_weight_decay(case, dtype):
    params = make_params(dtype)
    opt = SkewAdam(params, **{**case.kwargs, "weight_decay": 0.0})
    before = [p.detach().clone() for p in params]
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        assert all(torch.isfinite(s).all() for s in opt.state[p].values())


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_params_without_grads_are_untouched_and_get_no_state(case, dtype):
    params = make_params(dtype)
    opt = SkewAdam(params, **case.kwargs)
    with_grad, without = params[::2], params[1::2]
    before = [p.detach().clone() for p in without]
    _steps(opt, with_grad, 3)
    assert all(torch.equal(p.detach(), b) for p, b in zip(without, before))
    assert all(p not in opt.state for p in without)
    assert all(opt.state[p] for p in with_grad)  # and the others did step


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_grads_are_never_modified_in_place(case, dtype):
    params = make_params(dtype, noncontiguous=True)
    opt = SkewAdam(params, **case.kwargs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        make_grads(params, gen)
        grads = [p.grad.clone() for p in params]
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def _linear_problem(dtype, noncontiguous):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 10, generator=gen).t() if noncontiguous else torch.randn(10, 5, generator=gen)
    weight = torch.nn.Parameter(w.to(dtype))
    bias = torch.nn.Parameter(torch.randn(10, generator=gen).to(dtype))
    x = torch.randn(5, generator=gen).to(dtype)
    assert weight.is_contiguous() != noncontiguous
    return [weight, bias], lambda: (weight @ x + bias).float().square().sum()


@pytest.mark.parametrize("scheduler", ["StepLR", "ReduceLROnPlateau"])
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "noncontiguous"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_makes_progress_with_lr_schedulers(case, dtype, noncontiguous, scheduler):
    params, loss_fn = _linear_problem(dtype, noncontiguous)
    opt = SkewAdam(params, **{**case.kwargs, "lr": 0.05})
    if scheduler == "StepLR":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    else:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    initial = loss_fn().item()
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        if scheduler == "ReduceLROnPlateau":
            sched.step(loss.item())
        else:
            sched.step()
    assert loss_fn().item() < 0.5 * initial
    if scheduler == "StepLR":
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.7**3)


def _twin_groups_stepped(case, key: str, first: dict, second: dict):
    """Two groups of equal fp64 params with equal grads, differing only in ``key`` (``first``/``second``), after one
    step; returns the optimizer, the initial values and both groups' params."""
    a, b = make_params(torch.float64), make_params(torch.float64)
    kwargs = {k: v for k, v in case.kwargs.items() if k != key}
    opt = SkewAdam([{"params": a, **first}, {"params": b, **second}], **kwargs)
    p0 = [p.detach().clone() for p in a]
    make_grads(a, torch.Generator().manual_seed(0))
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    opt.step()
    return opt, p0, a, b


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_per_group_lr_scales_the_first_update(case):
    """Step 1 moves each group by ``lr * (u + wd * p)``: twice the lr, exactly twice the move."""
    _, p0, a, b = _twin_groups_stepped(case, "lr", {"lr": 1e-3}, {"lr": 2e-3})
    for x0, x, y in zip(p0, a, b):
        torch.testing.assert_close(x0 - y.detach(), 2 * (x0 - x.detach()), rtol=1e-9, atol=1e-15)
        assert not torch.equal(x0, x.detach())


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_per_group_weight_decay_is_decoupled(case):
    """Same grads, weight decay in one group only: the difference after one step is exactly ``-lr * wd * p``."""
    opt, p0, a, b = _twin_groups_stepped(case, "weight_decay", {}, {"weight_decay": 0.2})
    lr = opt.param_groups[1]["lr"]
    for x0, x, y in zip(p0, a, b):
        torch.testing.assert_close(y.detach() - x.detach(), -lr * 0.2 * x0, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_two_runs_are_bitwise_identical(case, dtype):
    runs = []
    for _ in range(2):
        params = make_params(dtype)
        opt = SkewAdam(params, **case.kwargs)
        _steps(opt, params, 4)
        runs.append(_snapshot(opt, params))
    _assert_same(*runs)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_converges_on_a_quadratic(case, dtype):
    params = make_params(dtype)
    targets = [torch.randn(p.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) for p in params]
    opt = SkewAdam(params, **{**case.kwargs, "lr": 0.2, "weight_decay": 0.0})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.3)

    def loss():
        return sum(0.5 * (p.double() - t).square().sum() for p, t in zip(params, targets))

    initial = loss().item()
    for _ in range(60):
        opt.zero_grad()
        loss().backward()
        opt.step()
        sched.step()
    assert loss().item() < 1e-2 * initial


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_converges_on_rosenbrock(dtype):
    p = torch.nn.Parameter(torch.tensor([0.0, 0.0], dtype=dtype))
    opt = SkewAdam([p], lr=0.02, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=250, gamma=0.3)
    for _ in range(800):
        opt.zero_grad()
        loss = (1 - p[0]) ** 2 + 100 * (p[1] - p[0] ** 2) ** 2
        loss.backward()
        opt.step()
        sched.step()
    torch.testing.assert_close(p.detach(), torch.ones(2, dtype=dtype), rtol=0, atol=1e-3)


# ---------------------------------------------------------------------------------- torch.optim.Optimizer machinery
def test_step_hooks_run_in_order_and_can_be_removed():
    params = make_params(torch.float32)
    opt = SkewAdam(params)
    calls = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    h3 = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global_pre", o)))
    try:
        _steps(opt, params, 1)
    finally:
        h3.remove()
    assert calls == [("global_pre", opt), ("pre", opt), ("post", opt)]
    h1.remove()
    h2.remove()
    _steps(opt, params, 1)
    assert len(calls) == 3


def test_state_dict_hooks_run():
    params = make_params(torch.float32)
    opt = SkewAdam(params)
    _steps(opt, params, 1)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load_pre", sd.pop("extra"))))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1 and "skipped_steps" in sd
    opt.load_state_dict(sd)
    assert seen == ["sd_pre", ("load_pre", 1), "load_post"]


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_deepcopy_is_independent_and_steps_identically(dtype):
    params = make_params(dtype)
    opt = SkewAdam([{"params": params[:3]}, {"params": params[3:], "tier": "expert"}], weight_decay=0.1,
                   skip_nonfinite=False)
    _steps(opt, params, 2)
    opt.skipped_steps = 3  # as if restored from a run that skipped some
    twin = copy.deepcopy(opt)
    assert (twin.skip_nonfinite, twin.skipped_steps) == (False, 3)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(q is not p for p, q in zip(params, twin_params))
    public = {k: v for k, v in vars(opt).items() if not k.startswith("_") and k not in ("state", "param_groups")}
    assert public.keys() == {"defaults", "skip_nonfinite", "skipped_steps"}
    assert public == {k: getattr(twin, k) for k in public} | {"defaults": opt.defaults}
    assert twin.defaults.items() >= opt.defaults.items()  # torch's __setstate__ adds differentiable=False
    _steps(opt, params, 2, seed=1)
    _steps(twin, twin_params, 2, seed=1)
    _assert_same(_snapshot(opt, params), _snapshot(twin, twin_params))
    _steps(twin, twin_params, 1, seed=2)  # stepping the copy leaves the original alone
    assert not torch.equal(params[2], twin_params[2])


def test_repr_shows_each_group_tier_and_size():
    a, b, c = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(2, 4, 3)), torch.nn.Parameter(
        torch.zeros(2, 3))
    opt = SkewAdam([{"params": [a]}, {"params": [b], "tier": "expert"}, {"params": [c], "tier": "router"}], lr=3e-4)
    text = repr(opt)
    assert text.startswith("SkewAdam (")
    assert "Parameter Group 0 [backbone: 1 tensors, 12 parameters]" in text
    assert "Parameter Group 1 [expert: 1 tensors, 24 parameters]" in text
    assert "Parameter Group 2 [router: 1 tensors, 6 parameters]" in text
    assert "lr: 0.0003" in text and "skipped_steps: 0" in text


def test_closure_runs_once_with_grad_enabled_and_its_loss_is_returned():
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = SkewAdam([w], lr=0.1)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = w.square().sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == [True] and loss.item() == 6.0
    assert (w.detach() < 1).all()


def test_add_param_group_applies_tier_defaults_and_validation():
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = SkewAdam([w], lr=0.1, weight_decay=0.01)
    r = torch.nn.Parameter(torch.ones(4, 3))
    opt.add_param_group({"params": r, "tier": "router"})
    group = opt.param_groups[1]
    assert (group["tier"], group["use_momentum"], group["use_factored"], group["lr"], group["weight_decay"]) == (
        "router", False, False, 0.1, 0.01)
    w.grad, r.grad = torch.ones_like(w), torch.ones_like(r)
    opt.step()
    assert set(opt.state[r]) == {"step", "exp_avg_sq"} and (r.detach() < 1).all()
    with pytest.raises(ValueError, match=r"param group 2 has unknown key\(s\) \['momentum'\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "momentum": 0.9})
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [r]})


def test_group_given_a_generator_keeps_its_params():
    model = torch.nn.Linear(3, 4)
    opt = SkewAdam([{"params": model.parameters(), "tier": "router"}])
    assert opt.param_groups[0]["params"] == list(model.parameters())


def test_named_parameters_are_accepted_and_validated():
    model = torch.nn.Linear(3, 4)
    opt = SkewAdam(model.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    with pytest.raises(TypeError, match="fp16 parameters are not supported"):
        SkewAdam(torch.nn.Linear(3, 4).half().named_parameters())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    params = make_params(torch.float32)
    opt = SkewAdam(params)
    make_grads(params, torch.Generator().manual_seed(0))
    opt.zero_grad(set_to_none=set_to_none)
    for p in params:
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


# ----------------------------------------------------------------------------------------------------- bad input
def _p(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.zeros(shape, dtype=dtype))


BAD_INPUTS = {
    "negative_lr": ({"lr": -1e-3}, ValueError, r"Invalid learning rate in param group 0: -0\.001"),
    "nan_lr": ({"lr": float("nan")}, ValueError, r"Invalid learning rate in param group 0"),
    "tensor_lr_of_2_elements": ({"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"^Tensor lr must be 1-element$"),
    "negative_tensor_lr": ({"lr": torch.tensor(-1e-3)}, ValueError, r"Invalid learning rate in param group 0: tensor"),
    "beta1_one": ({"betas": (1.0, 0.999)}, ValueError, r"Invalid beta parameter at index 0 in param group 0: 1\.0"),
    "beta1_negative": ({"betas": (-0.1, 0.999)}, ValueError, r"Invalid beta parameter at index 0"),
    "beta2_one": ({"betas": (0.9, 1.0)}, ValueError, r"Invalid beta parameter at index 1 in param group 0: 1\.0"),
    "betas_not_a_pair": ({"betas": (0.9,)}, ValueError, r"Invalid betas in param group 0.*expected a pair"),
    "eps_zero": ({"eps": 0.0}, ValueError, r"Invalid epsilon value in param group 0: 0\.0 \(expected a float > 0\)"),
    "eps_negative": ({"eps": -1e-8}, ValueError, r"Invalid epsilon value in param group 0: -1e-08"),
    "negative_weight_decay": ({"weight_decay": -0.1}, ValueError, r"Invalid weight_decay value in param group 0"),
    "bad_eps_mode": (
        {"eps_mode": "sqrt"}, ValueError, r"Invalid eps_mode in param group 0: 'sqrt' \(expected 'floor' or 'add'\)"
    ),
    "unknown_tier": (
        {"tier": "embedding"}, ValueError,
        r"param group 0: unknown tier 'embedding': use one of \['backbone', 'expert', 'router'\]",
    ),
    "non_bool_flag": (
        {"use_momentum": 1}, ValueError, r"Invalid use_momentum in param group 0: 1 \(expected True, False or None\)"
    ),
    "bad_seed": ({"seed": 1.5}, ValueError, r"Invalid seed in param group 0: 1\.5 \(expected an int\)"),
}


@pytest.mark.parametrize("kwargs,error,pattern", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_invalid_hyperparameters_raise_naming_the_group(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        SkewAdam([_p(2, 3)], **kwargs)
    # the same value given in a second param group names that group
    with pytest.raises(error, match=pattern.replace("group 0", "group 1")):
        SkewAdam([{"params": [_p(2, 3)]}, {"params": [_p(2, 3)], **kwargs}])


@pytest.mark.parametrize("shape", [(), (1,)], ids=["0d", "1-element"])
def test_a_tensor_lr_steps_like_its_float_and_schedulers_write_into_it(shape):
    """torch.compile'd loops, torchao and torchtitan keep ``lr`` a tensor; LR schedulers then fill it in place."""
    runs = []
    for lr in (torch.full(shape, 2**-5), 2**-5):  # exact in fp32: both runs step with the same lr by construction
        params = make_params(torch.float32)
        opt = SkewAdam([{"params": params[:3]}, {"params": params[3:], "tier": "expert"}], lr=lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for _ in range(4):
            _steps(opt, params, 1)
            sched.step()
        runs.append(_snapshot(opt, params))
        if isinstance(lr, torch.Tensor):
            assert opt.param_groups[0]["lr"] is lr and lr.reshape(()).item() == 2**-7
    _assert_same(*runs)


def test_unknown_group_key_raises_listing_the_valid_keys():
    pattern = r"param group 1 has unknown key\(s\) \['amsgrad', 'momentum'\]; SkewAdam groups take \["
    with pytest.raises(ValueError, match=pattern):
        SkewAdam([{"params": [_p(2)]}, {"params": [_p(2)], "momentum": 0.9, "amsgrad": True}])


@pytest.mark.parametrize(
    "dtype,pattern",
    [
        (torch.complex64, r"param group 0 \(tier 'backbone'\): complex parameters are not supported.*view_as_real"),
        (torch.float16, r"param group 0 \(tier 'backbone'\): fp16 parameters are not supported.*bf16"),
    ],
    ids=["complex", "fp16"],
)
def test_unsupported_parameter_dtypes_raise(dtype, pattern):
    with pytest.raises(TypeError, match=pattern):
        SkewAdam([_p(2, 3, dtype=dtype)])


def test_integer_parameters_raise():
    with pytest.raises(TypeError, match="parameters must be floating point, got torch.int64"):
        SkewAdam([torch.zeros(3, dtype=torch.int64)])


def test_bank_on_a_scalar_raises():
    with pytest.raises(ValueError, match="bank=True needs parameters with a leading expert dim"):
        SkewAdam([_p()], bank=True)


def test_sparse_gradient_raises_naming_its_group():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = SkewAdam([{"params": [_p(3, 4)]}, {"params": [_p(4, 4)]}, {"params": emb.parameters(), "tier": "router"}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"sparse gradients \(param group 2, tier 'router'\).*sparse=False"):
        opt.step()


# ------------------------------------------------------------------------------------------------ non-finite grads
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_nonfinite_grad_skips_the_whole_step_and_counts_it(dtype, bad):
    params = make_params(dtype)
    opt = SkewAdam([{"params": params[:2]}, {"params": params[2:], "tier": "expert"}], weight_decay=0.1)
    _steps(opt, params, 2)
    before = _snapshot(opt, params)
    gen = torch.Generator().manual_seed(5)
    make_grads(params, gen)
    params[3].grad[1, 2, 0] = bad  # one entry of one expert slice: every parameter must sit this step out
    opt.step()
    _assert_same(before, _snapshot(opt, params))
    assert opt.skipped_steps == 1 and "skipped_steps: 1" in repr(opt)
    # the skipped step leaves no trace: the run continues exactly like one that never saw it
    clean = make_params(dtype)
    clean_opt = SkewAdam([{"params": clean[:2]}, {"params": clean[2:], "tier": "expert"}], weight_decay=0.1)
    _steps(clean_opt, clean, 2)
    _steps(opt, params, 2, seed=7)
    _steps(clean_opt, clean, 2, seed=7)
    _assert_same(_snapshot(opt, params), _snapshot(clean_opt, clean))


def test_skipped_steps_add_up_between_reads():
    """Each step adds its skip flag to a count kept as a tensor (no host read); read, it is the number of skips."""
    params = make_params(torch.float32)
    opt = SkewAdam(params)
    gen = torch.Generator().manual_seed(0)
    for bad in (True, False, True, True):
        make_grads(params, gen)
        if bad:
            params[1].grad.view(-1)[0] = float("inf")
        opt.step()
    assert opt.skipped_steps == 3 and isinstance(opt.skipped_steps, int)
    make_grads(params, gen)
    params[0].grad.view(-1)[0] = float("nan")
    opt.step()
    assert opt.skipped_steps == 4


def test_nonfinite_grad_is_applied_when_skipping_is_off():
    params = make_params(torch.float32)
    opt = SkewAdam(params, skip_nonfinite=False)
    make_grads(params, torch.Generator().manual_seed(0))
    params[2].grad[0, 0] = float("nan")
    opt.step()
    assert opt.skipped_steps == 0
    assert opt.state[params[2]]["step"].item() == 1 and params[2].isnan().any()
    assert torch.isfinite(params[0]).all() and opt.state[params[0]]["step"].item() == 1


def test_kernel_records_follow_the_group_and_the_parameter_after_a_step():
    """What a record takes from its group and parameter (name, shape, bank flag, rounding stream) is kept across
    steps and rebuilt when any of them changes: the params list reordered in place, param_names set, the bank key
    changed, a parameter's data replaced by another shape."""
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(2, 4, 3))
    opt = SkewAdam([{"params": [a, b], "tier": "expert"}])

    def records():
        for p in (a, b):
            p.grad = torch.randn_like(p)
        return opt._init_group(opt.param_groups[0], 0, 0)[1].params

    opt.step()
    pts = records()
    assert [(pt.param is p, pt.shape, pt.bank, pt.stream) for pt, p in zip(pts, (a, b))] == [
        (True, (4, 3), False, 0), (True, (2, 4, 3), True, 1)]
    assert pts[0].name == "param_groups[0]['params'][0]"
    opt.param_groups[0]["params"].reverse()
    pts = records()
    assert [(pt.param is p, pt.bank, pt.stream) for pt, p in zip(pts, (b, a))] == [(True, True, 0), (True, False, 1)]
    opt.param_groups[0]["param_names"] = ["bank", "matrix"]
    assert [pt.name for pt in records()] == ["param_groups[0]['params'][0] ('bank')",
                                             "param_groups[0]['params'][1] ('matrix')"]
    opt.param_groups[0]["bank"] = False
    assert [pt.bank for pt in records()] == [False, False]
    opt.param_groups[0]["bank"] = None
    opt.state.clear()
    b.data = torch.randn(6, 5)
    records()
    opt.step()
    assert [(pt.shape, pt.bank) for pt in records()] == [((6, 5), False), ((4, 3), False)]
