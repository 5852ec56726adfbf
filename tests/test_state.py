"""`skewadam.state`: the flags a group resolves to, the state check, the census against what the optimizer holds, and
the measured bytes (`measure_state`) of any optimizer."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from skewadam import SkewAdam
from skewadam.bench.presets import load_model
from skewadam.groups import describe
from skewadam.state import MOMENTUM_DTYPES, TierSpec, check_state, measure_state, state_flags, state_spec


# ------------------------------------------------------------------------------------------------------- flags
def test_a_groups_tier_spec_takes_the_tier_defaults_where_the_group_gives_none():
    assert state_flags({}) == TierSpec("backbone", "fp32", "factored")
    assert state_flags({"tier": "router", "lr": 1e-3, "use_momentum": None}) == TierSpec("router", None, "full")
    assert state_flags({"tier": "expert", "use_momentum": True, "bank": False, "momentum_dtype": "int8"}) == \
        TierSpec("expert", "int8", "factored", "adam", False)
    assert state_flags({"tier": "expert", "momentum_dtype": "int8"}).momentum is None  # no momentum to store


@pytest.mark.parametrize("group, match", [
    ({"tier": "bogus"}, r"^param group 3: unknown tier 'bogus'"),
    ({"momentum_dtype": "fp8"}, r"^Invalid momentum_dtype in param group 3: 'fp8'"),
    ({"use_factored": 1}, r"^Invalid use_factored in param group 3: 1 \(expected True, False or None\)"),
    ({"update": "muon"}, r"^Invalid update in param group 3: 'muon'"),
    ({"update": "orthogonal", "use_factored": True}, r"^param group 3: update='orthogonal' keeps no second moment"),
    ({"tier": "expert", "update": "orthogonal", "experts": 2},
     r"^param group 3: update='orthogonal' takes matrices"),
    ({"tier": "expert", "experts": 0}, r"^Invalid experts in param group 3: 0"),
    ({"experts": 2}, r"^param group 3: experts=2 is a key of 'expert' groups"),
])
def test_a_groups_state_settings_are_validated_where_its_tier_spec_is_built(group, match):
    with pytest.raises(ValueError, match=match):
        state_flags(group, "param group 3")
    with pytest.raises(ValueError, match=match.replace("param group 3", "param group 0")):
        SkewAdam([{"params": [nn.Parameter(torch.zeros(4, 3))], **group}])


def test_every_state_key_the_spec_makes_is_a_named_field_of_the_kernels_record():
    """The optimizer fills a record's state from the state dict by `STATE_KEYS`, in `ParamTensors`' field order: every
    key `state_spec` makes is ``step`` or one of them, and they are the record's fields after ``step``."""
    from skewadam.kernels.types import STATE_KEYS, ParamTensors

    made = {key for shape in ((8, 6), (4, 8, 6), (6,)) for momentum in (None, *MOMENTUM_DTYPES)
            for factored in (True, False) for update in ("adam", "orthogonal")
            for key in state_spec(shape, torch.bfloat16, use_momentum=momentum is not None, use_factored=factored,
                                  bank=len(shape) == 3, momentum_dtype=momentum or "fp32", update=update)}
    assert made == {"step", *STATE_KEYS}
    fields = ParamTensors._fields
    assert fields[fields.index("step") + 1:fields.index("step") + 1 + len(STATE_KEYS)] == STATE_KEYS


def test_a_groups_flags_give_its_state_spec_with_the_bank_rule():
    expert = state_flags({"tier": "expert"})
    assert expert.spec((4, 6, 5), torch.bfloat16) == state_spec((4, 6, 5), torch.bfloat16, use_momentum=False,
                                                                 use_factored=True, bank=True)
    assert expert.is_bank(3) and not expert.is_bank(2) and not state_flags({"tier": "expert", "bank": False}).is_bank(3)


def test_check_state_names_the_parameter_and_what_differs():
    spec = state_spec((8, 6), torch.float32, use_momentum=True, use_factored=True, bank=False)
    good = {k: torch.zeros(st.shape, dtype=st.dtype) for k, st in spec.items()}
    check_state(good, spec, "p")  # the spec's own tensors pass
    with pytest.raises(ValueError, match=r"^p: state has keys .*\(missing \['exp_avg'\]\)"):
        check_state({k: v for k, v in good.items() if k != "exp_avg"}, spec, "p")
    with pytest.raises(ValueError, match=r"p: state 'row_var' is \[16, 1\] torch.float32, expected \[8, 1\]"):
        check_state({**good, "row_var": torch.zeros(16, 1)}, spec, "p")
    with pytest.raises(ValueError, match=r"'exp_avg' is \[8, 6\] torch.bfloat16, expected \[8, 6\] torch.float32"):
        check_state({**good, "exp_avg": torch.zeros(8, 6, dtype=torch.bfloat16)}, spec, "p")
    with pytest.raises(ValueError, match="state 'step' is a int, expected a tensor"):
        check_state({**good, "step": 3}, spec, "p")


# ------------------------------------------------------------------------------------------------------ census
TIER_OPTIONS = {
    "paper": None,
    "expert-momentum": {"expert": {"use_momentum": True}},
    "router-factored": {"router": {"use_momentum": True, "use_factored": True}},
    "backbone-plain": {"backbone": {"use_momentum": False, "use_factored": False}},
    "banks-off": {"expert": {"bank": False}},
    "backbone-bf16m": {"backbone": {"momentum_dtype": "bf16"}, "expert": {"use_momentum": True}},
}


