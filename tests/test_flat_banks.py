"""Flattened expert banks: 2-D tensors stacking E experts along dim 0 (``[E*D, F]``, OLMo-core's ``MoEMLP``, DBRX),
labelled by `skewadam.classify.flattened_experts` and grouped with ``experts=E`` by `param_groups`; SkewAdam validates
the key and steps each such tensor as the stacked bank ``[E, D, F]`` it flattens (per-expert clip, step counts and
factored statistics): a flattened bank trains bitwise like the stacked bank, and its state holds the stacked bank's
values in the flattened bank's own rows where it spans them (``exp_avg [E*D, F]``, ``row_var [E*D, 1]``), per expert
elsewhere (``col_var [E, 1, F]``, ``step [E]``), so it shards like the parameter under FSDP2 (the sharded checks are
``tests/distributed/test_flat_banks_distributed.py``). Legend: E experts, D rows of one expert, F columns.
"""

from __future__ import annotations

import copy as copy_module

import pytest
import torch
from torch import nn

from skewadam import SkewAdam, describe, kernels
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


@pytest.mark.parametrize("impl", kernels.cpu_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flags", [{}, {"use_momentum": True}, {"use_momentum": True, "momentum_dtype": "int8"}],
                         ids=["factored", "momentum", "int8-momentum"])
def test_flattened_bank_trains_bitwise_like_the_stacked_bank(flags, dtype, impl):
    """The rule: ``experts=E`` steps ``[E*D, F]`` as the stacked ``[E, D, F]`` (same kernel, same view of the same
    memory), so weights, step counts and every state tensor's values are bitwise the stacked bank's; a resumed copy
    of the flattened optimizer goes on bitwise."""
    gen = torch.Generator().manual_seed(0)
    w0_EDF = torch.randn(E, D, F, generator=gen).to(dtype)
    stacked = nn.Parameter(w0_EDF.clone())
    flat = nn.Parameter(w0_EDF.reshape(E * D, F).clone())
    kwargs = dict(lr=1e-2, weight_decay=0.1, impl=impl, **flags)
    opt_stacked = SkewAdam([{"params": [stacked], "tier": "expert"}], **kwargs)
    opt_flat = SkewAdam([{"params": [flat], "tier": "expert", "experts": E}], **kwargs)
    scale_E11 = torch.tensor([1.0, 100.0, 0.01, 1.0]).view(E, 1, 1)  # expert 1's clip binds
    resumed = None
    for t in range(6):
        grad_EDF = (torch.randn(E, D, F, generator=gen) * scale_E11).to(dtype)
        grad_EDF[3] = 0.0  # expert 3 never receives a token
        if t % 2:
            grad_EDF[0] = 0.0
        if t == 3:
            copy = nn.Parameter(flat.detach().clone())
            resumed = SkewAdam([{"params": [copy], "tier": "expert", "experts": E}], **kwargs)
            resumed.load_state_dict(copy_module.deepcopy(opt_flat.state_dict()))  # as from a file
        stacked.grad = grad_EDF.clone()
        flat.grad = grad_EDF.reshape(E * D, F).clone()
        opt_stacked.step()
        opt_flat.step()
        if resumed is not None:
            copy.grad = flat.grad.clone()
            resumed.step()
    assert torch.equal(flat.detach().view(E, D, F), stacked.detach())
    assert torch.equal(copy.detach(), flat.detach())
    assert opt_flat.state[flat]["step"].tolist() == [3, 6, 6, 0]  # expert 0 idle every other step, 3 always
    for key, value in opt_stacked.state[stacked].items():
        flat_value = opt_flat.state[flat][key]
        assert torch.equal(flat_value, value.reshape(flat_value.shape)), key
        assert torch.equal(resumed.state[copy][key], flat_value), key


def test_a_flattened_bank_keeps_its_state_in_its_rows_and_per_expert():
    """State spanning each expert's rows in the parameter's own layout (it shards as the parameter does), the rest per
    expert: what a checkpoint of one process holds, and of N ranks once gathered."""
    flat = nn.Parameter(torch.randn(E * D, F))
    opt = SkewAdam([{"params": [flat], "tier": "expert", "experts": E}], use_momentum=True, momentum_dtype="int8")
    flat.grad = torch.randn_like(flat)
    opt.step()
    assert {k: tuple(v.shape) for k, v in opt.state[flat].items()} == {
        "step": (E,), "exp_avg": (E * D, F), "exp_avg_scale": (E * D, 1), "row_var": (E * D, 1), "col_var": (E, 1, F)}


