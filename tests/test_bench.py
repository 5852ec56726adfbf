"""`skewadam bench` as a user meets it (`skewadam.harness.bench`, `config`, `report`): settings refused up front, a
run directory locked while in use, logs written atomically and damaged ones run again, runs that die with the bench,
optional packages found once before any run, the C++ kernel built before the first run, diverged runs flagged."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skewadam.cli import main
from skewadam.harness import bench as bench_mod
from skewadam.harness import report
from skewadam.harness.bench import BenchError, lock, preflight, run_bench
from skewadam.harness.config import BenchConfig, RunConfig, get_preset
from skewadam.harness.train import train, write_json

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


def test_a_users_folder_is_one_printed_line_counting_the_files_skipped_before_any_run(tmp_path, monkeypatch):
    for i in range(3):
        (tmp_path / f"m{i}.py").write_text("def f():\n    return 1\n" * 20)
    (tmp_path / "blob.pyc").write_bytes(b"\x00" * 64)
    bench = BenchConfig(base=RunConfig(**{**TINY, "data": str(tmp_path), "block_size": 16}), optimizers=("adamw",))
    monkeypatch.setattr(bench_mod, "_run_all", lambda *args: [])  # the runs are not what this test is about
    lines = []
    run_bench(bench, tmp_path / "out", progress=False, plots=False, echo=lines.append)
    assert lines == [f"--data {tmp_path}: 2 train docs (882 tokens), 1 val docs (440 tokens), byte vocabulary 256; "
                     f"skipped 1 binary"]


# ------------------------------------------------------------------------------------------ optional packages
def test_missing_optional_packages_are_found_once_before_any_run(monkeypatch, tmp_path):
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


def test_missing_packages_are_one_line_from_the_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--preset", "smoke", "--out", str(tmp_path / "out")])
    assert str(e.value.code).startswith("skewadam bench: missing optional package(s): tqdm (progress bars")
    assert "\n" not in str(e.value.code)


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
    code = ("import sys, time; from pathlib import Path; from skewadam.harness.bench import lock\n"
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
    with pytest.raises(ValueError, match=r"adamw_lr0.001_seed0.json: not valid JSON"):
        report.load_runs(out)
    lines.clear()
    assert run_bench(_smoke(), out, progress=False, plots=False, echo=lines.append) == []
    assert any("adamw_lr0.001_seed0: damaged log" in line and "running it again" in line for line in lines)
    assert report.read_log(log)["summary"]["best_val_ppl"] > 0  # complete again
    lines.clear()
    run_bench(_smoke(), out, progress=False, plots=False, echo=lines.append)
    assert any("done earlier, skipped" in line for line in lines)


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
        if marker in cmdline and "skewadam.harness.train" in cmdline and state != "Z":
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


# -------------------------------------------------------------------------------------- the kernel, built first
def test_the_bench_builds_the_cpp_kernel_before_its_first_run_and_only_when_needed(tmp_path, monkeypatch):
    from skewadam import kernels
    from skewadam.kernels import cpu

    calls = []
    monkeypatch.setattr(cpu, "built", lambda: False)
    monkeypatch.setattr(kernels, "select", lambda impl, device: calls.append((impl, device.type)))
    monkeypatch.setattr(bench_mod.subprocess, "run", lambda *a, **k: calls.append("run") or
                        subprocess.CompletedProcess(a, 1))
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
    logs = report.load_runs(tmp_path)
    assert report.divergence(logs[0]) is None
    assert report.divergence(logs[1]).startswith("final val ppl 40,893.0 is ")
    text = report.render(tmp_path, plots=False)
    assert "| skewadam | 0.001 | 1 (1 diverged) |" in text
    assert "**1 run(s) diverged**" in text and "skewadam_lr0.001_seed0: final val ppl 40,893.0" in text
    nan = dict(logs[0], summary={**logs[0]["summary"], "diverged": True})
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
