"""SkewAdam under DeepSpeed ZeRO on 2 ranks (`skewadam.integrations.deepspeed`): every stage trains as one process on
the global batch does, as exactly as DeepSpeed's own AdamW does, on every kernel that runs on CPU; the partitions cut
rows, experts and banks; the state over both ranks stays within 1.25x one process's; plain ``deepspeed.initialize``
and the step inside backward are refused.

The checks run in ``deepspeed_worker.py`` under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo,
``DS_ACCELERATOR=cpu``), once per kernel, and are asserted here one rule per test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

from skewadam import kernels

import test_distributed

pytest.importorskip("deepspeed")
import deepspeed_worker as dw  # noqa: E402  (it imports deepspeed)

WORKER = Path(__file__).with_name("deepspeed_worker.py")
#: check -> its yardstick: DeepSpeed's AdamW on the same stage against one-process AdamW
EXACT = {"accelerate_stage2": "adamw_stage2", "stage0": "adamw_stage0", "stage1": "adamw_stage1",
         "stage2": "adamw_stage2", "stage3": "adamw_stage3", "stage2_int8": "adamw_stage2",
         "stage3_int8": "adamw_stage3", "stage3_adafactor": "adamw_stage3", "stage2_orthogonal": "adamw_stage2",
         "stage3_orthogonal": "adamw_stage3", "stage2_round_robin": "adamw_stage2_round_robin",
         "stage2_offload": "adamw_stage2_offload", "stage3_offload": "adamw_stage3_offload",
         **{f"moe_ep{ep}_stage{s}": f"adamw_moe_ep{ep}_stage{s}" for ep in (1, 2) for s in (1, 2)}}
BF16 = {f"stage{s}_bf16": f"adamw_stage{s}_bf16" for s in (1, 2, 3)}


@pytest.fixture(scope="module", params=kernels.cpu_backends())
def results(request, tmp_path_factory) -> dict:
    """Every check's figures on both ranks, with every SkewAdam on one kernel (one torchrun launch per kernel)."""
    out = tmp_path_factory.mktemp(f"deepspeed-{request.param}")
    with mock.patch.dict("os.environ", {"DS_ACCELERATOR": "cpu", "SKEWADAM_IMPL": request.param}):
        model = dw.build()
        opt = dw.make_optimizer(model, "from_model", {})
        dw.one_process("from_model", {}, steps=range(dw.BEFORE), master=model, opt=opt)
        torch.save({"module": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "optimizer": opt.state_dict()}, out / "one_process.pt")  # what check_from_one_process loads
        figures = test_distributed.worker_results(WORKER, out, request.param)
    return {"out": out, "impl": request.param, **figures}


def _get(results: dict, check: str) -> list[dict]:
    return test_distributed._get(results, check)


@pytest.mark.distributed
@pytest.mark.parametrize("check", EXACT)
def test_every_zero_stage_trains_as_one_process_within_ten_times_deepspeed_s_own_adamw(results, check):
    """After 10 steps every weight is within 10x of the distance DeepSpeed's AdamW keeps from one-process AdamW
    (fp32 rounding of the gradients' reduction), and within 1e-6."""
    yardstick = _get(results, EXACT[check])[0]["max_diff"]
    for fig in _get(results, check):
        assert fig["max_diff"] <= min(10 * yardstick, 1e-6), (fig, yardstick)
        assert fig["finite"], fig


@pytest.mark.distributed
@pytest.mark.parametrize("check", BF16)
def test_bf16_mixed_precision_is_as_close_to_one_process_as_deepspeed_s_adamw_is(results, check):
    """``"bf16": {"enabled": true}``: bf16 forward and backward, fp32 masters (DeepSpeed's BF16 optimizer under stage
    1): against one process running the same recipe, no further than 10x AdamW's distance under it."""
    yardstick = _get(results, BF16[check])[0]["max_diff"]
    for fig in _get(results, check):
        assert fig["max_diff"] <= 10 * yardstick, (fig, yardstick)
    if check == "stage1_bf16":
        assert fig["zero_optimizer"] == "BF16_Optimizer", fig


@pytest.mark.distributed
def test_bf16_momentum_is_as_close_to_one_process_as_another_rounding_seed(results):
    """Each piece rounds its momentum with its own bits (as shards do), so the run can be as far from one process
    as one process with another seed, and no further."""
    for fig in _get(results, "stage2_bf16_momentum"):
        assert 0 < fig["max_diff"] <= fig["seed_diff"], fig


