"""Automatic tiering of MoE models from the codebases outside Transformers (`moe_library_cases`): torchtitan, OLMo-core,
megatron-core, DeepSpeed, litgpt, fairscale, mixture-of-experts, st-moe-pytorch, torchscale.

Every case must get each parameter the tier read from its library's MoE layer; then one test per signal the
classifier uses, each on a model the real library builds. A case whose library is absent is skipped.
"""

from __future__ import annotations

import collections
import re
import warnings

import pytest
import torch

from moe_library_cases import CASES, Case, one_process_group

from skewadam.classify import classify, flattened_experts, hidden_matrices, output_heads
from skewadam.groups import param_groups

_CACHE: dict[str, tuple] = {}


def _built(case: Case):
    """The case's model and its labels, built once per session (skips if the library is absent)."""
    missing = case.missing()
    if missing:
        pytest.skip(f"{case.library} not importable ({missing})")
    if case.id not in _CACHE:
        model = case.build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CACHE[case.id] = model, classify(model)
    return _CACHE[case.id]


def _case(case_id: str):
    return _built(next(c for c in CASES if c.id == case_id))


def _wrong(case: Case, model, labels) -> dict[str, tuple]:
    return {n: (labels.get(n), t) for n, t in case.expected(model).items() if labels.get(n) != t}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_library_model_tiers_match_the_moe_layer_source(case):
    model, labels = _built(case)
    expected = case.expected(model)
    assert {"expert", "router"} <= set(expected.values()), "the case must build an MoE layer with a router"
    wrong = _wrong(case, model, labels)
    assert not wrong, f"{len(wrong)} mislabelled (got, expected): {dict(list(wrong.items())[:8])}"
    assert set(labels) == set(expected)


def test_cases_cover_torchtitan_and_four_other_codebases():
    libraries = {c.library for c in CASES}
    assert {"torchtitan", "olmo_core", "megatron", "deepspeed", "litgpt"} <= libraries
    families = {c.id.split(":")[1].split("/")[0] for c in CASES if c.library == "torchtitan"}
    assert families == {"qwen3", "deepseek_v3", "gpt_oss", "kimi_k2_7", "qwen3_5"}  # every MoE registry of 0.3.0


def test_wrong_labels_per_library_are_zero():
    per_library: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for case in CASES:
        if case.missing():
            continue
        model, labels = _built(case)
        row = per_library[case.library]
        row[0] += 1
        row[1] += len(case.expected(model))
        row[2] += len(_wrong(case, model, labels))
    if not per_library:
        pytest.skip("none of the libraries is installed")
    print("\n" + "\n".join(f"{lib:<20} {m:>3} models {t:>6} tensors {w:>4} wrong" for lib, (m, t, w) in
                           per_library.items()))
    assert all(w == 0 for _, _, w in per_library.values())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_output_head_is_the_projection_that_produces_the_logits_and_every_other_matrix_is_hidden(case):
    """The head by structure (the vocabulary projection that ends the network), never by the table's shape: every
    other backbone matrix but the embedding tables (Megatron's ``VocabParallelEmbedding`` too) is a hidden matrix."""
    model, labels = _built(case)
    heads = output_heads(model, labels)
    assert heads == [n for n in labels if re.search(case.head, n)] and len(heads) == 1
    tables = {id(m.weight) for m in model.modules() if type(m).__name__.endswith("Embedding") and hasattr(m, "weight")}
    params = dict(model.named_parameters())
    expect = [n for n, t in labels.items()
              if t == "backbone" and params[n].ndim == 2 and id(params[n]) not in tables and n not in heads]
    assert hidden_matrices(model, labels) == expect


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_flattened_expert_tensors_stack_the_experts_their_router_scores(case):
    model, labels = _built(case)
    counts = flattened_experts(model)
    assert set(counts.values()) == ({case.flat} if case.flat else set())
    assert not counts or set(counts) == {n for n, t in labels.items() if t == "expert"}


@pytest.mark.parametrize("case", [c for c in CASES if c.flat], ids=lambda c: c.id)
def test_the_plan_of_a_model_with_flattened_banks_holds_the_state_skewadam_allocates(case):
    """On one process (no ``shards``), the planner's state for OLMo-core's flattened banks is byte for byte what
    SkewAdam allocates for them (``init_state``, on the meta device): per-expert step counts and column statistics."""
    from skewadam import SkewAdam, plan

    model, labels = _built(case)
    planned = plan(model, optimizers=["skewadam"], labels=labels, seq=16)["skewadam"].state.total
    optimizer = SkewAdam.from_model(model, lr=1e-3)  # (labelled by classify, as `labels`)
    optimizer.init_state()
    assert planned == optimizer.state_bytes().total


