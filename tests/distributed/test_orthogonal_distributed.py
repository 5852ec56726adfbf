"""The orthogonal tier on sharded parameters: equal to one process under FSDP2 (both expert placements, int8
momentum, int8 expert momentum, the Newton-Schulz options) and DDP, the gathered bytes what the math needs and what the planner counts;
Adafactor's options refused on DTensors. The checks run in ``orthogonal_worker.py`` under torchrun (2 CPU ranks,
gloo), once per kernel available here (the fused groups' kernel: eager, and the C++ one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skewadam import kernels
from test_distributed import TOL, _get, worker_results

WORKER = Path(__file__).with_name("orthogonal_worker.py")


@pytest.fixture(scope="module", params=kernels.cpu_backends())
def results(request, tmp_path_factory) -> dict:
    return worker_results(WORKER, tmp_path_factory.mktemp(f"orthogonal-{request.param}"), request.param)


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["fsdp2_shard0_uneven", "fsdp2_torchtitan_shard1", "fsdp2_int8_momentum",
                                   "fsdp2_experts_shard1_int8_expert_momentum",
                                   "fsdp2_experts_shard1_newton_schulz_options", "ddp"])
def test_orthogonal_tier_under_sharding_matches_one_process(results, check):
    for fig in _get(results, check):
        assert fig["max_diff"] <= TOL, fig


@pytest.mark.distributed
def test_without_the_gather_the_check_fails(results):
    """Negative control: orthogonalising each shard on its own is a different update."""
    for fig in _get(results, "fsdp2_negative_control"):
        assert fig["max_diff"] > 1e-4, fig


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["fsdp2_shard0_uneven", "fsdp2_torchtitan_shard1"])
def test_gathered_bytes_are_what_the_math_needs_and_what_the_planner_counts(results, check):
    """Each rank receives the rest of every sharded orthogonal matrix's update (float64 here); a bank sharded on its
    experts (Shard(0), 3 experts) sends nothing, one sharded on a matrix dim (Shard(1), one expert) does. The
    planner (Shard(0) everywhere, fp32 updates) counts half of each 2-D matrix per rank on 2 ranks."""
    figs = _get(results, check)
    for fig in figs:
        assert fig["gathered_bytes_per_step"] == fig["expected_gathered_bytes"] > 0, fig
    if check == "fsdp2_shard0_uneven":  # the planner's layout: both ranks together receive every matrix once
        total = sum(f["gathered_bytes_per_step"] for f in figs)
        assert total == 2 * 2 * figs[0]["planned_gather_bytes_fp32"]  # float64 vs the planner's fp32, 2 ranks


@pytest.mark.distributed
def test_ddp_needs_no_reducer(results):
    assert not any(f["reducer"] for f in _get(results, "ddp"))


@pytest.mark.distributed
def test_adafactor_options_under_sharding_match_one_process(results):
    for fig in _get(results, "fsdp2_adafactor_options"):
        assert fig["max_diff"] < TOL, fig