@pytest.mark.distributed
@pytest.mark.parametrize("stage, group, cut", [
    ("stage2", "inp.weight", [["inp.weight", 20, 25, 0]]),  # row 4 of [7, 5]: 2 elements on rank 0, 3 on rank 1
    ("stage3", "inp.weight", [["inp.weight", 15, 20, 0], ["head.weight", 0, 7, 0]]),
    ("stage2", "w1", [["w1", 50, 55, 0]]),  # expert 1, row 3 of the bank [3, 7, 5]
    ("stage2", "w2", [["w2", 49, 56, 0]]),  # expert 1, row 2 of the bank [3, 5, 7]
    ("stage2", "router.weight", [["router.weight", 7, 14, 0]]),
    ("stage2_orthogonal", "w1", [["w1", 35, 70, 0]]),  # the orthogonal tier owns whole experts
])
def test_the_partitions_cut_rows_and_experts_and_their_owner_steps_them_whole(results, stage, group, cut):
    for fig in _get(results, stage):
        assert fig["pieces"][group]["cut"] == cut, fig["pieces"][group]


@pytest.mark.distributed
def test_experts_banks_1d_tensors_and_the_router_that_both_ranks_hold_share_their_sums(results):
    """The cut expert 1 of each bank, ``norm`` (1-D) and the router are summed over both ranks; under stage 3 a rank
    holds part of ``head.weight`` but owns none of it, and nothing of ``head.bias``."""
    for check in ("stage2", "stage3"):
        for fig in _get(results, check):
            shared = {name: units for p in fig["pieces"].values() for name, units in p["shared"].items()}
            assert {"w1": [1], "w2": [1], "norm": [0], "router.weight": [0]}.items() <= shared.items(), shared
    rank0, rank1 = _get(results, "stage3")
    assert rank1["pieces"]["inp.weight"]["owns_none"] == ["head.weight"]
    assert rank1["pieces"]["inp.bias"]["holds_none"] == ["head.bias"] and not rank0["pieces"]["inp.bias"]["holds_none"]


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c for c in [*EXACT, "stage2_bf16_momentum", *BF16]
                                   if not c.startswith(("stage0", "accelerate", "moe"))])
def test_the_state_over_both_ranks_is_at_most_1_25_times_one_process_s(results, check):
    rank0, rank1 = _get(results, check)
    assert rank0["state_bytes"] + rank1["state_bytes"] <= 1.25 * rank0["one_process_state_bytes"], (rank0, rank1)


@pytest.mark.distributed
@pytest.mark.parametrize("ep_size, expert_world", [(1, 2), (2, 1)])
def test_deepspeed_moe_experts_are_tiered_as_experts_and_partitioned_over_their_expert_data_parallel_group(
        results, ep_size, expert_world):
    """``deepspeed.moe.layer.MoE`` (4 experts, ``allreduce=False``): `SkewAdam.from_model` labels them experts and the
    gate router; `initialize` gives them groups of their own (``moe``, their expert-parallel group's name), which ZeRO
    partitions over the expert-data-parallel group (2 ranks with the experts replicated, ``ep_size=1``; 1 with each
    rank holding 2 of them, ``ep_size=2``), and SkewAdam reduces their shared sums over it."""
    for stage in (1, 2):
        for fig in _get(results, f"moe_ep{ep_size}_stage{stage}"):
            assert fig["tiers"] == ["backbone", f"expert/moe:ep_size_{ep_size}", "router"], fig
            assert fig["expert_world"] == [expert_world], fig


@pytest.mark.distributed
def test_without_the_reductions_the_equivalence_check_fails(results):
    yardstick = _get(results, "adamw_stage2")[0]["max_diff"]
    for fig in _get(results, "negative_control"):
        assert fig["max_diff"] > 1e4 * yardstick, fig


@pytest.mark.distributed
def test_plain_deepspeed_initialize_raises_at_the_first_step_naming_the_drop_in_before_anything_moves(results):
    for fig in _get(results, "plain_initialize"):
        assert "skewadam.integrations.deepspeed.initialize" in fig["message"], fig
        assert not fig["moved"] and fig["state"] == 0, fig


@pytest.mark.distributed
def test_bf16_under_zero_stage_0_is_refused_naming_why(results):
    """DeepSpeed's stage-0 mixed-precision wrapper steps a client optimizer once with zero gradients when built."""
    for fig in _get(results, "stage0_bf16"):
        assert "zero gradients" in fig["message"] and "ZeRO stage 1" in fig["message"], fig