def test_cases_cover_every_moe_variant_of_olmo_core():
    """Each option of OLMo-core 3.0.0's MoE configs has a case: the v1 MoE (both MoE types, the four MoE block
    types, shared MLP, latent MoE and its options, router gating and expert bias) and the fused MoE-v2 blocks."""
    ids = {c.id.removeprefix("olmo_core:") for c in CASES if c.library == "olmo_core"}
    words = {w for i in ids for w in re.split(r"[/+]", i)}
    assert {"dropping", "dropless", "sigmoid", "topk_softmax", "expert_bias", "shared", "moe_hybrid", "bias",
            "norm"} <= words
    assert {"smallmoe", "small_hybrid_moe", "olmoe_1B_7B", "latent_moe", "latent_moe/dropless+bias", "v2/gpt_oss",
            "v2/nemotron3_nano", "v2/qwen3_moe/latent", "v2/qwen3_moe/2_shared", "v2/qwen3_moe/emo"} <= ids


# ------------------------------------------------------------------------------------------------ signals
def _tiers(labels, pattern):
    return {labels[n] for n in labels if re.search(pattern, n)}


def test_router_three_modules_above_the_bank_is_found():
    # torchtitan: banks at moe.routed_experts.inner_experts, router at moe.router.gate
    model, labels = _case("torchtitan:qwen3/debugmodel_moe")
    assert _tiers(labels, r"\.inner_experts\.w[123]_E..$") == {"expert"}
    assert _tiers(labels, r"\.moe\.router\.gate\.weight$") == {"router"}


def test_router_is_not_looked_for_in_another_block():
    # torchtitan DeepSeek-V3 keeps dense layers first: their FFNs stay backbone although an MoE block follows
    model, labels = _case("torchtitan:deepseek_v3/16B")
    assert _tiers(labels, r"\.feed_forward\.") == {"backbone"}
    assert _tiers(labels, r"\.moe\.shared_experts\.") == {"backbone"}


