"""The ``skewadam`` command (`skewadam.cli`): each subcommand end to end, one vocabulary of optimizer names across
them, and ``python -m skewadam``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skewadam.bench import arms
from skewadam.bench.config import ALL
from skewadam.cli import build_parser, main, parse_lrs, parse_optimizers
from skewadam.kernels import resolve_backend


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
def test_plan_bench_and_bench_step_take_the_same_names_and_no_aliases(capsys):
    plan = json.loads(_cli(["plan", "tiny", "--json", "--optimizer", "skewadam-lean"], capsys))
    assert list(plan["optimizers"]) == ["skewadam-lean"]
    assert parse_optimizers("skewadam-lean,skewadam-expert-momentum") == ("skewadam-lean", "skewadam-expert-momentum")
    assert _bench_step_rows(["--optimizers", "skewadam-lean", "adamw"], capsys) == ["skewadam", "skewadam-lean",
                                                                                    "adamw"]
    for old in ("skewadam-add", "skewadam-int8", "adamw8bit", "SkewAdam", "AdamW fused", "skewadam-eager"):
        with pytest.raises(ValueError, match=f"unknown optimizer '{old}'"):
            arms.get(old)
    assert not hasattr(arms, "ALIASES") and not hasattr(arms, "canonical")
    # what each command lists is a subset of the registry: buildable arms train, modelled arms plan
    assert set(ALL) <= set(arms.names(buildable=True)) and set(arms.PLAN_DEFAULT) <= set(arms.names(planned=True))


def test_the_arms_the_study_found_no_better_and_the_kernel_arm_are_gone():
    """Their results stay in docs/study (the cheaper quality recipe's screen: docs/study/cheaper.md); the kernel is
    ``--impl``, not an arm."""
    gone = ("skewadam-beta2-decay", "skewadam-orthogonal-lr3x", "skewadam-orthogonal-lr10x", "skewadam-eager",
            "skewadam-quality-bf16", "skewadam-quality-bf16-ns3", "skewadam-quality-bf16-ns4",
            "skewadam-quality-bf16-every2", "skewadam-quality-bf16-every4", "skewadam-quality-every4")
    assert not set(gone) & set(arms.ARMS)
    assert not any(f.name == "orthogonal_lr" for f in dataclasses.fields(arms.Arm))
    from skewadam.bench.config import PRESETS

    assert not any(set(gone) & set(preset().optimizers) for preset in PRESETS.values())


def test_the_docs_list_the_registrys_names_and_the_readmes_commands_use_them():
    """The docs are the registry's fourth user: the bench guide's list of names is `arms.names()`, in its order, and
    every optimizer a README command names is a current name, not an alias."""
    root = Path(__file__).resolve().parents[1]
    guide = (root / "docs" / "guide" / "bench.md").read_text()
    listing = guide[guide.index("Optimizer names are the same"):]
    listing = listing[listing.index(":"):listing.index("\n\n")]
    assert re.findall(r"`([\w+-]+)`", listing) == arms.names()
    text = (root / "README.md").read_text()
    commands = re.findall(r"--optimizers? ((?:[a-z][\w+-]*[ ,\n]*)+)", text)
    named = [n for c in commands for n in re.split(r"[ ,\n]+", c.strip()) if n != "all"]
    assert len(named) >= 10 and all(n in arms.ARMS for n in named), named

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
    from skewadam.state import format_bytes

    out = _cli(["plan", "tiny", "--optimizer", "skewadam", "--optimizer", "skewadam-orthogonal", "--shards", "2"],
               capsys)
    want = plan("tiny", optimizers=["skewadam-orthogonal"], shards=2)["skewadam-orthogonal"].gather_bytes
    assert want > 0 and "FSDP2 over 2 ranks" in out
    section = out[out.index("to gather the orthogonal tier's matrices"):].split("\n\n")[0]
    rows = [line.split() for line in section.splitlines() if line.startswith("skewadam")]
    assert rows == [["skewadam-orthogonal", *format_bytes(want).split(), f"{want:,}"]]  # only the arm that gathers


def test_cli_plan_shards_prints_what_the_statistics_all_reduce(capsys):
    """--shards N: the bytes each rank all-reduces per step for SkewAdam's statistics, the planner's."""
    from skewadam import plan

    out = _cli(["plan", "tiny", "--optimizer", "skewadam", "--optimizer", "adamw", "--shards", "2"], capsys)
    want = plan("tiny", optimizers=["skewadam"], shards=2)["skewadam"].reduce_bytes
    assert want > 0 and "all-reduces per step for the optimizer's statistics (FSDP2 over 2 ranks" in out
    table = out.split("all-reduces per step")[1].split("optimizers:")[0]
    assert [line.split()[-1] for line in table.splitlines() if line.startswith(("skewadam", "adamw"))] == [f"{want:,}"]


def test_cli_plan_zero_prints_skewadam_s_bytes_per_rank_under_deepspeed(capsys):
    """--zero STAGE --shards N: SkewAdam's weights, master, gradients and state per rank and what a rank all-reduces
    per step (the planner's `ZeroPlan`; checked against two ranks in tests/distributed/test_deepspeed_distributed.py),
    in place of the FSDP2 figures; the others' rows have none."""
    from skewadam import plan
    from skewadam.state import format_bytes

    out = _cli(["plan", "tiny", "--optimizer", "skewadam", "--optimizer", "adamw", "--zero", "3", "--shards", "4"],
               capsys)
    z = plan("tiny", optimizers=["skewadam"], shards=4, zero=3)["skewadam"].zero
    assert (z.stage, z.ranks) == (3, 4) and z.state < z.state_ranks and "FSDP2" not in out
    table = out.split("DeepSpeed ZeRO stage 3 over 4 ranks")[1].split("\n\n")[0]
    rows = [line for line in table.splitlines() if line.startswith(("skewadam", "adamw"))]
    assert len(rows) == 1 and rows[0].split()[-2:] == [f"{z.sent:,}", str(z.collectives)], rows
    assert " ".join(format_bytes(z.state).split()) in rows[0], rows


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
        _cli(["bench-step", "--optimizers", "adamw8bit-bnb"], capsys)


# ------------------------------------------------------------------------------------------------------- bench
def test_lr_specs_per_optimizer_for_all_and_as_multiples():
    opts = ("adamw", "adafactor")
    assert parse_lrs(["1e-4,3e-4"], opts) == {"adamw": (1e-4, 3e-4), "adafactor": (1e-4, 3e-4)}
    assert parse_lrs(["x1,x3"], opts) == {"adamw": pytest.approx((1e-3, 3e-3)), "adafactor": pytest.approx((1e-1, 3e-1))}
    assert parse_lrs(["x2", "adamw=1e-4"], opts) == {"adamw": (1e-4,), "adafactor": (2e-1,)}
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        parse_lrs(["adam=1e-3"], opts)
    with pytest.raises(ValueError, match="multipliers like x0.3"):
        parse_lrs(["fast"], opts)


def test_optimizer_lists_accept_default_and_all():
    assert parse_optimizers("adamw,skewadam") == ("adamw", "skewadam")
    assert parse_optimizers("all") == ALL
    assert "muon" in parse_optimizers("default")
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        parse_optimizers("sgd")


def test_cli_bench_writes_logs_table_and_plots_then_resumes_and_reports(tmp_path):
    out = tmp_path / "run"
    args = ["bench", "--preset", "smoke", "--optimizers", "adamw,skewadam", "--out", str(out), "--no-progress"]
    first = _subprocess(*args, "--jobs", "2", cwd=tmp_path)  # both runs at once
    assert first.returncode == 0, first.stderr
    assert "| adamw | 0.001 | 1 |" in first.stdout and "(1.00x)" in first.stdout and "wall time" in first.stdout
    assert "started from identical weights" in first.stdout and "2 runs into" in first.stdout and "2 at a time" in first.stdout
    for f in ("results.md", "val_ppl.png", "memory.png", "balance.png", "runs/adamw_lr0.001_seed0.json"):
        assert (out / f).stat().st_size > 0, f
    log = json.loads((out / "runs/skewadam_lr0.001_seed0.json").read_text())
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
    (["--data", "/dev/null"], "'/dev/null' is a device, not a file or a folder"),
    (["--jobs", "0"], r"jobs \(--jobs\) must be an integer >= 1"),
])
def test_cli_bench_rejects_bad_input_before_any_run(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", *flags, "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()




# -------------------------------------------------------------------------------------------------- bench-step
def _bench_step_rows(flags, capsys) -> list[str]:
    out = _cli(["bench-step", "--preset", "tiny", "--rounds", "2", "--steps", "1", "--warmup", "1", *flags], capsys)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("optimizer"))
    assert "transient" in lines[header] and "load average" in out
    return [line.split()[0] for line in lines[header + 1:]]


