"""Compact first moment (issue #9): int8 block-wise and bf16 storage, and chunked processing of large banks."""

from __future__ import annotations

import io

import pytest
import torch

import skewadam.kernels.eager as eager
from skewadam import SkewAdam, plan
from skewadam.kernels.quant import BLOCK, dequantize, num_blocks, quantize_


def _train(momentum_dtype, *, steps=30, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    target = torch.randn(48, 300)
    w = torch.nn.Parameter(torch.zeros(48, 300, dtype=dtype))
    b = torch.nn.Parameter(torch.zeros(300, dtype=dtype))
    opt = SkewAdam([{"params": [w, b], "momentum_dtype": momentum_dtype}], lr=3e-2)
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


@pytest.mark.parametrize("momentum_dtype", ["int8", "bf16"])
def test_compact_momentum_state_dict_round_trip_is_bitwise(momentum_dtype):
    w, b, opt, _ = _train(momentum_dtype, steps=5, dtype=torch.bfloat16)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = SkewAdam([{"params": [w2, b2], "momentum_dtype": momentum_dtype}], lr=3e-2)
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


def test_momentum_dtype_is_validated():
    with pytest.raises(ValueError, match="momentum_dtype"):
        SkewAdam([torch.nn.Parameter(torch.zeros(2, 2))], momentum_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum_dtype", ["fp32", "int8", "bf16"])
def test_bank_processed_in_chunks_is_bitwise_equal(monkeypatch, dtype, momentum_dtype):
    monkeypatch.setenv("SKEWADAM_IMPL", "eager")  # chunking is the eager kernels' (the C++ one needs no scratch)
    def run():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(7, 6, 300, dtype=dtype))
        opt = SkewAdam([{"params": [p], "tier": "expert", "use_momentum": True, "momentum_dtype": momentum_dtype}],
                       lr=1e-2, weight_decay=0.1)
        for s in range(5):
            g = torch.randn_like(p)
            g[s % 7] = 0  # an idle expert each step
            p.grad = g
            opt.step()
        return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}

    whole, state_whole = run()
    monkeypatch.setattr(eager, "CHUNK_NUMEL", 2 * 6 * 300 + 5)  # 2 slices per chunk, a ragged last chunk
    assert len(eager._chunks(torch.empty(7, 6, 300), True)) == 4
    chunked, state_chunked = run()
    assert torch.equal(whole.view(-1).float(), chunked.view(-1).float())
    for key in state_whole:
        assert torch.equal(state_whole[key], state_chunked[key]), key


def test_plan_int8_momentum_paper_model_about_a_third_of_a_gib():
    result = plan("paper-6.78b", optimizers=["adamw", "skewadam", "skewadam-int8m"])
    stats = {name: entry.state.statistics for name, entry in result.optimizers.items()}
    assert stats["skewadam"] == 1_380_029_764
    assert 0.32 * 2**30 < stats["skewadam-int8m"] < 0.35 * 2**30
    assert stats["skewadam-int8m"] / stats["adamw"] < 0.007