@pytest.mark.parametrize("tier_options", list(TIER_OPTIONS.values()), ids=list(TIER_OPTIONS))
@pytest.mark.parametrize("momentum_dtype", MOMENTUM_DTYPES)
def test_census_equals_state_bytes_after_a_step(momentum_dtype, tier_options, caplog):
    """The census counts the state the optimizer then holds, under SkewAdam's settings and the tier overrides (it
    ignored ``momentum_dtype``: 1,895,936 B vs 581,632 B held with int8 momentum on the CPU bench model)."""
    model = load_model("cpu", device="cpu")
    with caplog.at_level(logging.INFO, logger="skewadam"):
        opt = SkewAdam.from_model(model, momentum_dtype=momentum_dtype, tier_options=tier_options)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    held = opt.state_bytes()
    census = describe(model, tier_options=tier_options, defaults={"momentum_dtype": momentum_dtype})
    assert (census.state_bytes, census.counter_bytes) == (held.statistics, held.counters)
    assert {t: c.state_bytes for t, c in census.tiers.items()} == held.by_tier
    assert census.table() in caplog.text  # from_model logs the census of what it then holds
    if momentum_dtype == "int8" and tier_options is None:
        assert held.statistics == 581_632


# ---------------------------------------------------------------------------------------------------- measured
def test_measure_state_matches_hand_count():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)  # backbone: weight [4, 8], bias [4]
    bank = nn.Parameter(torch.randn(3, 5, 6))  # expert bank: 3 slices of [5, 6]
    router = nn.Parameter(torch.randn(3, 8))  # router: full second moment
    opt = SkewAdam([{"params": lin.parameters(), "tier": "backbone"}, {"params": [bank], "tier": "expert"},
                    {"params": [router], "tier": "router"}])
    for p in (*lin.parameters(), bank, router):
        p.grad = torch.randn_like(p)
    opt.step()
    got = opt.state_bytes()
    # backbone weight: exp_avg 32*4, row_var [4,1] 16, col_var [1,8] 32; bias: exp_avg 16, exp_avg_sq 16
    # expert bank: row_var [3,5,1] 60, col_var [3,1,6] 72; router: exp_avg_sq [3,8] 96
    assert got.by_tier == {"backbone": 128 + 16 + 32 + 16 + 16, "expert": 60 + 72, "router": 96}
    assert got.by_key == {"step": 4 + 4 + 3 * 4 + 4, "exp_avg": 128 + 16, "row_var": 16 + 60,
                          "col_var": 32 + 72, "exp_avg_sq": 16 + 96}
    assert (got.statistics, got.counters, got.total, got.tensors) == (436, 24, 460, 12)


def test_measure_state_counts_shared_tensors_and_views_once():
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p], "tier": "backbone"}, {"params": [q], "tier": "router"}])
    buf = torch.zeros(10)  # 40 B
    big = torch.zeros(20)  # 80 B, views cover [5, 20)
    part = torch.zeros(10)  # 40 B, one view covers [0, 4): the view keeps all of it alive
    opt.state[p].update(a=buf, c=big[5:15], d=part[:4])
    opt.state[q].update(a=buf, b=buf[2:6], c=big[10:20])
    got = measure_state(opt)
    assert got.total == 40 + 80 + 40
    assert got.by_key == {"a": 40, "c": 80, "d": 40}  # big's uncovered [0, 5) goes to its first view
    assert got.by_tier == {"backbone": 40 + 60 + 40, "router": 20}  # q's big[10:20] newly covers [15, 20)
    assert got.tensors == 4  # buf, big[5:15], part[:4], and big[10:20]'s new half


def test_measure_state_counts_dtensor_shards_at_local_size():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        p = nn.Parameter(torch.zeros(8, 4))
        # a shard of half the rows, as rank 0 of 2 would hold it
        shard = DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size([8, 4]), stride=(4, 1))
        opt = torch.optim.SGD([p])
        opt.state[p]["exp_avg"] = shard
        got = measure_state(opt)
    finally:
        dist.destroy_process_group()
    assert shard.shape == (8, 4) and got.total == 4 * 4 * 4


def test_an_orthogonal_group_keeps_momentum_only_and_its_banks_a_step_count_only():
    """update='orthogonal': no second moment (use_factored resolves to False); compact momentum as elsewhere."""
    flags = state_flags({"tier": "backbone", "update": "orthogonal"})
    assert flags == TierSpec("backbone", "fp32", "none", "orthogonal")
    assert {k: v.shape for k, v in flags.spec((8, 6), torch.bfloat16).items()} == {"step": (), "exp_avg": (8, 6)}
    int8 = state_flags({"update": "orthogonal", "momentum_dtype": "int8"}).spec((8, 300), torch.float32)
    assert {k: (v.shape, v.dtype) for k, v in int8.items()} == {
        "step": ((), torch.float32), "exp_avg": ((8, 300), torch.int8), "exp_avg_scale": ((8, 2), torch.float32)}
    bank = state_flags({"tier": "expert", "update": "orthogonal"}).spec((4, 6, 5), torch.float32)
    assert {k: v.shape for k, v in bank.items()} == {"step": (4,)}
    with pytest.raises(ValueError, match="Invalid update"):
        state_flags({"update": "muon"})
