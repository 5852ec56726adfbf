"""The benchmark harness: fair runs (same weights, same batches), the schedule, state accounting, every arm trains
(``skewadam bench`` itself is tested in test_cli.py)."""

import json
import math

import pytest

from skewadam.bench import arms
from skewadam.bench.config import ALL, BenchConfig, RunConfig, run_name
from skewadam.bench.models import MoETransformer, get_config
from skewadam.bench.report import sweep_table
from skewadam.bench.train import lr_factor, train

TINY = dict(model="tiny", steps=2, batch_size=2, eval_interval=1, eval_batches=1)


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_zero():
    steps = 100  # warm-up ceil(0.03 * 100) = 3 steps
    factors = [lr_factor(s, steps, 0.03) for s in range(steps)]
    assert factors[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert factors[3 + 48] == pytest.approx(0.5 * (1 + math.cos(math.pi * 48 / 97)))
    assert all(a >= b for a, b in zip(factors[2:], factors[3:])) and factors[-1] < 1e-3


def test_runs_with_one_seed_share_weights_batches_and_router_noise_across_optimizers():
    logs = {o: train(RunConfig(optimizer=o, **TINY), progress=False) for o in ("adamw", "skewadam", "muon")}
    first = logs["adamw"]
    for log in logs.values():
        assert log["init_checksum"] == first["init_checksum"]
        # step 1's loss depends on the weights, the batch and the router noise, not yet on the optimizer
        assert log["steps"][0]["loss"] == first["steps"][0]["loss"]
        assert log["evals"][0] == first["evals"][0]
    assert logs["skewadam"]["steps"][1]["loss"] != first["steps"][1]["loss"]
    other_seed = train(RunConfig(optimizer="adamw", seed=1, **TINY), progress=False)
    assert other_seed["init_checksum"] != first["init_checksum"]


@pytest.mark.parametrize("name", ALL)
def test_every_optimizer_trains_and_logs_state_by_tier(name):
    log = train(RunConfig(optimizer=name, **TINY), progress=False)
    s = log["summary"]
    assert len(log["steps"]) == 2 and len(log["evals"]) == 3 and not s["diverged"]
    assert s["state_bytes"] == sum(s["state_bytes_by_tier"].values()) > 0
    assert s["tokens_per_s"] > 0 and s["opt_time_s"] > 0 and s["peak_memory_bytes"] >= s["baseline_memory_bytes"] > 0
    assert log["config"]["lr"] == arms.get(name).lr
    assert json.loads(json.dumps(log))["steps"][0]["lr"] > 0  # the log is plain JSON (torchao keeps lr a tensor)


def test_state_bytes_follow_the_paper_tiers():
    """Tiny model, fp32: AdamW keeps 2 floats per parameter; SkewAdam keeps backbone momentum + factored rows and
    columns, expert rows and columns only, and the router's full second moment."""
    cfg = get_config("tiny")
    E, F, D = cfg.n_experts, cfg.d_expert, cfg.d_model
    adamw = train(RunConfig(optimizer="adamw", **TINY), progress=False)["summary"]["state_bytes_by_tier"]
    skew = train(RunConfig(optimizer="skewadam-floor", **TINY), progress=False)["summary"]["state_bytes_by_tier"]
    expert_params = 3 * E * F * D
    assert adamw["expert"] == 2 * 4 * expert_params
    assert skew["expert"] == 4 * (2 * E * (F + D) + E * (D + F))  # w1, w3: [E, F, D]; w2: [E, D, F]
    assert skew["router"] == 4 * E * D == adamw["router"] // 2


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = MoETransformer(get_config("tiny"))
    opt = arms.get("muon").build(model, 3e-4, 0.05)
    muon, adamw = opt.optimizers
    muon_names = {n for g in muon.param_groups for n in g["param_names"]}
    adamw_names = {n for g in adamw.param_groups for n in g["param_names"]}
    assert "blocks.0.attn.wq.weight" in muon_names and "blocks.0.ffn.w2.weight" in muon_names
    assert {"tok_emb.weight", "blocks.1.moe.router.weight", "blocks.1.moe.experts.w1"} <= adamw_names
    assert muon_names.isdisjoint(adamw_names)
    assert len(muon_names | adamw_names) == len(list(model.parameters()))
    router_group = next(g for g in adamw.param_groups if "blocks.1.moe.router.weight" in g["param_names"])
    assert router_group["weight_decay"] == 0.0


def test_bench_plans_every_optimizer_lr_and_seed_seed_major():
    bench = BenchConfig(optimizers=("adamw", "skewadam"), lrs={"adamw": (1e-4, 3e-4)}, seeds=2)
    names = [run_name(r) for r in bench.runs()]
    assert names == ["adamw_lr0.0001_seed0", "adamw_lr0.0003_seed0", "skewadam_lr0.001_seed0",
                     "adamw_lr0.0001_seed1", "adamw_lr0.0003_seed1", "skewadam_lr0.001_seed1"]


def test_the_study_trains_every_arm_once_and_no_implementation_variant():
    assert set(ALL) == {n for n, a in arms.ARMS.items() if a.make and not a.variant_of}
    assert "adamw-foreach" not in ALL and "adamw8bit-bnb" not in ALL
    with pytest.raises(ValueError, match="adamw8bit-bnb is a memory model only"):
        RunConfig(optimizer="adamw8bit-bnb")


def test_sweep_table_marks_the_best_lr_and_names_sweeps_whose_best_is_at_an_edge():
    def row(mean, seeds=3):
        return {"seeds": seeds, "diverged": 0, "best_val_ppl": (mean, 0.1 if seeds > 1 else 0.0)}

    summary = {("adamw", 1e-3): row(13.0), ("adamw", 3e-3): row(12.0), ("adamw", 1e-2): row(14.0),
               ("adafactor", 3e-2): row(11.0, seeds=1), ("adafactor", 1e-1): row(10.0)}
    table = sweep_table(summary)
    assert "| adamw | 0.001: 13.000 ± 0.100 (3 seeds) | **0.003: 12.000 ± 0.100** (3 seeds) |" in table
    assert "| adafactor | 0.03: 11.000 | **0.1: 10.000 ± 0.100** (3 seeds) |" in table
    assert table.endswith("Not bracketed (best lr at an edge of the lrs tried; extend with `--lrs NAME=...` into the "
                          "same `--out`): adafactor (best 0.1, tried 0.03 to 0.1).")
    assert sweep_table({("adamw", 1e-3): row(13.0)}) is None  # one lr: no sweep


def test_tensorboard_event_files_are_written_per_run(tmp_path):
    pytest.importorskip("tensorboard")
    train(RunConfig(optimizer="skewadam", **TINY), tensorboard=str(tmp_path), progress=False)
    assert list((tmp_path / "skewadam_lr0.001_seed0").glob("events.out.tfevents.*"))


def test_a_transformers_moe_trains_in_the_harness_with_tiers_logs_and_plots(tmp_path):
    """`--model` a Transformers preset scaled by `--set`: the same loop, its own losses, state by tier, the report."""
    pytest.importorskip("transformers")
    from test_models import HF_TINY

    from skewadam.bench import report
    from skewadam.bench.train import write_json

    (tmp_path / "runs").mkdir()
    for optimizer in ("adamw", "skewadam"):
        cfg = RunConfig(optimizer=optimizer, **{**TINY, "model": "qwen3-30b-a3b", "block_size": 16},
                        overrides=HF_TINY["qwen3-30b-a3b"])
        log = train(cfg, tmp_path / "runs" / f"{run_name(cfg)}.json", progress=None)
        by_tier = log["model"]["params_by_tier"]
        assert by_tier["expert"] > 0 and by_tier["router"] > 0 and log["model"]["block_size"] == 16
        assert log["model"]["config"]["model_type"] == "qwen3_moe" and log["model"]["balance_floor"] == 0.002
        assert all(s["balance_loss"] > 0 and math.isfinite(s["loss"]) for s in log["steps"])
    write_json(tmp_path / "bench.json", {"base": {"steps": 2}, "optimizers": ["adamw", "skewadam"]})
    text = report.render(tmp_path, plots=True)
    assert "Model `qwen3-30b-a3b` with `--set hidden_size=32" in text and "| skewadam | 0.001 | 1 |" in text
    assert (tmp_path / "balance.png").exists()


def test_a_bench_directory_written_before_a_setting_existed_resumes_and_another_setup_is_refused(tmp_path):
    """``bench.json`` of an earlier version lacks settings added since (``overrides``): they count at their default;
    a setting that differs still refuses the directory, naming it."""
    from skewadam.bench.run import _check_resume, _identity

    bench = BenchConfig(base=RunConfig(model="tiny", steps=2), optimizers=["adamw"])
    older = {k: v for k, v in _identity(bench.base).items() if k != "overrides"}
    (tmp_path / "bench.json").write_text(json.dumps({"base": older, "optimizers": ["skewadam"]}))
    assert _check_resume(tmp_path, bench) == ["skewadam", "adamw"]
    changed = BenchConfig(base=RunConfig(model="tiny", steps=3), optimizers=["adamw"])
    with pytest.raises(ValueError, match=r"different setup \(steps: 2 there vs 3 now\)"):
        _check_resume(tmp_path, changed)


def test_a_resumed_bench_reruns_a_run_whose_arm_settings_changed_since_its_log(tmp_path):
    """A log records its arm's settings (`Arm.settings`); a log that predates the record ran the arm as it was then
    (`arms.BEFORE_LOGGED_SETTINGS`: the quality recipe before its cheaper Newton-Schulz). Resuming counts a log as
    the run only if those settings are today's: an old quality log is run again, an old paper-recipe log is kept."""
    from skewadam.bench.run import _log_problem

    for optimizer in ("skewadam-quality", "skewadam"):
        cfg = RunConfig(optimizer=optimizer, **TINY)
        path = tmp_path / f"{run_name(cfg)}.json"
        log = train(cfg, path, progress=None)
        assert log["arm"] == arms.get(optimizer).settings() and _log_problem(path, cfg) is None
        del log["arm"]
        path.write_text(json.dumps(log))
        problem = _log_problem(path, cfg)
        if optimizer == "skewadam":
            assert problem is None
        else:
            assert "skewadam-quality ran other settings then" in problem and "'ns_interval': 4" in problem
