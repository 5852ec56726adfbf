"""``skewadam bench-step --roofline``: SkewAdam's step against its memory-traffic bound, per tier and per path.

Each row is a set of tensors stepped three ways, timed in interleaved rounds whose order rotates (load from other
processes falls on all alike): SkewAdam (its C++ kernel on CPU), torch's fused AdamW on copies of the same tensors,
and a plain stream, ``a.add_(b)`` over as many elements. Each time divides the bytes that step moves: SkewAdam's from
the traffic model (`skewadam.kernels.traffic`, the C++ kernel's schedules), AdamW's 7 element-sized streams, the
stream's 3. Printed per row: the modeled bytes per parameter, each one's time and attained GB/s, SkewAdam's
*efficiency* (its GB/s over AdamW's, and over the stream's), the bound on its time over AdamW's where reads alone
set the time (its modeled reads over AdamW's 4 streams) and that time ratio as measured (the paired median of the
rounds' ratios). Whether reads alone set the time here, the header says: ``a.add_(b)``'s time over
``torch.dot(a, b)``'s, both reading the same two fp32 tensors of the whole set's size (1.00 where an in-place write
costs nothing beside the reads, 1.50 where every byte costs alike; benchmarks/streams.py times more ops). Optionally
DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW, its own C++/OpenMP kernel) on the same tensors.

The rows: `MOE` (issue 34's MoE-shaped parameters: a 4096x256 token table, attention and dense FFN matrices, two
expert banks of 32 experts, a router, two norms), per tier and whole; then `PATHS`, one tensor for each schedule of
the C++ kernel at a size where memory, not per-call overhead, sets its time.

Example:
    skewadam bench-step --roofline --dtype bf16 --momentum int8 --threads 2
    skewadam bench-step --roofline --unchecked      # SkewAdam(skip_nonfinite=False)
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from typing import Any, Callable

import torch

from ..kernels import traffic
from ..state import state_flags
from ..tiers import Tier
from .bench_step import cpu_info, page_size

__all__ = ["MOE", "PATHS", "roofline", "format_roofline"]

Spec = tuple[str, tuple[int, ...], str, dict]  # (name, shape, tier, group overrides)

#: Issue 34's parameters: 14,164,480 in 12 tensors, 88.8% of them in the expert banks.
MOE: list[Spec] = [
    ("tok_emb", (4096, 256), "backbone", {}),
    *((f"attn.{w}", (256, 256), "backbone", {}) for w in ("wq", "wk", "wv", "wo")),
    ("ffn.w1", (512, 256), "backbone", {}), ("ffn.w2", (256, 512), "backbone", {}),
    ("norm1", (256,), "backbone", {}), ("norm2", (256,), "backbone", {}),
    ("experts.w1", (32, 1024, 256), "expert", {}), ("experts.w2", (32, 256, 512), "expert", {}),
    ("router", (32, 256), "router", {}),
]

#: One tensor per path of the C++ kernel, each large enough to be bound by memory traffic.
PATHS: list[tuple[str, list[Spec]]] = [
    ("backbone matrix [4096, 2048]", [("w", (4096, 2048), "backbone", {})]),
    ("backbone 1-D [2^21]", [("b", (1 << 21,), "backbone", {})]),
    ("full v, router tier [1024, 2048]", [("r", (1024, 2048), "router", {})]),
    ("expert bank + momentum [16, 1024, 256]", [("e", (16, 1024, 256), "expert", {"use_momentum": True})]),
    ("expert bank [8, 2048, 1024]", [("e", (8, 2048, 1024), "expert", {})]),
]


def _rows() -> list[tuple[str, list[Spec]]]:
    tiers = [(t.value, [s for s in MOE if s[2] == t.value]) for t in Tier]
    return [*tiers, ("all (one optimizer)", MOE), *PATHS]


def _tensors(specs: list[Spec], dtype: torch.dtype, gen: torch.Generator) -> list[torch.nn.Parameter]:
    params = []
    for _, shape, _, _ in specs:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def _copy(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = copy.deepcopy(params)
    for p, q in zip(out, params):
        p.grad = q.grad.clone()
    return out


def roofline(dtype: str = "fp32", momentum_dtype: str = "fp32", rounds: int = 9, steps: int = 3, warmup: int = 2,
             impl: str = "auto", clock: str = "cpu", deepspeed: bool = False, skip_nonfinite: bool = True,
             seed: int = 0) -> dict[str, Any]:
    """Time every row of `_rows` (SkewAdam, with ``skip_nonfinite`` as given; fused AdamW; a stream; ``deepspeed``:
    DeepSpeedCPUAdam too) and return per row its parameters, modeled bytes and reads and per optimizer the median
    time and paired ratio to SkewAdam's."""
    from ..kernels import resolve_backend
    from ..optimizer import SkewAdam
    from .planner import DTYPES

    if dtype not in DTYPES or DTYPES[dtype] == torch.float16:
        raise ValueError(f"dtype must be fp32, bf16 or fp64, got {dtype!r}")
    if momentum_dtype not in ("fp32", "bf16", "int8"):
        raise ValueError(f"momentum_dtype must be fp32, bf16 or int8, got {momentum_dtype!r}")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    dt = DTYPES[dtype]
    backend = resolve_backend(impl, torch.device("cpu")).name
    timer = time.process_time if clock == "cpu" else time.perf_counter
    gen = torch.Generator().manual_seed(seed)
    rows = []
    load_before = os.getloadavg()
    for label, specs in _rows():
        params = _tensors(specs, dt, gen)
        groups = [{"params": [p], "tier": tier, "momentum_dtype": momentum_dtype, **overrides}
                  for p, (_, _, tier, overrides) in zip(params, specs)]
        numel = sum(p.numel() for p in params)
        model = [traffic.cpp(g["params"][0].shape, dt, state_flags(g), skip_nonfinite=skip_nonfinite)
                 for g in groups]
        a, b = torch.zeros(numel, dtype=dt), torch.ones(numel, dtype=dt)
        steppers: dict[str, Callable[[], Any]] = {
            "skewadam": SkewAdam(groups, lr=1e-3, weight_decay=0.01, impl=backend,
                                 skip_nonfinite=skip_nonfinite).step,
            "adamw": torch.optim.AdamW(_copy(params), lr=1e-3, weight_decay=0.01, fused=True).step,
            "stream": lambda: a.add_(b),
        }
        adamw = traffic.adamw(numel, dt)
        nbytes = {"skewadam": sum(t.bytes for t in model), "adamw": adamw.bytes,
                  "stream": traffic.stream(numel, dt).bytes}
        reads = {"skewadam": sum(t.read for t in model), "adamw": adamw.read}
        if deepspeed:
            steppers["deepspeed"] = _deepspeed(_copy(params)).step
            nbytes["deepspeed"] = nbytes["adamw"]
        times = _interleaved(steppers, rounds, steps, warmup, timer)
        schedules = sorted({t.schedule for t in model})
        rows.append({"row": label, "params": numel, "tensors": len(params), "schedules": schedules,
                     "bytes": nbytes, "reads": reads, **times})
    # fp32 (torch's bf16 dot is not vectorised), as many elements as the whole set
    numel = sum(math.prod(shape) for _, shape, _, _ in MOE)
    a, b = torch.zeros(numel), torch.ones(numel)
    probe = _interleaved({"add_": lambda: a.add_(b), "dot": lambda: torch.dot(a, b)}, rounds, steps, warmup, timer)
    return {"dtype": dtype, "momentum_dtype": momentum_dtype, "skip_nonfinite": skip_nonfinite, "backend": backend,
            "clock": clock, "threads": torch.get_num_threads(), "rounds": rounds, "steps": steps, "cpu": cpu_info()[0],
            "pages": page_size(),
            "load": (load_before, os.getloadavg()), "rows": rows, "add_over_dot": probe["ratio"]["dot"]}


