"""``skewadam bench``: train the reference MoE with each optimizer, side by side, and report memory and quality.

Each (optimizer, lr, seed) run is a fresh Python process (`skewadam.harness.train`), so its peak RSS is its own; runs
with the same seed start from the same weights and see the same batches. Logs go to ``OUT/runs/<run>.json``; a run
whose log exists is skipped, so re-running the same command with the same ``--out`` resumes an interrupted bench (or
a study: ``--preset study``). ``--jobs N`` runs N at a time. At the end ``OUT/results.md`` and the plots are written
(`skewadam.harness.report`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from .config import PER_RUN_FIELDS, BenchConfig, RunConfig, run_name

__all__ = ["run_bench"]


def _identity(cfg: RunConfig) -> dict:
    """The RunConfig fields every run of one bench directory must share."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_RUN_FIELDS}


def _check_resume(out: Path, bench: BenchConfig) -> list[str]:
    """Create or validate ``out/bench.json``; return the optimizer order for the report (old runs' first)."""
    path = out / "bench.json"
    identity = _identity(bench.base)
    order = list(bench.optimizers)
    if path.exists():
        saved = json.loads(path.read_text())
        diff = {k: (saved["base"].get(k), v) for k, v in identity.items() if saved["base"].get(k) != v}
        if diff:
            changes = ", ".join(f"{k}: {a!r} there vs {b!r} now" for k, (a, b) in diff.items())
            raise ValueError(f"{out} holds runs of a different setup ({changes}); use another --out, or the same "
                             f"settings to resume")
        order = list(dict.fromkeys(saved["optimizers"] + order))
    path.write_text(json.dumps({"base": identity, "optimizers": order}, indent=1))
    return order


def _child_env() -> dict[str, str]:
    """The runs' environment: OpenMP workers sleep instead of spinning while they wait (unless the user chose).
    Measured on 2 shared cores (cpu model, 2 threads): spinning workers made some steps 10-25x slower (1.6-3.2 s
    instead of 0.12-0.3 s) whenever another process took a core; sleeping ones stayed within 0.15-0.31 s."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _quiet(line: str) -> None:
    pass


def run_bench(bench: BenchConfig, out: Path, *, tensorboard: Optional[str] = None, progress: bool = True,
              jobs: int = 1, echo: Callable[[str], None] = _quiet) -> list[str]:
    """Run every missing run of ``bench`` into ``out`` (one subprocess each, ``jobs`` at a time; a run's child
    prints its own progress bar unless ``progress`` is off), reporting each run's outcome to ``echo``. Returns the
    names of the runs that failed. The table and plots are `skewadam.harness.report.render`'s."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    (out / "jobs").mkdir(exist_ok=True)
    _check_resume(out, bench)
    runs = bench.runs()
    echo(f"skewadam bench: {len(runs)} runs into {out}" + (f", {jobs} at a time" if jobs > 1 else ""))
    todo = []
    for i, cfg in enumerate(runs, 1):
        if (out / "runs" / f"{run_name(cfg)}.json").exists():
            echo(f"[{i}/{len(runs)}] {run_name(cfg)}: done earlier, skipped")
        else:
            todo.append((i, cfg))

    def one(i: int, cfg: RunConfig) -> Optional[str]:
        """Run one config in a fresh process; its name if it failed."""
        name = run_name(cfg)
        log_path = out / "runs" / f"{name}.json"
        job = out / "jobs" / f"{name}.json"
        job.write_text(json.dumps({"config": dataclasses.asdict(cfg), "log_path": str(log_path.resolve()),
                                   "tensorboard": tensorboard, "progress": progress and jobs == 1}, indent=1))
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "skewadam.harness.train", str(job)], env=_child_env()).returncode
        if rc != 0 or not log_path.exists():
            echo(f"[{i}/{len(runs)}] {name}: FAILED (exit code {rc}); see the output above")
            return name
        summary = json.loads(log_path.read_text())["summary"]
        echo(f"[{i}/{len(runs)}] {name}: best val ppl {summary['best_val_ppl']:.3f}, "
             f"{time.perf_counter() - t0:.0f} s")
        return None

    with ThreadPoolExecutor(jobs) as pool:
        return [name for name in pool.map(lambda a: one(*a), todo) if name]
