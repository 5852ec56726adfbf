"""The update kernels: every implementation equals the fp64 reference; the C++ kernel equals eager, is bitwise equal
to itself across its fused and three-pass (distributed seam) paths and across thread counts, rounds bf16 with the
bits of `skewadam.kernels.rounding`, allocates no parameter-sized buffer, and degrades to eager without a compiler.

`impl` (a fixture over `skewadam.kernels.impls()`) runs a test on every implementation usable here.
"""

from __future__ import annotations

import os

import pytest
import torch

from reference import RefParam
from skewadam import SkewAdam, kernels
from skewadam.kernels import cpu, eager, rounding
from skewadam.state import is_bank

CPP = "cpp" in kernels.impls()
needs_cpp = pytest.mark.skipif(not CPP, reason="the C++ CPU kernel does not build here")


@pytest.fixture(params=kernels.impls())
def impl(request) -> str:
    return request.param


# (shape, tier, overrides): every rank 0-d..4-d, banks (3-d expert tensors), momentum and factoring switched both ways,
# and a unit too large for one core's cache (fp64 [600, 600] slices), which the C++ kernel splits across threads.
SPECS = [
    ((), "backbone", {}),
    ((7,), "backbone", {}),
    ((5, 9), "backbone", {}),
    ((2, 3, 4, 5), "backbone", {}),
    ((3, 5, 9), "expert", {}),
    ((4, 70, 130), "expert", {"use_momentum": True}),
    ((40,), "router", {}),
    ((6, 8), "router", {}),
    ((33, 17), "expert", {"use_factored": False}),
    ((3, 6, 10), "expert", {"bank": False}),
    ((2, 600, 600), "expert", {}),
    ((300, 1000), "backbone", {"use_factored": False}),
]


