"""``skewadam bench``: train the reference MoE with each optimizer, side by side, and report memory and quality.

Each (optimizer, lr, seed) run is a fresh Python process (`skewadam.harness.train`), so its peak RSS is its own; runs
with the same seed start from the same weights and see the same batches. Logs go to ``OUT/runs/<run>.json``; a run
whose log exists is skipped, so re-running the same command with the same ``--out`` resumes an interrupted bench (or
a study: ``--preset study``). ``--jobs N`` runs N at a time. At the end ``OUT/results.md`` and the plots are written
(`skewadam.harness.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from .config import PER_RUN_FIELDS, PRESETS, BenchConfig, RunConfig, get_preset, run_name
from .optimizers import DEFAULT_OPTIMIZERS, OPTIMIZERS

__all__ = ["register_cli", "run_bench", "parse_optimizers", "parse_lrs"]

# flag -> RunConfig field, for the flags that override the preset's shared settings
_RUN_FLAGS = ("model", "data", "steps", "batch_size", "block_size", "eval_interval", "eval_batches", "warmup_frac",
              "grad_clip", "device", "threads")


def parse_optimizers(text: str) -> tuple[str, ...]:
    """``"adamw,skewadam-add"`` -> names; ``all`` = every optimizer, ``default`` = the default five."""
    names: list[str] = []
    for token in text.replace(" ", ",").split(","):
        if token == "all":
            names += OPTIMIZERS
        elif token == "default":
            names += DEFAULT_OPTIMIZERS
        elif token:
            if token not in OPTIMIZERS:
                raise ValueError(f"unknown optimizer {token!r} in --optimizers: use any of {', '.join(OPTIMIZERS)}, "
                                 f"'default' or 'all'")
            names.append(token)
    return tuple(dict.fromkeys(names))


def parse_lrs(specs: list[str], optimizers: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """``--lrs`` specs -> lrs per optimizer. A spec is ``1e-4,3e-4`` (every optimizer), ``NAME=1e-4,3e-4`` (one),
    or ``x0.3,x1,x3`` (multiples of each optimizer's default lr). Later specs override earlier ones."""
    out: dict[str, tuple[float, ...]] = {}
    for spec in specs:
        name, _, values = spec.rpartition("=")
        if name and name not in OPTIMIZERS:
            raise ValueError(f"--lrs {spec!r}: unknown optimizer {name!r}; use any of {', '.join(OPTIMIZERS)}")
        for opt in [name] if name else optimizers:
            try:
                lrs = tuple(OPTIMIZERS[opt].lr * float(v[1:]) if v.startswith("x") else float(v)
                            for v in values.split(",") if v)
            except ValueError:
                raise ValueError(f"--lrs {spec!r}: expected numbers like 1e-4,3e-4 or multipliers like x0.3,x1,x3")
            if not lrs or any(lr <= 0 for lr in lrs):
                raise ValueError(f"--lrs {spec!r}: learning rates must be positive")
            out[opt] = lrs
    return out


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
            raise SystemExit(f"{out} holds runs of a different setup ({changes}); use another --out, or the same "
                             f"settings to resume")
        order = list(dict.fromkeys(saved["optimizers"] + order))
    path.write_text(json.dumps({"base": identity, "optimizers": order}, indent=1))
    return order


def _child_env() -> dict[str, str]:
    """The runs' environment: OpenMP workers sleep instead of spinning while they wait (unless the user chose).
    Measured on 2 shared cores (cpu model, 2 threads): spinning workers made some steps 10-25x slower (1.6-3.2 s
    instead of 0.12-0.3 s) whenever another process took a core; sleeping ones stayed within 0.15-0.31 s."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def run_bench(bench: BenchConfig, out: Path, *, tensorboard: Optional[str] = None, progress: bool = True,
              plots: bool = True, jobs: int = 1) -> int:
    """Run every missing run of ``bench`` into ``out`` (one subprocess each, ``jobs`` at a time), then render the
    report. Returns the number of failed runs."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    (out / "jobs").mkdir(exist_ok=True)
    _check_resume(out, bench)
    runs = bench.runs()
    print(f"skewadam bench: {len(runs)} runs into {out}" + (f", {jobs} at a time" if jobs > 1 else ""), flush=True)
    todo = []
    for i, cfg in enumerate(runs, 1):
        if (out / "runs" / f"{run_name(cfg)}.json").exists():
            print(f"[{i}/{len(runs)}] {run_name(cfg)}: done earlier, skipped", flush=True)
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
            print(f"[{i}/{len(runs)}] {name}: FAILED (exit code {rc}); see the output above", flush=True)
            return name
        summary = json.loads(log_path.read_text())["summary"]
        print(f"[{i}/{len(runs)}] {name}: best val ppl {summary['best_val_ppl']:.3f}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        return None

    try:
        with ThreadPoolExecutor(jobs) as pool:
            failed = [name for name in pool.map(lambda a: one(*a), todo) if name]
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished runs are kept. Resume with the same command and --out {out}", file=sys.stderr)
        raise
    from .report import render

    if any((out / "runs").glob("*.json")):
        print()
        print(render(out, plots=plots))
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return len(failed)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="compare optimizers training the reference MoE (memory, speed, quality), with plots",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="optimizers: " + ", ".join(OPTIMIZERS) + "\npresets: " + ", ".join(
            f"{k} ({v.__doc__.splitlines()[0].rstrip('.')})" for k, v in PRESETS.items()))
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="starting settings (default: default)")
    p.add_argument("--optimizers", metavar="LIST",
                   help="comma-separated names, 'default' or 'all' (default: " + ",".join(DEFAULT_OPTIMIZERS) + ")")
    p.add_argument("--lrs", nargs="+", metavar="SPEC", default=[],
                   help="learning rates: '1e-4,3e-4' (all), 'adamw=1e-4,3e-4' (one) or 'x0.3,x1,x3' (multiples "
                        "of each default)")
    p.add_argument("--seeds", type=int, help="repeat each run with seeds 0..N-1 (default 1)")
    p.add_argument("--model", help="model preset of skewadam.models: tiny, cpu, paper-6.78b (default: cpu)")
    p.add_argument("--data", help="text file or folder of text files (default: the embedded Shakespeare)")
    base = RunConfig()
    for flag, kind, what in (("steps", int, "training steps"), ("batch-size", int, "sequences per step"),
                             ("block-size", int, "tokens per sequence (default: the model's)"),
                             ("eval-interval", int, "steps between evaluations"),
                             ("eval-batches", int, "fixed validation batches"),
                             ("warmup-frac", float, "linear warm-up fraction of the steps, then cosine to 0"),
                             ("grad-clip", float, "max global grad norm, 0 = off")):
        default = getattr(base, flag.replace("-", "_"))
        p.add_argument(f"--{flag}", type=kind, help=what + ("" if default is None else f" (default: {default})"))
    p.add_argument("--device", choices=("cpu", "cuda"), help="cuda: bf16 weights (default cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads per run (default: torch's)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, each its own process (default 1; with N > 1 timings share the CPU: set "
                        "--threads so that jobs x threads <= cores)")
    p.add_argument("--out", type=Path, help="run directory; an existing one is resumed (default: "
                                            "bench-runs/<date-time>)")
    p.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard event files under DIR")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    try:
        bench = get_preset(args.preset)
        overrides = {f: getattr(args, f) for f in _RUN_FLAGS if getattr(args, f) is not None}
        base = dataclasses.replace(bench.base, **overrides)
        optimizers = parse_optimizers(args.optimizers) if args.optimizers else bench.optimizers
        lrs = {**{k: v for k, v in bench.lrs.items() if k in optimizers}, **parse_lrs(args.lrs, optimizers)}
        bench = BenchConfig(base=base, optimizers=optimizers, lrs=lrs,
                            seeds=args.seeds if args.seeds is not None else bench.seeds)
    except ValueError as e:
        raise SystemExit(f"skewadam bench: {e}")
    if args.jobs < 1:
        raise SystemExit(f"skewadam bench: --jobs must be >= 1, got {args.jobs}")
    out = args.out or Path("bench-runs") / time.strftime("%Y%m%d-%H%M%S")
    return 1 if run_bench(bench, out, tensorboard=args.tensorboard, progress=not args.no_progress,
                          plots=not args.no_plots, jobs=args.jobs) else 0
