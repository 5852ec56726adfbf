"""The update kernels: every backend equals the fp64 reference; the C++ kernel's element-wise state is bitwise
eager's and its weights equal eager's to rounding; it is bitwise equal to itself across its fused and three-pass
(distributed seam) paths, across thread counts and across SIMD widths (an x86-64-v3 build), rounds bf16 with the
bits of `skewadam.kernels.rounding`, allocates no parameter-sized buffer, and degrades to eager without a compiler.
Every kernel refuses a gradient or state that does not fit its parameter (naming it), leaves tensors with a zero-size
dim untouched, and takes a tensor lr.

`impl` (a fixture over `skewadam.kernels.cpu_backends(interpreted=True)`) runs a test on every backend usable here
(without a GPU, the Triton kernel in Triton's interpreter: tests/conftest.py sets it); `three_pass` runs it on one
process's whole-step call and on the three passes of the distributed seam (an identity reducer). They, the specs and
the gradients are the kernel tests' shared set (tests/kernel_cases.py). The interpreter is slow (about 0.1 s a
launch): for the Triton kernel, the fp64-reference check is tests/test_triton.py's (same reference, smaller shapes),
it skips the two large tensors of SPECS (there for the C++ kernel's threads), and the slow parametrizations run one
representative case (`_interpreted_case`).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernel_cases import IDENTITY, LIVE, SPECS, ZERO_SPECS, impl, step_grads, three_pass  # noqa: F401 - fixtures
from reference import RefParam
from skewadam import SkewAdam, kernels
from skewadam.kernels import cpu, eager, rounding, types
from skewadam.state import is_bank, state_flags

CPP = "cpp" in kernels.cpu_backends()
needs_cpp = pytest.mark.skipif(not CPP, reason="the C++ CPU kernel does not build here")


def _interpreted_case(impl, representative: bool) -> None:
    """Skip all but the representative case of a slow parametrization for the interpreted Triton kernel."""
    if impl == "triton" and not representative:
        pytest.skip("Triton's interpreter: one representative case of this parametrization runs")


def _specs(impl):
    """SPECS, without the two large tensors for the interpreted Triton kernel (each of its steps takes minutes)."""
    return SPECS[:-2] if impl == "triton" else SPECS


def _run(impl, specs, steps, dtype, *, seed=0, reducer=None, lr_tensor=None, **kw):
    """Train ``specs`` for ``steps`` on `step_grads`; ``lr_tensor``: set as every group's lr after construction (as
    torchao and torch.compile'd loops keep it)."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s, _, _ in specs]
    groups = [{"params": [p], "tier": t, **o} for p, (_, t, o) in zip(params, specs)]
    opt = SkewAdam(groups, impl=impl, **kw)
    if reducer is not None:
        opt._reducer = reducer
    if lr_tensor is not None:
        for group in opt.param_groups:
            group["lr"] = lr_tensor
    for grads in step_grads(specs, steps, dtype):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("eps_mode", ["floor", "add"])
def test_every_impl_matches_the_fp64_reference(impl, eps_mode):
    if impl == "triton":  # (cpu_backends() lists it on CPU only under the interpreter)
        pytest.skip("20 steps take ~6 min in Triton's interpreter: tests/test_triton.py checks the same reference")
    hp = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8 if eps_mode == "floor" else 1e-30, eps_mode=eps_mode,
              weight_decay=0.1)
    params, opt = _run(impl, SPECS, 20, torch.float64, **hp)
    torch.manual_seed(0)  # _run's initial values, in order
    refs = []
    for (shape, tier, _), p in zip(SPECS, params):
        group = next(g for g in opt.param_groups if g["params"][0] is p)
        refs.append(RefParam(torch.randn(shape, dtype=torch.float64), momentum=group["use_momentum"],
                             factored=group["use_factored"], bank=is_bank(len(shape), tier, group["bank"])))
    for grads in step_grads(SPECS, 20, torch.float64):
        for ref, g in zip(refs, grads):
            ref.step(g, **hp)
    for (shape, _, _), ref, p in zip(SPECS, refs, params):
        assert (p.detach() - ref.value).abs().max().item() <= 1e-12, shape


