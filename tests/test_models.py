"""The reference MoE transformer: exact paper size, fixed parameter names, dispatch and MoE losses."""

import math
import sys

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


# ------------------------------------------------------------------------------- a Transformers MoE in the bench
#: Tiny configs of each Transformers MoE preset (their own keys), built on CPU in milliseconds.
HF_TINY = {
    "mixtral-8x7b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4),
    "qwen3-30b-a3b": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2),
    "olmoe-1b-7b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2),
    "gpt-oss-120b": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                         experts_per_token=2, layer_types=["sliding_attention", "full_attention"]),
    "deepseek-v3": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("name", list(HF_TINY))
def test_a_transformers_moe_gives_its_own_lm_loss_and_router_aux_loss(name):
    """`lm_losses`: the model's causal-LM loss on the already shifted batch and its router's auxiliary loss times its
    coefficient, summed as its forward sums them; the vocabulary is the corpus's; uniform routing's balance loss is
    the floor the log records (DeepSeek-V3 balances by a bias: no auxiliary loss, no floor)."""
    pytest.importorskip("transformers")
    from skewadam.bench.presets import bench_model, lm_losses

    torch.manual_seed(0)
    built = bench_model(name, HF_TINY[name], vocab_size=256, block_size=16)
    model, config = built.model, built.model.config
    assert config.vocab_size == 256 and built.block_size == 16
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    out = lm_losses(model, x, y)
    plain = model(input_ids=x)
    own = F.cross_entropy(plain.logits.flatten(0, 1), y.flatten())
    assert out.lm_loss.item() == pytest.approx(own.item(), rel=1e-5)
    assert out.loss.item() == pytest.approx((out.lm_loss + out.balance_loss).item(), rel=1e-6)
    if name == "deepseek-v3":
        assert out.balance_loss.item() == 0 and built.balance_floor is None
        return
    coef, k = config.router_aux_loss_coef, config.num_experts_per_tok
    assert out.balance_loss.item() > 0 and built.balance_floor == pytest.approx(coef * k)
    module = sys.modules[type(model).__module__]
    n_experts = next(getattr(config, a) for a in ("num_local_experts", "num_experts") if hasattr(config, a))
    uniform = module.load_balancing_loss_func((torch.zeros(64, n_experts),), n_experts, k)
    assert coef * uniform.item() == pytest.approx(built.balance_floor)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.ndim >= 2)


def test_a_transformers_moe_takes_the_corpus_vocabulary_and_only_its_config_keys():
    pytest.importorskip("transformers")
    from skewadam.bench.presets import bench_model

    built = bench_model("olmoe-1b-7b", HF_TINY["olmoe-1b-7b"], vocab_size=256)
    assert built.model.config.eos_token_id is None  # its tokenizer's id 50279 is not a byte
    assert built.block_size == 128 and built.config["vocab_size"] == 256
    with pytest.raises(ValueError, match="'hiden_size' not a key of its config .mixtral.; --set takes the config's"):
        bench_model("mixtral-8x7b", {"hiden_size": 32}, vocab_size=256)
    with pytest.raises(ValueError, match="the vocabulary is the corpus's"):
        bench_model("mixtral-8x7b", {"vocab_size": 32}, vocab_size=256)
    with pytest.raises(ValueError, match="max_position_embeddings=64 is shorter than the window of 128 tokens"):
        bench_model("mixtral-8x7b", {**HF_TINY["mixtral-8x7b"], "max_position_embeddings": 64}, vocab_size=256)
    assert bench_model("cpu", {"n_experts": 4}, vocab_size=256).model.config.n_experts == 4