@pytest.mark.parametrize("impl", kernels.cpu_backends())
def test_a_checkpoint_in_the_stacked_layout_of_earlier_versions_loads_and_resumes_bitwise(impl):
    """Earlier versions saved a flattened bank's state as the stacked bank ``[E, D, F]`` keeps it: it loads (reshaped
    to the flattened layout) and training goes on bitwise as the optimizer that saved it."""
    gen = torch.Generator().manual_seed(3)
    flat = nn.Parameter(torch.randn(E * D, F, generator=gen))
    kwargs = dict(lr=1e-2, use_momentum=True, impl=impl)
    opt = SkewAdam([{"params": [flat], "tier": "expert", "experts": E}], **kwargs)
    grads = [torch.randn(E * D, F, generator=gen) for _ in range(3)]
    flat.grad = grads[0]
    opt.step()
    old = copy_module.deepcopy(opt.state_dict())
    for key, value in old["state"][0].items():  # what the stacked layout held: the same values, [E, D, ...] shapes
        if value.shape[0] == E * D:
            old["state"][0][key] = value.reshape(E, D, *value.shape[1:])
    assert old["state"][0]["row_var"].shape == (E, D, 1)
    copy = nn.Parameter(flat.detach().clone())
    resumed = SkewAdam([{"params": [copy], "tier": "expert", "experts": E}], **kwargs)
    resumed.load_state_dict(old)
    for g in grads[1:]:
        flat.grad, copy.grad = g.clone(), g.clone()
        opt.step()
        resumed.step()
    assert torch.equal(copy.detach(), flat.detach())
    assert all(torch.equal(resumed.state[copy][k], v) for k, v in opt.state[flat].items())


def test_the_reducer_gets_a_flattened_bank_as_one_item_in_the_bank_s_dims():
    """The reduce seam hands a flattened bank's statistics in the dims of the bank ``[E*D, F]`` (the view's expert and
    row dims are its dim 0): per-expert sums over dim 0 (and 1), row sums over dim 1 only, so a reducer that sums over
    the mesh dims sharding those dims needs to know nothing of the view."""
    flat = nn.Parameter(torch.randn(E * D, F))
    opt = SkewAdam([{"params": [flat], "tier": "expert", "experts": E}])
    seen = []
    opt._reducer = lambda items: seen.append([(p is flat, [(tuple(s.shape), d) for s, d in stats])
                                              for p, stats in items])
    flat.grad = torch.randn_like(flat)
    opt.step()
    assert seen == [
        [(True, [((E, 1, 1), (0, 1)), ((E, 1, 1), (0, 1)), ((E, D, 1), (1,)), ((E, 1, F), (0,)), ((E, 1, 1), (0,))])],
        [(True, [((E, 1, 1), (0, 1))])],  # pass 2: the clip's sums of u^2
    ]


def test_a_flattened_bank_s_state_is_counted_as_the_stacked_bank_s():
    """The census and the optimizer agree: both size a flattened bank's state as the stacked bank's."""
    model = FlatMoE()
    opt = SkewAdam(param_groups(model, log=False))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    census = describe(model)
    assert census.tiers["expert"].state_bytes == opt.state_bytes().by_tier["expert"]


def test_the_planner_counts_the_sums_fsdp2_all_reduces_per_step_every_expert_s_for_flattened_banks():
    """Under ``Shard(0)`` over several ranks a flattened bank's rows cut its experts: each of the E experts' column
    sums [1, D] and 4 sums per step (3 banks x 4 x (6 + 4) numbers); the same experts stacked ``[E, F, D]`` are
    sharded on experts and need none. 2 sums for each other tensor (router, norm weight and bias); float64 but sum u^2
    (fp32), and the 4-byte skip flag; an optimizer that reduces nothing, or one rank, counts 0."""
    from skewadam import plan

    flat = FlatMoE()
    stacked = FlatMoE()
    for name in ("w1", "v1", "w2"):
        stacked.experts.register_parameter(name, nn.Parameter(torch.randn(E, F, D)))
    got = plan(flat, optimizers=["skewadam", "adamw"], shards=2)
    units = 3 * E + 3  # each has a sum u^2, in fp32; the other sums are float64
    assert got["skewadam"].reduce_bytes == 8 * (3 * E * (D + 4) + 3 * 2 - units) + 4 * units + 4
    labels = {n: "expert" if n.startswith("experts.") else "router" if n.startswith("router") else "backbone"
              for n, _ in stacked.named_parameters()}
    assert plan(stacked, optimizers=["skewadam"], shards=2, labels=labels)["skewadam"].reduce_bytes == (8 + 4) * 3 + 4
    assert got["adamw"].reduce_bytes == 0 == plan(flat, optimizers=["skewadam"])["skewadam"].reduce_bytes


@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_the_planner_counts_a_flattened_bank_s_state_and_step_temporaries_as_the_optimizer_and_kernels_have_them(impl):
    """On one process too, the planner finds the flattened banks: their state is what SkewAdam allocates, and each
    backend's step temporaries are the stacked bank's (the kernels step it as that bank: factored per expert, not as
    one 2-D matrix)."""
    from skewadam import plan

    flat, stacked = FlatMoE(), FlatMoE()
    for name in ("w1", "v1", "w2"):
        stacked.experts.register_parameter(name, nn.Parameter(torch.randn(E, F, D)))
    labels = {n: "expert" if n.startswith("experts.") else "router" if n.startswith("router") else "backbone"
              for n, _ in stacked.named_parameters()}
    got = plan(flat, optimizers=["skewadam"], impl=impl)["skewadam"]
    want = plan(stacked, optimizers=["skewadam"], labels=labels, impl=impl)["skewadam"].step_temporaries
    assert got.step_temporaries == want > 0
    opt = SkewAdam(param_groups(flat, log=False))
    for p in flat.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert got.state.total == opt.state_bytes().total
