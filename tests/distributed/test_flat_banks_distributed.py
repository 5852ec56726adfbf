"""Flattened expert banks ``[E*H, M]`` under FSDP2 on 2 ranks: shards that cut an expert, hold no whole expert, or
hold nothing train as one process does on the global batch, on every kernel; the per-expert state stays bitwise
equal on every rank; what crosses ranks is what the planner counts; checkpoints move between 1 and 2 processes.

The checks run in ``flat_worker.py`` under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo), once per kernel
(the Triton kernel under its interpreter on a few of them: minutes), and are asserted here one rule per test. The
one-process side of the checkpoint checks runs here, in this process (world size 1).
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

import flat_worker as fw
from skewadam import kernels
import test_distributed
from launch import torchrun
from test_distributed import TOL, worker_results

WORKER = Path(__file__).with_name("flat_worker.py")
SHARDED = ["cut", "one_expert", "empty", "columns", "cut_momentum", "cut_int8", "empty_int8", "cut_in_backward",
           "empty_in_backward"]
INTERPRETED = ["cut", "empty", "cut_int8", "columns"]  # what the Triton kernel runs under its interpreter
DCP = ["dcp_from_one_process", "dcp_to_one_process"]


def _save_one_process(out: Path) -> None:
    """``STEPS_BEFORE`` steps of the cut model on one process, saved with DCP (and its tensors beside it)."""
    model, opt = fw.model_and_optimizer(sharded=False)
    fw.train(model, opt, fw.data(fw.STEPS_BEFORE), sharded=False)
    fw.save(model, opt, out / "ckpt_one")
    torch.save(fw.snapshot(model, opt), out / "ckpt_one.pt")


@pytest.fixture(scope="module", params=kernels.cpu_backends(interpreted=True))
def results(request, tmp_path_factory) -> dict:
    """Every check's figures on both ranks, on one kernel (one torchrun launch per kernel)."""
    impl = request.param
    out = tmp_path_factory.mktemp(f"flat-{impl}")
    checks = INTERPRETED if impl == "triton" else []  # (none named: every check)
    with mock.patch.dict("os.environ", {"SKEWADAM_IMPL": impl}):
        if impl != "triton":
            _save_one_process(out)
        figures = worker_results(WORKER, out, impl, *checks)
    return {"out": out, "impl": impl, **figures}


def _get(results: dict, check: str) -> list[dict]:
    """Both ranks' figures of one check (`test_distributed._get`); skipped where the kernel does not run it."""
    if check not in results:
        pytest.skip(f"{check} does not run on the {results['impl']} kernel (its interpreter is slow)")
    return test_distributed._get(results, check)


@pytest.mark.distributed
@pytest.mark.parametrize("check", SHARDED)
def test_flattened_banks_sharded_by_fsdp2_train_as_one_process(results, check):
    for fig in _get(results, check):
        assert fig["max_diff"] <= TOL, fig
        assert fig["finite"] and fig["skipped_steps"] == 0, fig


@pytest.mark.distributed
@pytest.mark.parametrize("check, pieces", [
    ("cut", [[[0, 1, 0, 5], [1, 1, 5, 3], [2, 1, 8, 0]], [[0, 1, 0, 0], [1, 1, 0, 2], [2, 1, 2, 5]]]),
    ("one_expert", [[[0, 1, 0, 3]], [[0, 1, 0, 2]]]),
    ("empty", [[[0, 1, 0, 1]], [[0, 1, 0, 0]]]),
    ("columns", [[[0, 3, 0, 5]], [[0, 3, 0, 5]]]),
])
def test_each_rank_steps_every_expert_once_with_the_rows_it_holds(results, check, pieces):
    """(first expert, experts, first local row, rows of each): the cut expert 1 split 3 + 2 rows, whole experts,
    experts of zero local rows, each rank part of the only expert, an empty shard; column shards hold every row."""
    assert [fig["pieces"] for fig in _get(results, check)] == pieces


@pytest.mark.distributed
@pytest.mark.parametrize("check", SHARDED + ["cut_bf16"])
def test_the_per_expert_state_is_replicated_and_stays_bitwise_equal_on_every_rank(results, check):
    for fig in _get(results, check):
        assert fig["replicas_equal"], fig
        pl = fig["placements"]
        if check == "columns":
            assert (pl["row_var"], pl["col_var"], pl["step"]) == ("(Replicate(),)", "(Shard(dim=2),)", "(Replicate(),)")
        else:
            assert {k for k, v in pl.items() if v == "(Shard(dim=0),)"} == set(pl) - {"col_var", "step"}, pl
            assert pl["col_var"] == pl["step"] == "(Replicate(),)", pl


@pytest.mark.distributed
def test_without_cross_rank_reductions_the_equivalence_check_fails(results):
    for fig in _get(results, "negative_control"):
        assert fig["max_diff"] > 1e3 * TOL, fig


@pytest.mark.distributed
def test_bf16_weights_round_each_piece_with_its_own_bits_as_close_as_another_seed(results):
    for fig in _get(results, "cut_bf16"):
        assert 0 < fig["max_diff"] <= fig["seed_diff"], fig


