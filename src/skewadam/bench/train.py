"""One benchmark training run: an MoE (the reference model, or a Transformers config: `presets.bench_model`) on a
corpus with one optimizer, logged to one JSON file.

`skewadam bench` runs each of these in a fresh process (``python -m skewadam.bench.train RUN.json``) so that
the peak RSS it reports belongs to that optimizer alone. Same seed => same initial weights (checked by
``init_checksum`` in the log), same batches in the same order, same router noise, whatever the optimizer.

The log (``RunConfig`` fields, then per-step and per-eval records, then a summary) is written atomically at the end
(`write_json`); a complete log marks the run finished, which is how an interrupted bench resumes. A run started by
`skewadam bench` dies with it (`die_with_parent`), so a killed bench leaves no run behind.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..classify import classify
from ..groups import orthogonal_flops
from ..state import measure_state
from . import arms
from .config import RunConfig, config_hash, run_identity, run_name
from .data import eval_batches, get_batch, load_corpus
from .measure import peak_rss
from .presets import bench_model, lm_losses

__all__ = ["train", "lr_factor", "evaluate", "main", "write_json", "die_with_parent"]


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically: a temporary file, flushed to disk, then renamed over ``path``; a reader,
    or a rerun after a crash, sees the old file or the new one, never a part of one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process (SIGKILL) when its parent ends, however it ends (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing), and exit now if the parent ``parent_pid`` already ended before this ran."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return  # not permitted here: the run just lives on, as before
    if os.getppid() != parent_pid:  # reparented: the bench is gone
        os._exit(1)


def lr_factor(step: int, steps: int, warmup_frac: float) -> float:
    """Multiplier of the base lr at 0-based ``step``: linear warm-up over ``ceil(warmup_frac*steps)`` steps
    (``(step+1)/warmup``), then cosine from 1 to 0 over the remaining steps."""
    warmup = math.ceil(warmup_frac * steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_MAX_LOG = math.log(sys.float_info.max)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list) -> dict[str, float]:
    """Mean LM loss and balance loss over the fixed validation batches (eval mode: no router noise); the perplexity
    of a loss past float64's range (a diverging run) is inf, for the report to flag, not an OverflowError."""
    model.eval()
    lm, bal = [], []
    for x, y in batches:
        out = lm_losses(model, x, y)
        lm.append(out.lm_loss.item())
        bal.append(out.balance_loss.item())
    model.train()
    val_loss = sum(lm) / len(lm)
    return {"val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss < _MAX_LOG else math.inf,
            "val_balance_loss": sum(bal) / len(bal)}


def _set_lr(optimizer, base_lrs: list[float], factor: float) -> None:
    for group, base in zip(optimizer.param_groups, base_lrs):
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr a tensor (no recompile per value)
            group["lr"].fill_(base * factor)
        else:
            group["lr"] = base * factor


def _train_step(model, optimizer, x, y, grad_clip: float, device: torch.device) -> dict[str, float]:
    """Forward, backward, clip, step; the losses, grad norm and timings (``opt_time_s``: the step alone)."""
    t0 = time.perf_counter()
    out = lm_losses(model, x, y)
    out.loss.backward()
    if getattr(optimizer, "in_backward", False):  # its gradients were stepped and freed: none to measure
        grad_norm = torch.tensor(math.nan)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    _sync(device)
    t1 = time.perf_counter()
    optimizer.step()
    _sync(device)
    t2 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": out.loss.item(), "lm_loss": out.lm_loss.item(), "balance_loss": out.balance_loss.item(),
            "z_loss": out.z_loss.item(), "grad_norm": grad_norm.item(), "step_time_s": t2 - t0, "opt_time_s": t2 - t1}


