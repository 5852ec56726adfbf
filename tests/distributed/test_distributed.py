"""SkewAdam on sharded parameters: equal to one process under FSDP2, DDP, ZeRO and expert parallelism, on every
kernel; DCP resumes bitwise; what crosses ranks is a few batched statistics; flattened and Partial layouts are refused.

The multi-process checks run in ``worker.py`` under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo, explicit
CPU device mesh), once per kernel available here (eager, what runs on GPUs, and the C++ kernel; the `results`
fixture), and are asserted here one rule per test. The placement rules and refusals that need no process group are
tested in-process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from skewadam import SkewAdam, kernels
from skewadam.distributed import check_layout, state_placements

from launch import torchrun

WORKER = Path(__file__).with_name("worker.py")
TOL = 1e-10


@pytest.fixture(scope="module", params=kernels.cpu_backends())
def results(request, tmp_path_factory) -> dict:
    """Every check's figures on both ranks, with every SkewAdam on one kernel (one torchrun launch per kernel)."""
    return worker_results(WORKER, tmp_path_factory.mktemp(f"distributed-{request.param}"), request.param)


def worker_results(worker: Path, out: Path, impl: str, *checks: str) -> dict:
    """Run ``worker`` on 2 ranks into ``out`` with every SkewAdam on kernel ``impl`` (the named checks, else every
    one); both ranks' figures, from the ``results.json`` rank 0 writes."""
    torchrun(str(worker), str(out), impl, *checks, result=out / "results.json")
    return json.loads((out / "results.json").read_text())


def _get(results: dict, check: str) -> list[dict]:
    """Both ranks' figures of one check; a check that raised fails with its traceback."""
    per_rank = [results[check][f"rank{r}"] for r in range(2)]
    for r, fig in enumerate(per_rank):
        if "error" in fig:
            pytest.fail(f"{check} raised on rank {r}:\n{fig['error']}")
    return per_rank


EQUIVALENT = [
    "fsdp2_uneven",  # dim-0 shards, uneven (vocab 67, 3 experts, 9 positions)
    "fsdp2_empty_shards",  # one expert: router and banks empty on rank 1
    "fsdp2_torchtitan_shard1",  # experts Shard(1) (fewer experts than ranks), attention Shard(1)
    "fsdp2_int8_momentum",  # fsdp2_uneven with int8 backbone momentum (blocks along the unsharded last dim)
    "toy_empty_head",  # the toy: the head's [1, 7] weight (momentum + factored) and [1] bias empty on rank 1
    "toy_every_tier_empty",  # one expert: empty backbone (momentum), bank, router and 1-D shards; a (0, 300) shard
    "toy_every_tier_empty_int8",  # the same with int8 momentum
    "ddp",
    "zero_redundancy",
    "ep_shard0_fsdp_strided",  # experts (_StridedShard(0), Shard(0)) on (efsdp, ep)
    "ep_shard1",  # experts (Shard(1), Shard(0)) on (efsdp, ep)
    "strided_1d",  # experts _StridedShard(0, sf=2): rank 0 holds experts {0, 2}
    "shard_last_dim",  # every tensor on its last dim
]


@pytest.mark.distributed
@pytest.mark.parametrize("check", EQUIVALENT)
def test_sharded_training_matches_one_process_on_the_global_batch(results, check):
    for fig in _get(results, check):
        assert fig["max_diff"] <= TOL, fig


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["fsdp2_negative_control", "ep_shard1_negative_control"])
def test_without_cross_rank_reductions_the_equivalence_check_fails(results, check):
    for fig in _get(results, check):
        assert fig["max_diff"] > 1e3 * TOL, fig


