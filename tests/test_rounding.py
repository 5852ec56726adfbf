"""bf16 parameters: unbiased, reproducible stochastic rounding; weight decay that survives bf16; fp32 state."""

from __future__ import annotations

import math

import pytest
import torch

from skewadam import SkewAdam
from skewadam.kernels.rounding import _mix32_, mix32, rounding_key, stochastic_round_bf16

N = 1 << 16  # draws per value


def _neighbours(x: float) -> tuple[float, float]:
    """The two bf16 values around fp32 ``x``: truncated toward zero, and one ULP further from zero."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32)
    lo = (bits & -65536).view(torch.float32)
    hi = ((bits & -65536) + 65536).view(torch.float32)
    return lo.item(), hi.item()


VALUES = {
    "one_eighth_ulp_above_1": 1.0 + 2**-10,
    "negative": -(1.0 + 2**-10),
    "carries_into_exponent": 2.0 - 2**-9,
    "pi": math.pi,
    "small": 1e-3 * math.pi,
    "fp32_subnormal": 3e-39,
}


@pytest.mark.parametrize("x", list(VALUES.values()), ids=list(VALUES))
def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_not(x):
    x32 = torch.tensor(x, dtype=torch.float32).item()
    lo, hi = _neighbours(x32)
    out = stochastic_round_bf16(torch.full((N,), x32), key=12345).double()
    assert set(out.unique().tolist()) <= {lo, hi}  # only the two neighbours
    p_up = (x32 - lo) / (hi - lo)
    sigma = math.sqrt(p_up * (1 - p_up) / N)
    assert abs((out == hi).double().mean().item() - p_up) < 5 * sigma
    # The mean is x to within 5 standard errors; round-to-nearest misses it by far more.
    tol = 5 * abs(hi - lo) * sigma
    assert abs(out.mean().item() - x32) < tol
    rtn = torch.tensor(x32).to(torch.bfloat16).double().item()
    assert abs(rtn - x32) > 10 * tol


def test_stochastic_rounding_is_unbiased_across_keys():
    x = torch.tensor([1.0 + 3 * 2**-10, -(1.0 + 3 * 2**-10)])  # p_up = 3/8
    ups = torch.stack([stochastic_round_bf16(x, key=k).float().abs() > 1.0 + 2**-8 for k in range(2048)])
    sigma = math.sqrt(3 / 8 * 5 / 8 / 2048)
    assert ((ups.double().mean(0) - 3 / 8).abs() < 5 * sigma).all()


def test_neighbouring_elements_round_independently():
    """One 32-bit hash serves two neighbours (its low and high halves): their decisions must be uncorrelated."""
    up = (stochastic_round_bf16(torch.full((N,), 1.0 + 2**-8), key=7) > 1.0).double()  # p_up = 1/2
    for a, b in [(up[0::2], up[1::2]), (up[1:-1:2], up[2::2])]:  # within a pair, across pairs
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(a.numel())


@pytest.mark.parametrize("x", [0.0, -0.0, 1.0, -2.5, 2**-130, float("inf"), float("-inf"), 3.3895313892515355e38])
def test_bf16_representable_values_are_unchanged(x):
    t = torch.full((8,), x)
    out = stochastic_round_bf16(t, key=99)
    assert torch.equal(out.view(torch.int16), t.to(torch.bfloat16).view(torch.int16))  # sign of zero included


def test_rounding_is_a_pure_function_of_key_and_index():
    x = torch.randn(4097, generator=torch.Generator().manual_seed(0))
    a, b, c = (stochastic_round_bf16(x, key=k) for k in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # element i's bits depend on i, not on the tensor around it
    assert torch.equal(stochastic_round_bf16(x[:100], key=5), a[:100])
    assert torch.equal(stochastic_round_bf16(x.view(17, 241), key=5).view(-1), a)


def test_tensor_hash_matches_scalar_mix32():
    vals = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    got = _mix32_(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [mix32(v) for v in vals]
    assert rounding_key(0, 1, 2) != rounding_key(0, 2, 1) != rounding_key(1, 1, 2)



# ------------------------------------------------------------------------------------- NaN and inf, every kernel
def _rounder(kernel: str):
    """``round(x, key)`` of one kernel: eager (this module), the C++ kernel where it builds, Triton on a GPU or in its
    interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA, as tests/test_triton.py runs it)."""
    if kernel == "eager":
        return stochastic_round_bf16
    if kernel == "cpp":
        from skewadam.kernels import cpu

        if not cpu.available():
            pytest.skip("the C++ CPU kernel does not build here")
        return cpu.stochastic_round_bf16
    pytest.importorskip("triton")
    from skewadam.kernels import triton as tk

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not tk.available(device):
        pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")
    return lambda x, key: tk.stochastic_round_bf16(x.to(device), key).cpu()


# fp32 bit pattern: the bf16 patterns it may round to (every draw of the random bits lands in the set)
SPECIAL = {
    0x7FC00000: {0x7FC0},  # NaN
    0xFFC00000: {0x7FC0},  # -NaN (x86's default NaN): the sign is dropped, as c10::BFloat16 does
    0x7FA5A5A5: {0x7FC0},  # a payload
    0x7F800001: {0x7FC0},  # a payload in the low half only: the add alone could truncate it to inf
    0xFF80FFFF: {0x7FC0},  # the same, negative
    0x7FFFFFFF: {0x7FC0},  # all ones: the add alone could carry it past the sign bit, to -0
    0xFFFFFFFF: {0x7FC0},  # -NaN, all ones: the add alone could wrap it to +0
    0x7F800000: {0x7F80},  # inf
    0xFF800000: {0xFF80},  # -inf
    0x7F7FFFFF: {0x7F7F, 0x7F80},  # the largest fp32: the largest bf16, or (almost always) a carry into inf
    0xFF7FFFFF: {0xFF7F, 0xFF80},
    0x7F7F8000: {0x7F7F, 0x7F80},  # halfway between the largest bf16 and inf
}
COPIES = 512  # draws of each value


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("kernel", ["eager", "cpp", "triton"])
@pytest.mark.parametrize("key", [0, 0xDEADBEEF, rounding_key(7, 3, 11)])
def test_nan_rounds_to_0x7fc0_and_inf_stays_inf_on_every_kernel(kernel, key):
    """Rule: a NaN, whatever its sign and payload, rounds to c10::BFloat16's NaN 0x7FC0 (not to inf or zero, where
    adding the random bits to its pattern would carry); inf stays inf; the largest finite values round to one of their
    two neighbours, inf above; every kernel writes eager's bits."""
    x_fp32 = torch.tensor(list(SPECIAL), dtype=torch.int64).to(torch.int32).view(torch.float32).repeat(COPIES)
    got = _bf16_bits(_rounder(kernel)(x_fp32, key)).view(COPIES, len(SPECIAL))
    for j, (pattern, allowed) in enumerate(SPECIAL.items()):
        seen = set(got[:, j].tolist())
        assert seen <= allowed, (kernel, hex(pattern), sorted(map(hex, seen)))
        assert max(allowed) in seen, (kernel, hex(pattern))  # NaN, inf, and the carries into inf do happen
    assert set(got[:, list(SPECIAL).index(0x7F7F8000)].tolist()) == SPECIAL[0x7F7F8000]  # p = 1/2 each
    if kernel != "eager":
        assert torch.equal(got, _bf16_bits(stochastic_round_bf16(x_fp32, key)).view(COPIES, len(SPECIAL)))


