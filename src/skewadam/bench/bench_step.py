"""``skewadam bench-step``: the time and transient memory of one optimizer step, SkewAdam against torch's optimizers.

Each optimizer steps its own copy of a `skewadam.bench.models` preset (same weights, same fixed random gradients, the
same per-tier param groups from `skewadam.groups.param_groups`). Steps are timed in interleaved rounds: every round runs
each optimizer ``--steps`` times, in an order that rotates from round to round, so load from other processes falls
on all of them alike. A ratio is the median over rounds of the ratio of the two optimizers' per-round medians
(paired), printed with its spread over the rounds (interquartile range and min..max); a time is the median over
all timed steps. The defaults, 1 thread and the process's CPU time (``--clock cpu``), are the measure that stays
steady on a machine shared with other work: with several threads a descheduled thread stalls the others at every
parallel region, and wall time counts other processes' turns on the CPU.

The report names SkewAdam's kernel backend (`skewadam.kernels.resolve`'s choice for ``--impl`` on CPU), the CPU and
its instruction sets (this CPU's AVX-512 / AVX2 / FMA flags from ``/proc/cpuinfo``: a compiled kernel is built for
them, ``-march=native``), since the kernel's speed depends on them.

Transient memory is the peak, during one step, of the bytes allocated through torch's allocator beyond those held
before it (torch's profiler); the optimizer state (allocated on the first step) is not part of it.

Example:
    skewadam bench-step --preset cpu --set n_layer=18 d_ff=512 d_expert=384 --dtype bf16
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

from ..kernels import BACKENDS, resolve
from ..state import format_bytes
from . import arms
from .models import MoETransformer, get_config
from .planner import DTYPES

__all__ = ["bench_step", "step_transient_bytes", "format_report", "cpu_info"]

#: The instruction-set flags of ``/proc/cpuinfo`` that decide how the C++ kernel's loops vectorise, widest first.
ISA_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "avx", "sse4_2", "asimd", "sve")


def cpu_info() -> tuple[str, list[str]]:
    """This CPU's model name and which of `ISA_FLAGS` it has (Linux ``/proc/cpuinfo``; elsewhere the platform's
    processor string and no flags)."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in (platform.processor(), platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [f for f in ISA_FLAGS if f in flags]