@pytest.mark.distributed
@pytest.mark.parametrize("check, empty", [
    ("fsdp2_empty_shards", {"blocks.1.moe.router.weight", "blocks.1.moe.experts.w1", "blocks.1.moe.experts.w2",
                            "blocks.1.moe.experts.w3"}),
    ("toy_empty_head", {"head.weight", "head.bias", "wide"}),
    ("toy_every_tier_empty", {"head.weight", "head.bias", "wide", "router.weight", "experts.w1", "experts.w2"}),
])
def test_empty_local_shards_are_exercised(results, check, empty):
    rank0, rank1 = _get(results, check)
    assert rank0["empty_local_shards"] == []
    assert set(rank1["empty_local_shards"]) == empty


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c for c in EQUIVALENT if c.startswith("toy")] + ["toy_every_tier_empty_bf16"])
def test_empty_shards_write_finite_weights_and_skip_no_step(results, check):
    """An empty shard's statistics are zeros (never uninitialised memory): the weights stay finite and no step is
    taken for non-finite."""
    for fig in _get(results, check):
        assert fig["finite"] and fig["skipped_steps"] == 0, fig


@pytest.mark.distributed
def test_bf16_momentum_with_empty_shards_is_as_close_to_one_process_as_another_rounding_seed(results):
    """bf16 momentum rounds each shard with its own bits (rank 1's rows draw other bits than one process), so the
    sharded run can be as far from one process as a run with another seed, and no further."""
    for fig in _get(results, "toy_every_tier_empty_bf16"):
        assert 0 < fig["max_diff"] <= fig["seed_diff"], fig


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c for c in EQUIVALENT if c.startswith(("fsdp2", "ep_", "strided", "shard"))])
def test_three_collectives_per_step(results, check):
    """Pass-1 statistics, the skip flag, the pass-2 clip sums: one all-reduce each (all mesh dims of size > 1 here
    are the same 2 ranks)."""
    for fig in _get(results, check):
        assert fig["collectives_per_step"] == 3, fig


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["fsdp2_uneven", "fsdp2_empty_shards"])
def test_only_statistics_cross_ranks(results, check):
    """Exactly the bytes the math needs (`worker.expected_bytes_shard0`): no gradient or parameter is gathered."""
    for fig in _get(results, check):
        assert fig["bytes_per_step"] == fig["expected_bytes_per_step"], fig