class _Monitor:
    """Where a run reports as it goes: a progress bar (tqdm) and TensorBoard event files, each optional."""

    def __init__(self, name: str, steps: int, tensorboard: Optional[str], progress: Optional[str]) -> None:
        self.writer = self.bar = None
        self.name, self.steps, self.lines, self.t0 = name, steps, progress == "lines", time.perf_counter()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SystemExit("--tensorboard needs the tensorboard package: pip install 'skewadam[tensorboard]'")
            self.writer = SummaryWriter(os.path.join(tensorboard, name))
        if progress == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=name, file=sys.stderr, dynamic_ncols=True, leave=True)

    def eval(self, ev: dict[str, Any]) -> None:
        if self.writer:
            for k in ("val_loss", "val_ppl", "val_balance_loss"):
                self.writer.add_scalar(f"val/{k[4:]}", ev[k], ev["step"])
        if self.bar:
            self.bar.set_postfix(val_ppl=f"{ev['val_ppl']:.2f}")
        if self.lines:  # several runs at a time share the terminal: a line per evaluation instead of a bar
            print(f"  {self.name}: step {ev['step']}/{self.steps}, val ppl {ev['val_ppl']:.2f}, "
                  f"{time.perf_counter() - self.t0:.0f} s", file=sys.stderr, flush=True)

    def step(self, rec: dict[str, Any], last_eval: dict[str, Any]) -> None:
        if self.writer:
            for k in ("loss", "lm_loss", "balance_loss", "z_loss", "grad_norm", "lr"):
                self.writer.add_scalar(f"train/{k}", rec[k], rec["step"])
            self.writer.add_scalar("perf/opt_time_ms", rec["opt_time_s"] * 1e3, rec["step"])
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['lm_loss']:.3f}", val_ppl=f"{last_eval['val_ppl']:.2f}")

    def close(self) -> None:
        for out in (self.bar, self.writer):
            if out:
                out.close()


