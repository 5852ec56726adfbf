"""The ``skewadam`` command (`skewadam.cli`): each subcommand end to end, one vocabulary of optimizer names across
them, and ``python -m skewadam``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from skewadam import arms
from skewadam.cli import main, parse_lrs, parse_optimizers
from skewadam.harness.config import ALL


def _cli(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _subprocess(*args, cwd):
    """``python -m skewadam ARGS`` in a fresh process (the command as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "skewadam", *args], cwd=cwd, capture_output=True, text=True)


# -------------------------------------------------------------------------------------------- python -m skewadam
def test_python_m_skewadam_is_the_skewadam_command(tmp_path):
    help_ = _subprocess("--help", cwd=tmp_path)
    assert help_.returncode == 0 and all(c in help_.stdout for c in ("tiers", "plan", "bench", "report", "bench-step"))
    plan = _subprocess("plan", "tiny", "--optimizer", "skewadam", "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert set(json.loads(plan.stdout)["optimizers"]) == {"skewadam"}


# ----------------------------------------------------------------------------------------- one vocabulary of names
def test_plan_bench_and_bench_step_take_the_same_names_and_the_old_ones_as_aliases(capsys):
    plan = json.loads(_cli(["plan", "tiny", "--json", "--optimizer", "skewadam-int8m",
                            "--optimizer", "skewadam-int8"], capsys))  # the planner's old name and the bench's
    assert list(plan["optimizers"]) == ["skewadam-int8m"]
    assert parse_optimizers("skewadam-int8m,skewadam-int8,skewadam+expert-momentum") == (
        "skewadam-int8m", "skewadam-expert-momentum")
    assert _bench_step_rows(["--optimizers", "skewadam-int8", "AdamW fused"], capsys) == [
        "skewadam", "skewadam-int8m", "adamw"]
    for old, new in arms.ALIASES.items():
        assert arms.get(old) is arms.ARMS[new]
    # what each command lists is a subset of the registry: buildable arms train, modelled arms plan
    assert set(ALL) <= set(arms.names(buildable=True)) and set(arms.PLAN_DEFAULT) <= set(arms.names(planned=True))


def test_an_unknown_name_is_refused_by_every_command_listing_the_registry(capsys):
    for argv in (["plan", "tiny", "--optimizer", "lion"], ["bench-step", "--optimizers", "lion"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "unknown optimizer 'lion': use any of adamw" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown optimizer 'lion' in --optimizers"):
        parse_optimizers("lion")


# ------------------------------------------------------------------------------------------------------- tiers
def test_cli_tiers_of_a_hf_config_json_builds_on_meta(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8)
    config.to_json_file(tmp_path / "config.json")
    d = json.loads(_cli(["tiers", str(tmp_path), "--json"], capsys))
    assert d["tiers"]["expert"]["params"] == 2 * 8 * 3 * 64 * 32  # 2 layers, 8 experts, gate/up/down [64, 32]
    assert d["tiers"]["router"]["params"] == 2 * 8 * 32


def test_cli_tiers_of_a_preset_prints_the_table(capsys):
    out = _cli(["tiers", "paper-6.78b"], capsys)
    assert "expert" in out and "6,442,450,944" in out  # 32 MoE experts' banks of the paper model, on meta


def test_cli_tiers_json_with_rules_and_listing(capsys):
    d = json.loads(_cli(["tiers", "tiny", "--json", "--list", "--rule", r"\.ffn\.=expert"], capsys))
    assert d["labels"]["blocks.0.ffn.w1.weight"] == "expert"
    assert d["tiers"]["router"]["tensors"] == 1 and d["warnings"] == []


def test_cli_tiers_of_a_missing_config_fails_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no such file"):
        _cli(["tiers", str(tmp_path / "config.json")], capsys)


def test_cli_tiers_of_an_unknown_preset_fails_clearly(capsys):
    with pytest.raises(SystemExit, match="neither a preset nor a config.json path"):
        _cli(["tiers", "no-such-preset"], capsys)


# -------------------------------------------------------------------------------------------------------- plan
def test_cli_plan_prints_the_table_and_json(capsys):
    text = _cli(["plan", "paper-6.78b"], capsys)
    assert "54,273,081,344" in text and "1,380,029,764" in text and "assumptions:" in text
    out = json.loads(_cli(["plan", "tiny", "--json", "--batch", "2", "--seq", "16", "--param-dtype", "bf16",
                           "--optimizer", "skewadam", "--optimizer", "adamw"], capsys))
    assert set(out["optimizers"]) == {"skewadam", "adamw"} and out["units"] == "bytes"
    assert out["optimizers"]["adamw"]["master"] == 4 * out["trainable"] and out["seq"] == 16


def test_cli_plan_shards_prints_what_the_orthogonal_tier_gathers(capsys):
    """--shards N: the gathered bytes per rank, the planner's (`plan(shards=N)`), for the arms that gather only."""
    from skewadam import plan

    out = _cli(["plan", "tiny", "--optimizer", "skewadam", "--optimizer", "skewadam-orthogonal", "--shards", "2"],
               capsys)
    want = plan("tiny", optimizers=["skewadam-orthogonal"], shards=2)["skewadam-orthogonal"].gather_bytes
    assert want > 0 and "FSDP2 over 2 ranks" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("skewadam")]
    assert ["skewadam-orthogonal", f"{want:,}"] == [rows[-1][0], rows[-1][-1]]
    assert not any(r[0] == "skewadam" and r[-1] == f"{want:,}" for r in rows)


def test_cli_plan_set_overrides_a_config_value(capsys):
    out = json.loads(_cli(["plan", "olmoe-1b-7b", "--json", "--optimizer", "skewadam",
                           "--set", "num_hidden_layers=2"], capsys))
    assert out["params"] < 2e9 and out["top_k"] == 8
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _cli(["plan", "tiny", "--set", "num_hidden_layers"], capsys)


def test_cli_plan_of_an_arm_without_a_memory_model_says_which_have_one(capsys, monkeypatch):
    unmodelled = dataclasses.replace(arms.ARMS["muon"], name="muon-unmodelled", state=None, transient=None)
    monkeypatch.setitem(arms.ARMS, unmodelled.name, unmodelled)
    with pytest.raises(SystemExit, match=r"skewadam plan: no memory model of \['muon-unmodelled'\]: plan any of adamw"):
        _cli(["plan", "tiny", "--optimizer", "muon-unmodelled"], capsys)
    with pytest.raises(SystemExit, match=r"skewadam plan: no memory model of \['muon-unmodelled'\]"):
        _cli(["plan", "tiny", "--measure", "muon-unmodelled"], capsys)
    with pytest.raises(SystemExit, match=r"skewadam bench-step: \['adamw8bit-bnb'\]: memory models only"):
        _cli(["bench-step", "--optimizers", "adamw8bit"], capsys)


# ------------------------------------------------------------------------------------------------------- bench
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
    assert parse_optimizers("adamw,skewadam-add") == ("adamw", "skewadam")
    assert parse_optimizers("all") == ALL
    assert "muon" in parse_optimizers("default")
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        parse_optimizers("sgd")


def test_cli_bench_writes_logs_table_and_plots_then_resumes_and_reports(tmp_path):
    out = tmp_path / "run"
    args = ["bench", "--preset", "smoke", "--optimizers", "adamw,skewadam", "--out", str(out), "--no-progress"]
    first = _subprocess(*args, "--jobs", "2", cwd=tmp_path)  # both runs at once
    assert first.returncode == 0, first.stderr
    assert "| adamw | 0.0003 | 1 |" in first.stdout and "(1.00x)" in first.stdout
    assert "started from identical weights" in first.stdout and "2 runs into" in first.stdout and "2 at a time" in first.stdout
    for f in ("results.md", "val_ppl.png", "memory.png", "balance.png", "runs/adamw_lr0.0003_seed0.json"):
        assert (out / f).stat().st_size > 0, f
    log = json.loads((out / "runs/skewadam_lr0.0003_seed0.json").read_text())
    assert [e["step"] for e in log["evals"]] == [0, 1, 2] and log["summary"]["state_bytes_by_tier"]["expert"] > 0

    again = _subprocess(*args, cwd=tmp_path)  # resume: nothing left to run
    assert again.returncode == 0 and again.stdout.count("done earlier, skipped") == 2

    clash = _subprocess(*args, "--steps", "3", cwd=tmp_path)
    assert clash.returncode != 0 and "steps: 2 there vs 3 now" in clash.stderr

    (out / "val_ppl.png").unlink()
    report = _subprocess("report", str(out), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert (out / "val_ppl.png").exists() and "skewadam" in report.stdout


@pytest.mark.parametrize("flags, message", [
    (["--optimizers", "adam"], "use any of adamw"),
    (["--model", "huge"], "unknown model"),
    (["--data", "missing.txt"], "does not exist"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_cli_bench_rejects_bad_input_before_any_run(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", *flags, "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()




# -------------------------------------------------------------------------------------------------- bench-step
def _bench_step_rows(flags, capsys) -> list[str]:
    out = _cli(["bench-step", "--preset", "tiny", "--rounds", "1", "--steps", "1", "--warmup", "1", *flags], capsys)
    assert "transient MiB" in out and "load average" in out
    return [line.split()[0] for line in out.splitlines()[3:]]


def test_bench_step_prints_times_ratios_and_memory(capsys):
    assert _bench_step_rows([], capsys) == list(arms.BENCH_STEP_DEFAULT)
    # the bench's arms too, built with their own param groups (Muon's hidden matrices, the int8 momentum)
    assert _bench_step_rows(["--optimizers", "muon", "skewadam-int8m"], capsys) == ["skewadam", "muon",
                                                                                  "skewadam-int8m"]