def test_flat_router_and_flattened_banks_with_their_expert_count():
    # OLMo-core MoELinearRouter.weight [E*D] and MoEMLP w1/w3 [E*D, F], w2 [E*F, D]
    case = next(c for c in CASES if c.id == "olmo_core:smallmoe")
    model, labels = _built(case)
    assert _tiers(labels, r"\.router\.weight$") == {"router"}
    assert _tiers(labels, r"\.shared_mlp\.") == {"backbone"}  # [2D, D] rows divide E*F: no router for that
    counts = flattened_experts(model)
    assert set(counts) == {n for n, t in labels.items() if t == "expert"}
    assert set(counts.values()) == {32}  # smallmoe: num_experts=32
    for name, k in counts.items():
        rows, cols = dict(model.named_parameters())[name].shape
        assert rows % k == 0 and {rows // k, cols} == {256, 128}  # per expert [D, F] or [F, D]


def test_flat_router_reading_the_model_width_of_a_latent_moe():
    model, labels = _case("olmo_core:latent_moe")
    assert _tiers(labels, r"\.router\.weight$") == {"router"}
    assert _tiers(labels, r"\.latent_(down|up)_proj\.") == {"backbone"}
    assert set(flattened_experts(model).values()) == {16}


def test_a_projection_mapped_back_to_the_width_it_reads_is_no_router_and_a_latent_router_reads_the_model_width():
    """A dropless latent MoE: its flattened experts [E*F, L] split for many E, so the up projection [D, L] (its rows
    a multiple of F) fits a router of D/F experts of width L; but the down projection beside it maps D back to L, so
    it is a step on the way back to the residual stream. The flat router [E*D] reads D, the width the loose
    projections go out from, so E = 16 (not 32 experts of width L)."""
    model, labels = _case("olmo_core:latent_moe/dropless+bias")
    assert _tiers(labels, r"\.latent_(down|up)_proj\.") == {"backbone"}
    assert _tiers(labels, r"\.feed_forward_moe\.router\.weight$") == {"router"}
    assert set(flattened_experts(model).values()) == {16}


def test_projections_with_e_rows_in_attention_are_not_routers():
    # OLMo-core's gated-delta-net w_a/w_b are [heads, D] = [E, D]; the router is the flat [E*D] beside them
    model, labels = _case("olmo_core:v2/qwen3_moe")
    assert _tiers(labels, r"\.attention\.w_[ab]\.weight$") == {"backbone"}
    assert _tiers(labels, r"\.routed_experts_router\.weight$") == {"router"}
    assert _tiers(labels, r"\.shared_experts(_router)?\.") == {"backbone"}


def test_depthwise_conv_weights_are_not_banks():
    # torchtitan Qwen3.5 linear attention: conv_q/k/v [C, 1, K] in torchtitan's own module class
    model, labels = _case("torchtitan:qwen3_5/35B-A3B")
    assert _tiers(labels, r"\.attn\.") == {"backbone"}
    assert _tiers(labels, r"\.shared_experts\.gate\.weight$") == {"backbone"}


@pytest.mark.parametrize("case_id, pattern", [
    ("fairscale:moe_layer", r"\.experts\."),  # p.expert = True
    ("torchscale:top2", r"\.experts\."),  # p.expert = True
    ("deepspeed:moe_top1", r"\.deepspeed_experts\."),  # allreduce = False, group_name
    ("deepspeed:grouped_experts", r"\.experts\.w[123]$"),  # is_expert_group = True
])
def test_marks_libraries_set_on_expert_parameters_label_them_expert(case_id, pattern):
    model, labels = _case(case_id)
    marked = [n for n, p in model.named_parameters() if re.search(pattern, n)]
    assert marked and all(labels[n] == "expert" for n in marked)


def test_marked_experts_of_one_expert_parallel_rank_take_the_router_of_all_experts():
    # fairscale's MOELayer on one rank of 2: it holds 4 of the 8 experts the Top2Gate scores
    pytest.importorskip("fairscale")
    from fairscale.nn.moe import MOELayer, Top2Gate
    from moe_library_cases import D, _mlp, _Model

    with one_process_group():
        model = _Model(MOELayer(Top2Gate(D, 8), torch.nn.ModuleList(_mlp() for _ in range(4))))
    labels = classify(model)
    assert labels["blocks.0.moe.gate.wg.weight"] == "router"
    assert _tiers(labels, r"\.moe\.experts\.") == {"expert"}


def test_marks_alone_make_experts_without_a_router_of_matching_size():
    # Megatron-LM marks expert parameters allreduce=False under expert parallelism; with the router removed the
    # experts stay experts and nothing becomes a router
    case = next(c for c in CASES if c.id == "megatron:moe_shared")
    _built(case)
    model = case.build()  # a fresh copy: it is edited
    for layer in model.decoder.layers:
        del layer.mlp.router
        for p in layer.mlp.experts.parameters():
            p.allreduce = False
    labels = classify(model)
    assert _tiers(labels, r"\.local_experts\.") == {"expert"}
    assert "router" not in labels.values()


def test_transposed_router():
    # mixture-of-experts Top2Gating.w_gating [D, E] (x @ w)
    model, labels = _case("mixture_of_experts:moe")
    assert _tiers(labels, r"\.gate\.w_gating$") == {"router"}


@pytest.mark.parametrize("case_id, router", [
    ("torchscale:xmoe", r"\.gate\.(wg|wg_reduction\.weight)$"),  # wg_reduction [16, D], then wg [E, 16]
    ("mixture_of_experts:hierarchical", r"\.gate_(outer|inner)\.w_gating$"),  # [D, Eo], then [Eo, D, Ei]
])
def test_both_stages_of_a_two_stage_router_are_router(case_id, router):
    model, labels = _case(case_id)
    names = [n for n in labels if re.search(router, n)]
    assert len(names) == 4 and all(labels[n] == "router" for n in names)


@pytest.mark.parametrize("case_id, gate", [
    ("deepspeed:moe_residual_e2", r"\.moe\.coefficient\."),  # Linear(D, 2) mixing the dense MLP in: [E, D] shaped
    ("megatron:moe_shared_gate", r"\.shared_experts\.gate_weight$"),  # [1, D] sigmoid gate of the shared expert
    ("olmo_core:v2/qwen3_moe", r"\.shared_experts_router\."),  # [S*D] gates of the always-on shared experts
])
def test_gates_of_always_on_experts_are_backbone(case_id, gate):
    model, labels = _case(case_id)
    assert _tiers(labels, gate) == {"backbone"}


def test_param_groups_put_flattened_banks_in_an_expert_group_with_their_count():
    case = next(c for c in CASES if c.id == "olmo_core:olmoe_1B_7B")
    model, labels = _built(case)
    groups = param_groups(model, weight_decay=0.1, exempt_1d=True, log=False)
    flat = [g for g in groups if "experts" in g]
    assert len(flat) == 1 and flat[0]["tier"] == "expert" and flat[0]["experts"] == 64
    assert set(flat[0]["param_names"]) == {n for n, t in labels.items() if t == "expert"}
    assert flat[0]["weight_decay"] == 0.1
    assert sum(len(g["params"]) for g in groups) == len(labels)
