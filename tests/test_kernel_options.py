"""Adafactor's options inside the kernels' passes (`skewadam.kernels.types.Group.relative_step` and ``beta2_decay``):
every kernel equals the fp64 reference on every tier, banks with per-slice step counts included, both eps modes, on
one process's step and on the three passes of the distributed seam; the C++ kernel's element-wise state is bitwise
eager's and its fused step bitwise its three passes, with the options as without.

The groups are given to the kernels as records (`step_records`), the options set on the optimizer's own records.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import impl  # noqa: F401 - a fixture
from reference import RefParam
from skewadam import SkewAdam, kernels
from skewadam.state import is_bank

# (shape, tier, overrides, initial scale): every rank, banks (slice 0 idle on odd steps, so slices count steps
# apart), momentum and factoring both ways; the scales put rms(p) above and below RELATIVE_STEP_EPS (a bank's per
# slice: the clip of the relative step is per unit).
SPECS = [
    ((), "backbone", {}, 0.5),
    ((7,), "backbone", {}, 2e-4),
    ((5, 9), "backbone", {}, 0.05),
    ((2, 3, 4, 5), "backbone", {}, 0.3),
    ((3, 5, 9), "expert", {}, (0.2, 0.01, 1e-4)),
    ((4, 7, 13), "expert", {"use_momentum": True}, 0.05),
    ((6, 8), "router", {}, 0.02),
    ((3, 6, 10), "expert", {"use_factored": False}, (0.1, 3e-4, 0.03)),
    ((3, 6, 10), "expert", {"bank": False}, 0.1),
]
OPTIONS = {"relative_step": {"relative_step": True}, "beta2_decay": {"beta2_decay": -0.8},
           "both": {"relative_step": True, "beta2_decay": -0.5}}
HP = dict(lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)


def _initial(specs, dtype):
    torch.manual_seed(0)
    out = []
    for shape, _, _, scale in specs:
        x = torch.randn(shape, dtype=torch.float64)
        x *= torch.tensor(scale, dtype=torch.float64).view(-1, *[1] * (len(shape) - 1)) if isinstance(scale, tuple) \
            else scale
        out.append(x.to(dtype))
    return out


def _grads(specs, steps, dtype):
    gen = torch.Generator().manual_seed(1)
    out = []
    for k in range(steps):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s, _, _, _ in specs]
        for g in grads:
            if g.ndim == 3 and k % 2:
                g[0].zero_()  # an expert that received no token: its slice and its count stay as they are
        out.append(grads)
    return out


@torch.no_grad()
def step_records(impl, specs, steps, dtype, options, *, three_pass=False, eps_mode="floor", **kw):
    """Train ``specs`` for ``steps`` through the kernel's records with ``options`` set on them: one process's
    ``step_``, or (``three_pass``) the three passes with nothing reduced between them. Returns the parameters and the
    optimizer holding their state."""
    params = [torch.nn.Parameter(x) for x in _initial(specs, dtype)]
    opt = SkewAdam([{"params": [p], "tier": t, **o} for p, (_, t, o, _) in zip(params, specs)], impl=impl,
                   eps=1e-8 if eps_mode == "floor" else 1e-30, eps_mode=eps_mode, **HP, **kw)
    mod = kernels.resolve_backend(impl, torch.device("cpu")).load()
    for grads in _grads(specs, steps, dtype):
        for p, g in zip(params, grads):
            p.grad = g
        groups = [opt._init_group(group, i, i)[1]._replace(**options) for i, group in enumerate(opt.param_groups)]
        if three_pass:
            stats = [mod.grad_stats(group) for group in groups]
            moments = [mod.update_moments_(group, st) for group, st in zip(groups, stats)]
            for group, mo in zip(groups, moments):
                mod.apply_updates_(group, mo)
        else:
            assert not bool(mod.step_(groups, skip_nonfinite=True))
    return params, opt


def _reference(specs, steps, opt, options, eps_mode):
    refs = [RefParam(x, momentum=g["use_momentum"], factored=g["use_factored"],
                     bank=is_bank(x.ndim, g["tier"], g["bank"]))
            for x, g in zip(_initial(specs, torch.float64), opt.param_groups)]
    b1, b2 = HP["betas"]
    for grads in _grads(specs, steps, torch.float64):
        for ref, g in zip(refs, grads):
            ref.step(g, lr=HP["lr"], betas=(b1, b2), eps=1e-8 if eps_mode == "floor" else 1e-30, eps_mode=eps_mode,
                     weight_decay=HP["weight_decay"], **options)
    return [ref.value for ref in refs]


@pytest.mark.parametrize("eps_mode", ["floor", "add"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("three_pass", [False, True], ids=["one-process", "three-pass"])
def test_adafactor_options_match_the_fp64_reference(impl, option, eps_mode, three_pass):
    params, opt = step_records(impl, SPECS, 12, torch.float64, OPTIONS[option], three_pass=three_pass,
                               eps_mode=eps_mode)
    expected = _reference(SPECS, 12, opt, OPTIONS[option], eps_mode)
    without = _reference(SPECS, 12, opt, {}, eps_mode)
    for (shape, _, _, _), p, ref, plain in zip(SPECS, params, expected, without):
        assert (p - ref).abs().max().item() <= 1e-12, shape
    # the options change every tensor's update (the check can fail)
    assert min((ref - plain).abs().max().item() for ref, plain in zip(expected, without)) > 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adafactor_options_match_the_reference_in_fp32_and_bf16(impl, dtype):
    """fp32 to its rounding; bf16 within the spread stochastic rounding gives (its mean is unbiased)."""
    options = OPTIONS["both"]
    params, opt = step_records(impl, SPECS, 8, dtype, options)
    expected = _reference(SPECS, 8, opt, options, "floor")
    for (shape, _, _, _), p, ref in zip(SPECS, params, expected):
        scale = ref.abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (p.double() - ref).abs().max().item() <= tol * scale, shape


needs_cpp = pytest.mark.skipif("cpp" not in kernels.cpu_backends(), reason="the C++ CPU kernel does not build here")
MOMENTUM = ["fp32", "bf16", "int8"]


@needs_cpp
@pytest.mark.parametrize("momentum_dtype", MOMENTUM)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
def test_cpp_element_wise_state_with_the_options_is_bitwise_eager_s(option, dtype, momentum_dtype):
    """The contract of `skewadam.kernels.cpu` with the options: step counts, the first moment in every storage and
    the full second moment (its per-slice beta2_t included) bitwise; the fused step bitwise the three passes."""
    if dtype == torch.float64 and momentum_dtype == "bf16":
        pytest.skip("bf16 momentum of fp64 parameters is refused")
    kw = dict(momentum_dtype=momentum_dtype)
    a, opt_a = step_records("eager", SPECS, 6, dtype, OPTIONS[option], **kw)
    b, opt_b = step_records("cpp", SPECS, 6, dtype, OPTIONS[option], **kw)
    c, opt_c = step_records("cpp", SPECS, 6, dtype, OPTIONS[option], three_pass=True, **kw)
    compared = set()
    for (shape, _, _, _), x, y, z in zip(SPECS, a, b, c):
        assert torch.equal(y, z), shape
        for key, value in opt_a.state[x].items():
            assert torch.equal(opt_b.state[y][key], opt_c.state[z][key]), (shape, key)
            if key in ("step", "exp_avg", "exp_avg_scale", "exp_avg_sq"):
                assert torch.equal(opt_b.state[y][key], value), (shape, key)
                compared.add(key)
        if dtype != torch.bfloat16:
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    assert {"step", "exp_avg", "exp_avg_sq"} <= compared
