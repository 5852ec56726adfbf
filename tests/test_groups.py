"""Param groups and their census (`skewadam.groups`): one labelling per call, the caller's rules honoured; and a
SkewAdam built without tiers (`skewadam.groups.warn_untiered_experts`): when its untiered groups hold tensors shaped
like expert banks, or a bank beside its gate, it warns once and points to `SkewAdam.from_model` / ``tier=``; tiered
groups, plain dense models and conv kernels stay silent."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

from skewadam import SkewAdam
from skewadam.classify import label
from skewadam.groups import describe, param_groups
from skewadam.bench.models import MoETransformer, get_config
from test_flat_banks import FlatMoE  # a router beside flattened expert tensors [E*F, D] (DBRX's layout)


# ------------------------------------------------------------------------------------------------ one labelling
def test_param_groups_describe_and_from_model_walk_the_structure_once(monkeypatch):
    calls = []
    classify = importlib.import_module("skewadam.classify")  # the module (the package re-exports the function)
    structure = classify.structure
    monkeypatch.setattr(classify, "structure", lambda model: calls.append(1) or structure(model))
    model = MoETransformer(get_config("tiny"))
    for build in (lambda: param_groups(model, orthogonal="experts", exempt_1d=True, log=False),
                  lambda: describe(model, orthogonal="experts"),
                  lambda: SkewAdam.from_model(model, orthogonal=True, log=False)):
        calls.clear()
        build()
        assert len(calls) == 1


def test_describe_honours_the_callers_rules():
    """A rule moving one flattened tensor out of the expert tier: the census counts it as the optimizer holds it
    (backbone state of a plain matrix), and the bank left in the tier as a stacked bank."""
    model = FlatMoE()
    rules = [(r"^experts\.w2$", "backbone")]
    census = describe(model, rules=rules)
    assert census.tiers["expert"].tensors == 2 and census.tiers["backbone"].tensors == 3  # w2 and the norm
    assert describe(model, labels=label(model, rules)).to_dict() == census.to_dict()
    opt = SkewAdam.from_model(model, rules=rules, log=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    held = opt.state_bytes().by_tier
    assert {t: c.state_bytes for t, c in census.tiers.items()} == {t: held.get(t, 0) for t in census.tiers}


def test_rules_beside_labels_are_refused():
    model = FlatMoE()
    with pytest.raises(ValueError, match=r"rules and labels given.*not both"):
        describe(model, rules=[(r"^norm\.", "backbone")], labels=label(model))


# ------------------------------------------------------------------------------------------------ untiered groups


def _warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if "names no tier" in str(w.message)]


def test_untiered_expert_banks_warn_once_pointing_to_from_model_and_tier():
    model = MoETransformer(get_config("tiny"))
    (message,) = _warnings(lambda: SkewAdam(model.parameters()))  # one warning for the 3 banks
    E, F, D = 4, 32, 32
    assert f"({E}, {F}, {D})" in message and f"beside a gate [{E}, {D}]" in message
    assert "SkewAdam.from_model" in message and "'expert' for banks, 'router' for the gate" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = SkewAdam(model.parameters())
        caught.clear()
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 32, 32))]})
    assert not [w for w in caught if "names no tier" in str(w.message)]  # once per optimizer


def test_the_warning_points_at_the_users_line():
    model = MoETransformer(get_config("tiny"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SkewAdam(model.parameters())
    (w,) = [w for w in caught if "names no tier" in str(w.message)]
    assert w.filename == __file__


def test_tiered_groups_dense_models_and_conv_kernels_do_not_warn():
    model = MoETransformer(get_config("tiny"))
    assert _warnings(lambda: SkewAdam.from_model(model)) == []
    bank = nn.Parameter(torch.zeros(4, 32, 32))
    assert _warnings(lambda: SkewAdam([{"params": [bank], "tier": "expert"}])) == []
    assert _warnings(lambda: SkewAdam([bank], tier="expert")) == []  # the constructor's tier is a choice too
    dense = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    assert _warnings(lambda: SkewAdam(dense.parameters())) == []
    conv = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv1d(16, 16, 5), nn.Linear(16, 10))
    assert _warnings(lambda: SkewAdam(conv.parameters())) == []


def test_a_small_bank_beside_its_gate_warns_and_named_parameters_work():
    gate, bank = nn.Parameter(torch.zeros(4, 6)), nn.Parameter(torch.zeros(4, 6, 6))  # below the matrix size
    (message,) = _warnings(lambda: SkewAdam([("gate", gate), ("experts", bank)]))
    assert "(4, 6, 6)" in message and "beside a gate [4, 6]" in message
    assert _warnings(lambda: SkewAdam([nn.Parameter(torch.zeros(4, 6, 6))])) == []  # a small 3-D tensor alone
