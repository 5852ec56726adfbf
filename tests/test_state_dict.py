"""Checkpoints: save -> torch.save -> torch.load(weights_only=True) -> load into a fresh model and optimizer -> keep
stepping gives, bitwise, the run that was never interrupted (bf16 stochastic rounding and expert banks included), on
every kernel; and `load_state_dict` refuses what does not fit, changing nothing."""

from __future__ import annotations

import io
import re

import pytest
import torch
from torch import nn

from optim_db import every_impl  # noqa: F401 (autouse fixture: every test on every kernel)
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


# ------------------------------------------------------------------------------------------------ refused at load
def _stepped(dtype=torch.float32):
    params, opt = _build(dtype)
    _run(opt, params, range(2))
    return params, opt


def _everything(params, opt) -> tuple:
    """What a refused load must leave as it was: weights, state, hyperparameters, the skip count."""
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {n: p.detach().clone() for n, p in params.items()}, state, groups, opt.skipped_steps


def _assert_unchanged(before, after) -> None:
    for a, b in zip(before[:2], after[:2], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], dict):
                assert a[name].keys() == b[name].keys() and all(torch.equal(a[name][k], b[name][k]) for k in a[name])
            else:
                assert torch.equal(a[name], b[name])
    assert before[2:] == after[2:]


@pytest.mark.parametrize("key,value", [("lr", -5), ("tier", "bogus"), ("betas", (2, 2)), ("eps_mode", "sqrt"),
                                       ("momentum_dtype", "fp8")])
def test_load_refuses_invalid_hyperparameters_with_the_constructors_message(key, value):
    params, opt = _stepped()
    bad = opt.state_dict()
    bad["param_groups"][1][key] = value
    target_params, target = _stepped()
    before = _everything(target_params, target)
    with pytest.raises(ValueError) as at_load:
        target.load_state_dict(bad)
    with pytest.raises(ValueError) as at_construction:
        SkewAdam([{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": [torch.nn.Parameter(torch.ones(2))],
                                                                    key: value}])
    assert str(at_load.value) == str(at_construction.value) and "param group 1" in str(at_load.value)
    _assert_unchanged(before, _everything(target_params, target))


def test_load_refuses_a_torch_adamw_state_dict_and_says_what_it_is():
    params, _ = _build(torch.float32)
    adamw = torch.optim.AdamW([{"params": list(params.values())[:4]}, {"params": [params["experts.w1"]]},
                               {"params": [params["router.weight"]]}])
    for p in params.values():
        p.grad = torch.ones_like(p)
    adamw.step()
    target_params, target = _stepped()
    before = _everything(target_params, target)
    with pytest.raises(ValueError, match=r"param group 0 of the state dict is not SkewAdam's: .*'amsgrad'.* and no "
                                         r"tier; it looks like the state dict of torch.optim.AdamW"):
        target.load_state_dict(adamw.state_dict())
    _assert_unchanged(before, _everything(target_params, target))


def test_load_refuses_state_without_exp_avg_where_the_group_has_momentum():
    params, opt = _stepped()
    bad = opt.state_dict()
    del bad["state"][2]["exp_avg"]  # proj.weight: backbone, momentum on
    target_params, target = _stepped()
    before = _everything(target_params, target)
    with pytest.raises(ValueError, match=r"state of parameter 2 of param group 0 \(tier 'backbone'\): state has keys "
                                         r".*\(missing \['exp_avg'\]\)"):
        target.load_state_dict(bad)
    _assert_unchanged(before, _everything(target_params, target))


def test_load_refuses_state_of_another_shape_or_momentum_dtype():
    a = nn.Parameter(torch.randn(8, 6))
    oa = SkewAdam([a])
    a.grad = torch.randn_like(a)
    oa.step()
    b = nn.Parameter(torch.randn(16, 12))
    ob = SkewAdam([b])
    with pytest.raises(ValueError, match=r"state 'exp_avg' is \[8, 6\] torch.float32, expected \[16, 12\]"):
        ob.load_state_dict(oa.state_dict())
    assert not ob.state
    int8 = oa.state_dict()
    int8["param_groups"][0]["momentum_dtype"] = "int8"  # the state is fp32 momentum: it does not fit
    with pytest.raises(ValueError, match=r"\(missing \['exp_avg_scale'\]\)"):
        SkewAdam([nn.Parameter(a.detach().clone())]).load_state_dict(int8)


def test_a_python_number_step_is_loaded_as_a_tensor():
    """Older checkpoints and other tools save ``step`` as a number; the resumed run equals the tensor-step one."""
    params, opt = _stepped()
    resumed = []
    for as_number in (False, True):
        ckpt = _checkpoint(params, opt)  # its own tensors: a loaded state aliases them, as torch's does
        if as_number:
            for state in ckpt["optim"]["state"].values():
                if state["step"].ndim == 0:  # a bank's step is one count per slice: it stays a tensor
                    state["step"] = int(state["step"].item())
        resumed.append(_resume(ckpt, torch.float32, False))
        _run(resumed[-1][1], resumed[-1][0], range(2, 4))
    assert all(s["step"].dtype == torch.float32 for s in resumed[1][1].state.values())
    _assert_bitwise(*resumed[0], *resumed[1])