def _statistics(experts: int) -> int:
    """What must cross ranks per step, from the math: each factored matrix's column sums and 4 sums ([8, 6] and
    [1, 8]), 2 sums for each other tensor (2 biases, the router), each bank's column sums and 4 sums per expert."""
    return (6 + 4) + (8 + 4) + 3 * 2 + 2 * experts * (fw.M + 4)


def _units(experts: int) -> int:
    """Update units: 2 matrices, 2 biases, the router, each bank's experts: each has a sum u^2 (in the state dtype:
    float32 for bf16 weights), and float64 weights add each one's max |g| (whether it is idle)."""
    return 2 + 3 + 2 * experts


@pytest.mark.distributed
@pytest.mark.parametrize("check, experts", [("cut", 3), ("one_expert", 1), ("empty", 1), ("cut_bf16", 3)])
def test_what_crosses_ranks_is_the_per_expert_sums_the_planner_counts(results, check, experts):
    """Three all-reduces per step (pass 1, the skip flag, the clip); float64 statistics, sum u^2 in the state dtype,
    plus the 4-byte flag; `skewadam.plan(..., shards=2)` counts them for fp32 or bf16 weights (what it plans)."""
    sums, units = _statistics(experts), _units(experts)
    as_bf16 = 8 * (sums - units) + 4 * units + 4
    for fig in _get(results, check):
        assert fig["collectives_per_step"] == 3, fig
        assert fig["bytes_per_step"] == (as_bf16 if check.endswith("bf16") else 8 * (sums + units) + 4), fig
        assert fig["planned_bytes_per_step"] == as_bf16, fig


@pytest.mark.distributed
def test_a_one_process_checkpoint_loads_on_two_ranks_bitwise_and_trains_on(results):
    for fig in _get(results, "dcp_from_one_process"):
        assert fig["bitwise"] and fig["max_diff"] <= TOL, fig
        assert fig["placements"] == "(Shard(dim=0),)", fig


@pytest.mark.distributed
def test_a_two_rank_checkpoint_resumes_bitwise_on_two_ranks_and_on_one_process(results):
    for fig in _get(results, "dcp_to_one_process"):
        assert fig["resumed_bitwise"], fig
    out = results["out"]
    with mock.patch.dict("os.environ", {"SKEWADAM_IMPL": results["impl"]}):
        model, opt = fw.model_and_optimizer(sharded=False, seed=5)
        fw.load(model, opt, out / "ckpt_two")
        saved, loaded = torch.load(out / "ckpt_two.pt"), fw.snapshot(model, opt)
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
        batches = fw.data(fw.STEPS_BEFORE + fw.STEPS_AFTER)
        fw.train(model, opt, batches[fw.STEPS_BEFORE:], sharded=False, first=fw.STEPS_BEFORE)
        ref, ref_opt = fw.model_and_optimizer(sharded=False)
        fw.train(ref, ref_opt, batches, sharded=False)
    assert fw.max_diff(fw.snapshot(ref, ref_opt), fw.snapshot(model, opt)) <= TOL


@pytest.mark.distributed
def test_a_flattened_bank_whose_local_rows_are_not_one_run_is_refused_naming_the_fix(results):
    for fig in _get(results, "refusal"):
        assert "not one contiguous run" in fig["message"] and "Shard(0)" in fig["message"], fig


@pytest.mark.distributed
def test_the_olmo_core_example_trains_an_olmoe_under_fsdp2_and_resumes_bitwise(tmp_path):
    """examples/train_olmo_core.py: OLMo-core's OLMoE config (5 experts of width 24: 2 ranks cut expert 2 in half),
    its own apply_fsdp, SkewAdam.from_model; the statistics crossing ranks are what the planner counts; a run resumed
    from the DCP checkpoint ends bitwise equal to the uninterrupted one."""
    pytest.importorskip("olmo_core")
    proc = torchrun("examples/train_olmo_core.py", "--steps", "4", "--checkpoint", str(tmp_path / "ckpt"))
    out = proc.stdout
    assert "expert    6 tensors, flattened banks of 5 experts" in out and "router    2 tensors" in out, out
    assert "expert 1: 24 rows, expert 2: 12 rows" in out and "-> expert 2: 12 rows, expert 3: 24 rows" in out, out
    steps = [line for line in out.splitlines() if line.startswith("step")]
    losses = [float(line.split("loss")[1].split("|")[0]) for line in steps]
    assert len(steps) == 4 and all(3.0 < x < 7.0 for x in losses) and losses[-1] < losses[0], out  # ln(256) = 5.55
    planned = out.split("planned all-reduces of SkewAdam's statistics: ")[1].split(" B per step")[0]
    assert all(f"3 all-reduces, {planned} B per step | skipped 0" in line for line in steps), out
    assert "resumed from step 2: bitwise equal to the uninterrupted run at step 4" in out, out
    assert (tmp_path / "ckpt" / ".metadata").exists()