@needs_cpp
@pytest.mark.parametrize("skip_nonfinite", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("cache", [1 << 10, None, 1 << 30], ids=["all-split", "this-cache", "none-split"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpp_single_process_step_is_bitwise_the_three_pass_path(dtype, cache, skip_nonfinite, monkeypatch):
    # No reducer: one C++ call, its units scheduled by what fits a core's cache (`cpu.step_`: with a 1 KiB cache
    # every unit is split, with 1 GiB none is; unchecked, an early unit's pass 3 follows its pass 2 at once). An
    # identity reducer forces the three passes with the seam between.
    if cache is not None:
        monkeypatch.setattr(cpu, "cache_bytes", lambda: cache)
    hp = dict(lr=0.01, weight_decay=0.1, skip_nonfinite=skip_nonfinite)
    fused, opt_f = _run("cpp", SPECS, 6, dtype, **hp)
    passes, opt_p = _run("cpp", SPECS, 6, dtype, reducer=lambda items: None, **hp)
    for a, b in zip(fused, passes):
        assert torch.equal(a, b)
        for key, value in opt_f.state[a].items():
            assert torch.equal(value, opt_p.state[b][key]), key


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unchecked_whole_units_write_a_non_finite_gradient_as_the_three_passes_do(dtype):
    # skip_nonfinite=False: each early slice is written right after its pass 2, before later slices are read; a
    # slice with a NaN (idle) and one with an inf (stepped) end as the three passes (all reads first) leave them
    specs = [((4, 70, 130), "expert", {}), ((3, 5, 9), "expert", {})]
    out = []
    for reducer in (None, IDENTITY):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s, _, _ in specs]
        opt = SkewAdam([{"params": [p], "tier": t} for p, (_, t, _) in zip(params, specs)], lr=0.01,
                       skip_nonfinite=False, impl="cpp")
        opt._reducer = reducer
        for step, grads in enumerate(step_grads(specs, 3, dtype)):
            if step == 1:
                grads[0][1, 3, 5], grads[1][2, 0, 0] = float("nan"), float("inf")
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        out.append((params, opt))
    (a, opt_a), (b, opt_b) = out
    assert a[0][0].isfinite().all() and not a[1][2].isfinite().all()  # slice 0 stepped on; the inf reached slice 2
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        for key, value in opt_a.state[x].items():
            torch.testing.assert_close(value, opt_b.state[y][key], rtol=0, atol=0, equal_nan=True)


@needs_cpp
def test_cpp_matches_eager_in_fp32():
    a, _ = _run("eager", SPECS, 8, torch.float32, lr=0.01, weight_decay=0.1)
    b, _ = _run("cpp", SPECS, 8, torch.float32, lr=0.01, weight_decay=0.1)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


@needs_cpp
@pytest.mark.parametrize("eps_mode", ["floor", "add"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpp_element_wise_state_is_bitwise_eager_s(dtype, eps_mode, three_pass):
    """The contract (cpu.py): step counts, the first moment and the full second moment are element-wise EMAs that
    both kernels compute with the same IEEE operations (no fused multiply-add), so they are bitwise equal on any CPU;
    the factored statistics and the weights depend on sums added in different orders, so they agree to rounding."""
    hp = dict(lr=0.01, weight_decay=0.1, eps_mode=eps_mode, eps=1e-8 if eps_mode == "floor" else 1e-30)
    a, opt_a = _run("eager", SPECS, 6, dtype, **hp)
    b, opt_b = _run("cpp", SPECS, 6, dtype, reducer=IDENTITY if three_pass else None, **hp)
    compared = set()
    for (shape, _, _), x, y in zip(SPECS, a, b):
        for key, value in opt_a.state[x].items():
            if key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt_b.state[y][key], value), (shape, key)
                compared.add(key)
            else:
                torch.testing.assert_close(opt_b.state[y][key], value, rtol=1e-3, atol=1e-12)
        if dtype != torch.bfloat16:
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    assert compared == {"step", "exp_avg", "exp_avg_sq"}


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


def _x86_64_v3() -> bool:
    """Whether this CPU runs x86-64-v3 code (AVX2, FMA, BMI1/2, F16C, MOVBE, LZCNT): the flags the build keys on."""
    flags = next((line.split(":", 1)[1].split() for line in cpu._cpu_id().splitlines() if line.startswith("flags")), [])
    return {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"} <= set(flags)


@needs_cpp
@pytest.mark.skipif(not _x86_64_v3(), reason="the CPU does not run x86-64-v3 (AVX2 and FMA) code")
def test_cpp_results_do_not_depend_on_the_simd_width(monkeypatch):
    # A build for x86-64-v3 (AVX2 and FMA, no AVX-512: 8-lane vectors, base.h's vmadd in halves) against this CPU's:
    # each lane does the same IEEE operations in the same order, so every weight and state tensor has the same bits.
    cases = [(torch.float32, {}), (torch.bfloat16, {}), (torch.float32, {"momentum_dtype": "int8"})]

    def results():
        out = []
        for dtype, kw in cases:
            params, opt = _run("cpp", SPECS, 3, dtype, lr=0.01, **kw)
            out += [*params, *(t for st in opt.state_dict()["state"].values() for t in st.values())]
        return out

    native = results()
    assert "-march=native" in cpu._CFLAGS
    monkeypatch.setattr(cpu, "_CFLAGS", ["-march=x86-64-v3" if f == "-march=native" else f for f in cpu._CFLAGS])
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_error", None)
    v3 = results()
    assert cpu._lib is not None and len(native) == len(v3) > 3 * len(SPECS)
    assert all(torch.equal(a, b) for a, b in zip(native, v3))


@pytest.mark.parametrize("where", ["last tensor", "bank slice"])
def test_a_nonfinite_gradient_skips_the_whole_step(impl, where):
    params, opt = _run(impl, _specs(impl), 2, torch.float32, lr=0.01)
    before = [p.detach().clone() for p in params]
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    for p, g in zip(params, step_grads(_specs(impl), 1, torch.float32, seed=5)[0]):
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
def test_cpp_step_allocates_at_most_what_step_transient_bytes_says():
    """The C++ step's allocations (torch's profiler) stay within `cpu.step_transient_bytes` given each state (what the
    planner counts), itself below what it counts without the states (backbone matrices without weighted column
    sums) and below a quarter of one fp32 copy of the largest parameter here."""
    from skewadam.bench.bench_step import step_transient_bytes

    specs = [((8, 384, 128), "expert", {}), ((512, 128), "backbone", {}), ((128,), "backbone", {}),
             ((8, 128), "router", {}), ((700, 600), "expert", {"bank": False}),  # split across threads
             ((4, 700, 600), "expert", {})]  # bank slices of fp32 gradients above a core's L2 cache: split
    for dtype in (torch.float32, torch.bfloat16):
        params, opt = _run("cpp", specs, 1, dtype)
        transient = step_transient_bytes(opt)
        planned = cpu.step_transient_bytes([state_flags(g).planned(p.shape, dtype)
                                            for g in opt.param_groups for p in g["params"]], dtype)
        unknown = cpu.step_transient_bytes([(tuple(p.shape), is_bank(p.ndim, g["tier"], g["bank"]))
                                            for g in opt.param_groups for p in g["params"]], dtype)
        assert transient is not None and 0 < transient <= planned < unknown, (transient, planned, unknown)
        assert planned <= max(p.numel() for p in params), planned


def test_resolve_backend_picks_and_refuses_backends(monkeypatch):
    monkeypatch.delenv("SKEWADAM_IMPL", raising=False)
    assert kernels.resolve_backend("eager", torch.device("cpu")).load() is eager
    assert kernels.resolve_backend("auto", torch.device("meta")).load() is eager  # no C++ kernel off the CPU
    assert kernels.resolve_backend("auto", torch.device("cpu")).load() is (cpu if CPP else eager)
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        kernels.resolve_backend("cpp", torch.device("meta")).load()
    with pytest.raises(ValueError, match="impl='triton' runs on CUDA tensors"):
        kernels.resolve_backend("triton", torch.device("meta")).load()
    if "triton" in kernels.cpu_backends(interpreted=True):  # explicit only: auto on CPU stays the C++ kernel or eager
        from skewadam.kernels import triton as tk

        assert kernels.resolve_backend("triton", torch.device("cpu")).load() is tk
        assert "triton" not in kernels.cpu_backends()
    monkeypatch.setenv("SKEWADAM_IMPL", "eager")
    assert kernels.resolve_backend("auto", torch.device("cpu")).load() is eager
    monkeypatch.setenv("SKEWADAM_IMPL", "fast")
    with pytest.raises(ValueError, match="SKEWADAM_IMPL='fast'"):
        kernels.resolve_backend("auto", torch.device("cpu")).load()
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


# ------------------------------------------------------------------------------------------- sizes a kernel indexes
NAME = r"param_groups\[0\]\['params'\]\[0\]"


def _stepped(impl, shape=(8, 6), **kw):
    p = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
    opt = SkewAdam([p], impl=impl, **kw)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt


def test_state_of_another_shape_is_refused_at_the_step_naming_the_parameter(impl, three_pass):
    """Issue 13 item 2: a (8, 6) parameter's state under a (16, 12) one. The C++ kernel read and wrote out of bounds
    ("corrupted size vs. prev_size", abort); every kernel raises a ValueError naming the parameter and the fix."""
    a, opt_a = _stepped(impl)
    b = torch.nn.Parameter(torch.randn(16, 12, dtype=torch.float64))
    opt_b = SkewAdam([b], impl=impl)
    if three_pass:
        opt_b._reducer = IDENTITY
    opt_b.state[b] = {k: v.clone() for k, v in opt_a.state[a].items()}  # what a load leaves if it does not check
    before = b.detach().clone()
    b.grad = torch.randn_like(b)
    with pytest.raises(ValueError, match=NAME + r": state '\w+' has shape .* needs .*del optimizer\.state\[p\]"):
        opt_b.step()
    assert torch.equal(b, before)
    del opt_b.state[b]  # the fix the message names
    opt_b.step()
    assert not torch.equal(b, before)


def test_a_state_dict_of_another_shape_is_refused(impl):
    """The reproduction of issue 13 item 2 (refused at the load where it validates shapes, else at the step)."""
    a, opt_a = _stepped(impl)
    b = torch.nn.Parameter(torch.randn(16, 12, dtype=torch.float64))
    opt_b = SkewAdam([b], impl=impl)
    before = b.detach().clone()
    with pytest.raises(ValueError, match="shape"):
        opt_b.load_state_dict(opt_a.state_dict())
        b.grad = torch.randn_like(b)
        opt_b.step()
    assert torch.equal(b, before)


def test_parameter_data_of_a_new_shape_is_refused(impl, three_pass):
    p, opt = _stepped(impl)
    if three_pass:
        opt._reducer = IDENTITY
    p.data = torch.randn(16, 12, dtype=torch.float64)
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=NAME + r": state .* shape"):
        opt.step()


def test_gradient_data_of_another_shape_is_refused(impl, three_pass):
    p, opt = _stepped(impl)
    if three_pass:
        opt._reducer = IDENTITY
    p.grad.data = torch.randn(3, 3, dtype=torch.float64)  # .data skips autograd's own shape check
    before = p.detach().clone()
    with pytest.raises(ValueError, match=NAME + r": gradient of shape .*3, 3.* for a parameter of shape .*8, 6"):
        opt.step()
    assert torch.equal(p, before)


def test_errors_name_the_parameter_by_its_name_when_the_group_has_param_names(impl):
    model = torch.nn.Linear(6, 8).double()
    opt = SkewAdam(model.named_parameters(), impl=impl)
    model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    opt.step()
    model.weight.data = torch.randn(16, 12, dtype=torch.float64)
    model.weight.grad = torch.randn_like(model.weight)
    with pytest.raises(ValueError, match=NAME + r" \('weight'\): state"):
        opt.step()


def _record(impl_name, shape=(8, 6), bank=False, **kw):
    """One parameter after a step, as the kernel's record (its group's), with the kernel module."""
    p, opt = _stepped(impl_name, shape, **kw)
    p.grad = torch.randn_like(p)
    _, group = opt._init_group(opt.param_groups[0], 0, 0)
    return kernels.resolve_backend(impl_name, p.device).load(), group


@pytest.mark.parametrize("field, make", [
    ("grad", lambda pt: pt.grad[:4]),
    ("step", lambda pt: torch.zeros(2)),
    ("exp_avg", lambda pt: pt.exp_avg[:, :3]),
    ("row_var", lambda pt: pt.row_var[:7]),
    ("col_var", lambda pt: pt.col_var[..., :5]),
    ("exp_avg_sq", lambda pt: torch.zeros(8, 6, dtype=torch.float64)),
    ("shape", lambda pt: (8,)),
])
def test_every_kernel_checks_the_record_sizes_it_indexes_with(impl, field, make):
    mod, group = _record(impl)
    pt = group.params[0]
    _assert_refused(mod, group._replace(params=[pt._replace(**{field: make(pt)})]), pt.param, ValueError, NAME)


def _assert_refused(mod, bad, param, error, match):
    """Both entry points (the one-process step, pass 1) raise ``error`` for the group record ``bad``; ``param`` is
    left as it was."""
    before = param.clone()
    with pytest.raises(error, match=match):
        mod.step_([bad], skip_nonfinite=True)
    with pytest.raises(error, match=match):
        mod.grad_stats(bad)
    assert torch.equal(param, before)


def test_every_kernel_explains_a_missing_gradient_in_a_record_naming_the_parameter(impl):
    mod, group = _record(impl)
    pt = group.params[0]
    _assert_refused(mod, group._replace(params=[pt._replace(grad=None)]), pt.param, ValueError,
                    NAME + ": gradient of shape None")


@needs_cpp
@pytest.mark.parametrize("field, value, error, match", [
    ("step", 1.0, ValueError, NAME + ": step of shape float"),  # a field types.check explains
    ("eps_mode", 3, TypeError, "record field 'eps_mode' has the wrong type"),
    ("stream", 2.5, TypeError, "record field 'stream' has the wrong type"),
    ("params", "ab", TypeError, "record field 'params' has the wrong type"),
])
def test_cpp_refuses_a_record_field_of_another_type_naming_it(field, value, error, match):
    """The C++ kernel converts the records itself (not through pybind's casters): a field of another type is a
    TypeError naming the field, or types.check's ValueError naming the parameter; nothing written."""
    mod, group = _record("cpp")
    pt = group.params[0]
    _assert_refused(mod, group._replace(**{field: value}) if field in group._fields
                    else group._replace(params=[pt._replace(**{field: value})]), pt.param, error, match)


def test_every_kernel_checks_the_int8_scales_and_bank_step_counts(impl):
    mod, group = _record(impl, momentum_dtype="int8")
    pt = group.params[0]
    with pytest.raises(ValueError, match=NAME + ".*exp_avg_scale"):
        mod.grad_stats(group._replace(params=[pt._replace(exp_avg_scale=pt.exp_avg_scale[:4])]))
    mod, group = _record(impl, (3, 4, 5), tier="expert")
    pt = group.params[0]
    with pytest.raises(ValueError, match=NAME + ".*step"):
        mod.grad_stats(group._replace(params=[pt._replace(step=pt.step[:2])]))


@needs_cpp
@pytest.mark.parametrize("field", ["sumsq", "rc_sumsq", "row", "col", "row_var_sum", "absmax"])
def test_cpp_checks_the_statistics_it_indexes_with(field):
    mod, group = _record("cpp")
    stats = mod.grad_stats(group)
    bad = stats[0]._replace(**{field: getattr(stats[0], field)[..., :0]})
    step = group.params[0].step.clone()
    with pytest.raises(ValueError, match=NAME + f".*GradStats.{field}"):
        mod.update_moments_(group, [bad])
    assert torch.equal(group.params[0].step, step)  # nothing written


@needs_cpp
@pytest.mark.parametrize("field", ["u_sumsq", "rinv", "cinv", "active"])
def test_cpp_checks_the_moments_it_indexes_with(field):
    mod, group = _record("cpp")
    moments = mod.update_moments_(group, mod.grad_stats(group))
    value = getattr(moments[0], field)
    bad = moments[0]._replace(**{field: torch.ones(1, dtype=torch.bool) if value is None else value[..., :0]})
    before = group.params[0].param.clone()
    with pytest.raises(ValueError, match=NAME + f".*Moments.{field}"):
        mod.apply_updates_(group, [bad])
    assert torch.equal(group.params[0].param, before)


def test_a_step_count_that_is_a_python_number_is_explained(impl):
    p, opt = _stepped(impl)
    opt.state[p]["step"] = 3.0  # as old checkpoints and other tools save it
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=NAME + ": step of shape float"):
        opt.step()


def test_cpp_reads_the_records_fields_of_types_py():
    if not CPP:
        pytest.skip("the C++ CPU kernel does not build here")
    fields = cpu._ext().fields()
    assert {name: tuple(f) for name, f in fields.items()} == {
        name: getattr(types, name)._fields for name in ("ParamTensors", "Group", "GradStats", "Moments")}

    class Renamed:
        def fields(self):
            return {**fields, "Group": [*fields["Group"][:-1], "rounding_seed"]}

    with pytest.raises(RuntimeError, match="reads Group as .*rounding_seed"):
        cpu._check_fields(Renamed())


# ------------------------------------------------------------------------------------------- zero-size dims
@pytest.mark.parametrize("momentum_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tensors_with_a_zero_size_dim_are_left_untouched(impl, three_pass, dtype, momentum_dtype):
    """Issue 13 item 3: eager crashed on int8 momentum of (0, 5) ("cannot reshape tensor of 0 elements"), the C++
    kernel on (3, 0) ("does not hold one scale per 256"). Every tier and momentum dtype: the empty tensors keep
    zero state and step counts (nothing to update), the tensor beside them steps exactly as it does alone."""
    if dtype == torch.float64 and momentum_dtype == "bf16":
        pytest.skip("bf16 momentum of fp64 parameters is refused")
    _interpreted_case(impl, dtype == torch.bfloat16 and momentum_dtype == "int8" and not three_pass)
    kw = dict(lr=0.01, weight_decay=0.1, momentum_dtype=momentum_dtype, reducer=IDENTITY if three_pass else None)
    params, opt = _run(impl, [LIVE] + ZERO_SPECS, 3, dtype, **kw)
    alone, opt_alone = _run(impl, [LIVE], 3, dtype, **kw)
    assert torch.equal(params[0], alone[0])
    assert all(torch.equal(v, opt_alone.state[alone[0]][k]) for k, v in opt.state[params[0]].items())
    for (shape, _, _), p in zip(ZERO_SPECS, params[1:]):
        assert p.shape == shape
        for key, value in opt.state[p].items():
            assert not value.float().any(), (shape, key)


# ------------------------------------------------------------------------------------------- tensor lr
@pytest.mark.parametrize("lr", [torch.tensor(0.01, dtype=torch.float64), torch.tensor([0.01], dtype=torch.float64)],
                         ids=["0-d", "1-element"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_lr_steps_bitwise_like_its_float(impl, three_pass, lr, dtype):
    """Issue 13 item 4: torch.compile'd loops, torchao and torchtitan keep lr a 0-d tensor; every kernel uses it as a
    tensor (eager: no host read)."""
    _interpreted_case(impl, dtype == torch.bfloat16 and lr.ndim == 0 and three_pass)
    kw = dict(lr=0.01, weight_decay=0.1, reducer=IDENTITY if three_pass else None)
    a, opt_a = _run(impl, SPECS[:9], 3, dtype, **kw)
    b, opt_b = _run(impl, SPECS[:9], 3, dtype, lr_tensor=lr, **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert all(torch.equal(v, opt_b.state[y][k]) for k, v in opt_a.state[x].items())


def test_a_scheduler_writing_into_a_tensor_lr_takes_effect(impl):
    p, opt = _stepped(impl)
    q = torch.nn.Parameter(p.detach().clone())
    ref = SkewAdam([q], impl=impl)
    ref.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
    lr = torch.tensor(0.01, dtype=torch.float64)
    opt.param_groups[0]["lr"] = lr
    for value in (0.02, 0.005):
        lr.fill_(value)  # as torchao's and torchtitan's schedulers write it
        ref.param_groups[0]["lr"] = value
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        assert torch.equal(p, q)


def test_a_tensor_lr_of_more_than_one_element_is_refused(impl):
    p, opt = _stepped(impl)
    opt.param_groups[0]["lr"] = torch.tensor([0.01, 0.02])
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        opt.step()