def test_bench_step_prints_times_ratios_and_memory(capsys):
    assert _bench_step_rows([], capsys) == list(arms.BENCH_STEP_DEFAULT)
    # the bench's arms too, built with their own param groups (Muon's hidden matrices, the int8 momentum)
    assert _bench_step_rows(["--optimizers", "muon", "skewadam-lean"], capsys) == ["skewadam", "muon",
                                                                                  "skewadam-lean"]


def test_bench_step_times_a_bench_batchs_forward_and_backward_and_gives_each_steps_share(capsys):
    """The forward and backward of one --batch-size batch runs in the same rounds; each step is printed as a multiple
    of it and as its share of a training step (forward, backward, step); --batch-size 0 leaves it out."""
    out = _cli(["bench-step", "--preset", "tiny", "--rounds", "2", "--steps", "2", "--warmup", "1", "--optimizers",
                "skewadam-quality"], capsys)
    fb = float(re.search(r"forward\+backward of one 16 x 32 batch: ([\d.]+) ms", out).group(1))
    lines = out.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("optimizer")) + 1:]
    assert [row.split()[0] for row in rows] == ["skewadam", "skewadam-quality"]
    for row in (row.split() for row in rows):
        t, times, share = float(row[1]), float(row[-2].rstrip("x")), float(row[-1].rstrip("%"))
        assert times == pytest.approx(t / fb, rel=0.02, abs=0.01) and abs(share - 100 * t / (t + fb)) <= 1
    out = _cli(["bench-step", "--preset", "tiny", "--rounds", "1", "--steps", "1", "--batch-size", "0"], capsys)
    assert "forward+backward" not in out and "share" not in out


