"""Compact first moment: int8 block-wise and bf16 storage.

The C++ kernel stores the compact momentum itself: its bytes (int8 codes and scales, bf16 values) are eager's on any
x86-64, by construction (the same IEEE operations, each rounded on its own; a correctly rounded square root for the
int8 code), which the tests here check bitwise. (Chunked processing of large tensors: tests/test_eager.py.)
"""

from __future__ import annotations

import io

import pytest
import torch

import numpy as np

from skewadam import SkewAdam, kernels, plan
from skewadam.kernels.quant import BLOCK, dequantize, num_blocks, quantize_
from skewadam.state import is_bank

CPP = "cpp" in kernels.cpu_backends()
needs_cpp = pytest.mark.skipif(not CPP, reason="the C++ CPU kernel does not build here")


def _train(momentum_dtype, *, steps=30, seed=0, dtype=torch.float32, impl="auto"):
    torch.manual_seed(seed)
    target = torch.randn(48, 300)
    w = torch.nn.Parameter(torch.zeros(48, 300, dtype=dtype))
    b = torch.nn.Parameter(torch.zeros(300, dtype=dtype))
    opt = SkewAdam([{"params": [w, b], "momentum_dtype": momentum_dtype}], lr=3e-2, impl=impl)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((w.float() + b.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
    return w, b, opt, ((w.float() + b.float() - target) ** 2).mean().item()


def test_int8_codec_error_is_small_and_block_extremes_are_exact():
    torch.manual_seed(0)
    x = torch.randn(4, 1000) * torch.logspace(-3, 0, 1000)
    q = torch.empty_like(x, dtype=torch.int8)
    scale = torch.empty(4, num_blocks(1000))
    quantize_(q, scale, x)
    y = dequantize(q, scale)
    assert ((y - x).norm() / x.norm()).item() < 0.01
    blocks = torch.nn.functional.pad(x.abs(), (0, num_blocks(1000) * BLOCK - 1000)).view(4, -1, BLOCK)
    torch.testing.assert_close(scale, blocks.amax(-1), rtol=0, atol=0)
    # decoding and re-encoding is the identity: an idle bank slice stays bitwise untouched
    q2, scale2 = torch.empty_like(q), torch.empty_like(scale)
    quantize_(q2, scale2, y)
    assert torch.equal(q2, q) and torch.equal(scale2, scale)


def test_int8_code_is_the_ieee_rounding_of_its_formula():
    """q = round(127 * sqrt(fp32(|x| / absmax))), every operation IEEE-rounded (numpy's fp32 ops here), whatever the
    CPU: torch's CPU sqrt goes through MKL's vector math, which is not correctly rounded (here 1 in 5 fp32 roots is
    one ULP off), and at a rounding boundary that moves a code by one. Inputs: ratios within a few
    ULPs of every boundary ((k + 1/2) / 127)^2, in blocks whose absmax is 1."""
    k = torch.arange(127, dtype=torch.float64)
    edges = ((k + 0.5) / 127).square().float()
    ulps = torch.arange(-6, 7, dtype=torch.float32)
    ratios = (edges[:, None] * (1 + ulps * 2**-23)).flatten()
    n = ratios.numel()
    per = BLOCK - 1
    blocks = -(-n // per)
    signed = torch.zeros(blocks * per)
    signed[:n] = ratios * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    x = torch.cat([torch.ones(blocks, 1), signed.view(blocks, per)], dim=1)
    q = torch.empty_like(x, dtype=torch.int8)
    scale = torch.empty(blocks, 1)
    quantize_(q, scale, x)
    xn = x.numpy()
    ratio = np.abs(xn) / np.float32(1.0)
    code = np.copysign(np.rint(np.sqrt(ratio) * np.float32(127.0)), xn)
    assert np.array_equal(q.numpy(), code.astype(np.int8))
    assert (scale == 1.0).all()


@pytest.mark.parametrize("momentum_dtype,dtype", [("int8", torch.int8), ("bf16", torch.bfloat16)])
def test_compact_momentum_is_stored_compactly(momentum_dtype, dtype):
    w, b, opt, _ = _train(momentum_dtype, steps=1)
    assert opt.state[w]["exp_avg"].dtype == dtype
    if momentum_dtype == "int8":
        assert opt.state[w]["exp_avg_scale"].shape == (48, num_blocks(300))
        assert opt.state[b]["exp_avg"].dtype == torch.float32  # < 2 dims: kept in the statistics dtype
    full = _train("fp32", steps=1)[2].state_bytes().total
    assert opt.state_bytes().total < full


@pytest.mark.parametrize("momentum_dtype", ["int8", "bf16"])
def test_compact_momentum_trains_like_fp32_momentum(momentum_dtype):
    *_, loss_fp32 = _train("fp32")
    w, _, _, loss = _train(momentum_dtype)
    w32 = _train("fp32")[0]
    assert loss == pytest.approx(loss_fp32, rel=0.05)
    assert not torch.equal(w, w32)  # the compact storage really is in the loop
    assert ((w - w32).norm() / w32.norm()).item() < 0.05


@pytest.mark.parametrize("impl", kernels.cpu_backends())
@pytest.mark.parametrize("momentum_dtype", ["int8", "bf16"])
def test_compact_momentum_state_dict_round_trip_is_bitwise(momentum_dtype, impl):
    w, b, opt, _ = _train(momentum_dtype, steps=5, dtype=torch.bfloat16, impl=impl)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = SkewAdam([{"params": [w2, b2], "momentum_dtype": momentum_dtype}], lr=3e-2, impl=impl)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for key, value in opt.state[w].items():
        assert opt2.state[w2][key].dtype == value.dtype and torch.equal(opt2.state[w2][key], value)
    for p, q in ((w, w2), (b, b2)):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(w.view(torch.int16), w2.view(torch.int16))


def test_bf16_momentum_of_fp64_parameters_is_refused_with_the_alternatives():
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="momentum_dtype='bf16'.*fp64 parameters.*'fp32'.*'int8'"):
        SkewAdam([p], momentum_dtype="bf16")
    SkewAdam([p], momentum_dtype="int8")  # int8 takes any float dtype


def test_momentum_dtype_is_validated():
    with pytest.raises(ValueError, match="momentum_dtype"):
        SkewAdam([torch.nn.Parameter(torch.zeros(2, 2))], momentum_dtype="fp8")


def test_plan_int8_momentum_paper_model_about_a_third_of_a_gib():
    result = plan("paper-6.78b", optimizers=["adamw", "skewadam", "skewadam-lean"])
    stats = {name: entry.state.statistics for name, entry in result.optimizers.items()}
    assert stats["skewadam"] == 1_380_029_764
    assert 0.32 * 2**30 < stats["skewadam-lean"] < 0.35 * 2**30
    assert stats["skewadam-lean"] / stats["adamw"] < 0.007


# (shape, tier, overrides), all with momentum: 1-D to 4-D, last dims not a multiple of BLOCK (a padded last block),
# banks (factored and full second moment, slice 0 idle on odd steps), a full tensor whose C++ work items are cut at
# whole rows, and a bank slice too large for one core's cache (the C++ kernel splits it across its work items).
COMPACT_SPECS = [
    ((7,), "backbone", {}),
    ((5, 300), "backbone", {}),
    ((2, 3, 4, 520), "backbone", {}),
    ((3, 6, 9), "expert", {"use_momentum": True}),
    ((4, 40, 600), "expert", {"use_momentum": True}),
    ((3, 20, 300), "expert", {"use_momentum": True, "use_factored": False}),
    ((150, 700), "backbone", {"use_factored": False}),
    ((3, 6, 600), "expert", {"bank": False, "use_momentum": True}),
]
LARGE_SLICE = ((1, 1100, 1200), "expert", {"use_momentum": True})  # 1.3M elements: > 1.25 MiB even as int8


def _run_compact(impl, specs, momentum_dtype, dtype, *, steps=4, three_pass=False, eps_mode="add"):
    """Train each spec on fixed random gradients; bank slice 0 is idle (all-zero gradient) on odd steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s, _, _ in specs]
    groups = [{"params": [p], "tier": t, **o} for p, (_, t, o) in zip(params, specs)]
    opt = SkewAdam(groups, lr=0.01, weight_decay=0.1, momentum_dtype=momentum_dtype, eps_mode=eps_mode, impl=impl)
    if three_pass:
        opt._reducer = lambda items: None  # an identity reducer: the three passes with the distributed seam between
    banks = [is_bank(len(s), t, o.get("bank")) for s, t, o in specs]
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        for p, bank in zip(params, banks):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            if bank and k % 2:
                p.grad[0].zero_()
        opt.step()
    return params, opt


def _assert_weights_close(a, b, dtype):
    """Equal up to summation order (the kernels add the statistics in different orders): fp32 to a few ULPs; bf16,
    rounded with the same bits, at most a few elements one step apart."""
    if dtype == torch.float32:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        return
    a, b = a.detach().float(), b.detach().float()
    ulp = torch.finfo(torch.bfloat16).eps * a.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((a - b).abs() <= 2 * ulp).all()
    assert (a != b).float().mean() < 1e-2


@needs_cpp
@pytest.mark.parametrize("three_pass", [False, True], ids=["fused", "three-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum_dtype", ["bf16", "int8"])
def test_cpp_compact_momentum_stores_eager_s_bytes_and_matches_its_weights(momentum_dtype, dtype, three_pass):
    # The contract (cpu.py): the element-wise state is bitwise eager's on any x86-64; weights agree to rounding.
    specs = COMPACT_SPECS + [LARGE_SLICE]
    a, opt_a = _run_compact("eager", specs, momentum_dtype, dtype)
    b, opt_b = _run_compact("cpp", specs, momentum_dtype, dtype, three_pass=three_pass)
    for (shape, _, _), x, y in zip(specs, a, b):
        for key in ("step", "exp_avg", "exp_avg_scale", "exp_avg_sq"):
            if key in opt_a.state[x]:
                assert torch.equal(opt_b.state[y][key], opt_a.state[x][key]), (shape, key)
        _assert_weights_close(x, y, dtype)
    assert opt_b.state[b[1]]["exp_avg"].dtype == (torch.int8 if momentum_dtype == "int8" else torch.bfloat16)


@needs_cpp
@pytest.mark.parametrize("eps_mode", ["floor", "add"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum_dtype", ["bf16", "int8"])
def test_cpp_fused_step_is_bitwise_the_three_pass_path_with_compact_momentum(momentum_dtype, dtype, eps_mode):
    specs = COMPACT_SPECS + [LARGE_SLICE]
    fused, opt_f = _run_compact("cpp", specs, momentum_dtype, dtype, eps_mode=eps_mode)
    passes, opt_p = _run_compact("cpp", specs, momentum_dtype, dtype, three_pass=True, eps_mode=eps_mode)
    for (shape, _, _), x, y in zip(specs, fused, passes):
        assert torch.equal(x, y), shape
        for key, value in opt_f.state[x].items():
            assert torch.equal(value, opt_p.state[y][key]), (shape, key)


@pytest.mark.parametrize("impl", kernels.cpu_backends())
@pytest.mark.parametrize("momentum_dtype", ["bf16", "int8"])
def test_idle_bank_slice_keeps_its_compact_momentum_bytes_and_scales(momentum_dtype, impl):
    specs = [s for s in COMPACT_SPECS if s[1] == "expert" and s[2].get("bank") is not False]
    params, opt = _run_compact(impl, specs, momentum_dtype, torch.float32, steps=2)  # slice 0 idle at step 2
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    weights = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
        p.grad[0] = 0
    opt.step()
    for p, w in zip(params, weights):
        assert torch.equal(p[0], w[0]) and not torch.equal(p[1:], w[1:])
        for key, value in opt.state[p].items():
            assert torch.equal(value[0], before[p][key][0]), key
            if key in ("exp_avg", "exp_avg_scale"):
                assert not torch.equal(value[1:], before[p][key][1:]), key