@pytest.mark.distributed
def test_state_placements_follow_the_parameter(results):
    rank0, _ = _get(results, "fsdp2_torchtitan_shard1")
    pl = rank0["placements"]
    assert pl["tok_emb.weight"] == {"param": "(Shard(dim=0),)", "step": "plain cpu", "exp_avg": "(Shard(dim=0),)",
                                    "row_var": "(Shard(dim=0),)", "col_var": "(Replicate(),)"}
    assert pl["blocks.0.attn.wq.weight"]["row_var"] == "(Replicate(),)"
    assert pl["blocks.0.attn.wq.weight"]["col_var"] == "(Shard(dim=1),)"
    assert pl["blocks.1.moe.experts.w1"] == {"param": "(Shard(dim=1),)", "step": "(Replicate(),)",
                                             "row_var": "(Shard(dim=1),)", "col_var": "(Replicate(),)"}
    ep = _get(results, "ep_shard0_fsdp_strided")[0]["placements"]["blocks.1.moe.experts.w2"]
    assert set(ep.values()) == {"(_StridedShard(dim=0, sf=2), Shard(dim=0))"}


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["dcp_fsdp2", "dcp_ep"])
def test_dcp_round_trip_resumes_bitwise(results, check):
    for fig in _get(results, check):
        assert fig["bitwise"], fig
        assert fig["steps"] == [4.0], fig  # the loaded step counts, not the fresh optimizer's


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["nonfinite_agreement", "zero_nonfinite_agreement"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(results, check):
    for fig in _get(results, check):
        assert fig == {"skipped_steps": 1, "unchanged": True}


@pytest.mark.distributed
def test_partial_parameters_and_gradients_are_refused(results):
    for fig in _get(results, "refusals"):
        assert "Partial" in fig["param"] and "redistribute" in fig["param"]
        assert "Partial" in fig["grad"] and "redistribute" in fig["grad"]


@pytest.mark.distributed
def test_int8_momentum_of_a_last_dim_sharded_parameter_is_refused(results):
    for fig in _get(results, "refusals"):
        assert "int8 momentum" in fig["int8_last_dim"] and "momentum_dtype='bf16'" in fig["int8_last_dim"]


@pytest.mark.distributed
def test_bf16_shards_round_with_their_own_bits_and_replicas_alike(results):
    for fig in _get(results, "rounding_streams"):
        assert fig["rounded_both_ways"] == [0.99609375, 1.0]  # 1 - lr lies between these: the rounding was random
        assert fig["shards_differ"] and fig["first_shard_as_one_process"] and fig["replicas_equal"]


@pytest.mark.distributed
def test_fsdp2_example_trains(tmp_path):
    proc = torchrun("examples/train_fsdp.py", "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("step")]
    assert len(lines) == 2 and "3 all-reduces" in lines[-1], proc.stdout
    losses = [float(l.split("loss")[1].split("|")[0]) for l in lines]
    assert all(math.isfinite(x) and 3.0 < x < 7.0 for x in losses), losses  # ln(256) = 5.55 at init
    assert (tmp_path / "ckpt" / ".metadata").exists()


# ------------------------------------------------------------------------------------------------ in-process rules
S = _StridedShard(0, split_factor=2)


@pytest.mark.parametrize(
    "placements, ndim, key, state_ndim, expected",
    [
        ((Shard(0),), 2, "exp_avg", 2, (Shard(0),)),
        ((Shard(0),), 2, "row_var", 2, (Shard(0),)),  # [R, 1]: rows stay sharded
        ((Shard(0),), 2, "col_var", 2, (Replicate(),)),  # [1, C]: summed over the sharded rows
        ((Shard(1),), 2, "row_var", 2, (Replicate(),)),
        ((Shard(1),), 2, "col_var", 2, (Shard(1),)),
        ((Shard(-1),), 3, "col_var", 3, (Shard(-1),)),
        ((Shard(0),), 3, "step", 1, (Shard(0),)),  # a bank's per-expert counts
        ((Shard(1), Shard(0)), 3, "step", 1, (Replicate(), Shard(0))),
        ((S, Shard(0)), 3, "col_var", 3, (S, Shard(0))),  # experts stay sharded in every statistic
        ((S, Shard(0)), 2, "col_var", 2, (Replicate(), Replicate())),
        ((Replicate(), Shard(0)), 1, "exp_avg_sq", 1, (Replicate(), Shard(0))),
        ((Shard(0),), 3, "exp_avg_scale", 3, (Shard(0),)),  # int8 momentum: [E, F, blocks of D]
        ((Shard(1),), 3, "exp_avg_scale", 3, (Shard(1),)),
    ],
)
def test_state_placement_keeps_sharded_dims_the_state_spans(placements, ndim, key, state_ndim, expected):
    assert state_placements(placements, ndim, key, state_ndim) == expected


def test_unknown_state_key_is_an_error():
    with pytest.raises(KeyError, match="momentum_buffer"):
        state_placements((Shard(0),), 2, "momentum_buffer", 2)


@pytest.mark.parametrize("attr, value, match, fix", [
    ("ds_shape", torch.Size([4, 3]), r"deepspeed\.zero\.Init", r"skewadam\.integrations\.deepspeed\.initialize"),
    ("ds_tensor", torch.zeros(6), r"deepspeed\.zero\.Init", r"skewadam\.integrations\.deepspeed\.initialize"),
    ("_is_flat_param", True, "FSDP1 FlatParameter", "FSDP2")])
def test_flattened_parameters_are_refused(attr, value, match, fix):
    """A parameter DeepSpeed partitioned before the optimizer was built (``deepspeed.zero.Init``) or FSDP1's flat
    parameter: the fix named (build the optimizer on the whole model, then the drop-in; FSDP2)."""
    p = torch.nn.Parameter(torch.zeros(0))
    setattr(p, attr, value)
    with pytest.raises(TypeError, match=match):
        check_layout(p)
    with pytest.raises(TypeError, match=f"param group 0.*{match}.*{fix}"):
        SkewAdam([p])