# ------------------------------------------------------------------------------- a user's mistake: one line
def _one_line_error(argv, capsys) -> str:
    """Run the command; it must fail with exit status 1 and one line on stderr (no traceback); return that line."""
    try:
        rc = main(argv)
        message = capsys.readouterr().err
    except SystemExit as e:  # `raise SystemExit(message)`: the interpreter prints the message to stderr
        rc, message = (1, str(e.code)) if isinstance(e.code, str) else (e.code, capsys.readouterr().err)
    assert rc == 1, (argv, message)
    lines = message.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in message, message
    assert lines[0].startswith(f"skewadam {argv[0]}: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["tiers", "tiny", "--rule", "foo=router"], "match no trainable parameter"),
    (["tiers", "tiny", "--rule", "(=router"], "invalid regular expression"),
    (["tiers", "tiny", "--rule", "x=foo"], "unknown tier 'foo'"),
    (["plan", "tiny", "--set", "d_model=-4"], "d_model=-4: a size, must be an integer >= 1"),
    (["bench-step", "--preset", "tiny", "--set", "n_experts=0"], "n_experts=0: a size"),
    (["bench", "--block-size", "0"], "block_size (--block-size) must be an integer >= 1, got 0"),
    (["bench", "--grad-clip", "-1"], "grad_clip (--grad-clip) must be a finite number >= 0"),
    (["bench", "--steps", "-5"], "steps (--steps) must be an integer >= 1"),
    (["bench", "--lrs", "0"], "learning rates must be positive"),
    (["bench", "--warmup-frac", "1.5"], "warmup_frac (--warmup-frac) must be a finite number in [0, 1)"),
    (["bench", "--eval-batches", "0"], "eval_batches (--eval-batches) must be an integer >= 1"),
    (["bench", "--threads", "0"], "threads (--threads) must be an integer >= 1"),
    (["bench", "--seeds", "0"], "seeds (--seeds) must be an integer >= 1"),
    (["bench-step", "--rounds", "0"], "--rounds must be >= 1"),
])
def test_a_users_mistake_is_one_line_naming_it_not_a_traceback(argv, says, tmp_path, capsys):
    out = tmp_path / "out"
    line = _one_line_error([*argv, "--out", str(out)] if argv[0] == "bench" else argv, capsys)
    assert says in line
    assert not out.exists()  # refused before anything ran


