"""The benchmark harness: fair runs (same weights, same batches), the schedule, state accounting, the CLI."""

import json
import math
import subprocess
import sys

import pytest

from skewadam.cli import main as cli_main
from skewadam.harness.bench import parse_lrs, parse_optimizers
from skewadam.harness.config import BenchConfig, RunConfig, run_name
from skewadam.harness.optimizers import OPTIMIZERS, build_optimizer
from skewadam.harness.report import sweep_table
from skewadam.harness.train import lr_factor, train
from skewadam.models import MoETransformer, get_config

TINY = dict(model="tiny", steps=2, batch_size=2, eval_interval=1, eval_batches=1)


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_zero():
    steps = 100  # warm-up ceil(0.03 * 100) = 3 steps
    factors = [lr_factor(s, steps, 0.03) for s in range(steps)]
    assert factors[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert factors[3 + 48] == pytest.approx(0.5 * (1 + math.cos(math.pi * 48 / 97)))
    assert all(a >= b for a, b in zip(factors[2:], factors[3:])) and factors[-1] < 1e-3


def test_runs_with_one_seed_share_weights_batches_and_router_noise_across_optimizers():
    logs = {o: train(RunConfig(optimizer=o, **TINY), progress=False) for o in ("adamw", "skewadam-add", "muon")}
    first = logs["adamw"]
    for log in logs.values():
        assert log["init_checksum"] == first["init_checksum"]
        # step 1's loss depends on the weights, the batch and the router noise, not yet on the optimizer
        assert log["steps"][0]["loss"] == first["steps"][0]["loss"]
        assert log["evals"][0] == first["evals"][0]
    assert logs["skewadam-add"]["steps"][1]["loss"] != first["steps"][1]["loss"]
    other_seed = train(RunConfig(optimizer="adamw", seed=1, **TINY), progress=False)
    assert other_seed["init_checksum"] != first["init_checksum"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_trains_and_logs_state_by_tier(name):
    log = train(RunConfig(optimizer=name, **TINY), progress=False)
    s = log["summary"]
    assert len(log["steps"]) == 2 and len(log["evals"]) == 3 and not s["diverged"]
    assert s["state_bytes"] == sum(s["state_bytes_by_tier"].values()) > 0
    assert s["tokens_per_s"] > 0 and s["opt_time_s"] > 0 and s["peak_memory_bytes"] >= s["baseline_memory_bytes"] > 0
    assert log["config"]["lr"] == OPTIMIZERS[name].lr
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
    opt = build_optimizer("muon", model, 3e-4, 0.05)
    muon, adamw = opt.optimizers
    muon_names = {n for g in muon.param_groups for n in g["param_names"]}
    adamw_names = {n for g in adamw.param_groups for n in g["param_names"]}
    assert "blocks.0.attn.wq.weight" in muon_names and "blocks.0.ffn.w2.weight" in muon_names
    assert {"tok_emb.weight", "blocks.1.moe.router.weight", "blocks.1.moe.experts.w1"} <= adamw_names
    assert muon_names.isdisjoint(adamw_names)
    assert len(muon_names | adamw_names) == len(list(model.parameters()))
    router_group = next(g for g in adamw.param_groups if "blocks.1.moe.router.weight" in g["param_names"])
    assert router_group["weight_decay"] == 0.0


def test_lr_specs_per_optimizer_for_all_and_as_multiples():
    opts = ("adamw", "adafactor")
    assert parse_lrs(["1e-4,3e-4"], opts) == {"adamw": (1e-4, 3e-4), "adafactor": (1e-4, 3e-4)}
    assert parse_lrs(["x1,x3"], opts) == {"adamw": (3e-4, 9e-4), "adafactor": (1e-2, 3e-2)}
    assert parse_lrs(["x2", "adamw=1e-3"], opts) == {"adamw": (1e-3,), "adafactor": (2e-2,)}
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        parse_lrs(["adam=1e-3"], opts)
    with pytest.raises(ValueError, match="multipliers like x0.3"):
        parse_lrs(["fast"], opts)


def test_optimizer_lists_accept_default_and_all():
    assert parse_optimizers("adamw,skewadam-add") == ("adamw", "skewadam-add")
    assert parse_optimizers("all") == tuple(OPTIMIZERS)
    assert "muon" in parse_optimizers("default")
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        parse_optimizers("sgd")


def test_bench_plans_every_optimizer_lr_and_seed_seed_major():
    bench = BenchConfig(optimizers=("adamw", "skewadam-add"), lrs={"adamw": (1e-4, 3e-4)}, seeds=2)
    names = [run_name(r) for r in bench.runs()]
    assert names == ["adamw_lr0.0001_seed0", "adamw_lr0.0003_seed0", "skewadam-add_lr0.0003_seed0",
                     "adamw_lr0.0001_seed1", "adamw_lr0.0003_seed1", "skewadam-add_lr0.0003_seed1"]


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "skewadam.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_cli_bench_writes_logs_table_and_plots_then_resumes_and_reports(tmp_path):
    out = tmp_path / "run"
    args = ["bench", "--preset", "smoke", "--optimizers", "adamw,skewadam-add", "--out", str(out), "--no-progress"]
    first = _cli(*args, "--jobs", "2", cwd=tmp_path)  # both runs at once
    assert first.returncode == 0, first.stderr
    assert "| adamw | 0.0003 | 1 |" in first.stdout and "(1.00x)" in first.stdout
    assert "started from identical weights" in first.stdout and "2 runs into" in first.stdout and "2 at a time" in first.stdout
    for f in ("results.md", "val_ppl.png", "memory.png", "balance.png", "runs/adamw_lr0.0003_seed0.json"):
        assert (out / f).stat().st_size > 0, f
    log = json.loads((out / "runs/skewadam-add_lr0.0003_seed0.json").read_text())
    assert [e["step"] for e in log["evals"]] == [0, 1, 2] and log["summary"]["state_bytes_by_tier"]["expert"] > 0

    again = _cli(*args, cwd=tmp_path)  # resume: nothing left to run
    assert again.returncode == 0 and again.stdout.count("done earlier, skipped") == 2

    clash = _cli(*args, "--steps", "3", cwd=tmp_path)
    assert clash.returncode != 0 and "steps: 2 there vs 3 now" in clash.stderr

    (out / "val_ppl.png").unlink()
    report = _cli("report", str(out), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert (out / "val_ppl.png").exists() and "skewadam-add" in report.stdout


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


@pytest.mark.parametrize("flags, message", [
    (["--optimizers", "adam"], "use any of adamw"),
    (["--model", "huge"], "unknown model"),
    (["--data", "missing.txt"], "does not exist"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_cli_bench_rejects_bad_input_before_any_run(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        cli_main(["bench", *flags, "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_tensorboard_event_files_are_written_per_run(tmp_path):
    pytest.importorskip("tensorboard")
    train(RunConfig(optimizer="skewadam-add", **TINY), tensorboard=str(tmp_path), progress=False)
    assert list((tmp_path / "skewadam-add_lr0.0003_seed0").glob("events.out.tfevents.*"))
