"""Automatic tiering (`skewadam.classify`): labels and user rules; and the param groups and census built on them
(`skewadam.groups`). The ``tiers`` command is tested in test_cli.py.

Transformers families are tested in test_hf_families.py; here: the reference model and plain-PyTorch MoE layouts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from skewadam import SkewAdam
from skewadam.bench.models import MoETransformer, get_config
from skewadam.classify import Labels, classify, flattened_experts, hidden_matrices, label, output_heads
from skewadam.groups import describe, param_groups, split_kwargs

D, F, E = 16, 24, 4


# ------------------------------------------------------------------------------------------------ toy models
class MLP(nn.Module):
    """SwiGLU with HF names: `gate_proj` is a SwiGLU gate, not a router."""

    def __init__(self, d=D, f=F):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class ListMoE(nn.Module):
    """Experts as a ModuleList of MLPs next to a gate nn.Linear(d, E), plus a shared expert and its sigmoid gate."""

    def __init__(self, shared=True):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=True)
        self.experts = nn.ModuleList(MLP() for _ in range(E))
        if shared:
            self.shared_expert = MLP()
            self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(2, dim=-1)
        y = sum(w[..., j:j + 1] * torch.stack([self.experts[int(e)](t) for t, e in zip(x, idx[..., j])]) for j in range(2))
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class BankMoE(nn.Module):
    """A 3-D expert bank [E, F, D] / [E, D, F] with a per-expert bias, next to a gate nn.Linear(d, E)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, F, D) * 0.1)
        self.w_out = nn.Parameter(torch.randn(E, D, F) * 0.1)
        self.b_out = nn.Parameter(torch.zeros(E, D))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(1, dim=-1)
        h = torch.einsum("nd,nfd->nf", x, self.w_in[idx[:, 0]]).relu()
        return w * (torch.einsum("nf,ndf->nd", h, self.w_out[idx[:, 0]]) + self.b_out[idx[:, 0]])


class GatedAttention(nn.Module):
    """Attention with a sigmoid output gate called `gate`: not a router."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.gate = nn.Linear(D, D)
        self.out = nn.Linear(D, D)


class Block(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = GatedAttention()
        self.moe = moe


class Net(nn.Module):
    def __init__(self, *moes, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block(m) for m in moes)
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b.moe(b.norm(h))
        return self.head(h)


def by_tier(labels):
    out = {"backbone": set(), "expert": set(), "router": set()}
    for name, tier in labels.items():
        out[tier].add(name)
    return out


class _FFN(nn.Module):
    """A dense FFN whose hidden width equals the vocabulary: its up projection has the token table's shape."""

    def __init__(self, d, f, sequential):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d)) if sequential else None
        if not sequential:
            self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)


class _Layer(nn.Module):
    def __init__(self, d, f, sequential=False):
        super().__init__()
        self.norm, self.attn, self.ffn = nn.LayerNorm(d), nn.Linear(d, d), _FFN(d, f, sequential)


class _LMHead(nn.Module):  # OLMo-core's LMHead: the final norm and the projection to the vocabulary
    def __init__(self, d, v):
        super().__init__()
        self.norm, self.w_out = nn.LayerNorm(d), nn.Linear(d, v, bias=False)


class _Decoder(nn.Module):  # the layers, the final norm and the head in one module; the table outside it
    def __init__(self, d, v):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(d, v) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, v, bias=False)


class HeadLM(nn.Module):
    """An LM with an untied head in one of the layouts libraries use, its FFN as wide as the vocabulary."""

    HEADS = {"torchtitan": "output.weight", "sequential_ffn": "output.weight", "olmo_core": "lm_head.w_out.weight",
             "nested": "decoder.head.weight", "bare": "unembed", "bare_transposed": "unembed"}

    def __init__(self, layout, v=40, d=D):
        super().__init__()
        self.tok = nn.Embedding(v, d)
        if layout == "nested":
            self.decoder = _Decoder(d, v)
            return
        self.layers = nn.ModuleList(_Layer(d, v, sequential=layout == "sequential_ffn") for _ in range(2))
        self.norm = nn.LayerNorm(d)
        if layout == "olmo_core":
            self.lm_head = _LMHead(d, v)
        elif layout.startswith("bare"):  # logits = x @ unembed.T, or x @ unembed
            self.unembed = nn.Parameter(torch.zeros((d, v) if layout == "bare_transposed" else (v, d)))
        else:
            self.output = nn.Linear(d, v, bias=False)