def _summary(optimizer, steps_log, evals_log, device, baseline_memory: int, tokens_per_step: int) -> dict[str, Any]:
    """Memory, speed and quality of a finished run. State bytes are by tier (the param groups' ``tier``), moments
    apart from step counters: the same count for every optimizer, and SkewAdam.state_bytes() for SkewAdam."""
    state = measure_state(optimizer)
    timed = steps_log[min(2, len(steps_log) // 4):]  # skip the first steps (lazy state allocation, warm caches)
    finite = [e["val_ppl"] for e in evals_log if math.isfinite(e["val_ppl"])]
    return {
        "state_bytes": state.statistics,
        "state_bytes_by_tier": state.by_tier,
        "state_bytes_by_key": state.by_key,
        "state_counter_bytes": state.counters,
        "peak_memory_bytes": _peak_memory(device),
        "baseline_memory_bytes": baseline_memory,
        "train_peak_memory_bytes": _peak_memory(device) - baseline_memory,
        "memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "peak RSS of the run's process",
        "tokens_per_s": tokens_per_step * len(timed) / sum(r["step_time_s"] for r in timed),
        "opt_time_s": statistics.median(r["opt_time_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "best_val_ppl": min(finite) if finite else math.inf,
        "final_val_ppl": evals_log[-1]["val_ppl"],
        "final_val_balance_loss": evals_log[-1]["val_balance_loss"],
        "diverged": not math.isfinite(steps_log[-1]["loss"]),
    }


def train(cfg: RunConfig, log_path: Optional[Path] = None, *, tensorboard: Optional[str] = None,
          progress: Optional[str] = "bar") -> dict[str, Any]:
    """Train per ``cfg``; return the log (and write it to ``log_path``, atomically, if given). ``progress``: a tqdm
    ``"bar"``, a line per evaluation (``"lines"``), or None."""
    progress = "bar" if progress is True else progress or None
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    corpus = load_corpus(cfg.data)
    torch.manual_seed(cfg.seed)
    built = bench_model(cfg.model, cfg.overrides, vocab_size=corpus.vocab_size, block_size=cfg.block_size)
    T = built.block_size
    model = built.model.to(device=device, dtype=cfg.param_dtype)
    init_checksum = sum(p.double().sum().item() for p in model.parameters())
    data_gen = torch.Generator().manual_seed(cfg.seed)
    val_batches = [(x.to(device), y.to(device))
                   for x, y in eval_batches(corpus.val, cfg.eval_batches, cfg.batch_size, T)]
    params = dict(model.named_parameters())
    params_by_tier = {"backbone": 0, "expert": 0, "router": 0}
    for n, tier in classify(model).items():
        params_by_tier[tier] += params[n].numel()
    baseline_memory = _peak_memory(device)
    lr, wd = cfg.resolved_lr, cfg.resolved_weight_decay
    optimizer = arms.get(cfg.optimizer).build(model, lr, wd)
    base_lrs = [float(g["lr"]) for g in optimizer.param_groups]

    name = run_name(cfg)
    monitor = _Monitor(name, cfg.steps, tensorboard, progress)
    steps_log: list[dict[str, Any]] = []
    evals_log: list[dict[str, Any]] = []
    load_start, t_start = os.getloadavg()[0], time.perf_counter()
    for step in range(cfg.steps + 1):
        diverged = bool(steps_log) and not math.isfinite(steps_log[-1]["loss"])
        if step % cfg.eval_interval == 0 or step == cfg.steps or diverged:  # the fixed validation batches
            evals_log.append({"step": step, "tokens": step * cfg.batch_size * T, **evaluate(model, val_batches)})
            monitor.eval(evals_log[-1])
        if step == cfg.steps or diverged:
            break
        factor = lr_factor(step, cfg.steps, cfg.warmup_frac)
        _set_lr(optimizer, base_lrs, factor)
        x, y = get_batch(corpus.train, cfg.batch_size, T, data_gen)
        rec = _train_step(model, optimizer, x.to(device), y.to(device), cfg.grad_clip, device)
        steps_log.append({"step": step + 1, "lr": base_lrs[0] * factor, **rec})
        monitor.step(steps_log[-1], evals_log[-1])
    wall = time.perf_counter() - t_start
    monitor.close()

    summary = _summary(optimizer, steps_log, evals_log, device, baseline_memory, cfg.batch_size * T)
    arm = arms.get(cfg.optimizer)
    summary["newton_schulz_flops"] = orthogonal_flops(model, arm.orthogonal, defaults=arm.options,
                                                      tier_options=dict(arm.tier_options)) if arm.orthogonal else 0
    identity = run_identity(cfg)
    summary["wall_time_s"] = wall
    summary["loadavg_1min"] = [load_start, os.getloadavg()[0]]  # machine load at start and end: context for timings
    log = {
        "name": name,
        "config": identity,
        "config_hash": config_hash(identity),
        "arm": arm.settings(),
        "model": {"name": cfg.model, "params": sum(p.numel() for p in params.values()),
                  "params_by_tier": params_by_tier, "block_size": T, "balance_floor": built.balance_floor,
                  "config": built.config},
        "data": {"name": corpus.name, "train_tokens": corpus.train.numel(), "val_tokens": corpus.val.numel(),
                 "val_docs": list(corpus.val_docs)},
        "optimizer_repr": repr(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else
        "\n".join(repr(o) for o in optimizer.optimizers),
        "init_checksum": init_checksum,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "summary": summary,
        "evals": evals_log,
        "steps": steps_log,
    }
    if log_path is not None:
        write_json(Path(log_path), log)
    return log


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m skewadam.bench.train JOB.json``: JOB holds ``config`` (RunConfig fields), ``log_path`` and
    optional ``tensorboard``, ``progress`` (see `train`) and ``parent_pid`` (the bench: this run dies with it). This
    is how `skewadam bench` starts each run in a fresh process."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m skewadam.bench.train JOB.json")
    job = json.loads(Path(argv[0]).read_text())
    if job.get("parent_pid"):
        die_with_parent(job["parent_pid"])
    train(RunConfig(**job["config"]), Path(job["log_path"]), tensorboard=job.get("tensorboard"),
          progress=job.get("progress", "bar"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
