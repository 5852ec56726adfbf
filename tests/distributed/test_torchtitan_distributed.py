"""`skewadam.integrations.torchtitan` on 2 ranks: a torchtitan MoE parallelized by torchtitan (expert parallelism
``Shard(0)`` on the EP mesh; FSDP ``Shard(1)`` experts) trains as one process does, on both kernels, and resumes
bitwise from torchtitan's checkpoint.

The checks run in ``torchtitan_worker.py`` under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo), once per
kernel (``SKEWADAM_IMPL``), and are asserted here one rule per test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launch import torchrun

pytest.importorskip("torchtitan")

WORKER = Path(__file__).with_name("torchtitan_worker.py")
TOL = 1e-12  # float64 throughout; reductions in another order than one process's
BACKEND_SETTINGS = ["eager", "default"]  # SKEWADAM_IMPL=eager, and unset: the C++ kernel where it builds


@pytest.fixture(scope="module", params=BACKEND_SETTINGS)
def results(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"torchtitan_{request.param}")
    env = dict(os.environ)
    env.pop("SKEWADAM_IMPL", None)
    if request.param != "default":
        env["SKEWADAM_IMPL"] = request.param
    torchrun(str(WORKER), str(out), result=out / "results.json", env=env)
    return {"backend": request.param, **json.loads((out / "results.json").read_text())}


def _get(results: dict, check: str) -> list[dict]:
    per_rank = [results[check][f"rank{r}"] for r in range(2)]
    for r, fig in enumerate(per_rank):
        if "error" in fig:
            pytest.fail(f"{check} raised on rank {r} ({results['backend']} backend):\n{fig['error']}")
    return per_rank


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["ep_shard0", "fsdp_shard1"])
def test_torchtitan_parallel_training_matches_one_process(results, check):
    for fig in _get(results, check):
        assert fig["max_diff"] <= TOL, fig
        assert fig["tiers"] == ["backbone", "expert", "router"]
        if results["backend"] == "eager":
            assert fig["backend"] == "skewadam.kernels.eager"


@pytest.mark.distributed
def test_torchtitan_places_experts_on_the_ep_mesh_and_shard1_when_fsdp_exceeds_experts(results):
    ep = _get(results, "ep_shard0")[0]["placements"]
    assert ep["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == (
        "(_StridedShard(dim=0, sf=2), Shard(dim=0)) on ('efsdp', 'ep')")
    shard1 = _get(results, "fsdp_shard1")[0]["placements"]
    assert shard1["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == "(Shard(dim=1),) on ('fsdp',)"
    assert shard1["layers.0.moe.router.gate.weight"] == "(Shard(dim=0),) on ('fsdp',)"  # [1, D]: empty on rank 1


@pytest.mark.distributed
def test_torchtitan_checkpoint_resume_is_bitwise(results):
    for fig in _get(results, "dcp_resume"):
        assert fig["loaded"] and fig["max_diff"] == 0.0, fig
