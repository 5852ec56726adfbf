"""Every Mixture-of-Experts family of the installed Hugging Face Transformers, from a tiny config on the meta device:
`skewadam.classify` must give each parameter the tier read from the family's forward code (`hf_family_cases`).

Also the figure the classifier must beat: a name-only regex baseline mislabels parameters across these families.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from hf_family_cases import FAMILIES, Family  # noqa: E402

from skewadam.classify import classify, hidden_matrices, output_heads  # noqa: E402


_CACHE: dict[str, tuple] = {}


def _built(family: Family):
    """The family's tiny model (on meta) and its labels, built once per session."""
    if family.id not in _CACHE:
        model = family.build()
        _CACHE[family.id] = model, classify(model)
    return _CACHE[family.id]


def name_only_baseline(names):
    """What the issue calls the baseline: substrings on names, ``experts?`` -> expert, ``gate``/``router`` -> router."""
    out = {}
    for name in names:
        if re.search(r"experts?\b", name):
            out[name] = "expert"
        elif re.search(r"\bgate\b|router", name):
            out[name] = "router"
        else:
            out[name] = "backbone"
    return out


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.id)
def test_family_tiers_match_the_forward_code(family):
    model, labels = _built(family)
    expected, frozen = family.expected(model)
    assert "expert" in expected.values(), "the tiny config must build an MoE layer"
    assert ("router" in expected.values()) == bool(family.router)
    wrong = {n: (labels.get(n), t) for n, t in expected.items() if labels.get(n) != t}
    assert not wrong, f"{len(wrong)} mislabelled (got, expected): {dict(list(wrong.items())[:8])}"
    assert set(labels) == set(expected)  # frozen tensors left out, nothing invented
    assert all(re.search(family.frozen, n) for n in frozen) if frozen else not family.frozen


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.id)
def test_hidden_matrices_are_every_backbone_matrix_but_the_tables_and_the_head(family):
    """The head is what ``get_output_embeddings()`` returns (none when tied or on a base model); no matrix of a layer
    is left out for having a table's shape (a DSA indexer's ``wk``, a shared expert's ``up_proj``)."""
    model, labels = _built(family)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    untied = [] if head is None or id(head.weight) in tables else [head.weight]
    params = dict(model.named_parameters())
    assert output_heads(model, labels) == [n for n, p in params.items() if any(p is w for w in untied)]
    expect = [n for n, t in labels.items() if t == "backbone" and params[n].ndim == 2 and id(params[n]) not in tables
              and not any(params[n] is w for w in untied)]
    assert hidden_matrices(model, labels) == expect


def test_families_cover_the_issue_list():
    modules = {f.module for f in FAMILIES}
    listed = {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
              "switch_transformers", "nllb_moe", "dbrx", "jamba", "granitemoe", "granitemoeshared",
              "granitemoehybrid", "phimoe", "jetmoe", "glm4_moe", "llama4", "ernie4_5_moe", "hunyuan_v1_moe",
              "minimax"}
    assert listed <= modules, listed - modules


def test_name_only_baseline_mislabels_what_structure_gets_right():
    tensors = baseline_wrong = ours_wrong = 0
    for family in FAMILIES:
        model, labels = _built(family)
        expected, _ = family.expected(model)
        baseline = name_only_baseline(expected)
        tensors += len(expected)
        baseline_wrong += sum(baseline[n] != t for n, t in expected.items())
        ours_wrong += sum(labels[n] != t for n, t in expected.items())
    print(f"\n{len(FAMILIES)} families, {tensors} trainable tensors: name-only baseline wrong on {baseline_wrong}, "
          f"skewadam.classify wrong on {ours_wrong}")
    assert ours_wrong == 0
    assert baseline_wrong >= 100  # shared experts, non-router gates, router biases, flattened/foreign experts


def test_experts_declared_by_the_model_stay_experts_without_a_recognisable_router():
    # Mixtral's expert-parallel plan and experts class mark the bank; remove the router: the bank is still expert
    mixtral = next(f for f in FAMILIES if f.module == "mixtral")
    model = mixtral.build()
    for layer in model.model.layers:
        del layer.mlp.gate
    tiers = set(classify(model).values())
    assert tiers == {"backbone", "expert"}
