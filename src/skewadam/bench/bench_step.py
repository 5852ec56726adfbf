"""``skewadam bench-step``: the time and transient memory of one optimizer step, SkewAdam against torch's optimizers.

Each optimizer steps its own copy of a `skewadam.bench.models` preset (same weights, same fixed random gradients, the
same per-tier param groups from `skewadam.groups.param_groups`). Steps are timed in interleaved rounds: every round runs
each optimizer ``--steps`` times, in an order that rotates from round to round, so load from other processes falls
on all of them alike. A round's time is the mean of its steps (give ``--steps`` a multiple of an ``ns_interval`` to
average whole intervals); a ratio is the median over rounds of the ratio of the two optimizers' round times (paired),
printed with its spread over the rounds (interquartile range and min..max); a time is the median over rounds. The
forward and backward of one bench batch (``--batch-size`` sequences of the model's context, random tokens) is timed
in the same rounds, so each optimizer's step is also given as a multiple of it and as its share of a training step
(forward, backward and step). The defaults, 1 thread and the process's CPU time (``--clock cpu``), are the measure
that stays steady on a machine shared with other work: with several threads a descheduled thread stalls the others at every
parallel region, and wall time counts other processes' turns on the CPU.

The report names SkewAdam's backend (`skewadam.kernels.resolve_backend`'s choice for ``--impl`` on CPU), the CPU and
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

from ..kernels import BACKENDS, resolve_backend
from ..state import format_bytes
from . import arms
from .models import MoETransformer, get_config
from .planner import DTYPES

__all__ = ["bench_step", "step_transient_bytes", "format_report", "cpu_info", "page_size"]

#: The instruction-set flags of ``/proc/cpuinfo`` that decide how the C++ kernel's loops vectorise, widest first.
ISA_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "avx", "sse4_2", "asimd", "sve")


FWD_BWD = "forward+backward"  # the rounds' entry timing one batch's forward and backward


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


def page_size() -> str:
    """The pages this process's large tensors get: "2 MiB" where a 16 MiB tensor, once written, adds to the process's
    transparent huge pages (Linux with them ``always`` on, or ``madvise`` and torch's ``THP_MEM_ALLOC_ENABLE=1``),
    "4 KiB" where it does not, "unknown" where ``/proc/self/smaps_rollup`` is missing. Memory streams here run up to
    1.8x faster on 2 MiB pages (docs/guide/kernels.md), so a timing says which it had."""
    before = _huge_kib()
    probe = torch.ones(1 << 22)
    after = _huge_kib()
    del probe
    if before is None or after is None:
        return "unknown"
    return "2 MiB" if after - before >= 2048 else "4 KiB"


def _huge_kib() -> Optional[int]:
    """This process's AnonHugePages in KiB (its memory map summary), or None where there is none."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


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
    batch_size: int = 16,
) -> dict[str, Any]:
    """Time ``optimizers`` (arms of `skewadam.bench.arms`, built as the bench builds them, at ``lr``; ``impl`` is the
    backend of their SkewAdam arms) stepping copies of the model preset, and the forward and backward of one
    batch of ``batch_size`` sequences (0: not timed); return times, ratios and memory.

    Returns:
        The settings, the model's ``params``, ``tensors`` and ``largest`` tensor (elements), the SkewAdam
        ``backend`` used on CPU (its name), the ``cpu`` model and its ``isa`` flags (`cpu_info`), the load
        average before and after, ``fwd_bwd_s`` (median over rounds; None when not timed) and ``results``: per
        optimizer ``median_s``, ``ratio`` (paired median of the first optimizer's time over this one's), ``ratios``
        (one per round) and ``transient_bytes``.
    """
    if not optimizers:
        raise ValueError("bench_step needs at least one optimizer")
    optimizers = tuple(dict.fromkeys(arms.get(n).name for n in optimizers))
    unbuildable = [n for n in optimizers if arms.ARMS[n].make is None]
    if unbuildable:
        raise ValueError(f"{unbuildable}: memory models only; use any of {', '.join(arms.names(buildable=True))}")
    inside = [n for n in optimizers if arms.ARMS[n].in_backward]
    if inside:
        raise ValueError(f"{inside} step inside backward, which bench-step does not run (it times step() over fixed "
                         f"gradients); time them with benchmarks/in_backward.py, or bench-step skewadam")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0 (0: no forward and backward timed), got {batch_size}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    backend = resolve_backend(impl, torch.device("cpu")).name  # what its SkewAdam arms step with; raises if none runs
    torch.manual_seed(seed)
    cfg = get_config(preset, **(overrides or {}))
    base = MoETransformer(cfg).to(DTYPES[dtype])
    for p in base.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {}
    for name in optimizers:
        model = copy.deepcopy(base)
        for p, q in zip(model.parameters(), base.parameters()):
            p.grad = q.grad.clone()  # deepcopy does not copy .grad
        opts[name] = arms.ARMS[name].build(model, lr, impl=backend)
    first = optimizers[0]
    memory = {}
    for name, opt in opts.items():
        for _ in range(warmup):
            opt.step()
        memory[name] = step_transient_bytes(opt)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size),
                           generator=torch.Generator().manual_seed(seed))

    def forward_backward() -> None:  # the bench's training step without the optimizer (its model: the base copy)
        base.zero_grad(set_to_none=True)
        base(tokens, tokens).loss.backward()

    work = {name: opt.step for name, opt in opts.items()}
    if batch_size:
        forward_backward()  # (warm-up)
        work[FWD_BWD] = forward_backward
    flush = torch.zeros(flush_mb << 18) if flush_mb else None
    load_before = os.getloadavg()
    names = list(work)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in optimizers}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            ts = []
            for _ in range(steps):
                _flush(flush)
                t0 = timer()
                work[name]()
                ts.append(timer() - t0)
            times[name].append(statistics.fmean(ts))
        for name in optimizers:
            ratios[name].append(times[first][-1] / times[name][-1])
    params = list(base.parameters())
    model_name, isa = cpu_info()
    return {
        "preset": preset, "overrides": dict(overrides or {}), "dtype": dtype, "clock": clock,
        "backend": backend,
        "threads": torch.get_num_threads(), "params": sum(p.numel() for p in params), "tensors": len(params),
        "largest": max(p.numel() for p in params), "load": (load_before, os.getloadavg()), "rounds": rounds,
        "steps": steps, "cpu": model_name, "isa": isa, "pages": page_size(), "batch_size": batch_size,
        "block_size": cfg.block_size,
        "fwd_bwd_s": statistics.median(times[FWD_BWD]) if batch_size else None,
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
        f"CPU: {res['cpu']} ({os.cpu_count()} CPUs; {' '.join(res['isa']) or 'baseline instruction set'}; "
        f"{res['pages']} pages); SkewAdam backend: {res['backend']} ({BACKENDS[res['backend']].summary})",
        f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}, {res['clock']} clock, {res['rounds']} "
        f"interleaved rounds x {res['steps']} steps, load average {l1:.1f} -> {l2:.1f}",
    ]
    fb = res.get("fwd_bwd_s")
    if fb:
        lines.append(f"forward+backward of one {res['batch_size']} x {res['block_size']} batch: {fb * 1e3:.1f} ms; "
                     f"each step as a multiple of it and as its share of a training step (forward, backward, step)")
    width = max(24, *map(len, res["results"]))
    lines.append(f"{'optimizer':<{width}} {'median ms':>10} {first + ' / this':>22} {'IQR  min-max over rounds':>26} "
                 f"{'transient':>12}" + (f" {'x fwd+bwd':>10} {'share':>6}" if fb else ""))
    for name, r in res["results"].items():
        mem = "n/a" if r["transient_bytes"] is None else format_bytes(r["transient_bytes"])
        t = r["median_s"]
        lines.append(f"{name:<{width}} {t * 1e3:>10.2f} {r['ratio']:>21.3f}x {_spread(r['ratios']):>26} {mem:>12}"
                     + (f" {t / fb:>9.2f}x {t / (t + fb):>6.0%}" if fb else ""))
    return "\n".join(lines)