# ------------------------------------------------------------------------------------------------ in the optimizer
@pytest.mark.parametrize("tier", ["backbone", "expert", "router"])
def test_state_of_bf16_params_is_fp32(tier):
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(), (5,), (6, 4), (3, 4, 5)]]
    opt = SkewAdam(params, tier=tier, use_momentum=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        assert p.dtype == torch.bfloat16
        assert {k: v.dtype for k, v in opt.state[p].items()} == dict.fromkeys(opt.state[p], torch.float32)


def test_bf16_weight_decay_shrinks_weights_like_fp32_on_average():
    """lr * wd = 2e-4 is below half a bf16 ULP (2^-9 relative): decaying the bf16 weight, as the paper's code does,
    changes nothing; fused into the fp32 update and rounded stochastically, it shrinks bf16 weights as fp32 ones."""
    lr, wd, steps = 1e-3, 0.2, 100
    w0 = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    assert torch.equal(w0.bfloat16().mul(1 - lr * wd), w0.bfloat16())  # round-to-nearest decay is a no-op
    ratios = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(w0.to(dtype, copy=True))
        opt = SkewAdam([w], lr=lr, weight_decay=wd)
        for _ in range(steps):
            w.grad = torch.zeros_like(w)
            opt.step()
        ratios[dtype] = (w.detach().float() * w0).sum().item() / w0.square().sum().item()
    expected = (1 - lr * wd) ** steps  # 0.9802
    assert ratios[torch.float32] == pytest.approx(expected, rel=1e-5)
    assert ratios[torch.bfloat16] == pytest.approx(expected, abs=2e-3)  # ~10 sigma; no decay is 10x further


def test_bf16_updates_are_reproducible_given_the_seed():
    def run(seed):
        w = torch.nn.Parameter(torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).bfloat16())
        opt = SkewAdam([w], lr=1e-3, weight_decay=0.1, seed=seed)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            w.grad = torch.randn(32, 16, generator=gen).bfloat16()
            opt.step()
        return w.detach()

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_bf16_bank_rounds_each_step_and_skips_idle_slices():
    w0 = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    w = torch.nn.Parameter(w0.clone())
    opt = SkewAdam([{"params": [w], "tier": "expert"}], lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        w.grad = torch.randn(3, 8, 8).bfloat16()
        w.grad[1] = 0
        opt.step()
    assert torch.equal(w.detach()[1], w0[1])
    assert not torch.equal(w.detach()[0], w0[0])
    assert opt.state[w]["step"].tolist() == [3, 0, 3]