# ------------------------------------------------------------------------------------------------ labels
def test_reference_model_labels_routers_experts_and_backbone_exactly():
    model = MoETransformer(get_config("tiny"))
    labels = classify(model)
    n_layer = model.config.n_layer
    moe = [i for i in range(n_layer) if i % 2 == 1]
    assert moe, "the tiny preset must have an MoE block"
    assert by_tier(labels)["router"] == {f"blocks.{i}.moe.router.weight" for i in moe}
    assert by_tier(labels)["expert"] == {f"blocks.{i}.moe.experts.{w}" for i in moe for w in ("w1", "w2", "w3")}
    assert labels["blocks.0.ffn.w1.weight"] == "backbone"  # dense SwiGLU of the even blocks
    # the LM head is tied to tok_emb: one entry, every trainable tensor labelled exactly once
    assert list(labels) == [n for n, _ in model.named_parameters()]


def test_reference_model_paper_size_on_meta_labels_the_same_way():
    with torch.device("meta"):
        model = MoETransformer(get_config("paper-6.78b"))
    tiers = by_tier(classify(model))
    assert tiers["router"] == {"blocks.1.moe.router.weight"}
    assert tiers["expert"] == {f"blocks.1.moe.experts.{w}" for w in ("w1", "w2", "w3")}


def test_module_list_experts_next_to_a_gate_linear_are_experts_and_gate_is_router():
    labels = classify(Net(ListMoE()))
    tiers = by_tier(labels)
    assert tiers["expert"] == {f"blocks.0.moe.experts.{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up", "down")}
    assert tiers["router"] == {"blocks.0.moe.gate.weight", "blocks.0.moe.gate.bias"}


def test_shared_expert_and_its_sigmoid_gate_are_backbone():
    labels = classify(Net(ListMoE(shared=True)))
    shared = [n for n in labels if ".shared_expert" in n]
    assert len(shared) == 4 and all(labels[n] == "backbone" for n in shared)


def test_gate_named_things_that_are_not_routers_are_backbone():
    labels = classify(Net(ListMoE()))
    assert labels["blocks.0.attn.gate.weight"] == "backbone"  # attention output gate [D, D]
    assert labels["blocks.0.moe.experts.0.gate_proj.weight"] == "expert"  # SwiGLU gate of a routed expert
    dense = classify(nn.Sequential(MLP(), MLP()))
    assert set(dense.values()) == {"backbone"}  # gate_proj of a dense model


def test_3d_bank_with_per_expert_bias_is_expert():
    labels = classify(Net(BankMoE()))
    tiers = by_tier(labels)
    assert tiers["expert"] == {"blocks.0.moe.w_in", "blocks.0.moe.w_out", "blocks.0.moe.b_out"}
    assert tiers["router"] == {"blocks.0.moe.gate.weight"}


def test_router_as_bare_parameter_with_per_expert_scale():
    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.router_weight = nn.Parameter(torch.randn(E, D))
            self.expert_scale = nn.Parameter(torch.ones(E))  # per-expert vector on the block: router
            self.out_bias = nn.Parameter(torch.zeros(D))  # added for every token: backbone
            self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    labels = classify(Net(Moe()))
    assert labels["blocks.0.moe.router_weight"] == "router"
    assert labels["blocks.0.moe.expert_scale"] == "router"
    assert labels["blocks.0.moe.out_bias"] == "backbone"
    assert all(labels[f"blocks.0.moe.experts.{e}.{w}"] == "expert" for e in range(E) for w in ("weight", "bias"))


def test_identical_modules_without_a_router_are_not_experts():
    # a ModuleList of identical layers and 3-D tensors (conv weights, a relative-position bias) next to an
    # output-sized linear: structure without a router of matching size is no MoE.
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = nn.Conv1d(D, D, 4, groups=D)  # weight [D, 1, 4]
            self.dt_proj = nn.Linear(2, D)  # weight [D, 2]: rows == conv channels
            self.rel_bias = nn.Parameter(torch.zeros(4, 8, 8))
            self.heads = nn.Linear(D, 4)  # rows == rel_bias.shape[0] but input D is no size of the bias

    model = nn.Sequential(nn.ModuleList(MLP() for _ in range(3)), Mixer())
    assert set(classify(model).values()) == {"backbone"}