def test_a_negative_size_in_a_hugging_face_config_is_one_line(capsys):
    pytest.importorskip("transformers")
    assert "negative size(s) hidden_size=-4" in _one_line_error(["plan", "mixtral-8x7b", "--set", "hidden_size=-4"],
                                                               capsys)


SMALL_MIXTRAL = ["hidden_size=32", "intermediate_size=64", "num_hidden_layers=2", "num_attention_heads=4",
                 "num_key_value_heads=2", "num_local_experts=4"]
UNRUNNABLE = {  # a config that builds on the meta device but cannot train: each refused by name, in one line
    "no experts": (["num_local_experts=0"], "num_local_experts=0 with num_experts_per_tok=2: routing needs an expert"),
    "top-k above the experts": (["num_experts_per_tok=5"], "num_experts_per_tok=5 > num_local_experts=4"),
    "no layers": (["num_hidden_layers=0"], "num_hidden_layers=0: the model needs a layer"),
    "heads the kv heads do not divide": (["num_attention_heads=6", "hidden_size=36", "num_key_value_heads=4"],
                                         "num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
    "a string size": (['hidden_size="big"'], "hidden_size='big': sizes and counts are integers"),
    "a string size from a shell": (['hidden_size="32"'], "hidden_size='32': sizes and counts are integers"),
}


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("case", list(UNRUNNABLE))
def test_a_transformers_config_that_cannot_train_is_one_line_before_anything_runs(command, case, tmp_path, capsys):
    pytest.importorskip("transformers")
    sets, says = UNRUNNABLE[case]
    argv = [command, *(["--model"] if command == "bench" else []), "mixtral-8x7b", "--set", *SMALL_MIXTRAL, *sets]
    line = _one_line_error([*argv, "--out", str(tmp_path / "out")] if command == "bench" else argv, capsys)
    assert says in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, says", [
    (lambda raw: raw.update(hidden_size="32"), "hidden_size='32': sizes and counts are integers (in config.json, "
                                               "32, not \"32\""),
    (lambda raw: raw.pop("num_key_value_heads") and raw.update(num_attention_heads=6, hidden_size=36),
     "num_attention_heads=6 is not a multiple of num_key_value_heads=8"),  # the config class's default: 8
])
def test_a_config_json_with_a_wrong_typed_or_missing_size_is_one_line_naming_the_key(edit, says, tmp_path, capsys):
    pytest.importorskip("transformers")
    from skewadam.bench.presets import HF_PRESETS

    raw = dict(HF_PRESETS["mixtral-8x7b"].config, num_hidden_layers=2, intermediate_size=64, hidden_size=32)
    edit(raw)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    for argv in (["plan", str(path)], ["bench", "--model", str(path), "--out", str(tmp_path / "out")]):
        line = _one_line_error(argv, capsys)
        assert str(path) in line and says in line, line
    assert not (tmp_path / "out").exists()


