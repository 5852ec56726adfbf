"""``skewadam bench-step``: the time and transient memory of one optimizer step, SkewAdam against torch's optimizers.

Each optimizer steps its own copy of a `skewadam.models` preset (same weights, same fixed random gradients, the same
per-tier param groups from `skewadam.classify.param_groups`). Steps are timed in interleaved rounds: every round runs
each optimizer ``--steps`` times, in an order that rotates from round to round, so load from other processes falls
on all of them alike. A ratio is the median over rounds of the ratio of the two optimizers' per-round medians
(paired); a time is the median over all timed steps. ``--clock cpu`` times the process's CPU time instead of the
wall clock: with ``--threads 1`` it is the steadiest measure on a machine shared with other work.

Transient memory is the peak, during one step, of the bytes allocated through torch's allocator beyond those held
before it (torch's profiler); the optimizer state (allocated on the first step) is not part of it.

Example:
    skewadam bench-step --preset cpu --set n_layer=18 d_ff=512 d_expert=384 --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["register_cli", "bench_step", "step_transient_bytes", "OPTIMIZERS"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _skewadam(groups: list[dict[str, Any]], lr: float, impl: str) -> torch.optim.Optimizer:
    from ..optimizer import SkewAdam

    return SkewAdam(groups, lr=lr, impl=impl)


#: name -> build(param_groups, lr, skewadam_impl). The first is the one the others are compared with.
OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]], float, str], torch.optim.Optimizer]] = {
    "SkewAdam": _skewadam,
    "AdamW fused": lambda groups, lr, impl: torch.optim.AdamW(groups, lr=lr, fused=True),
    "AdamW foreach": lambda groups, lr, impl: torch.optim.AdamW(groups, lr=lr, foreach=True),
    "Adafactor": lambda groups, lr, impl: torch.optim.Adafactor(groups, lr=lr),
    "SkewAdam eager": lambda groups, lr, impl: _skewadam(groups, lr, "eager"),
}
_DEFAULT = ("SkewAdam", "AdamW fused", "AdamW foreach", "Adafactor")


def _names() -> list[str]:
    """Every name `bench_step` takes: its own, then `skewadam bench`'s arms (built as the bench builds them)."""
    from .optimizers import OPTIMIZERS as ARMS

    return list(OPTIMIZERS) + [n for n in ARMS if n not in OPTIMIZERS]


