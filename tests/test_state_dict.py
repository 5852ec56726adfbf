"""Checkpoints: save -> torch.save -> torch.load(weights_only=True) -> load into a fresh model and optimizer -> keep
stepping gives, bitwise, the run that was never interrupted (bf16 stochastic rounding and expert banks included)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from skewadam import SkewAdam

#: name -> (shape, group): every tier, ranks 0-d to 4-d, an expert bank.
LAYOUT = {
    "scale": ((), 0),
    "norm.weight": ((6,), 0),
    "proj.weight": ((6, 4), 0),
    "conv.weight": ((3, 2, 3, 3), 0),
    "experts.w1": ((4, 5, 6), 1),
    "router.weight": ((4, 6), 2),
}
GROUP_KW = [{"weight_decay": 0.1}, {"tier": "expert", "weight_decay": 0.1}, {"tier": "router"}]
N, K = 4, 3  # steps before and after the checkpoint
SKIP_AT = 1  # this step's gradients hold an inf: the step is skipped and counted


def _build(dtype, *, named=False, init_seed=0):
    gen = torch.Generator().manual_seed(init_seed)
    params = {n: nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for n, (s, _) in LAYOUT.items()}
    groups = [dict(kw, params=[]) for kw in GROUP_KW]
    for name, (_, g) in LAYOUT.items():
        groups[g]["params"].append((name, params[name]) if named else params[name])
    return params, SkewAdam(groups, lr=1e-2, eps_mode="floor")


def _run(opt, params, steps):
    """Gradients are a pure function of the step index, so a resumed run sees the same ones."""
    for t in steps:
        gen = torch.Generator().manual_seed(1000 + t)
        for name, p in params.items():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) * (10.0 if t % 2 else 1e-3)
        params["experts.w1"].grad[t % 4] = 0.0  # an idle expert
        if t == SKIP_AT:
            params["proj.weight"].grad[0, 0] = float("inf")
        opt.step()


def _checkpoint(params, opt) -> dict:
    buf = io.BytesIO()
    torch.save({"model": {n: p.detach() for n, p in params.items()}, "optim": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, map_location="cpu")


def _resume(ckpt, dtype, named):
    params, opt = _build(dtype, named=named, init_seed=1)  # a fresh model: different init
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(ckpt["model"][name])
    opt.load_state_dict(ckpt["optim"])
    return params, opt


def _assert_bitwise(params_a, opt_a, params_b, opt_b):
    for name in LAYOUT:
        a, b = params_a[name], params_b[name]
        assert a.dtype == b.dtype and torch.equal(a, b), name
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, (name, key)
            assert sa[key].device == sb[key].device, (name, key)
            assert torch.equal(sa[key], sb[key]), (name, key)


@pytest.mark.parametrize("named", [False, True], ids=["ids", "named"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_resumed_run_is_bitwise_identical_to_uninterrupted(dtype, named):
    straight_params, straight = _build(dtype, named=named)
    _run(straight, straight_params, range(N + K))

    params, opt = _build(dtype, named=named)
    _run(opt, params, range(N))
    resumed_params, resumed = _resume(_checkpoint(params, opt), dtype, named)
    _run(resumed, resumed_params, range(N, N + K))

    _assert_bitwise(straight_params, straight, resumed_params, resumed)
    assert straight.skipped_steps == resumed.skipped_steps == 1
    assert straight.state[straight_params["experts.w1"]]["step"].tolist() != [N + K - 1] * 4  # idle slices lag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_state_dict_round_trip_is_deterministic(dtype):
    params, opt = _build(dtype)
    _run(opt, params, range(N))
    saved = opt.state_dict()
    loaded = _checkpoint(params, opt)["optim"]
    _, fresh = _resume({"model": {n: p.detach() for n, p in params.items()}, "optim": loaded}, dtype, False)
    again = fresh.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    assert again["skipped_steps"] == saved["skipped_steps"] == 1
    assert again["state"].keys() == saved["state"].keys()
    for i, state in saved["state"].items():
        for key, value in state.items():
            assert again["state"][i][key].dtype == value.dtype and torch.equal(again["state"][i][key], value)


def test_fp32_state_of_bf16_params_stays_fp32_after_load():
    params, opt = _build(torch.bfloat16)
    _run(opt, params, range(2))
    ckpt = _checkpoint(params, opt)
    _, fresh = _resume(ckpt, torch.bfloat16, False)
    for p in fresh.state:
        assert p.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for v in fresh.state[p].values())
    # what the override prevents: torch's own load casts floating state to the parameter's dtype
    _, plain = _build(torch.bfloat16, init_seed=1)
    torch.optim.Optimizer.load_state_dict(plain, {k: v for k, v in ckpt["optim"].items() if k != "skipped_steps"})
    assert any(v.dtype == torch.bfloat16 for s in plain.state.values() for v in s.values())


def test_named_state_dict_records_parameter_names():
    params, opt = _build(torch.float32, named=True)
    _run(opt, params, range(1))
    names = [g["param_names"] for g in _checkpoint(params, opt)["optim"]["param_groups"]]
    assert names == [["scale", "norm.weight", "proj.weight", "conv.weight"], ["experts.w1"], ["router.weight"]]


def test_skipped_steps_round_trip():
    params, opt = _build(torch.float32)
    _run(opt, params, range(N))
    opt.skipped_steps = 7
    ckpt = _checkpoint(params, opt)
    assert ckpt["optim"]["skipped_steps"] == 7
    assert _resume(ckpt, torch.float32, False)[1].skipped_steps == 7


def test_state_dict_of_an_unstepped_optimizer_loads():
    params, opt = _build(torch.float32)
    ckpt = _checkpoint(params, opt)
    assert ckpt["optim"]["state"] == {} and ckpt["optim"]["skipped_steps"] == 0
    resumed_params, resumed = _resume(ckpt, torch.float32, False)
    _run(resumed, resumed_params, range(2))
    _run(opt, params, range(2))
    _assert_bitwise(params, opt, resumed_params, resumed)


def test_loaded_hyperparameters_replace_the_constructor_ones():
    params, opt = _build(torch.float32)
    opt.param_groups[2]["lr"] = 0.5
    opt.param_groups[0]["seed"] = 3
    _, fresh = _resume(_checkpoint(params, opt), torch.float32, False)
    assert fresh.param_groups[2]["lr"] == 0.5 and fresh.param_groups[0]["seed"] == 3
    assert [g["tier"] for g in fresh.param_groups] == ["backbone", "expert", "router"]
