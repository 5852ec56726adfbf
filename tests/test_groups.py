"""A SkewAdam built without tiers (`skewadam.groups.warn_untiered_experts`): when its untiered groups hold tensors
shaped like expert banks, or a bank beside its gate, it warns once and points to `SkewAdam.from_model` / ``tier=``;
tiered groups, plain dense models and conv kernels stay silent."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from skewadam import SkewAdam
from skewadam.bench.models import MoETransformer, get_config


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
