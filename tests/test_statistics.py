"""Pass 1's statistics on every kernel: float64 sums, so a finite gradient never counts as non-finite and steps as the
fp64 reference does up to the documented bound (`skewadam.kernels.eager`: the fp32 second moment must hold
``(1 - beta2) * mean(g^2)``); a bank slice is idle only when its gradient has no nonzero element, decided by
statistics a reducer can sum across shards; the C++ kernel's state-shape error names the parameter's shape.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_cases import impl, three_pass  # noqa: F401 - fixtures
from reference import RefParam
from skewadam import SkewAdam, kernels
from skewadam.kernels import cpu, types
from skewadam.state import is_bank

# every tier: a factored matrix with momentum, a 1-D tensor, a factored bank, a router (full second moment), an
# unfactored bank
SPECS = [((6, 9), "backbone", {}), ((7,), "backbone", {}), ((3, 5, 9), "expert", {}), ((4, 8), "router", {}),
         ((3, 4, 6), "expert", {"use_factored": False})]
HP = dict(lr=0.01, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-30, eps_mode="add")
#: The largest |g| whose first step keeps the fp32 second moment finite (`skewadam.kernels.eager`'s docstring).
BOUND = math.sqrt(torch.finfo(torch.float32).max / (1 - HP["betas"][1]))


def _train(impl, specs, grads, dtype, *, three_pass=False, hp=HP, init=1.0, **kw):
    """One optimizer over ``specs`` (initial weights of scale ``init``) stepped on each list of ``grads``; with a
    reference per parameter."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, dtype=torch.float64) * init).to(dtype)) for s, _, _ in specs]
    opt = SkewAdam([{"params": [p], "tier": t, **o} for p, (_, t, o) in zip(params, specs)], impl=impl, **hp, **kw)
    if three_pass:
        opt._reducer = lambda items: None  # the three passes of the distributed seam, nothing to reduce
    refs = [RefParam(p.detach(), momentum=g["use_momentum"], factored=g["use_factored"],
                     bank=is_bank(p.ndim, g["tier"], g["bank"])) for p, g in zip(params, opt.param_groups)]
    for step in grads:
        for p, g, ref in zip(params, step, refs):
            p.grad = g.to(dtype)
            ref.step(p.grad, **hp)
        opt.step()
    return params, opt, refs


def _grads(specs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s, _, _ in specs]


def _assert_matches(params, opt, refs, tol):
    for p, ref in zip(params, refs):
        assert all(bool(v.isfinite().all()) for v in opt.state[p].values())
        scale = ref.value.abs().max().item()
        assert (p.detach().double() - ref.value).abs().max().item() <= tol * scale, tuple(p.shape)


