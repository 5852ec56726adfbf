"""The reference MoE transformer: exact paper size, fixed parameter names, dispatch and MoE losses."""

import math

import pytest
import torch
import torch.nn.functional as F

from skewadam.bench.models import MoETransformer, expert_dispatch, get_config


def _tiny(**overrides):
    torch.manual_seed(0)
    return MoETransformer(get_config("tiny", **overrides))


def test_paper_config_has_exactly_6_784_135_168_parameters():
    with torch.device("meta"):
        model = MoETransformer(get_config("paper-6.78b"))
    assert model.num_params() == 6_784_135_168
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["blocks.1.moe.experts.w1"] == (128, 4096, 4096)
    assert shapes["blocks.1.moe.router.weight"] == (128, 4096)
    assert shapes["blocks.0.attn.wk.weight"] == (1024, 4096)  # 8 kv heads of 128
    assert "lm_head.weight" not in shapes  # tied to tok_emb


def test_parameter_names_are_the_published_ones():
    names = {n for n, _ in _tiny(n_layer=4).named_parameters()}
    expected = {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"}
    for i in range(4):
        expected |= {f"blocks.{i}.{m}" for m in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")}
        expected |= {f"blocks.{i}.attn.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        if i % 2 == 0:
            expected |= {f"blocks.{i}.ffn.{w}.weight" for w in ("w1", "w2", "w3")}
        else:
            expected |= {f"blocks.{i}.moe.router.weight"} | {f"blocks.{i}.moe.experts.{w}" for w in ("w1", "w2", "w3")}
    assert names == expected


def test_init_zero_router_and_scaled_residual_projections():
    model = _tiny(d_model=64, d_ff=256, d_expert=256, n_experts=8)
    params = dict(model.named_parameters())
    assert params["blocks.1.moe.router.weight"].abs().max() == 0
    assert params["blocks.0.attn.wq.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    residual_std = 0.02 / math.sqrt(2 * 2)
    for name in ("blocks.0.attn.wo.weight", "blocks.0.ffn.w2.weight", "blocks.1.moe.experts.w2"):
        assert params[name].std().item() == pytest.approx(residual_std, rel=0.1), name


def test_forward_backward_gives_finite_losses_and_grads_everywhere():
    model = _tiny()
    idx = torch.randint(0, 256, (2, 32))
    out = model(idx, idx)
    assert out.logits.shape == (2, 32, 256)
    torch.testing.assert_close(out.loss, out.lm_loss + out.balance_loss + out.z_loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.blocks[1].moe.router.weight.grad.abs().sum() > 0  # the zero-init router learns


def test_forward_without_targets_returns_no_losses():
    out = _tiny().eval()(torch.randint(0, 256, (1, 8)))
    assert out.loss is None and out.balance_loss is None and out.logits.shape == (1, 8, 256)


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        _tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_dispatch_equals_naive_per_token_loop():
    experts = _tiny(n_experts=6).blocks[1].moe.experts
    N, k = 37, 3
    x = torch.randn(N, 32)  # grouped_mm takes fp32/bf16/fp16; the reference is computed in fp64
    expert = torch.stack([torch.randperm(6)[:k] for _ in range(N)])
    weight = torch.rand(N, k)
    got = expert_dispatch(x, expert, weight, experts)
    w1, w2, w3 = (w.detach().double() for w in (experts.w1, experts.w2, experts.w3))
    want = torch.zeros(N, 32, dtype=torch.float64)
    for n in range(N):
        xn = x[n].double()
        for j in range(k):
            e = expert[n, j]
            want[n] += weight[n, j].double() * (w2[e] @ (F.silu(w1[e] @ xn) * (w3[e] @ xn)))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_dispatch_leaves_idle_experts_with_exactly_zero_grad():
    experts = _tiny(n_experts=4).blocks[1].moe.experts
    x = torch.randn(5, 32)
    expert_dispatch(x, torch.tensor([[0, 2]] * 5), torch.rand(5, 2), experts).square().sum().backward()
    for w in (experts.w1, experts.w2, experts.w3):
        assert w.grad[[1, 3]].abs().max() == 0 and w.grad[[0, 2]].abs().min(dim=-1).values.sum() > 0


def test_balance_loss_is_coef_under_uniform_routing():
    """Zero router, no noise: every prob is 1/E, so sum_i p_i f_i = 1/E whatever the top-k tie-break picks."""
    model = _tiny(router_noise_std=0.0).eval()
    out = model(torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32)))
    assert out.balance_loss.item() == pytest.approx(0.05, abs=1e-7)
    assert out.z_loss.item() == pytest.approx(1e-4 * math.log(4) ** 2, rel=1e-5)


def test_balance_loss_rises_when_routing_collapses():
    model = _tiny(router_noise_std=0.0).eval()
    with torch.no_grad():
        model.blocks[1].moe.router.weight.zero_()
        model.blocks[1].moe.router.weight[0] = 50.0  # every token prefers expert 0
        model.blocks[1].ln2.bias.fill_(1.0)
        model.blocks[1].ln2.weight.zero_()
    out = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    # p = (~1, ~0, ...), f = (1/2, 1/2 on a tie partner, ...): coef * E * 1/2
    assert out.balance_loss.item() == pytest.approx(0.05 * 4 * 0.5, rel=1e-3)


def test_router_noise_only_in_training():
    model = _tiny()
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    a, b = model(idx, idx).loss, model(idx, idx).loss
    assert a == b
    model.train()
    torch.manual_seed(1)
    c = model(idx, idx).balance_loss
    torch.manual_seed(2)
    assert c != model(idx, idx).balance_loss


def test_bf16_model_runs_forward_and_backward():
    model = _tiny().bfloat16()
    out = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)


def test_bad_config_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        get_config("tiny", n_kv_head=3)
    with pytest.raises(ValueError, match="unknown model config"):
        get_config("huge")
