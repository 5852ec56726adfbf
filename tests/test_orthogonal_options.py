"""The orthogonal tier's Newton-Schulz options (issue 35): ``ns_steps``, ``ns_dtype`` and ``ns_interval``, against
the float64 reference (tests/reference.py) and torch.optim.Muon where the math coincides; refusals, checkpoints saved
before the options, the compute an interval saves.

Shape legend: A rows, B columns, E bank slices (experts).
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from reference import RefOrthogonal, newton_schulz as ref_newton_schulz
from skewadam import SkewAdam, kernels
from skewadam.kernels import orthogonal
from test_orthogonal import _LR, _MU, _WD, _grads, _model, _params, _train


# ----------------------------------------------------------------------------------------------- Newton-Schulz
@pytest.mark.parametrize("steps", [1, 3, 9])
def test_ns_steps_runs_that_many_iterations_of_the_reference(steps):
    gen = torch.Generator().manual_seed(0)
    for shape in [(32, 12), (12, 32), (16, 16)]:
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        o = orthogonal.newton_schulz(g.unsqueeze(0), steps)[0]
        torch.testing.assert_close(o, ref_newton_schulz(g, steps), rtol=0, atol=1e-13)


# ----------------------------------------------------------------------------------------- the update, by case
OPTION_CASES = {
    # shapes, tier, group settings: each option alone, and together
    "three_steps": ([(12, 5), (5, 12)], "backbone", {"ns_steps": 3}),
    "interval_banks_with_momentum": ([(4, 5, 12), (3, 12, 5)], "expert", {"use_momentum": True, "ns_interval": 3}),
    "interval_matrices": ([(12, 5), (6, 9)], "backbone", {"ns_interval": 2}),
    "interval_from_the_gradient": ([(4, 5, 12)], "expert", {"ns_interval": 2, "ns_steps": 2}),
    "both": ([(4, 5, 12), (5, 12)], "expert", {"use_momentum": True, "ns_interval": 2, "ns_steps": 6}),
}


@pytest.mark.parametrize("impl", kernels.cpu_backends())
@pytest.mark.parametrize("chunk", [None, 50], ids=["one_chunk", "chunks_of_2_matrices"])
@pytest.mark.parametrize("case", list(OPTION_CASES.values()), ids=list(OPTION_CASES))
def test_newton_schulz_options_match_float64_reference(monkeypatch, case, chunk, impl):
    """Each matrix on its own in the reference, batched by shape (and cut into chunks) in the optimizer; with an
    interval a unit's weights move at its steps k, 2k, ... by k steps' update, its momentum every step, and an idle
    expert (every other step one slice gets no token) falls out of step with the others; on every kernel."""
    shapes, tier, flags = case
    if chunk:
        monkeypatch.setattr(orthogonal, "CHUNK_NUMEL", chunk)
    params = _params(shapes)
    opt = SkewAdam([{"params": params, "tier": tier, "update": "orthogonal", "betas": (_MU, 0.999), **flags}],
                   lr=_LR, weight_decay=_WD, impl=impl)
    momentum = opt.param_groups[0]["use_momentum"]
    refs = [RefOrthogonal(p, momentum=momentum, bank=p.ndim == 3, steps=flags.get("ns_steps", 5),
                          interval=flags.get("ns_interval", 1)) for p in params]
    gen = torch.Generator().manual_seed(1)
    for step in range(7):
        for p, g in zip(params, _grads(params, gen, step)):
            p.grad = g
        opt.step()
        for ref, p in zip(refs, params):
            ref.step(p.grad, lr=_LR, mu=_MU, weight_decay=_WD)
            torch.testing.assert_close(p.detach(), ref.value, rtol=0, atol=1e-12, msg=lambda m: f"{step + 1}: {m}")
    for ref, p in zip(refs, params):
        if ref.bank:
            assert opt.state[p]["step"].tolist() == ref.t


def test_ns_dtype_bf16_runs_torch_muons_bf16_newton_schulz_on_fp32_weights():
    """torch.optim.Muon always orthogonalises in bf16; ``ns_dtype="bf16"`` does so for fp32 weights (otherwise in
    fp32): the same update up to the rounding of bf16 matmuls batched another way (2% of the largest change)."""
    a = _params([(16, 8), (8, 24), (16, 8)], dtype=torch.float32)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    start = [p.detach().clone() for p in a]
    theirs = torch.optim.Muon(a, lr=_LR, weight_decay=_WD, momentum=_MU, adjust_lr_fn="match_rms_adamw")
    ours = SkewAdam([{"params": b, "update": "orthogonal", "betas": (_MU, 0.999), "ns_dtype": "bf16"}], lr=_LR,
                    weight_decay=_WD)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        for x, y, g in zip(a, b, _grads(a, gen, step)):
            x.grad, y.grad = g.clone(), g.clone()
        theirs.step()
        ours.step()
    for x, y, p0 in zip(a, b, start):
        change = (x - p0).abs().max()
        assert (y - x).abs().max() < 0.02 * change, (y - x).abs().max() / change


@pytest.mark.parametrize("param_dtype,choice,runs_in", [
    (torch.float32, None, torch.float32), (torch.float32, "bf16", torch.bfloat16),
    (torch.bfloat16, None, torch.bfloat16), (torch.bfloat16, "fp32", torch.float32),
    (torch.float64, "fp32", torch.float32),
])
def test_newton_schulz_runs_in_ns_dtype_whatever_the_parameters(monkeypatch, param_dtype, choice, runs_in):
    seen = []
    original = orthogonal.newton_schulz_
    monkeypatch.setattr(orthogonal, "newton_schulz_", lambda x, *a: seen.append(x.dtype) or original(x, *a))
    [p] = _params([(6, 4)], dtype=param_dtype)
    opt = SkewAdam([{"params": [p], "update": "orthogonal", "ns_dtype": choice}], lr=_LR)
    p.grad = torch.ones_like(p)
    opt.step()
    assert seen == [runs_in] and p.dtype == param_dtype


@pytest.mark.parametrize("native", [True, False], ids=["bf16_matmuls", "emulated_bf16"])
def test_ns_dtype_auto_is_bf16_where_the_device_multiplies_bf16_natively_else_the_parameters_rule(monkeypatch,
                                                                                                  native):
    """A CPU with AVX512-BF16 or AMX (as torch reports it), or a GPU: bf16; elsewhere bf16 matmuls are emulated and
    slower than fp32, so the parameter's rule (fp32 for fp32 weights)."""
    orthogonal.bf16_matmuls.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    try:
        assert orthogonal.bf16_matmuls("cpu") is native and orthogonal.bf16_matmuls("cuda")
        assert orthogonal.ns_dtype(torch.float32, "auto", torch.device("cpu")) == (
            torch.bfloat16 if native else torch.float32)
        assert orthogonal.ns_dtype(torch.float64, "auto", torch.device("cuda")) == torch.bfloat16
        assert orthogonal.ns_dtype(torch.bfloat16, "auto", torch.device("cpu")) == torch.bfloat16
    finally:
        orthogonal.bf16_matmuls.cache_clear()