# ------------------------------------------------------------------------------------ checkpoints checked by value
def _refused(bad: dict, match: str) -> None:
    """Loading ``bad`` into a stepped optimizer raises a ValueError matching ``match`` and changes nothing."""
    target_params, target = _stepped()
    before = _everything(target_params, target)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(bad)
    _assert_unchanged(before, _everything(target_params, target))


# (parameter id in the state dict, key, value written into it, the rule the message names)
BAD_VALUES = {
    "nan_row_var": (2, "row_var", float("nan"), "finite and >= 0"),
    "negative_col_var": (2, "col_var", -1.0, "finite and >= 0"),
    "inf_exp_avg_sq": (5, "exp_avg_sq", float("inf"), "finite and >= 0"),
    "nan_exp_avg": (2, "exp_avg", float("nan"), "finite"),
    "nan_step": (2, "step", float("nan"), "a whole number >= 0"),
    "negative_step": (0, "step", -3.0, "a whole number >= 0"),
    "fractional_step": (2, "step", 2.5, "a whole number >= 0"),
    "negative_bank_step": (4, "step", -1.0, "a whole number >= 0"),
}


@pytest.mark.parametrize("pid, key, value, rule", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_a_checkpoint_with_nonfinite_or_negative_statistics_or_steps_is_refused_naming_the_tensor(pid, key, value,
                                                                                                   rule):
    """No step leaves a non-finite statistic, a negative sum of squares or a step count that is no whole number >= 0:
    a checkpoint holding one is refused at the load (it would poison the weights at the next step)."""
    _, opt = _stepped()
    bad = opt.state_dict()
    bad["state"][pid] = {k: v.clone() for k, v in bad["state"][pid].items()}
    bad["state"][pid][key].view(-1)[0] = value
    _refused(bad, rf"state of parameter \d \(?.*of param group \d .*: state '{key}' holds 1 value\(s\) that are not "
                  rf"{rule} .*the checkpoint is corrupted")


@pytest.mark.parametrize("key", ["lr", "betas", "tier", "momentum_dtype", "beta2_decay", "params"])
def test_a_checkpoint_group_missing_a_hyperparameter_is_refused_naming_it(key):
    """A saved group without ``lr`` (saved 0.5) is refused, not given the constructor's value: nothing is filled in."""
    _, opt = _stepped()
    opt.param_groups[2]["lr"] = 0.5
    bad = opt.state_dict()
    del bad["param_groups"][2][key]
    _refused(bad, rf"param group 2 of the state dict has no \['{key}'\]: .*nothing is filled in")


@pytest.mark.parametrize("idx, key, value", [(0, "tier", "router"), (0, "tier", "expert"), (1, "experts", 2)])
def test_a_checkpoint_group_whose_tier_contradicts_the_optimizers_is_refused_naming_the_key(idx, key, value):
    """A checkpoint's groups are the optimizer's: group 0 saved as ``tier='router'`` over the backbone's settings is
    refused, not relabelled (state_bytes would report backbone bytes as the router's)."""
    _, opt = _stepped()
    bad = opt.state_dict()
    bad["param_groups"][idx][key] = value
    _refused(bad, rf"param group {idx} of the state dict has {key}={value!r}, this optimizer's param group {idx} "
                  rf"{key}=")


@pytest.mark.parametrize("missing", [("state",), ("param_groups",), ("state", "param_groups")])
def test_a_state_dict_missing_a_top_level_key_is_refused_naming_it(missing):
    _, opt = _stepped()
    bad = {k: v for k, v in opt.state_dict().items() if k not in missing}
    _refused(bad, "the state dict has no " + " and no ".join(f"'{k}'" for k in missing))


@pytest.mark.parametrize("value", [-1, 1.5, None, True])
def test_a_checkpoint_skip_count_that_is_no_whole_number_is_refused(value):
    _, opt = _stepped()
    _refused({**opt.state_dict(), "skipped_steps": value}, "skipped_steps is .*, expected a whole number >= 0")


def test_a_checkpoint_of_another_tiering_or_recipe_is_refused_naming_the_groups_of_both():
    """Saved by an optimizer whose groups differ (all in one tier; the quality recipe's orthogonal groups): the
    error lists both sets of groups (tier, update, size) instead of torch's "different number of parameter
    groups", and nothing changes."""
    from skewadam.bench.models import MoETransformer, get_config

    params, _ = _build(torch.float32)
    one_tier = SkewAdam([{"params": list(params.values()), "tier": "backbone"}], lr=1e-2)
    for p in params.values():
        p.grad = torch.ones_like(p)
    one_tier.step()
    _refused(one_tier.state_dict(), re.escape("the state dict's param groups are not this optimizer's: saved [0] "
                                              "backbone (6 tensors); this optimizer [0] backbone (4 tensors), [1] "
                                              "expert (1 tensor), [2] router (1 tensor). It was saved by an "
                                              "optimizer built with other tiers or another recipe"))
    model = MoETransformer(get_config("tiny"))
    quality = SkewAdam.from_model(model, recipe="quality", log=False).state_dict()
    paper = SkewAdam.from_model(model, log=False)
    with pytest.raises(ValueError, match=r"saved .*\[\d\] backbone orthogonal \(\d+ tensors\).*; this optimizer "
                                         r"\[0\] backbone \(\d+ tensors\)"):
        paper.load_state_dict(quality)