def _build(name: str, model: torch.nn.Module, lr: float, impl: str):
    from ..classify import param_groups
    from .optimizers import OPTIMIZERS as ARMS, build_optimizer

    if name in OPTIMIZERS:
        return OPTIMIZERS[name](param_groups(model), lr, impl)
    return build_optimizer(name, model, lr, ARMS[name].weight_decay)


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
    optimizers: tuple[str, ...] = _DEFAULT,
    rounds: int = 15,
    steps: int = 5,
    warmup: int = 3,
    impl: str = "auto",
    clock: str = "wall",
    flush_mb: int = 0,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``optimizers`` stepping copies of the model preset; return per-optimizer times, ratios and memory.
    Names are `OPTIMIZERS`' or `skewadam bench`'s arms (`skewadam.harness.optimizers`: its param groups and weight
    decay; ``impl`` applies to `OPTIMIZERS`' SkewAdam entries).

    Returns:
        The settings, the model's ``params``, ``tensors`` and ``largest`` tensor (elements), the SkewAdam
        ``kernel`` used on CPU, the load average before and after, and ``results``: per optimizer ``median_s``,
        ``ratio`` (paired median of the first optimizer's time over this one's) and ``transient_bytes``.
    """
    from ..kernels import select
    from ..models import MoETransformer, get_config

    if not optimizers:
        raise ValueError("bench_step needs at least one optimizer")
    unknown = [n for n in optimizers if n not in _names()]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}: use any of {_names()}")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    torch.manual_seed(seed)
    base = MoETransformer(get_config(preset, **(overrides or {}))).to(_DTYPES[dtype])
    for p in base.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {}
    for name in optimizers:
        model = copy.deepcopy(base)
        for p, q in zip(model.parameters(), base.parameters()):
            p.grad = q.grad.clone()  # deepcopy does not copy .grad
        opts[name] = _build(name, model, lr, impl)
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
    return {
        "preset": preset, "overrides": dict(overrides or {}), "dtype": dtype, "clock": clock,
        "kernel": "cpp" if select(impl, torch.device("cpu")).__name__.endswith(".cpu") else "eager",
        "threads": torch.get_num_threads(), "params": sum(p.numel() for p in params), "tensors": len(params),
        "largest": max(p.numel() for p in params), "load": (load_before, os.getloadavg()), "rounds": rounds,
        "steps": steps,
        "results": {
            n: {"median_s": statistics.median(times[n]), "ratio": statistics.median(ratios[n]),
                "transient_bytes": memory[n]}
            for n in optimizers
        },
    }


def format_report(res: dict[str, Any]) -> str:
    """The table `skewadam bench-step` prints."""
    first = next(iter(res["results"]))
    over = " ".join(f"{k}={v}" for k, v in res["overrides"].items())
    (l1, _, _), (l2, _, _) = res["load"]
    lines = [
        f"skewadam bench-step: preset {res['preset']!r}{' (' + over + ')' if over else ''}: {res['tensors']} tensors, "
        f"{res['params']:,} parameters, {res['dtype']}; largest tensor {res['largest']:,} elements "
        f"({res['largest'] * 4 / 2**20:.2f} MiB as fp32)",
        f"{res['threads']} threads, {res['clock']} clock, {res['rounds']} rounds x {res['steps']} steps, "
        f"load average {l1:.1f} -> {l2:.1f} on {os.cpu_count()} CPUs" + (
            f", SkewAdam kernel: {res['kernel']}"),
        f"{'optimizer':<24} {'median ms':>10} {first + ' / this':>22} {'transient MiB':>14}",
    ]
    for name, r in res["results"].items():
        mem = "n/a" if r["transient_bytes"] is None else f"{r['transient_bytes'] / 2**20:.2f}"
        lines.append(f"{name:<24} {r['median_s'] * 1e3:>10.2f} {r['ratio']:>21.3f}x {mem:>14}")
    return "\n".join(lines)


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. n_layer=18")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def _main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    names = tuple(dict.fromkeys(("SkewAdam",) + tuple(args.optimizers or _DEFAULT[1:])))
    res = bench_step(
        preset=args.preset, overrides=_parse_set(args.set), dtype=args.dtype, optimizers=names, rounds=args.rounds,
        steps=args.steps, warmup=args.warmup, impl=args.impl, clock=args.clock, flush_mb=args.flush_mb, lr=args.lr,
        seed=args.seed,
    )
    print(format_report(res))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench-step", help="time one optimizer step: SkewAdam vs fused/foreach AdamW and Adafactor, with memory",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="cpu", help="model preset of skewadam.models: tiny, cpu, ... (default: cpu)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override model config fields, e.g. --set n_layer=18 d_ff=512 d_expert=384")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="parameter dtype (default: fp32)")
    p.add_argument("--optimizers", nargs="+", choices=[n for n in _names() if n != "SkewAdam"], metavar="NAME",
                   help="compared with SkewAdam (default: " + ", ".join(repr(n) for n in _DEFAULT[1:]) +
                        "; also 'SkewAdam eager' and the arms of `skewadam bench`, e.g. skewadam-int8, muon)")
    p.add_argument("--impl", choices=("auto", "cpp", "eager"), default="auto", help="SkewAdam's kernel (default: auto)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: 15)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per optimizer per round (default: 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (steadier under load with --threads 1)")
    p.add_argument("--flush-mb", type=int, default=0, metavar="MB",
                   help="write an MB-sized buffer before each timed step, so the step starts with cold caches")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of every optimizer (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_main)
