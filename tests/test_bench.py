"""`skewadam bench` as a user meets it (`skewadam.bench.run`, `config`, `report`): settings refused up front, a
run directory locked while in use, logs written atomically and damaged ones run again, runs that die with the bench,
optional packages found once before any run, the C++ kernel built before the first run, diverged runs flagged."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from skewadam.bench import run as bench_mod
from skewadam.bench import logs, report
from skewadam.bench.config import BenchConfig, RunConfig, config_hash, get_preset, run_identity
from skewadam.bench.run import BenchError, lock, preflight, run_bench
from skewadam.bench.train import train, write_json
from skewadam.cli import main

TINY = dict(model="tiny", steps=2, batch_size=2, eval_interval=1, eval_batches=1)


def _smoke(**kwargs) -> BenchConfig:
    return BenchConfig(base=get_preset("smoke").base, optimizers=("adamw",), **kwargs)


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value, says", [
    ("steps", 0, "steps (--steps) must be an integer >= 1, got 0"),
    ("steps", 2.5, "steps (--steps) must be an integer >= 1, got 2.5"),
    ("batch_size", -1, "batch_size (--batch-size) must be an integer >= 1"),
    ("block_size", 0, "block_size (--block-size) must be an integer >= 1"),
    ("eval_interval", 0, "eval_interval (--eval-interval) must be an integer >= 1"),
    ("eval_batches", 0, "eval_batches (--eval-batches) must be an integer >= 1"),
    ("threads", 0, "threads (--threads) must be an integer >= 1"),
    ("seed", -1, "seed must be an integer >= 0"),
    ("lr", 0.0, "lr (--lrs) must be a finite number > 0"),
    ("lr", float("nan"), "lr (--lrs) must be a finite number > 0"),
    ("weight_decay", -0.1, "weight_decay must be a finite number >= 0"),
    ("warmup_frac", 1.0, "warmup_frac (--warmup-frac) must be a finite number in [0, 1)"),
    ("grad_clip", -1.0, "grad_clip (--grad-clip) must be a finite number >= 0 (0 = off)"),
    ("grad_clip", float("inf"), "grad_clip (--grad-clip) must be a finite number"),
    ("device", "tpu", "device must be 'cpu' or 'cuda'"),
    ("model", "huge", "unknown model 'huge'"),
])
def test_every_run_setting_is_validated_with_a_message_naming_field_and_flag(field, value, says):
    with pytest.raises(ValueError) as e:
        RunConfig(**{field: value})
    assert says in str(e.value)


def test_a_bench_refuses_bad_lrs_seeds_and_jobs():
    for kwargs, says in (({"lrs": {"adamw": (-1e-3,)}}, "lr (--lrs) must be a finite number > 0"),
                         ({"lrs": {"adamw": ()}}, "no learning rate given for adamw"),
                         ({"seeds": 0}, "seeds (--seeds) must be an integer >= 1"),
                         ({"jobs": 0}, "jobs (--jobs) must be an integer >= 1")):
        with pytest.raises(ValueError) as e:
            BenchConfig(**kwargs)
        assert says in str(e.value)


def test_a_text_shorter_than_the_block_size_is_refused_before_any_run(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be")
    bench = BenchConfig(base=RunConfig(**{**TINY, "data": str(text), "block_size": 64}), optimizers=("adamw",))
    with pytest.raises(ValueError, match="shorter than block_size"):
        run_bench(bench, tmp_path / "out", progress=False, plots=False)
    assert not (tmp_path / "out").exists()


def test_the_bench_prints_the_tier_census_of_the_model_it_trains_before_any_run(tmp_path, monkeypatch):
    from skewadam.bench.models import MoETransformer, get_config
    from skewadam.groups import describe

    monkeypatch.setattr(bench_mod, "_run_all", lambda *args: [])
    lines: list[str] = []
    run_bench(_smoke(), tmp_path / "out", progress=False, plots=False, echo=lines.append)
    with torch.device("meta"):
        model = MoETransformer(get_config("tiny"))
    assert lines == [describe(model).table()] and lines[0].startswith("SkewAdam tiers of MoETransformer")


def test_a_users_folder_is_one_printed_line_counting_the_files_skipped_before_any_run(tmp_path, monkeypatch):
    for i in range(3):
        (tmp_path / f"m{i}.py").write_text("def f():\n    return 1\n" * 20)
    (tmp_path / "blob.pyc").write_bytes(b"\x00" * 64)
    bench = BenchConfig(base=RunConfig(**{**TINY, "data": str(tmp_path), "block_size": 16}), optimizers=("adamw",))
    monkeypatch.setattr(bench_mod, "_run_all", lambda *args: [])  # the runs are not what this test is about
    lines = []
    run_bench(bench, tmp_path / "out", progress=False, plots=False, echo=lines.append)
    assert lines[1:] == [f"--data {tmp_path}: 2 train docs (882 tokens), 1 val docs (440 tokens), byte vocabulary "
                         f"256; skipped 1 binary"]


# ------------------------------------------------------------------------------------------ optional packages
def _terminal(monkeypatch) -> None:
    """As if stderr were a terminal (progress bars are drawn only there)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def test_missing_optional_packages_are_found_once_before_any_run(monkeypatch, tmp_path):
    _terminal(monkeypatch)
    for module in ("tqdm", "matplotlib", "torchao"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    bench = BenchConfig(base=get_preset("smoke").base, optimizers=("adamw", "adamw8bit-torchao"))
    with pytest.raises(BenchError) as e:
        run_bench(bench, tmp_path / "out")
    message = str(e.value)
    assert message.count("missing optional package") == 1 and "pip install 'skewadam[bench]'" in message
    assert all(f"{m} (" in message for m in ("tqdm", "matplotlib", "torchao"))
    assert "--no-progress" in message and "--no-plots" in message and "adamw8bit-torchao arm" in message
    assert not (tmp_path / "out").exists()
    preflight(_smoke(), progress=False, plots=False)  # what it does not need, it does not ask for


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cuda", torch.bfloat16)])
def test_the_preflight_builds_the_model_on_the_runs_device_in_their_dtype(monkeypatch, device, dtype):
    """One model, built where and as the runs train it (a CUDA bench needs no host copy of it), one batch of one
    window through it. Without a GPU here, the CUDA bench's model is built on the CPU in its dtype (bf16), and
    its forward and backward run there."""
    from skewadam.bench import presets

    built, checked, real = [], [], (presets.bench_model, presets.check_trains)

    def bench_model(*args, device, dtype, **kwargs):
        built.append((device, dtype))
        return real[0](*args, device="cpu", dtype=dtype, **kwargs)

    def check_trains(model, origin):
        real[1](model, origin)
        checked.append({p.dtype for p in model.model.parameters()})

    monkeypatch.setattr(presets, "bench_model", bench_model)
    monkeypatch.setattr(presets, "check_trains", check_trains)
    base = dataclasses.replace(get_preset("smoke").base, device=device)
    preflight(BenchConfig(base=base, optimizers=("adamw",)), progress=False, plots=False)
    assert built == [(device, dtype)] and checked == [{dtype}]


def test_missing_packages_are_one_line_from_the_command(monkeypatch, tmp_path, capsys):
    _terminal(monkeypatch)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--preset", "smoke", "--out", str(tmp_path / "out")])
    assert str(e.value.code).startswith("skewadam bench: missing optional package(s): tqdm (progress bars")
    assert "\n" not in str(e.value.code)


def test_no_progress_bars_when_output_is_not_a_terminal(monkeypatch):
    """A bar only on a terminal and for one run at a time; a pipe or a file gets a line per evaluation (and needs
    no tqdm)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert [bench_mod._progress(True, jobs) for jobs in (1, 2)] == ["lines", "lines"]
    monkeypatch.setitem(sys.modules, "tqdm", None)
    preflight(_smoke(), progress=True, plots=False)  # tqdm not asked for
    _terminal(monkeypatch)
    assert [bench_mod._progress(True, jobs) for jobs in (1, 2)] == ["bar", "lines"]
    assert bench_mod._progress(False, 1) is None


# ---------------------------------------------------------------------------------------------------- locking
def test_a_run_directory_in_use_is_refused_in_one_line_and_free_again_after(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with lock(out):
        with pytest.raises(BenchError, match=r"is in use by another skewadam bench \(pid \d+, since"):
            run_bench(_smoke(), out, progress=False, plots=False)
        with pytest.raises(SystemExit) as e:
            main(["bench", "--preset", "smoke", "--optimizers", "adamw", "--out", str(out), "--no-progress"])
        assert "in use by another skewadam bench" in str(e.value.code) and "\n" not in str(e.value.code)
        assert not (out / "runs").exists()  # nothing was started
    with lock(out):  # released: a later bench takes it
        pass


def test_the_lock_is_held_by_another_process_while_a_bench_runs(tmp_path):
    """flock belongs to the open file: a second process sees it, and the kernel releases it when the holder dies."""
    out = tmp_path / "out"
    out.mkdir()
    code = ("import sys, time; from pathlib import Path; from skewadam.bench.run import lock\n"
            "with lock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(BenchError, match=f"pid {holder.pid}"):
            with lock(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    with lock(out):  # killed: the kernel dropped its lock
        pass


# --------------------------------------------------------------------------------------- atomic, damaged logs
def test_a_log_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "log.json"
    write_json(path, {"a": 1})

    def dies_midway(obj, f, **kwargs):
        f.write('{"a": 2, "b"')
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole
    monkeypatch.undo()
    write_json(path, {"a": math.inf})
    assert json.loads(path.read_text()) == {"a": math.inf}


def test_a_damaged_log_is_run_again_and_reported_by_name(tmp_path, capsys):
    out = tmp_path / "out"
    lines: list[str] = []
    assert run_bench(_smoke(), out, progress=False, plots=False, echo=lines.append) == []
    log = out / "runs" / "adamw_lr0.001_seed0.json"
    complete = log.read_text()
    log.write_text(complete[: len(complete) // 2])  # truncated, as by a crash of an older writer
    runs, skipped = logs.load_runs(out)
    assert runs == [] and len(skipped) == 1 and "adamw_lr0.001_seed0.json: not valid JSON" in skipped[0]
    lines.clear()
    assert run_bench(_smoke(), out, progress=False, plots=False, echo=lines.append) == []
    assert any("adamw_lr0.001_seed0: damaged log" in line and "running it again" in line for line in lines)
    assert logs.read_log(log)["summary"]["best_val_ppl"] > 0  # complete again
    lines.clear()
    run_bench(_smoke(), out, progress=False, plots=False, echo=lines.append)
    assert any("done earlier, skipped" in line for line in lines)


def test_the_report_gives_each_optimizers_share_of_the_step_and_its_newton_schulz_flops(two_seeds, tmp_path):
    """The share is measured (the step's time over the training step's, summed after the first 2 steps); FLOPs come
    from the log (`orthogonal_flops` at the run's settings): n/a where a log predates them or a run has no step
    after the warm-up."""
    out = _copy(two_seeds, tmp_path / "out")
    for seed in (0, 1):
        _edit(out / "runs" / f"adamw_lr0.001_seed{seed}.json", lambda log: log.update(steps=[
            {"step": i, "loss": 1.0, "balance_loss": 0.1, "step_time_s": 1.0, "opt_time_s": 0.2 + 0.1 * (i > 2)}
            for i in range(1, 7)]) or log["summary"].update(newton_schulz_flops=1.5e9))
    header, rule, row = report.results_table(report.summarize(logs.load_runs(out)[0])).splitlines()
    cells = dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    assert cells["opt share"] == "30%" and cells["NS FLOPs"] == "1.5e+09"  # no ratio to itself: no "(1.00x)"
    _edit(out / "runs" / "adamw_lr0.001_seed1.json", lambda log: log["summary"].pop("newton_schulz_flops"))
    _edit(out / "runs" / "adamw_lr0.001_seed0.json", lambda log: log.update(steps=log["steps"][:2]))
    text = report.render(out, plots=False)
    assert "| n/a | n/a |" in text and "skipped" not in text


# ------------------------------------------------------------------------------- logs by schema and identity
@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory) -> Path:
    """A finished smoke bench of AdamW with seeds 0 and 1 (copied by each test that edits it)."""
    out = tmp_path_factory.mktemp("bench") / "out"
    assert run_bench(_smoke(seeds=2), out, progress=False, plots=False) == []
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, edit) -> None:
    log = json.loads(path.read_text())
    edit(log)
    path.write_text(json.dumps(log))


def _resume(out: Path) -> list[str]:
    lines: list[str] = []
    assert run_bench(_smoke(seeds=2), out, progress=False, plots=False, echo=lines.append) == []
    return [line for line in lines if "running it again" in line or "done earlier" in line]


def test_a_log_with_null_or_wrong_typed_values_is_run_again_saying_why(two_seeds, tmp_path):
    out = _copy(two_seeds, tmp_path / "out")
    seed1 = out / "runs" / "adamw_lr0.001_seed1.json"
    _edit(seed1, lambda log: log["summary"].update(best_val_ppl=None))
    runs, skipped = logs.load_runs(out)  # the report lists it and counts the rest
    assert [r["name"] for r in runs] == ["adamw_lr0.001_seed0"]
    assert skipped == [f"{seed1}: not a complete log (summary.best_val_ppl is null, not a number)"]
    text = report.render(out, plots=False)
    assert "**1 run log(s) skipped**" in text and "summary.best_val_ppl is null" in text
    _edit(seed1, lambda log: log["summary"].update(best_val_ppl=1.5) or log["evals"][0].update(step="0"))
    assert "evals[0].step is \"0\", not an integer" in logs.load_runs(out)[1][0]
    assert _resume(out) == [
        "[1/2] adamw_lr0.001_seed0: done earlier, skipped",
        f"[2/2] adamw_lr0.001_seed1: damaged log ({seed1}: not a complete log (evals[0].step is \"0\", not an "
        f"integer)); running it again"]
    assert len(logs.load_runs(out)[0]) == 2


def test_a_log_of_another_run_is_run_again_saying_whose_it_is(two_seeds, tmp_path):
    out = _copy(two_seeds, tmp_path / "out")
    runs_dir = out / "runs"
    (runs_dir / "adamw_lr0.001_seed1.json").write_text((runs_dir / "adamw_lr0.001_seed0.json").read_text())
    runs, skipped = logs.load_runs(out)  # not two copies of seed 0 in the table
    assert [r["config"]["seed"] for r in runs] == [0]
    assert skipped == [f"{runs_dir / 'adamw_lr0.001_seed1.json'}: it is the log of adamw_lr0.001_seed0, not of "
                       f"adamw_lr0.001_seed1"]
    assert "| adamw | 0.001 | 1 |" in report.render(out, plots=False)
    assert _resume(out)[1] == ("[2/2] adamw_lr0.001_seed1: its log is not this run's: it is the log of "
                               "adamw_lr0.001_seed0, not of adamw_lr0.001_seed1; running it again")


def test_a_log_of_other_settings_is_run_again_naming_them(two_seeds, tmp_path):
    out = _copy(two_seeds, tmp_path / "out")
    seed1 = out / "runs" / "adamw_lr0.001_seed1.json"
    _edit(seed1, lambda log: log["config"].update(steps=3))
    assert _resume(_copy(out, tmp_path / "edited"))[1] == (
        "[2/2] adamw_lr0.001_seed1: its log is not this run's: its config hash does not match its config (edited?); "
        "running it again")
    _edit(seed1, lambda log: log.pop("config_hash"))  # as a log written before the hash was
    assert "it ran other settings (steps: 3 there, 2 now)" in logs.load_runs(out)[1][0]
    assert _resume(out)[1] == ("[2/2] adamw_lr0.001_seed1: its log is not this run's: it ran other settings (steps: "
                               "3 there, 2 now); running it again")


def _paths(schema, prefix=()):
    """Every key path of `LOG_SCHEMA`, lists by their first item."""
    if isinstance(schema, dict):
        for key, sub in schema.items():
            yield (*prefix, key)
            yield from _paths(sub, (*prefix, key))
    elif isinstance(schema, list):
        yield from _paths(schema[0], (*prefix, 0))


@pytest.mark.parametrize("value", [None, "x", [], True, "delete"])
def test_the_report_never_crashes_on_a_log(two_seeds, tmp_path, value):
    """Any value of any key the report reads (null, a string, a list, a bool, or none at all): the log is listed and
    skipped unless the value is valid there, the other is rendered, nothing raises (plots drawn for null)."""
    out = _copy(two_seeds, tmp_path / "out")
    seed1 = out / "runs" / "adamw_lr0.001_seed1.json"
    good = json.loads(seed1.read_text())
    for path in _paths(logs.LOG_SCHEMA):
        log = json.loads(json.dumps(good))
        parent = log
        for key in path[:-1]:
            parent = parent[key]
        if value == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        seed1.write_text(json.dumps(log))
        runs, skipped = logs.load_runs(out)
        assert runs[0]["name"] == "adamw_lr0.001_seed0" and len(runs) + len(skipped) == 2, path
        if logs.schema_problem(log):
            assert len(skipped) == 1 and str(seed1) in skipped[0], path
        text = report.render(out, plots=value is None)
        assert ("skipped" in text) == bool(skipped), path


def test_the_config_hash_covers_every_setting_but_threads():
    cfg = RunConfig(**TINY)
    base = run_identity(cfg)
    changed = {"optimizer": "adafactor", "lr": 0.5, "weight_decay": 0.5, "seed": 3, "model": "cpu", "data": "x",
               "steps": 9, "batch_size": 9, "block_size": 9, "eval_interval": 9, "eval_batches": 9,
               "warmup_frac": 0.5, "grad_clip": 0.5, "device": "cuda", "overrides": {"n_layer": 4}}
    assert set(changed) | {"threads"} == set(base)  # every setting is tried
    for key, value in changed.items():
        assert config_hash({**base, key: value}) != config_hash(base), key
    assert config_hash({**base, "threads": 7}) == config_hash(base)
    for key in ("eval_batches", "overrides"):  # a log written before a setting existed: its default
        older = {k: v for k, v in base.items() if k != key}
        assert config_hash(older) == config_hash({**base, key: getattr(RunConfig(), key)}), key


# ---------------------------------------------------------------------------------------- dies with the bench
def _children(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and "skewadam.bench.train" in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_dies_with_its_bench_even_when_the_bench_is_killed(tmp_path):
    """SIGKILL leaves the bench no chance to clean up: the kernel kills the run (PR_SET_PDEATHSIG), or, killed before
    the run armed that, the run sees it was orphaned and exits."""
    out = tmp_path / "out"
    bench = subprocess.Popen([sys.executable, "-m", "skewadam", "bench", "--preset", "smoke", "--steps", "1000000",
                              "--optimizers", "adamw", "--out", str(out), "--no-progress", "--no-plots"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not _children(str(out)):  # the run's process has started
            assert bench.poll() is None and time.monotonic() < deadline, "the bench ended or never started its run"
            time.sleep(0.5)
        time.sleep(5)  # most often it is training by now; either way the contract holds
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait()
    deadline = time.monotonic() + 120  # generous: an orphan still importing torch on a loaded machine
    while _children(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _children(str(out)), "the run outlived its killed bench"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
def test_ctrl_c_stops_every_run_and_prints_one_line(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the foreground process group): the runs, in their own process groups, get
    none; the bench stops them and says in one line how to resume, with no traceback and no "FAILED" line."""
    import os

    out = tmp_path / "out"
    bench = subprocess.Popen([sys.executable, "-m", "skewadam", "bench", "--preset", "smoke", "--steps", "1000000",
                              "--optimizers", "adamw,skewadam", "--jobs", "2", "--out", str(out), "--no-progress",
                              "--no-plots"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True,  # a group of its own, as a shell's foreground job has
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while len(_children(str(out))) < 2:
            assert bench.poll() is None and time.monotonic() < deadline, "the bench ended or never started its runs"
            time.sleep(0.5)
        time.sleep(3)
        os.killpg(bench.pid, signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 130, stderr
    assert stderr.strip().splitlines() == [f"interrupted; finished runs are kept. Resume with the same command and "
                                           f"--out {out}"], stderr
    assert "Traceback" not in stdout and "FAILED" not in stdout, stdout
    deadline = time.monotonic() + 60
    while _children(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _children(str(out)), "a run outlived the interrupted bench"


def test_a_damaged_bench_json_says_how_to_resume_past_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.json").write_text('{"base": {')
    with pytest.raises(ValueError, match=r"bench.json: not valid JSON .*It records the settings the runs in .* share: "
                                         r"to resume past it, delete it"):
        run_bench(_smoke(), out, progress=False, plots=False)
    assert not (out / "runs").exists() or not any((out / "runs").iterdir())
    (out / "bench.json").unlink()  # as it says: the bench writes it again
    assert bench_mod._check_resume(out, _smoke()) == ["adamw"]


# -------------------------------------------------------------------------------------- the kernel, built first
class _Failed:
    """A run's process that failed at once (what `subprocess.Popen` returns, as far as the bench uses it)."""

    def wait(self) -> int:
        return 1


def test_the_bench_builds_the_cpp_kernel_before_its_first_run_and_only_when_needed(tmp_path, monkeypatch):
    from skewadam import kernels
    from skewadam.kernels import cpu

    calls = []
    monkeypatch.setattr(cpu, "built", lambda: False)
    monkeypatch.setattr(kernels, "resolve_backend", lambda impl, device: calls.append((impl, device.type)))
    monkeypatch.setattr(bench_mod.subprocess, "Popen", lambda *a, **k: calls.append("run") or _Failed())
    monkeypatch.delenv("SKEWADAM_IMPL", raising=False)
    run_bench(BenchConfig(base=get_preset("smoke").base, optimizers=("adamw", "skewadam")), tmp_path / "a",
              progress=False, plots=False)
    assert calls == [("auto", "cpu"), "run", "run"]  # built (announced by the kernel) before the first run
    calls.clear()
    run_bench(_smoke(), tmp_path / "b", progress=False, plots=False)  # no SkewAdam arm: nothing built
    assert calls == ["run"]


# ------------------------------------------------------------------------------------------------- divergence
def test_a_diverged_run_is_flagged_in_the_table_the_report_and_the_summary_line(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("adamw", "skewadam"):
        log = train(RunConfig(optimizer=name, **TINY), progress=None)
        if name == "skewadam":  # as `--grad-clip -1` did: the model ends far worse than it started
            log["summary"]["final_val_ppl"] = 40_893.0
        write_json(runs / f"{log['name']}.json", log)
    runs, _ = logs.load_runs(tmp_path)
    assert report.divergence(runs[0]) is None
    assert report.divergence(runs[1]).startswith("final val ppl 40,893.0 is ")
    text = report.render(tmp_path, plots=False)
    assert "| skewadam | 0.001 | 1 (1 diverged) |" in text
    assert "**1 run(s) diverged**" in text and "skewadam_lr0.001_seed0: final val ppl 40,893.0" in text
    nan = dict(runs[0], summary={**runs[0]["summary"], "diverged": True})
    assert report.divergence(nan).startswith("non-finite loss at step")


def test_a_run_diverging_past_floats_range_is_flagged_by_the_command_not_failed(tmp_path, capsys):
    """lr 100 blows AdamW up within 4 steps: whether the loss turns non-finite or a validation loss passes
    float64's exp range (once an OverflowError that failed the run), the run is kept and flagged on every line."""
    out = tmp_path / "out"
    assert main(["bench", "--preset", "smoke", "--optimizers", "adamw", "--lrs", "100", "--steps", "4", "--out",
                 str(out), "--no-progress", "--no-plots"]) == 0
    stdout, stderr = capsys.readouterr()
    assert re.search(r"\[1/1\] adamw_lr100_seed0: best val ppl [\d.]+, \d+ s; DIVERGED: ", stdout)
    assert "| adamw | 100 | 1 (1 diverged) |" in stdout and "**1 run(s) diverged**" in stdout
    assert "1 run(s) diverged: adamw_lr100_seed0 (" in stderr and "failed" not in stderr


# ------------------------------------------------------------------------------------------------------- layout
def _bench_modules() -> list[Path]:
    import skewadam.bench

    return sorted(Path(skewadam.bench.__file__).parent.glob("*.py"))


def test_each_bench_module_imports_only_those_listed_above_it_in_the_package_docstring():
    """The order `skewadam.bench`'s docstring lists (the planner above the arms, the arms above no optimizer at module
    level): every module-level import of a bench module names one listed before it."""
    import ast

    import skewadam.bench

    order = re.findall(r"^(\w+)\.py\s", skewadam.bench.__doc__, re.M)
    assert sorted(order) == sorted(p.stem for p in _bench_modules() if p.stem != "__init__")
    wrong = []
    for path in _bench_modules():
        for node in ast.parse(path.read_text()).body:  # module level only: builders import lazily
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                wrong += [f"{path.stem} imports {n}" for n in names if path.stem != "__init__"
                          and order.index(n.split(".")[0]) >= order.index(path.stem)]
            if isinstance(node, ast.ImportFrom) and node.level == 2 and path.stem in ("arms", "planner"):
                if (node.module or "").split(".")[0] in ("optimizer", "functional") or \
                        (node.module or "").startswith("kernels."):
                    wrong.append(f"{path.stem} imports ..{node.module} at module level")
    assert not wrong, wrong


def test_no_kernel_name_is_spelled_outside_the_kernels_package():
    """The bench and the command line ask `skewadam.kernels.BACKENDS` / `resolve`; no backend's name is a literal."""
    import ast

    from skewadam.kernels import BACKENDS

    sources = [*_bench_modules(), Path(main.__code__.co_filename)]
    found = [f"{p.name}:{n.lineno} {n.value!r}" for p in sources for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Constant) and n.value in BACKENDS]
    assert not found, found


def test_the_memory_plot_sets_the_full_size_plan_beside_the_measured_peaks(two_seeds, tmp_path):
    """At the bench's size activations dominate the measured peak; the plot adds the planner's peaks of the full-size
    model (the paper's 6.78B for the reference presets, a Transformers config unscaled), where the state matters."""
    from skewadam.bench.planner import plan
    from skewadam.bench.report import FULL_SIZE_PLAN, full_size_peaks

    (what, peaks), why = full_size_peaks("tiny", ["adamw", "skewadam", "adamw8bit-bnb"])
    expected = plan("paper-6.78b", optimizers=["adamw", "skewadam", "adamw8bit-bnb"], **FULL_SIZE_PLAN)
    assert why == "" and what.startswith("paper-6.78b (6.78B), bf16") and peaks == {
        o: row.peak for o, row in expected.optimizers.items()}
    assert peaks["skewadam"] < peaks["adamw"] / 3
    assert full_size_peaks("tiny", ["lion"]) == (None, "no optimizer of this bench has a memory model")
    if importlib.util.find_spec("transformers"):  # a Transformers bench plans its config without the bench's --set
        assert full_size_peaks("mixtral-8x7b", ["adamw"])[0][0].startswith("mixtral-8x7b (46.70B), bf16")
    out = _copy(two_seeds, tmp_path / "out")
    report.render(out, plots=True)
    assert (out / "memory.png").stat().st_size > 10_000