def test_grad_stats_are_float64_for_every_parameter_dtype(impl):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        params, opt, _ = _train(impl, SPECS, [_grads(SPECS)], dtype)
        mod = kernels.resolve_backend(impl, torch.device("cpu")).load()
        for i, group in enumerate(opt.param_groups):
            [stats] = mod.grad_stats(opt._init_group(group, i, i)[1])
            present = [t for t in stats if t is not None]
            assert present and all(t.dtype == torch.float64 for t in present), (dtype, stats)
            assert (stats.absmax is not None) == (dtype == torch.float64)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_element_of_1_9e19_steps_finite(impl, three_pass, dtype, skip_nonfinite):
    """Its square overflows fp32: the sums of squares once did too, so the step was skipped as non-finite
    (skip_nonfinite=True) or turned the weights NaN (False). Now it steps, as torch's AdamW does, like the fp64
    reference."""
    grads = _grads(SPECS)
    for g in grads:
        g.view(-1)[1] = 1.9e19
    params, opt, refs = _train(impl, SPECS, [grads, _grads(SPECS, seed=2)], dtype, three_pass=three_pass,
                               skip_nonfinite=skip_nonfinite)
    assert opt.skipped_steps == 0
    _assert_matches(params, opt, refs, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ordinary_huge_and_tiny_rows_of_one_tensor_step_like_the_reference(impl, three_pass, dtype):
    """A matrix of several summation blocks (a kernel may add a block in float where that is safe, in double where
    not): rows of 1e20 (their squares overflow fp32) and of 1e-18 (sums below 2^-90) among ordinary ones, in a
    backbone matrix and an unfactored router."""
    specs = [((300, 1000), "backbone", {}), ((256, 128), "router", {})]
    grads = _grads(specs)
    for g in grads:
        g[7] *= 1e20
        g[-40:] *= 1e-18
    params, opt, refs = _train(impl, specs, [grads, _grads(specs, seed=2)], dtype, three_pass=three_pass)
    _assert_matches(params, opt, refs, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("eps_mode, eps", [("add", 1e-30), ("floor", 1e-30), ("floor", 1e-3)])
def test_expert_slices_clip_like_the_reference_where_weighted_sums_hold_it_or_not(impl, three_pass, eps_mode, eps,
                                                                                  dtype):
    """Bank slices of several summation blocks (the C++ kernel takes an fp32 or bf16 slice's clip's sum of u^2 from
    pass 1's weighted column sums, `cpu.weighted`, and re-reads the gradient where those do not hold it; an fp32 slice
    is split on a core of 1 MiB of L2, a bf16 one early): in slice 0 a spike
    makes the clip bite (rms(u) well above 1); slice 1 has a zero row, a zero column, a row of 1e20 (its squares
    overflow fp32) and rows of 1e-18 (sums below 2^-90), which eps_mode floor with eps 1e-3 floors. Both step like
    the fp64 reference."""
    if impl == "triton":
        pytest.skip("Triton's interpreter takes minutes on these sizes: tests/test_triton.py checks the reference")
    specs = [((2, 600, 600), "expert", {})]
    assert 600 > cpu.BLOCK // 600 >= cpu.MIN_BLOCK_ROWS  # several blocks of rows a slice
    steps = []
    for seed in (1, 2, 3):
        (g,) = _grads(specs, seed)
        g[0, 3, 5] = 300.0
        g[1, 10] = 0.0
        g[1, :, 20] = 0.0
        g[1, 7] *= 1e20
        g[1, -40:] *= 1e-18
        steps.append([g])
    hp = {**HP, "eps_mode": eps_mode, "eps": eps}
    # bf16: weights of 1e-3 that the updates (lr 0.01 a step) outgrow, so that bf16's rounding of them (~1e-3 of
    # their scale a step) stays far below what a wrong clip would move
    params, opt, refs = _train(impl, specs, steps, dtype, three_pass=three_pass, hp=hp,
                               init=1.0 if dtype == torch.float32 else 1e-3)
    _assert_matches(params, opt, refs, 1e-5 if dtype == torch.float32 else 1e-2)


def test_nonfinite_gradients_are_still_skipped(impl, three_pass):
    for bad in (float("inf"), float("nan")):
        grads = _grads(SPECS)
        grads[2][1, 0, 0] = bad
        params, opt, _ = _train(impl, SPECS, [_grads(SPECS), grads], torch.float32, three_pass=three_pass)
        assert opt.skipped_steps == 1, bad
        assert all(bool(p.isfinite().all()) for p in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_step_exactly_up_to_the_documented_bound(impl, dtype):
    """|g| = sqrt(FLT_MAX / (1 - beta2)) on every element (a row's mean of g^2 is then g^2): just below, every tier
    steps like the fp64 reference, its state finite; just above, the first step's fp32 second moment overflows and
    the update vanishes: the weights are only decayed."""
    sign = [torch.randn(s, generator=torch.Generator().manual_seed(3)).sign() for s, _, _ in SPECS]
    params, opt, refs = _train(impl, SPECS, [[x * 0.99 * BOUND for x in sign]], dtype)
    _assert_matches(params, opt, refs, 1e-5 if dtype == torch.float32 else 2e-2)
    params, opt, _ = _train(impl, SPECS, [[x * 1.01 * BOUND for x in sign]], dtype)
    torch.manual_seed(0)  # _train's initial values
    for (shape, _, _), p in zip(SPECS, params):
        second = [v for k, v in opt.state[p].items() if k in ("exp_avg_sq", "row_var", "col_var")]
        assert any(bool(v.isinf().any()) for v in second), shape
        decayed = torch.randn(shape, dtype=torch.float64).to(dtype).float() * (1 - HP["lr"] * HP["weight_decay"])
        if dtype == torch.float32:
            assert torch.equal(p.detach(), decayed), shape
        else:
            assert (p.detach().float() - decayed).abs().max() <= decayed.abs().max() * 2**-7, shape


@pytest.mark.parametrize("dtype, tiny", [(torch.float32, 1e-23), (torch.float32, 1e-45), (torch.bfloat16, 1e-23),
                                         (torch.float64, 1e-170), (torch.float64, 5e-324)])
def test_a_bank_slice_with_a_tiny_nonzero_gradient_is_active(impl, three_pass, dtype, tiny):
    """Idle means all-zero: slice 1's gradient is ``tiny`` everywhere (its squares underflow fp32, for fp64 fp64 too),
    slice 2's one element; both count a step and move like the reference; slice 0 (all zero) stays as it was."""
    specs = [((3, 5, 9), "expert", {}), ((3, 4, 6), "expert", {"use_factored": False, "use_momentum": True})]
    grads = []
    for s, _, _ in specs:
        g = torch.zeros(s, dtype=torch.float64)
        g[1] = tiny
        g[2, 1, 1] = -tiny
        grads.append(g)
    params, opt, refs = _train(impl, specs, [_grads(specs), grads], dtype, three_pass=three_pass)
    for p, ref in zip(params, refs):
        assert opt.state[p]["step"].tolist() == [1.0, 2.0, 2.0]
        torch.testing.assert_close(p.detach().double(), ref.value, rtol=1e-5 if dtype != torch.bfloat16 else 1e-2,
                                   atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_an_unchecked_bank_slice_with_a_nan_gradient_is_left_untouched(impl, three_pass, dtype):
    """Without the non-finite check a NaN reaches no weight of a bank: its slice is idle (`types.active_units`; fp64
    decides by max |g|, where kernels' maxima take a NaN differently, and the NaN sum), the other slices step."""
    specs = [((3, 5, 9), "expert", {}), ((3, 4, 6), "expert", {"use_factored": False, "use_momentum": True})]
    params, opt, _ = _train(impl, specs, [_grads(specs)], dtype, three_pass=three_pass, skip_nonfinite=False)
    before = [p.detach().clone() for p in params]
    grads = _grads(specs, seed=2)
    for g in grads:
        g[1, 2, 3] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g.to(dtype)
    opt.step()
    for p, b in zip(params, before):
        assert opt.state[p]["step"].tolist() == [2.0, 1.0, 2.0]
        assert torch.equal(p[1], b[1]) and not torch.equal(p[0], b[0]) and bool(p.isfinite().all())


def test_activity_is_decidable_from_shards_summed(impl):
    """A bank row-sharded in two: each shard's statistics (`types.stat_dims`: what a reducer sums), added, tell the
    active slices as the whole tensor's do; slice 1's only nonzero element (1e-170, whose square underflows fp64) lies
    in the second shard."""
    mod = kernels.resolve_backend(impl, torch.device("cpu")).load()
    shards, whole = [], torch.zeros(3, 8, 5, dtype=torch.float64)
    whole[0] = 1.0
    whole[1, 6, 2] = 1e-170
    for rows in (slice(0, 4), slice(4, 8)):
        p = torch.nn.Parameter(torch.zeros(3, 4, 5, dtype=torch.float64))
        p.grad = whole[:, rows].clone()
        opt = SkewAdam([{"params": [p], "tier": "expert"}], impl=impl)
        record = opt._init_group(opt.param_groups[0], 0, 0)[1]
        record = record._replace(params=[record.params[0]._replace(shape=(3, 8, 5))])
        shards.append(mod.grad_stats(record)[0])
    summed = [a + b for a, b in zip(*[[t for t, dims in types.stat_dims(st, 3, True) if 1 in dims] for st in shards])]
    reduced = shards[0]._replace(sumsq=summed[0], absmax=summed[-1])
    assert types.active_units(reduced).view(-1).tolist() == [True, True, False]
    assert types.active_units(shards[0]).view(-1).tolist() == [True, False, False]


def test_a_state_of_another_shape_is_named_with_the_parameter_s_shape(impl):
    p = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    opt = SkewAdam([p], impl=impl)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p]["row_var"] = torch.zeros(5, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'row_var' has shape .5, 1., a parameter of shape .3, 4. needs (shape )?"
                                         r".3, 1."):
        opt.step()