def test_flattened_expert_weights_under_experts_are_experts():
    # DBRX layout: `experts` holds [E*F, D] tensors viewed per expert in forward; router Linear(D, E) beside it
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(E * F, D))
            self.w2 = nn.Parameter(torch.randn(E * F, D))

    class Ffn(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(D, E, bias=False)
            self.experts = Flat()

    labels = classify(Ffn())
    assert labels == {"router.weight": "router", "experts.w1": "expert", "experts.w2": "expert"}


def test_tied_parameters_appear_once_under_their_first_name():
    model = Net(ListMoE())
    labels = classify(model)
    assert "emb.weight" in labels and "head.weight" not in labels


# ------------------------------------------------------------------------------------------------ one labels object
@pytest.mark.parametrize("layout", ["tiny", "olmo_core"])
def test_label_holds_what_classify_flattened_experts_hidden_matrices_and_output_heads_return(layout):
    model = MoETransformer(get_config("tiny")) if layout == "tiny" else HeadLM("olmo_core")
    found = label(model)
    assert isinstance(found, Labels)
    assert found.tiers == classify(model) and found.experts == flattened_experts(model)
    assert list(found.hidden) == hidden_matrices(model) and list(found.heads) == output_heads(model)
    assert list(found.trainable) == list(found.tiers) and found.frozen == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.tiers = {}  # type: ignore[misc]


def test_labels_from_given_tiers_follow_them_and_must_cover_every_parameter():
    model = Net(BankMoE())
    tiers = dict(classify(model), **{"blocks.0.moe.w_in": "backbone"})
    found = label(model, tiers=tiers)
    assert found.tiers == tiers and "blocks.0.moe.w_in" not in found.hidden  # a 3-D tensor is no matrix
    assert hidden_matrices(model, tiers) == list(found.hidden)
    with pytest.raises(ValueError, match=r"labels miss trainable parameter\(s\) \['emb.weight'\]"):
        label(model, tiers={n: t for n, t in tiers.items() if n != "emb.weight"})
    with pytest.raises(ValueError, match=r"labels\['emb.weight'\]: unknown tier 'dense'"):
        label(model, tiers=dict(tiers, **{"emb.weight": "dense"}))
    with pytest.raises(ValueError, match="pass rules or tiers, not both"):
        label(model, [(r"\.gate\.", "backbone")], tiers=tiers)


# ------------------------------------------------------------------------------------------------ rules
def test_user_rules_apply_before_automatic_labels_and_first_match_wins():
    model = Net(ListMoE())
    rules = [(r"\.shared_expert\.", "expert"), (r"\.shared_expert", "router"), (r"\.experts\.0\.", "backbone")]
    labels = classify(model, rules=rules)
    assert all(labels[n] == "expert" for n in labels if ".shared_expert." in n)  # first rule, not the second
    assert labels["blocks.0.moe.shared_expert_gate.weight"] == "router"  # second rule
    assert labels["blocks.0.moe.experts.0.up_proj.weight"] == "backbone"  # overrides the automatic expert
    assert labels["blocks.0.moe.experts.1.up_proj.weight"] == "expert"  # untouched by rules


def test_rule_matching_nothing_raises_naming_the_rule():
    with pytest.raises(ValueError, match=r"no_such_module.*match no trainable parameter"):
        classify(Net(ListMoE()), rules=[(r"\.experts\.", "expert"), (r"no_such_module", "router")])


def test_rule_shadowed_by_an_earlier_rule_raises():
    with pytest.raises(ValueError, match=r"experts\\\\\.0"):
        classify(Net(ListMoE()), rules=[(r"\.experts\.", "expert"), (r"\.experts\.0", "router")])


@pytest.mark.parametrize(
    "rules, match",
    [([("x", "shared")], "unknown tier 'shared'"), ([("(", "expert")], "invalid regular expression"),
     (["experts"], r"\(pattern, tier\) pair")],
)
def test_bad_rules_raise_clear_errors(rules, match):
    with pytest.raises(ValueError, match=match):
        classify(Net(ListMoE()), rules=rules)


def test_frozen_parameters_are_left_out_and_reported():
    model = Net(ListMoE())
    model.blocks[0].moe.gate.bias.requires_grad_(False)
    model.emb.weight.requires_grad_(False)
    labels = classify(model)
    assert "blocks.0.moe.gate.bias" not in labels and "emb.weight" not in labels
    assert labels["blocks.0.moe.gate.weight"] == "router"
    census = describe(model)
    assert set(census.frozen_names) == {"blocks.0.moe.gate.bias", "emb.weight"}
    assert census.frozen_params == E + 50 * D
    groups = param_groups(model, log=False)
    grouped = {id(p) for g in groups for p in g["params"]}
    assert id(model.emb.weight) not in grouped and id(model.blocks[0].moe.gate.bias) not in grouped


# ------------------------------------------------------------------------------------------------ param groups
def _group(groups, tier, decayed=None):
    found = [g for g in groups if g["tier"] == tier and (decayed is None or (g["weight_decay"] > 0) == decayed)]
    assert len(found) == 1, [(g["tier"], g["weight_decay"]) for g in groups]
    return found[0]


def test_param_groups_default_decay_on_backbone_and_experts_none_on_router():
    model = Net(ListMoE())
    groups = param_groups(model, weight_decay=0.1, log=False)
    assert [g["tier"] for g in groups] == ["backbone", "expert", "router"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0]
    labels = classify(model)
    for g in groups:
        assert g["param_names"] == [n for n, t in labels.items() if t == g["tier"]]
        params = dict(model.named_parameters())
        assert all(p is params[n] for p, n in zip(g["params"], g["param_names"]))
    assert sum(len(g["params"]) for g in groups) == len(labels)  # every trainable tensor exactly once


def test_exempt_1d_moves_norms_and_biases_to_groups_without_decay():
    model = Net(ListMoE())
    groups = param_groups(model, weight_decay=0.1, exempt_1d=True, log=False)
    backbone_nd = _group(groups, "backbone", decayed=False)
    assert set(backbone_nd["param_names"]) == {
        "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.attn.qkv.bias", "blocks.0.attn.gate.bias",
        "blocks.0.attn.out.bias",
    }
    assert all(p.ndim >= 2 for p in _group(groups, "backbone", decayed=True)["params"])
    assert all(g["weight_decay"] == 0.0 for g in groups if g["tier"] == "router")
    assert len([g for g in groups if g["tier"] == "expert"]) == 1  # the list experts have no 1-D tensors


def test_tier_options_override_any_setting_per_tier():
    groups = param_groups(Net(ListMoE()), weight_decay=0.1, tier_options={"router": {"lr": 1e-4, "weight_decay": 0.5},
                                                                          "expert": {"use_factored": False}}, log=False)
    router, expert = _group(groups, "router"), _group(groups, "expert")
    assert router["lr"] == 1e-4 and router["weight_decay"] == 0.5
    assert expert["use_factored"] is False and "lr" not in expert


def test_tier_options_for_an_unknown_tier_raise():
    with pytest.raises(ValueError, match="tier_options.*unknown tier 'experts'"):
        param_groups(Net(ListMoE()), tier_options={"experts": {"lr": 1.0}}, log=False)


def test_empty_tiers_produce_no_group_and_warn_that_a_dense_model_gets_factored_adam():
    with pytest.warns(UserWarning, match="factored Adam with momentum on everything"):
        groups = param_groups(nn.Sequential(MLP(), nn.LayerNorm(D)), weight_decay=0.1, log=False)
    assert [g["tier"] for g in groups] == ["backbone"]


def test_split_kwargs_routes_grouping_options_and_optimizer_options():
    group, opt = split_kwargs({"lr": 1e-3, "weight_decay": 0.1, "rules": [], "exempt_1d": True, "eps_mode": "add"})
    assert group == {"weight_decay": 0.1, "rules": [], "exempt_1d": True}
    assert opt == {"lr": 1e-3, "eps_mode": "add"}


def test_from_model_builds_tiered_groups_logs_the_census_and_trains(caplog):
    torch.manual_seed(0)
    model = Net(BankMoE())
    with caplog.at_level(logging.INFO, logger="skewadam"):
        opt = SkewAdam.from_model(model, lr=1e-2, weight_decay=0.1, tier_options={"router": {"lr": 1e-3}})
    assert "router" in caplog.text and "expert" in caplog.text and "state" in caplog.text
    tiers = {g["tier"]: g for g in opt.param_groups}
    assert tiers["router"]["lr"] == 1e-3 and tiers["router"]["weight_decay"] == 0.0
    assert tiers["expert"]["weight_decay"] == 0.1 and tiers["expert"]["use_momentum"] is False
    x = torch.randint(0, 50, (8,))
    before = model.blocks[0].moe.gate.weight.detach().clone()
    model(x).square().mean().backward()
    opt.step()
    assert not torch.equal(before, model.blocks[0].moe.gate.weight)


# ------------------------------------------------------------------------------------------------ census
def test_census_state_bytes_equal_the_state_the_optimizer_allocates():
    model = MoETransformer(get_config("tiny"))
    options = {"expert": {"use_momentum": True}}
    census = describe(model, tier_options=options)
    opt = SkewAdam.from_model(model, tier_options=options, log=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for g in opt.param_groups:
        states = [opt.state[p] for p in g["params"]]
        stats = sum(t.numel() * t.element_size() for s in states for k, t in s.items() if k != "step")
        steps = sum(s["step"].numel() * s["step"].element_size() for s in states)
        tc = census.tiers[g["tier"]]
        assert (tc.state_bytes, tc.counter_bytes) == (stats, steps), g["tier"]
        assert tc.tensors == len(g["params"]) and tc.params == sum(p.numel() for p in g["params"])
    assert abs(sum(t.share for t in census.tiers.values()) - 1) < 1e-12


def test_census_table_and_dict():
    census = describe(MoETransformer(get_config("tiny")))
    table = census.table()
    for word in ("backbone", "expert", "router", "total"):
        assert word in table
    d = json.loads(json.dumps(census.to_dict()))
    assert d["params"] == sum(p.numel() for p in MoETransformer(get_config("tiny")).parameters())
    assert set(d["tiers"]) == {"backbone", "expert", "router"}


def test_census_warns_when_only_the_router_is_missing():
    model = Net(BankMoE())
    with pytest.warns(UserWarning, match=r"\['router'\] are empty"):
        describe(model, rules=[(r"\.gate\.", "backbone")])


def test_census_of_an_moe_model_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        describe(MoETransformer(get_config("tiny")))


# ------------------------------------------------------------------------------------------------ heads
def test_dense_ffn_matrices_of_the_token_tables_shape_are_hidden_in_the_bench_model():
    """The cpu preset's dense w1/w3 are [256, 128], the token table's shape: hidden matrices; the head is tied (no
    head of its own) and neither table is hidden."""
    model = MoETransformer(get_config("cpu"))
    names = hidden_matrices(model)
    assert tuple(model.tok_emb.weight.shape) == tuple(model.blocks[0].ffn.w1.weight.shape) == (256, 128)
    assert {f"blocks.{i}.ffn.{w}.weight" for i in (0, 2) for w in ("w1", "w2", "w3")} <= set(names)
    assert output_heads(model) == [] and not any(n.startswith(("tok_emb", "pos_emb")) for n in names)


@pytest.mark.parametrize("layout", sorted(HeadLM.HEADS))
def test_an_untied_head_is_the_vocabulary_projection_that_ends_the_network(layout):
    """Found by structure in each layout (at the root, in an LMHead, beside the layers in one module, a bare
    parameter either way round); the FFN's [V, D] up projection is not a head: its block reads V back."""
    model = HeadLM(layout)
    assert output_heads(model) == [HeadLM.HEADS[layout]]
    names = hidden_matrices(model)
    ffn = [n for n, p in model.named_parameters() if ".ffn." in n and p.ndim == 2]
    assert len(ffn) == 4 and set(ffn) <= set(names)
    assert HeadLM.HEADS[layout] not in names and "tok.weight" not in names


def test_a_tied_head_is_the_table_and_a_matrix_of_the_tables_shape_stays_hidden():
    model = Net(ListMoE(), vocab=3 * D)  # attention's qkv [3D, D] has the table's shape [V, D]
    assert output_heads(model) == []
    names = hidden_matrices(model)
    assert "blocks.0.attn.qkv.weight" in names and "emb.weight" not in names


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_transformers_head_is_what_get_output_embeddings_returns(tied):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)  # gate_proj/up_proj [64, 16]: the table's shape
    assert output_heads(model) == ([] if tied else ["lm_head.weight"])
    names = hidden_matrices(model)
    assert {f"model.layers.{i}.mlp.{w}_proj.weight" for i in range(2) for w in ("gate", "up", "down")} <= set(names)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)


def test_importing_classify_does_not_import_transformers():
    code = "import sys, skewadam.classify; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
