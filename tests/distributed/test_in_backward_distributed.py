"""The step inside backward on sharded parameters: FSDP2 runs SkewAdam's hooks on its sharded parameters after the
reduce-scatter, with each parameter's cross-rank reductions inside them, and training equals one regular process on
the global batch (1e-10, float64, 2 CPU ranks, every kernel): uneven and empty shards, experts ``Shard(0)`` and
``Shard(1)``, int8 momentum, accumulation through FSDP2's ``set_requires_gradient_sync(False)`` or
``hold_gradients()``; a non-finite gradient on one rank skips that tensor on every rank; DDP (which all-reduces after
the hooks) is refused at the first ``step()``. The checks run in ``in_backward_worker.py`` under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from skewadam import kernels
from test_distributed import TOL, _get, worker_results

WORKER = Path(__file__).with_name("in_backward_worker.py")


@pytest.fixture(scope="module", params=kernels.cpu_backends())
def results(request, tmp_path_factory) -> dict:
    return worker_results(WORKER, tmp_path_factory.mktemp(f"in-backward-{request.param}"), request.param)


EQUIVALENT = ["fsdp2_uneven", "fsdp2_empty_shards", "fsdp2_torchtitan_shard1", "fsdp2_int8_momentum",
              "toy_every_tier_empty", "toy_every_tier_empty_int8", "accumulate_no_sync", "accumulate_hold"]


@pytest.mark.distributed
@pytest.mark.parametrize("check", EQUIVALENT)
def test_fsdp2_stepping_inside_backward_matches_one_regular_process(results, check):
    for fig in _get(results, check):
        assert fig["max_diff"] <= TOL, fig
        assert fig.get("freed", True), fig  # every gradient freed by backward


@pytest.mark.distributed
def test_without_the_reductions_inside_the_hooks_the_check_fails(results):
    for fig in _get(results, "fsdp2_negative_control"):
        assert fig["max_diff"] > 1e3 * TOL, fig


@pytest.mark.distributed
@pytest.mark.parametrize("check, empty", [
    ("fsdp2_empty_shards", {"blocks.1.moe.router.weight", "blocks.1.moe.experts.w1", "blocks.1.moe.experts.w2",
                            "blocks.1.moe.experts.w3"}),
    ("toy_every_tier_empty", {"head.weight", "head.bias", "wide", "router.weight", "experts.w1", "experts.w2"}),
])
def test_empty_local_shards_step_inside_backward(results, check, empty):
    rank0, rank1 = _get(results, check)
    assert rank0["empty_local_shards"] == [] and set(rank1["empty_local_shards"]) == empty


@pytest.mark.distributed
def test_a_non_finite_gradient_on_one_rank_skips_that_tensor_on_every_rank(results):
    for fig in _get(results, "nonfinite"):
        assert fig == {"bank_unchanged": True, "others_moved": True, "skipped_tensors": 1, "skipped_steps": 1}, fig


@pytest.mark.distributed
def test_ddp_is_refused_at_the_first_step(results):
    for fig in _get(results, "ddp"):
        assert "has a gradient again after it was stepped in backward" in fig["error_message"], fig
        assert "DistributedDataParallel" in fig["error_message"] and "FSDP2" in fig["error_message"], fig