@pytest.mark.distributed
def test_the_step_inside_backward_is_refused_naming_why(results):
    for fig in _get(results, "in_backward"):
        assert "in_backward" in fig["message"] and "whole gradient" in fig["message"], fig


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_planner_s_zero_figures_are_the_state_and_traffic_measured_on_two_ranks(results, stage):
    """``skewadam plan MODEL --zero STAGE --shards 2`` on the worker's model with `SkewAdam.from_model`'s groups: the
    state of the rank keeping the most and of both, the master partition, the bytes and all-reduces of a step."""
    rank0, rank1 = _get(results, f"planned_stage{stage}")
    planned = rank0["planned"]
    assert planned["state"] == max(rank0["state_bytes"], rank1["state_bytes"]), (planned, rank0, rank1)
    assert planned["state_ranks"] == rank0["state_bytes"] + rank1["state_bytes"], (planned, rank0, rank1)
    assert planned["master"] == rank0["master_bytes"] == rank1["master_bytes"], (planned, rank0)
    for fig in (rank0, rank1):
        assert (planned["sent"], planned["collectives"]) == (fig["bytes_per_step"], fig["collectives_per_step"]), fig


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_checkpoints_resume_bitwise(results, stage):
    """``engine.save_checkpoint`` after 5 steps, ``load_checkpoint`` into an engine built from other weights: the 5
    steps after it end with the weights and state pieces of the uninterrupted run, bit for bit."""
    for fig in _get(results, f"resume_stage{stage}"):
        assert fig["weights_bitwise"] and fig["state_bitwise"] and fig["skipped_steps"] == 0, fig


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_a_two_rank_checkpoint_consolidates_and_resumes_on_one_process(results, stage):
    """`consolidate` merges the 2 ranks' checkpoint into one process's: the master weights bitwise, SkewAdam's state
    in the tensors' layout, loaded by a plain one-process SkewAdam that trains on as one process does."""
    from skewadam.integrations.deepspeed import consolidate

    out, yardstick = results["out"], _get(results, "adamw_stage2")[0]["max_diff"]
    full = consolidate(out / f"ckpt{stage}", tag="resume")
    saved = torch.load(out / f"ckpt{stage}_weights.pt")
    assert full["module"].keys() == saved.keys() and all(torch.equal(full["module"][n], saved[n]) for n in saved)
    with mock.patch.dict("os.environ", {"SKEWADAM_IMPL": results["impl"]}):
        model = dw.build(seed=5)
        opt = dw.make_optimizer(model, "from_model", {})
        model.load_state_dict(full["module"])
        opt.load_state_dict(full["optimizer"])
        got, _ = dw.one_process("from_model", {}, steps=range(dw.BEFORE, dw.STEPS), master=model, opt=opt)
        ref, _ = dw.one_process("from_model", {})
    assert dw.max_diff(ref, got) <= min(10 * yardstick, 1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_a_one_process_checkpoint_loads_on_two_ranks_bitwise_and_trains_on(results, stage):
    """`load_consolidated`: one process's ``{"module", "optimizer"}`` after 5 steps into 2 ranks: the weights
    bitwise, and the 5 steps after it as one process takes them."""
    yardstick = _get(results, "adamw_stage2")[0]["max_diff"]
    for fig in _get(results, f"from_one_process_stage{stage}"):
        assert fig["bitwise"] and fig["max_diff"] <= min(10 * yardstick, 1e-6), fig


def _weights(run: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(run / f"checkpoint-{step}" / "model.safetensors")


@pytest.mark.distributed
def test_the_hf_trainer_example_trains_under_deepspeed_as_under_ddp_and_resumes_bitwise(tmp_path):
    """examples/train_hf_trainer.py (SkewAdamTrainer, a Mixtral-style MoE) on 2 ranks: under ZeRO-2
    (``--deepspeed 2``: ``TrainingArguments(deepspeed=...)``, nothing else) the weights after 4 steps are those of
    DDP, which steps whole tensors, within fp32 rounding; resumed from its step-2 checkpoint (Trainer's DeepSpeed
    resume), bitwise those of the uninterrupted run."""
    pytest.importorskip("transformers")
    from launch import torchrun

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    common = ["examples/train_hf_trainer.py", "--max-steps", "4", "--save-steps", "2", "--batch-size", "4"]
    runs = {name: tmp_path / name for name in ("deepspeed", "ddp", "resumed")}
    torchrun(*common, "--deepspeed", "2", "--out", str(runs["deepspeed"]), env=env)
    torchrun(*common, "--out", str(runs["ddp"]), env=env)
    shutil.copytree(runs["deepspeed"], runs["resumed"], ignore=shutil.ignore_patterns("checkpoint-4"))
    proc = torchrun(*common, "--deepspeed", "2", "--out", str(runs["resumed"]), "--resume", env=env)
    assert "validation loss" in proc.stdout, proc.stdout[-2000:]
    ds, ddp, resumed = (_weights(runs[n], 4) for n in ("deepspeed", "ddp", "resumed"))
    assert ds.keys() == ddp.keys() == resumed.keys()
    assert max((ds[k] - ddp[k]).abs().max().item() for k in ds) <= 1e-6
    assert all(torch.equal(ds[k], resumed[k]) for k in ds)