def test_an_interval_orthogonalises_only_the_matrices_that_are_due(monkeypatch):
    """The compute an interval saves: with ns_interval=2 the expert slices go through Newton-Schulz at every second
    of their steps and not between; an idle slice drops out of step with the others and is orthogonalised alone."""
    counted = []
    original = orthogonal.newton_schulz_
    monkeypatch.setattr(orthogonal, "newton_schulz_", lambda x, *a: counted.append(x.shape[0]) or original(x, *a))
    [bank] = _params([(4, 6, 5)])
    opt = SkewAdam([{"params": [bank], "tier": "expert", "update": "orthogonal", "ns_interval": 2}], lr=_LR)
    for step in range(3):
        bank.grad = torch.ones_like(bank)
        if step == 1:
            bank.grad[3] = 0.0  # slice 3 gets no token: its count lags the others' from then on
        opt.step()
    # counts after steps 1, 2, 3: (1, 1, 1, 1), (2, 2, 2, 1), (3, 3, 3, 2): none due, slices 0-2, slice 3
    assert counted == [3, 1] and opt.state[bank]["step"].tolist() == [3, 3, 3, 2]


@pytest.mark.parametrize("shape,block", [((5, 7, 3), 50), ((5, 7, 3), 21), ((5, 7, 3), 8), ((9, 4), 10),
                                         ((2, 3, 40), 16), ((0, 4, 3), 8)])
