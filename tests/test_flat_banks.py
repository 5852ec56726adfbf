"""Flattened expert banks: 2-D tensors stacking E experts along dim 0 (``[E*D, F]``, OLMo-core's ``MoEMLP``, DBRX),
labelled by `skewadam.classify.flattened_experts` and grouped with ``experts=E`` by `param_groups`; SkewAdam validates
the key. The optimizer does not apply it yet (each such tensor is factored and clipped as one matrix): the test of
the contract, a flattened bank trains bitwise like the stacked bank ``[E, D, F]``, is marked xfail until it does.
Legend: E experts, D rows of one expert, F columns.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from skewadam import SkewAdam
from skewadam.classify import flattened_experts
from skewadam.groups import param_groups

E, D, F = 4, 6, 5


class FlatMoE(nn.Module):
    """DBRX's layout: `experts` holds w1/v1 [E*F, D] and w2 [E*F, D] viewed per expert; router Linear(D, E)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.Module()
        for name in ("w1", "v1", "w2"):
            self.experts.register_parameter(name, nn.Parameter(torch.randn(E * F, D)))
        self.norm = nn.LayerNorm(D)


def test_flattened_experts_count_the_experts_the_router_scores():
    assert flattened_experts(FlatMoE()) == {"experts.w1": E, "experts.v1": E, "experts.w2": E}


def test_flattened_experts_leave_out_tensors_rules_move_out_of_the_expert_tier():
    assert flattened_experts(FlatMoE(), rules=[(r"\.w2$", "backbone")]) == {"experts.w1": E, "experts.v1": E}


def test_param_groups_give_flattened_banks_an_expert_group_with_experts():
    groups = param_groups(FlatMoE(), weight_decay=0.1, log=False)
    assert [(g["tier"], g.get("experts"), g["param_names"]) for g in groups] == [
        ("backbone", None, ["norm.weight", "norm.bias"]),
        ("expert", E, ["experts.w1", "experts.v1", "experts.w2"]),
        ("router", None, ["router.weight"]),
    ]


def test_tier_options_may_not_set_experts():
    with pytest.raises(ValueError, match="may not set 'experts'"):
        param_groups(FlatMoE(), tier_options={"expert": {"experts": 2}}, log=False)


@pytest.mark.parametrize("experts, tier, shape, match", [
    (0, "expert", (8, 3), r"Invalid experts .*expected an int >= 1"),
    (True, "expert", (8, 3), r"Invalid experts"),
    (4, "backbone", (8, 3), r"experts=4 is a key of 'expert' groups"),
    (3, "expert", (8, 3), r"dim 0 stacks that many experts, got shape \(8, 3\)"),
    (2, "expert", (8,), r"needs tensors of >= 2 dims"),
])
def test_skewadam_validates_the_experts_key(experts, tier, shape, match):
    with pytest.raises(ValueError, match=match):
        SkewAdam([{"params": [nn.Parameter(torch.zeros(shape))], "tier": tier, "experts": experts}])


def test_skewadam_warns_that_experts_is_not_applied_yet():
    with pytest.warns(UserWarning, match="experts=4 is not applied yet"):
        SkewAdam([{"params": [nn.Parameter(torch.zeros(8, 3))], "tier": "expert", "experts": 4}])


@pytest.mark.xfail(strict=True, reason="the kernels do not apply `experts` yet: a flattened bank is factored and "
                                       "clipped as one matrix (planned with the kernel rewrite)")
@pytest.mark.parametrize("flags", [{}, {"use_momentum": True}], ids=["factored", "momentum"])
def test_flattened_bank_trains_bitwise_like_the_stacked_bank(flags):
    gen = torch.Generator().manual_seed(0)
    w0_EDF = torch.randn(E, D, F, generator=gen)
    stacked = nn.Parameter(w0_EDF.clone())
    flat = nn.Parameter(w0_EDF.reshape(E * D, F).clone())
    kwargs = dict(lr=1e-2, weight_decay=0.1, **flags)
    opt_stacked = SkewAdam([{"params": [stacked], "tier": "expert"}], **kwargs)
    with pytest.warns(UserWarning):
        opt_flat = SkewAdam([{"params": [flat], "tier": "expert", "experts": E}], **kwargs)
    scale_E11 = torch.tensor([1.0, 100.0, 0.01, 1.0]).view(E, 1, 1)  # expert 1's clip binds
    for t in range(6):
        grad_EDF = torch.randn(E, D, F, generator=gen) * scale_E11
        grad_EDF[3] = 0.0  # expert 3 never receives a token
        if t % 2:
            grad_EDF[0] = 0.0
        stacked.grad = grad_EDF.clone()
        flat.grad = grad_EDF.reshape(E * D, F).clone()
        opt_stacked.step()
        opt_flat.step()
    assert torch.equal(flat.detach().view(E, D, F), stacked.detach())
    assert opt_flat.state[flat]["step"].tolist() == opt_stacked.state[stacked]["step"].tolist()  # [6, 3, 6, 0]