def test_a_config_that_passes_every_key_check_but_cannot_step_is_refused_by_the_bench_before_any_run(
        tmp_path, capsys, monkeypatch):
    """The bench's last check: one forward and backward of the model it builds (`check_trains`); here the model's
    forward fails as a config no key check knows would make it fail."""
    from skewadam.bench import models

    def broken(self, idx_BT, targets_BT=None):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x32 and 33x32)\nmore detail")

    monkeypatch.setattr(models.MoETransformer, "forward", broken)
    line = _one_line_error(["bench", "--preset", "smoke", "--out", str(tmp_path / "out")], capsys)
    assert line == ("skewadam bench: tiny: builds, but one forward and backward of a 32-token window on CPU failed "
                    "(RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x32 and 33x32)): change the sizes it "
                    "names")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, says", [(b'{"model_type": "mixtral",', "not valid JSON"),
                                           (b"\xff\xfe{}", "not UTF-8 text")])
def test_a_malformed_or_non_utf8_config_json_is_one_line_naming_the_file(tmp_path, capsys, content, says):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    line = _one_line_error(["tiers", str(path)], capsys)
    assert str(path) in line and says in line


def test_report_on_a_folder_without_runs_or_with_a_damaged_log_is_one_line_naming_it(tmp_path, capsys):
    assert "no run logs in" in _one_line_error(["report", str(tmp_path)], capsys)
    assert "no such directory" in _one_line_error(["report", str(tmp_path / "missing")], capsys)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "adamw_lr0.001_seed0.json").write_text('{"name": "adamw_lr0.001_seed0", "conf')
    (tmp_path / "runs" / "skewadam_lr0.001_seed0.json").write_bytes(b"\x80\x81")
    line = _one_line_error(["report", str(tmp_path)], capsys)
    assert "no valid run log in" in line and "(2 skipped: " in line
    assert "adamw_lr0.001_seed0.json: not valid JSON" in line
    assert "skewadam_lr0.001_seed0.json: not UTF-8 text" in line and "runs them again" in line


def test_debug_or_skewadam_debug_shows_the_traceback_and_a_bug_keeps_its_own(monkeypatch, capsys):
    argv = ["tiers", "tiny", "--rule", "foo=router"]
    for debug in (["--debug", *argv], [*argv, "--debug"]):
        with pytest.raises(ValueError, match="match no trainable parameter"):
            main(debug)
    monkeypatch.setenv("SKEWADAM_DEBUG", "1")
    with pytest.raises(ValueError):
        main(argv)
    monkeypatch.delenv("SKEWADAM_DEBUG")
    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(sys.modules["skewadam.classify"], "classify", bug)
    with pytest.raises(KeyError):  # not a user's mistake: not turned into one line
        main(["tiers", "tiny"])


# ----------------------------------------------------------------------------------------------- small things
def test_bench_help_names_no_internal_issue_and_every_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "issue" not in text.lower()
    epilog = text[text.index("presets:"):]
    assert epilog.count("(") == epilog.count(")")
    assert re.search(r"--no-plots\s+write results.md only", text)
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_bench_runs_are_ignored_by_git():
    root = Path(__file__).resolve().parents[1]
    assert "bench-runs/" in (root / ".gitignore").read_text().split()


def test_every_printed_size_is_in_binary_units(capsys):
    from skewadam.bench.planner import format_bytes as planner_format_bytes
    from skewadam.state import format_bytes

    assert planner_format_bytes is format_bytes  # one function
    assert [format_bytes(n) for n in (512, 1600, 15 * 2**20 + 2**19, 1_380_029_764)] == [
        "512 B", "1.56 KiB", "15.50 MiB", "1.29 GiB"]
    texts = [_cli(["plan", "paper-6.78b"], capsys), _cli(["tiers", "paper-6.78b"], capsys)]
    texts.append(_cli(["bench-step", "--preset", "tiny", "--rounds", "2", "--steps", "1", "--warmup", "1"], capsys))
    for text in texts:
        assert re.search(r"\d (KiB|MiB|GiB)\b", text)
        assert not re.search(r"\d (kB|KB|MB|GB)\b", text), text


# -------------------------------------------------------------------------------------------------- defaults
#: The names docs/study/results.md's runs were made under, where they differ from the registry's.
_STUDY_NAMES = {"skewadam-add": "skewadam", "skewadam-int8": "skewadam-lean"}