def _deepspeed(params: list[torch.nn.Parameter]):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        raise ImportError(f"--deepspeed needs deepspeed (pip install deepspeed): {e}") from None
    return DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)


def _interleaved(steppers: dict[str, Callable[[], Any]], rounds: int, steps: int, warmup: int,
                 timer: Callable[[], float]) -> dict[str, Any]:
    """Per stepper: median time over every timed step, and the paired median over rounds of its time over the
    first stepper's (per-round medians)."""
    names = list(steppers)
    for step in steppers.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        per_round = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            ts = []
            for _ in range(steps):
                t0 = timer()
                steppers[name]()
                ts.append(timer() - t0)
            times[name] += ts
            per_round[name] = statistics.median(ts)
        for name in names:
            ratios[name].append(per_round[names[0]] / per_round[name])  # the first's time over this one's
    return {"median_s": {n: statistics.median(times[n]) for n in names},
            "ratio": {n: statistics.median(ratios[n]) for n in names}}


def format_roofline(res: dict[str, Any]) -> str:
    """The table ``skewadam bench-step --roofline`` prints."""
    (l1, _, _), (l2, _, _) = res["load"]
    others = [n for n in res["rows"][0]["median_s"] if n != "skewadam"]
    lines = [
        f"skewadam bench-step --roofline: {res['dtype']} weights, {res['momentum_dtype']} momentum"
        f"{'' if res['skip_nonfinite'] else ', no non-finite check'}; backend "
        f"{res['backend']}; CPU: {res['cpu']}, {res['pages']} pages; "
        f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}, "
        f"{res['clock']} clock, {res['rounds']} interleaved rounds x {res['steps']} steps, load average {l1:.1f} -> "
        f"{l2:.1f}",
        "bytes: skewadam.kernels.traffic (SkewAdam), 7 streams (AdamW), 3 (a.add_(b)); efficiency: SkewAdam's GB/s "
        "over AdamW's / the stream's; read bound: SkewAdam's reads over AdamW's; time: SkewAdam's over AdamW's, paired",
        f"a.add_(b) / torch.dot(a, b), fp32, the whole set's size: {res['add_over_dot']:.2f} (1.00: an in-place "
        "write costs no time beside the reads, so the read bound holds; 1.50: every byte costs alike)",
        f"{'row':<38} {'params':>11} {'B/param':>7} {'skewadam ms':>11} {'GB/s':>6} " +
        " ".join(f"{n + ' ms':>12} {'GB/s':>6}" for n in others) +
        f" {'eff/adamw':>9} {'eff/stream':>10} {'read bound':>10} {'time/adamw':>10}" +
        (f" {'time/ds':>8}" if "deepspeed" in others else ""),
    ]
    for row in res["rows"]:
        t, b = row["median_s"], row["bytes"]
        gbs = {n: b[n] / t[n] / 1e9 for n in t}
        line = (f"{row['row'] + ' (' + ', '.join(row['schedules']) + ')':<38} {row['params']:>11,} "
                f"{b['skewadam'] / row['params']:>7.2f} {t['skewadam'] * 1e3:>11.3f} {gbs['skewadam']:>6.1f} " +
                " ".join(f"{t[n] * 1e3:>12.3f} {gbs[n]:>6.1f}" for n in others) +
                f" {gbs['skewadam'] / gbs['adamw']:>9.2f} {gbs['skewadam'] / gbs['stream']:>10.2f}"
                f" {row['reads']['skewadam'] / row['reads']['adamw']:>9.2f}x {row['ratio']['adamw']:>9.3f}x")
        if "deepspeed" in others:
            line += f" {row['ratio']['deepspeed']:>7.3f}x"
        lines.append(line)
    return "\n".join(lines)