def test_the_momentum_and_weight_passes_blocks_tile_a_tensor_once_at_its_row_major_offsets(monkeypatch, shape, block):
    """Blocks of whole matrices (several of a bank when they fit), else of whole rows (at least one): every element
    in exactly one block, each block's start its first element's row-major position (stochastic rounding and the
    int8 momentum's row blocks depend on it); off the CPU one block, the whole tensor."""
    monkeypatch.setattr(orthogonal, "BLOCK_NUMEL", block)
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    for index, start in orthogonal._blocks(t):
        piece = t[index]
        assert piece.numel() and piece.flatten()[0] == start and (piece.numel() <= block or piece.shape[-2] == 1)
        seen[index] += 1
    assert bool((seen == 1).all())
    assert list(orthogonal._blocks(torch.empty(shape, device="meta"))) == [((), 0)]


# ---------------------------------------------------------------------------------------- refusals, checkpoints
@pytest.mark.parametrize("key,value,match", [
    ("ns_steps", 0, r"Invalid ns_steps in param group 0: 0 \(expected an int >= 1"),
    ("ns_steps", 2.0, "Invalid ns_steps"),
    ("ns_dtype", "fp16", r"Invalid ns_dtype in param group 0: 'fp16' \(expected None.*'fp32', 'bf16', 'auto'\)"),
    ("ns_interval", 0, r"Invalid ns_interval in param group 0: 0 \(expected an int >= 1"),
    ("ns_interval", True, "Invalid ns_interval"),
])
def test_bad_newton_schulz_options_are_refused_at_construction_and_before_a_step_writes(key, value, match):
    [p] = _params([(6, 4)])
    with pytest.raises(ValueError, match=match):
        SkewAdam([{"params": [p], "update": "orthogonal", key: value}])
    with pytest.raises(ValueError, match=match):
        SkewAdam([p], update="orthogonal", **{key: value})
    opt = SkewAdam([{"params": [p], "update": "orthogonal"}], lr=_LR)
    opt.param_groups[0][key] = value  # changed after construction: refused at the step, nothing written
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p, before) and not opt.state[p]


OPTIONS = {"orthogonal": "experts", "momentum_dtype": "int8", "orthogonal_options": {"use_momentum": True},
           "ns_dtype": "bf16", "ns_steps": 4, "ns_interval": 3}


def test_resume_with_the_options_is_bitwise():
    """Train 4 steps (an interval of 3 in mid-cycle), save, load into a fresh model and optimizer, train 3 more:
    bitwise the uninterrupted run; the options come back with the groups."""
    model = _model()
    opt = SkewAdam.from_model(model, log=False, **OPTIONS)
    _train(model, opt, 4, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, 3, seed=2)
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=True)
    fresh = _model()
    fresh.load_state_dict(saved["model"])
    opt2 = SkewAdam.from_model(fresh, log=False, **{k: v for k, v in OPTIONS.items() if not k.startswith("ns_")})
    assert {g["ns_steps"] for g in opt2.param_groups} == {5}  # built without them: the checkpoint's groups carry them
    opt2.load_state_dict(saved["opt"])
    assert [(g["ns_steps"], g["ns_interval"]) for g in opt2.param_groups] == [(4, 3)] * len(opt.param_groups)
    _train(fresh, opt2, 3, seed=2)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n


def test_a_checkpoint_saved_before_the_options_loads_with_the_values_it_was_trained_with():
    """State dicts saved before these keys existed hold none of them: they load as Muon's 5 fp32-or-parameter-dtype
    iterations every step (what they were trained with), and the run goes on as one that never saved."""
    model = _model()
    opt = SkewAdam.from_model(model, log=False, orthogonal="experts")
    _train(model, opt, 2, seed=1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # (a copy: loading shares the state tensors otherwise)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    for g in state["param_groups"]:
        for key in ("ns_steps", "ns_dtype", "ns_interval"):
            del g[key]
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    opt2 = SkewAdam.from_model(fresh, log=False, orthogonal="experts", ns_steps=3, ns_interval=2)
    opt2.load_state_dict(state)
    assert {(g["ns_steps"], g["ns_dtype"], g["ns_interval"]) for g in opt2.param_groups} == {(5, None, 1)}
    _train(model, opt, 2, seed=2)
    _train(fresh, opt2, 2, seed=2)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