def _study_best_lrs() -> dict[str, float]:
    """Each arm's best lr as docs/study/results.md reports it (its table: optimizer | lr | ...)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "study" / "results.md").read_text()
    rows = re.findall(r"^\| ([\w+-]+) \| ([0-9.e-]+) \| \d", text, re.M)
    return {arms.get(_STUDY_NAMES.get(name, name)).name: float(lr) for name, lr in rows}


def test_every_arm_trains_by_default_at_its_best_lr_of_the_study():
    from skewadam.bench.config import (DEFAULT_EVAL_INTERVAL, DEFAULT_OPTIMIZERS, DEFAULT_STEPS, STUDY_ARMS, default,
                                       study)

    best = _study_best_lrs()
    assert set(best) == set(STUDY_ARMS)  # the study covers every arm of its grid
    assert {name: arms.get(name).lr for name in best} == best
    text = (Path(__file__).resolve().parents[1] / "docs" / "study" / "orthogonal.md").read_text()
    bold = {name: lr for name, lr in re.findall(r"^\| ([\w-]+) \| ([0-9.e-]+) \| [0-9, ]+ \| \*\*", text, re.M)
            if name in arms.ARMS}  # each current arm's best row
    assert {name: arms.get(name).lr for name in bold} == {name: float(lr) for name, lr in bold.items()}
    assert "skewadam-orthogonal" in bold

    rerun = (Path(__file__).resolve().parents[1] / "docs" / "study" / "rerun.md").read_text()
    best.update({name: float(lr) for name, lr in re.findall(r"^\| ([\w-]+) \| \*\*([0-9.e-]+)\*\* \|", rerun, re.M)})
    bench = default()  # every arm at its best lr of the study at the default's horizon, the orthogonal ones after the fix
    assert {r.optimizer: r.resolved_lr for r in bench.runs()} == {n: best[n] for n in DEFAULT_OPTIMIZERS}
    assert bench.base == dataclasses.replace(study().base, steps=DEFAULT_STEPS, eval_interval=DEFAULT_EVAL_INTERVAL,
                                             threads=1)  # shorter


def test_the_default_bench_runs_one_single_threaded_run_per_core():
    from skewadam.bench.config import RunConfig, default, default_jobs

    cores = len(os.sched_getaffinity(0))
    assert default().resolved_jobs == cores
    assert default_jobs(RunConfig()) == 1 and default_jobs(RunConfig(threads=2)) == max(1, cores // 2)
    assert default_jobs(RunConfig(threads=1, device="cuda")) == 1


# -------------------------------------------------------------------------------------------------- bench-step
def test_bench_step_defaults_to_one_thread_cpu_time_and_prints_the_spread_cpu_and_isa(capsys):
    args = build_parser().parse_args(["bench-step"])
    assert (args.threads, args.clock) == (1, "cpu")
    out = _cli(["bench-step", "--preset", "tiny", "--rounds", "3", "--steps", "1", "--warmup", "1"], capsys)
    from skewadam.bench.bench_step import cpu_info, page_size

    model, isa = cpu_info()
    assert f"CPU: {model}" in out and "1 thread, cpu clock, 3 interleaved rounds" in out
    assert "IQR  min-max over rounds" in out
    row = next(line for line in out.splitlines() if line.startswith("adamw "))
    q1, q3, lo, hi = map(float, re.search(r"x\s+([\d.]+)-([\d.]+)\s+([\d.]+)-([\d.]+)", row).groups())
    assert lo <= q1 <= q3 <= hi
    assert (f"({os.cpu_count()} CPUs; {' '.join(isa) or 'baseline instruction set'}; {page_size()} pages); SkewAdam "
            "backend: ") in out
    backend = resolve_backend("auto", "cpu")
    assert f"SkewAdam backend: {backend.name} ({backend.summary})" in out
    flags = open("/proc/cpuinfo").read()
    assert all(f" {flag}" in flags for flag in isa)  # read from the CPU, not made up


# -------------------------------------------------------------------------------------------------- plan --measure
def test_plan_measure_names_the_estimate_it_compares_with_and_shows_progress(capsys):
    assert main(["plan", "tiny", "--measure", "adamw", "--optimizer", "skewadam", "--batch", "2", "--seq", "16"]) == 0
    out, err = capsys.readouterr()
    line = next(line for line in out.splitlines() if line.startswith("measured:"))
    assert "vs the estimate in the table (row adamw, column peak, --impl" in line
    assert re.search(r"^adamw\s", out, re.M)  # the row it names is in the table
    estimate = line.split("--impl ")[1].split(")")[0]
    assert estimate == resolve_backend("auto", "cpu").name
    assert f"SkewAdam's backend: {estimate}" in out  # the table was planned with the backend that was measured
    assert "measuring adamw on cpu" in err and "step 2/2" in err  # as it goes, on stderr


# ------------------------------------------------------------------------------------------- --model of Transformers
def test_bench_of_a_transformers_preset_runs_and_prints_no_third_party_load_lines(tmp_path):
    """``skewadam bench --model <Transformers preset> --set ... --steps 1``: it trains and reports, and no library's
    import failures (torchao's ``_C_mxfp8`` on a CPU build, say) reach the user."""
    pytest.importorskip("transformers")
    sets = ["hidden_size=32", "intermediate_size=64", "num_hidden_layers=2", "num_attention_heads=4",
            "num_key_value_heads=2", "num_local_experts=4"]
    proc = _subprocess("bench", "--model", "mixtral-8x7b", "--set", *sets, "--steps", "1", "--batch-size", "2",
                       "--block-size", "16", "--eval-batches", "1", "--optimizers", "skewadam", "--no-plots",
                       "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Model `mixtral-8x7b` with `--set hidden_size=32" in proc.stdout and "| skewadam |" in proc.stdout
    assert "SkewAdam tiers of MixtralForCausalLM" in proc.stdout  # the census, before the runs
    text = proc.stdout + proc.stderr
    assert not re.search(r"_C_\w+|Failed to load|Traceback|warn", text, re.I), text[-3000:]
    assert "\r" not in text and "step 1/1, val ppl" in proc.stderr  # a pipe: lines, no progress bar
    assert "device cpu, 1 thread," in proc.stdout  # not "1 threads"
    bad = _subprocess("bench", "--model", "mixtral-8x7b", "--set", "hiden_size=3", "--out", str(tmp_path / "x"),
                      cwd=tmp_path)
    assert bad.returncode == 1 and "'hiden_size' not a key of its config" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------ first-hour polish
def test_bench_help_shows_each_presets_real_defaults_and_whole_descriptions(capsys):
    from skewadam.bench.config import PRESETS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    presets = {name: make() for name, make in PRESETS.items()}
    for flag, field in (("training steps", "steps"), ("steps between evaluations", "eval_interval")):
        by_value: dict[int, list[str]] = {}  # presets of one value share an entry, in the order they come
        for name, b in presets.items():
            by_value.setdefault(getattr(b.base, field), []).append(name)
        values = ", ".join(f"{value} ({', '.join(names)})" for value, names in by_value.items())
        assert f"{flag} (default: the preset's: {values})" in text
    for name, make in PRESETS.items():
        whole = " ".join(make.__doc__.split("\n\n")[0].split()).split(". ")[0].rstrip(".") + "."
        assert f"{name}: {whole} ({', '.join(presets[name].optimizers)}; {len(presets[name].runs())} runs" in text


def test_importing_the_command_line_and_the_bench_loads_no_third_party_model_library():
    """torchao is imported only when its arm runs, Transformers only when a Transformers model is built."""
    code = textwrap.dedent("""
        import importlib, pkgutil, sys
        import skewadam.bench, skewadam.cli
        for m in pkgutil.iter_modules(skewadam.bench.__path__):
            importlib.import_module(f"skewadam.bench.{m.name}")
        skewadam.cli.build_parser()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torchao", "transformers"))
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-3000:]