def _grads(shapes, steps, dtype, seed=0):
    """Per step, a gradient per shape; bank slice 0 of 3-d expert tensors is idle (all zero) on odd steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        grads = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
        for grad in grads:
            if grad.ndim == 3 and k % 2:
                grad[0].zero_()
        out.append(grads)
    return out


def _run(impl, specs, steps, dtype, *, seed=0, reducer=None, **kw):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s, _, _ in specs]
    groups = [{"params": [p], "tier": t, **o} for p, (_, t, o) in zip(params, specs)]
    opt = SkewAdam(groups, impl=impl, **kw)
    if reducer is not None:
        opt._reducer = reducer
    for grads in _grads([s for s, _, _ in specs], steps, dtype):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("eps_mode", ["floor", "add"])
def test_every_impl_matches_the_fp64_reference(impl, eps_mode):
    hp = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8 if eps_mode == "floor" else 1e-30, eps_mode=eps_mode,
              weight_decay=0.1)
    params, opt = _run(impl, SPECS, 20, torch.float64, **hp)
    torch.manual_seed(0)  # _run's initial values, in order
    refs = []
    for (shape, tier, _), p in zip(SPECS, params):
        group = next(g for g in opt.param_groups if g["params"][0] is p)
        refs.append(RefParam(torch.randn(shape, dtype=torch.float64), momentum=group["use_momentum"],
                             factored=group["use_factored"], bank=is_bank(len(shape), tier, group["bank"])))
    for grads in _grads([s for s, _, _ in SPECS], 20, torch.float64):
        for ref, g in zip(refs, grads):
            ref.step(g, **hp)
    for (shape, _, _), ref, p in zip(SPECS, refs, params):
        assert (p.detach() - ref.value).abs().max().item() <= 1e-12, shape


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpp_single_process_step_is_bitwise_the_three_pass_path(dtype):
    # No reducer: one fused C++ call. An identity reducer forces the three passes with the distributed seam between.
    fused, opt_f = _run("cpp", SPECS, 6, dtype, lr=0.01, weight_decay=0.1)
    passes, opt_p = _run("cpp", SPECS, 6, dtype, reducer=lambda items: None, lr=0.01, weight_decay=0.1)
    for a, b in zip(fused, passes):
        assert torch.equal(a, b)
        for key, value in opt_f.state[a].items():
            assert torch.equal(value, opt_p.state[b][key]), key


@needs_cpp
def test_cpp_matches_eager_in_fp32():
    a, _ = _run("eager", SPECS, 8, torch.float32, lr=0.01, weight_decay=0.1)
    b, _ = _run("cpp", SPECS, 8, torch.float32, lr=0.01, weight_decay=0.1)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


@needs_cpp
def test_cpp_bf16_rounds_with_the_same_random_bits_as_eager():
    # The fp32 values before rounding agree to the last bits, so identical random bits leave at most a handful of
    # elements one bf16 step apart; different bits (here: another seed) move a third of them.
    a, _ = _run("eager", SPECS, 4, torch.bfloat16, lr=0.01, weight_decay=0.1)
    b, _ = _run("cpp", SPECS, 4, torch.bfloat16, lr=0.01, weight_decay=0.1)
    c, _ = _run("eager", SPECS, 4, torch.bfloat16, lr=0.01, weight_decay=0.1, seed=1)
    a, b, c = (torch.cat([t.detach().float().flatten() for t in ts]) for ts in (a, b, c))
    assert (a != b).float().mean() < 1e-3
    ulp = torch.finfo(torch.bfloat16).eps * a.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((a - b).abs() <= 2 * ulp).all()
    assert (a != c).float().mean() > 0.1  # the measure can fail


@needs_cpp
@pytest.mark.parametrize("key", [0, 1, 0xDEADBEEF, rounding.rounding_key(7, 3, 11)])
def test_cpp_stochastic_rounding_is_bit_identical_to_rounding_py(key):
    g = torch.Generator().manual_seed(key & 0xFFFF)
    x = torch.randn(100_003, generator=g) * torch.logspace(-30, 30, 100_003)
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -3e38])
    assert torch.equal(cpu.stochastic_round_bf16(x, key).view(torch.int16),
                       rounding.stochastic_round_bf16(x, key).view(torch.int16))


@needs_cpp
def test_cpp_rounding_key_is_rounding_py_s():
    lib = cpu._ext()
    for seed in (0, 1, 12345, 2**31 - 1, 2**32 - 1):
        for index in (0, 1, 210, 2**20):
            for step in (1, 2, 1000, 2**24):
                assert lib.rounding_key(seed, index, step) == rounding.rounding_key(seed, index, step)


@needs_cpp
def test_cpp_results_do_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run("cpp", SPECS, 3, torch.float32, lr=0.01)
        torch.set_num_threads(2)
        two, _ = _run("cpp", SPECS, 3, torch.float32, lr=0.01)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("where", ["last tensor", "bank slice"])
def test_a_nonfinite_gradient_skips_the_whole_step(impl, where):
    params, opt = _run(impl, SPECS, 2, torch.float32, lr=0.01)
    before = [p.detach().clone() for p in params]
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    for p, g in zip(params, _grads([p.shape for p in params], 1, torch.float32, seed=5)[0]):
        p.grad = g
    bad = params[-1] if where == "last tensor" else params[4]
    bad.grad.view(-1)[-1] = float("nan") if where == "bank slice" else float("inf")
    opt.step()
    assert opt.skipped_steps == 1
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        assert all(torch.equal(v, state[p][k]) for k, v in opt.state[p].items())


@needs_cpp
def test_cpp_updates_noncontiguous_parameters_in_place_like_eager():
    def noncontiguous(shape, g):
        return torch.randn(shape, generator=g, dtype=torch.float64).transpose(0, -1).contiguous().transpose(0, -1)

    def run(impl):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(noncontiguous((30, 20), g)), torch.nn.Parameter(noncontiguous((4, 12, 10), g))]
        storage = [p.data_ptr() for p in ps]
        opt = SkewAdam([{"params": ps[:1]}, {"params": ps[1:], "tier": "expert"}], lr=0.01, impl=impl)
        for _ in range(3):
            for p in ps:
                p.grad = noncontiguous(p.shape, g)
            opt.step()
        assert [p.data_ptr() for p in ps] == storage and not any(p.is_contiguous() for p in ps)
        return ps

    for a, b in zip(run("eager"), run("cpp")):
        assert (a - b).abs().max() <= 1e-12


def test_a_step_bumps_the_version_counters_of_what_it_writes(impl):
    # as torch's in-place ops do: autograd then refuses a backward through a weight the step has changed
    for reducer in (None, lambda items: None):  # one process, and the three passes of the distributed seam
        params, opt = _run(impl, SPECS[:6], 1, torch.float32, reducer=reducer)
        versions = {id(t): t._version for p in params for t in (p, *opt.state[p].values())}
        loss = (params[2] * params[2]).sum()
        opt.step()
        for p in params:
            for t in (p, *opt.state[p].values()):
                assert t._version > versions[id(t)]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@needs_cpp
def test_cpp_step_allocates_less_than_one_fp32_copy_of_the_largest_parameter():
    from skewadam.harness.bench_step import step_transient_bytes

    specs = [((8, 384, 128), "expert", {}), ((512, 128), "backbone", {}), ((128,), "backbone", {}),
             ((8, 128), "router", {}), ((700, 600), "expert", {"bank": False})]  # the last is split across threads
    for dtype in (torch.float32, torch.bfloat16):
        params, opt = _run("cpp", specs, 1, dtype)
        transient = step_transient_bytes(opt)
        assert transient is not None
        assert transient <= max(p.numel() for p in params), transient  # a quarter of one fp32 copy


def test_select_picks_and_refuses_implementations(monkeypatch):
    monkeypatch.delenv("SKEWADAM_IMPL", raising=False)
    assert kernels.select("eager", torch.device("cpu")) is eager
    assert kernels.select("auto", torch.device("meta")) is eager  # no C++ kernel off the CPU
    assert kernels.select("auto", torch.device("cpu")) is (cpu if CPP else eager)
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        kernels.select("cpp", torch.device("meta"))
    monkeypatch.setenv("SKEWADAM_IMPL", "eager")
    assert kernels.select("auto", torch.device("cpu")) is eager
    monkeypatch.setenv("SKEWADAM_IMPL", "fast")
    with pytest.raises(ValueError, match="SKEWADAM_IMPL='fast'"):
        kernels.select("auto", torch.device("cpu"))
    with pytest.raises(ValueError, match="Invalid impl"):
        SkewAdam([torch.nn.Parameter(torch.ones(2))], impl="gpu")


def test_without_a_compiler_auto_warns_once_and_runs_eager(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.delenv("SKEWADAM_IMPL", raising=False)
    for name, value in (("_lib", None), ("_error", None), ("_warned", False), ("_load", no_compiler)):
        monkeypatch.setattr(cpu, name, value)
    with pytest.warns(UserWarning) as record:
        params, _ = _run("auto", SPECS[:3], 2, torch.float64)
        _run("auto", SPECS[:3], 1, torch.float64)
    fallback = [str(w.message) for w in record if "could not be built" in str(w.message)]
    assert len(fallback) == 1 and "c++: command not found" in fallback[0] and "eager" in fallback[0]
    assert "\n" not in fallback[0]
    expected, _ = _run("eager", SPECS[:3], 2, torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(params, expected))
    with pytest.raises(RuntimeError, match="could not be built"):
        _run("cpp", SPECS[:3], 1, torch.float64)


@needs_cpp
@pytest.mark.bigmem
@pytest.mark.skipif(os.environ.get("SKEWADAM_BIGMEM") != "1", reason="needs ~9 GB; opt in with SKEWADAM_BIGMEM=1")
def test_cpp_updates_a_tensor_of_more_than_2_31_elements():
    # Every |g| = 1 and beta2 = 0.75 make the statistics exact: u = g exactly, rms(u) = 1, so the new weight is
    # exactly -lr * g (representable in bf16) wherever int64 indexing reaches.
    shape = (65536, 32769)  # 2^31 + 65536 elements, bf16: 4 GiB for the weight, 4 GiB for the gradient
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
    p.grad = torch.ones(shape, dtype=torch.bfloat16)
    p.grad[1::2].neg_()
    opt = SkewAdam([{"params": [p], "tier": "expert"}], lr=2**-4, betas=(0.9, 0.75), impl="cpp")
    opt.step()
    for rows in torch.arange(shape[0]).split(2048):
        expected = -(2**-4) * p.grad[rows].float()
        assert torch.equal(p.detach()[rows].float(), expected), int(rows[0])