def step_transient_bytes(optimizer: torch.optim.Optimizer) -> Optional[int]:
    """Peak bytes allocated during one ``optimizer.step()`` beyond those held before it (torch's CPU profiler), or
    None where this torch's profiler does not report allocations."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError:  # pragma: no cover - older/newer profiler API
        return None
    allocs, stack = [], list(roots)
    while stack:
        node = stack.pop()
        size = getattr(node.extra_fields, "alloc_size", None)
        if size is not None:
            allocs.append((node.start_time_ns, size))
        stack.extend(node.children)
    held = peak = 0
    for _, size in sorted(allocs):
        held += size
        peak = max(peak, held)
    return peak


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _flush(buffer: Optional[torch.Tensor]) -> None:
    if buffer is not None:
        buffer.add_(1)  # evict the caches: the next step reads its tensors from memory


def bench_step(
    preset: str = "cpu",
    overrides: Optional[dict[str, Any]] = None,
    dtype: str = "fp32",
    optimizers: tuple[str, ...] = arms.BENCH_STEP_DEFAULT,
    rounds: int = 15,
    steps: int = 5,
    warmup: int = 3,
    impl: str = "auto",
    clock: str = "cpu",
    flush_mb: int = 0,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``optimizers`` (arms of `skewadam.bench.arms`, built as the bench builds them, at ``lr``; ``impl`` is the
    kernel backend of their SkewAdam arms) stepping copies of the model preset; return times, ratios and memory.

    Returns:
        The settings, the model's ``params``, ``tensors`` and ``largest`` tensor (elements), the SkewAdam
        ``kernel`` used on CPU (a backend's name), the ``cpu`` model and its ``isa`` flags (`cpu_info`), the load
        average before and after, and ``results``: per optimizer ``median_s``, ``ratio`` (paired median of the first
        optimizer's time over this one's), ``ratios`` (one per round) and ``transient_bytes``.
    """
    if not optimizers:
        raise ValueError("bench_step needs at least one optimizer")
    optimizers = tuple(dict.fromkeys(arms.get(n).name for n in optimizers))
    unbuildable = [n for n in optimizers if arms.ARMS[n].make is None]
    if unbuildable:
        raise ValueError(f"{unbuildable}: memory models only; use any of {', '.join(arms.names(buildable=True))}")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    kernel = resolve(impl, torch.device("cpu")).name  # what its SkewAdam arms step with; raises if it cannot run
    torch.manual_seed(seed)
    base = MoETransformer(get_config(preset, **(overrides or {}))).to(DTYPES[dtype])
    for p in base.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {}
    for name in optimizers:
        model = copy.deepcopy(base)
        for p, q in zip(model.parameters(), base.parameters()):
            p.grad = q.grad.clone()  # deepcopy does not copy .grad
        opts[name] = arms.ARMS[name].build(model, lr, impl=kernel)
    first = optimizers[0]
    memory = {}
    for name, opt in opts.items():
        for _ in range(warmup):
            opt.step()
        memory[name] = step_transient_bytes(opt)
    flush = torch.zeros(flush_mb << 18) if flush_mb else None
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {n: [] for n in optimizers}
    ratios: dict[str, list[float]] = {n: [] for n in optimizers}
    for r in range(rounds):
        order = optimizers[r % len(optimizers):] + optimizers[: r % len(optimizers)]
        per_round = {}
        for name in order:
            ts = []
            for _ in range(steps):
                _flush(flush)
                t0 = timer()
                opts[name].step()
                ts.append(timer() - t0)
            times[name] += ts
            per_round[name] = statistics.median(ts)
        for name in optimizers:
            ratios[name].append(per_round[first] / per_round[name])
    params = list(base.parameters())
    model_name, isa = cpu_info()
    return {
        "preset": preset, "overrides": dict(overrides or {}), "dtype": dtype, "clock": clock,
        "kernel": kernel,
        "threads": torch.get_num_threads(), "params": sum(p.numel() for p in params), "tensors": len(params),
        "largest": max(p.numel() for p in params), "load": (load_before, os.getloadavg()), "rounds": rounds,
        "steps": steps, "cpu": model_name, "isa": isa,
        "results": {
            n: {"median_s": statistics.median(times[n]), "ratio": statistics.median(ratios[n]),
                "ratios": ratios[n], "transient_bytes": memory[n]}
            for n in optimizers
        },
    }


def _spread(ratios: list[float]) -> str:
    """Interquartile range and min..max of per-round ratios."""
    if len(ratios) < 2:
        return "(1 round)"
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{q1:.3f}-{q3:.3f}  {min(ratios):.3f}-{max(ratios):.3f}"


def format_report(res: dict[str, Any]) -> str:
    """The table `skewadam bench-step` prints."""
    first = next(iter(res["results"]))
    over = " ".join(f"{k}={v}" for k, v in res["overrides"].items())
    (l1, _, _), (l2, _, _) = res["load"]
    lines = [
        f"skewadam bench-step: preset {res['preset']!r}{' (' + over + ')' if over else ''}: {res['tensors']} tensors, "
        f"{res['params']:,} parameters, {res['dtype']}; largest tensor {res['largest']:,} elements "
        f"({format_bytes(res['largest'] * 4)} as fp32)",
        f"CPU: {res['cpu']} ({os.cpu_count()} CPUs; {' '.join(res['isa']) or 'baseline instruction set'}); SkewAdam "
        f"kernel: {res['kernel']} ({BACKENDS[res['kernel']].summary})",
        f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}, {res['clock']} clock, {res['rounds']} "
        f"interleaved rounds x {res['steps']} steps, load average {l1:.1f} -> {l2:.1f}",
        f"{'optimizer':<24} {'median ms':>10} {first + ' / this':>22} {'IQR  min-max over rounds':>26} "
        f"{'transient':>12}",
    ]
    for name, r in res["results"].items():
        mem = "n/a" if r["transient_bytes"] is None else format_bytes(r["transient_bytes"])
        lines.append(f"{name:<24} {r['median_s'] * 1e3:>10.2f} {r['ratio']:>21.3f}x {_spread(r['ratios']):>26} "
                     f"{mem:>12}")
    return "\n".join(lines)
