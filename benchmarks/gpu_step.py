"""One optimizer step on a GPU: SkewAdam's Triton kernel against AdamW(fused=True), foreach AdamW and torch Adafactor.

The parameters are the paper's 6.78B MoE model (`skewadam.bench.models`, preset ``paper-6.78b``: 128-expert banks, a
50,257-token embedding, attention, a router) scaled to fit one GPU with every optimizer's state at once:
``d_expert=1024`` (banks [128, 1024, 4096] and [128, 4096, 1024]), 1.95B parameters. All optimizers step the same
parameters with the same fixed gradients (values drift; only time and memory are measured), in rounds whose order
rotates; each step is timed with CUDA events. A ratio is the median over rounds of (this optimizer's median step)
/ (AdamW fused's median step in the same round). Transient memory is ``max_memory_allocated`` during one step
beyond what was allocated before it (the state exists from the warm-up steps on). Then it runs
``tests/test_triton.py`` (compiled, on the GPU) and prints one JSON summary.

Beside each time, the bytes that step moves and its attained bandwidth: SkewAdam's per pass from the traffic model
(`skewadam.kernels.traffic.triton`: ``stats_tiles`` in pass 1, ``direction_tiles`` in passes 2 and 3, over every
parameter), fused AdamW's 7 element-sized streams, and a plain stream ``a.add_(b)`` (3, over 2^28 elements) timed in
the same rounds: SkewAdam's efficiency is its GB/s over AdamW's.

Goals (from memory traffic): SkewAdam/AdamW fused <= 0.8 with fp32 weights, <= 0.55 with bf16 weights; transient
memory < 1% of the parameters' bytes.

``--train-memory`` measures whole training steps instead (forward, backward, ``step()``, ``zero_grad()``) of SkewAdam
on Triton: the peak allocated bytes over a few steps after warm-up, for the regular step and, where SkewAdam takes
``in_backward=True``, the step inside backward (gradients stepped and freed as they complete), each on a fresh copy
of the same model and tokens; their losses (equal when the two steps are) and the planner's peak beside them.

Usage (from the repository root):
    python benchmarks/gpu_step.py                      # on a GPU: < 5 minutes on one H200
    python benchmarks/gpu_step.py --dry-run            # CPU, Triton's interpreter, a tiny model: the script's logic
    python benchmarks/gpu_step.py --compile-only       # no GPU needed: compile every kernel a step launches (sm_90)
    python benchmarks/gpu_step.py --train-memory       # on a GPU: peak memory of training steps, regular/in backward

The SkewAdam arms are ``SkewAdam(param_groups(model), impl="triton")`` (and ``impl="eager"``), stepped as a user
would: ``opt.step()``, with ``skip_nonfinite=True`` (the Triton kernel's finite check stays on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GOALS = {"fp32": 0.8, "bf16": 0.55}
BENCH_MODEL = dict(preset="paper-6.78b", overrides=dict(d_expert=1024))
DRY_MODEL = dict(preset="tiny", overrides={})


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, Triton's interpreter, the tiny model")
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel a step launches; no GPU needed")
    ap.add_argument("--arch", type=int, default=90, help="--compile-only: the CUDA compute capability (90: H100/H200)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="parameter dtypes to measure, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per optimizer per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--momentum-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="SkewAdam's first-moment storage (backbone tier)")
    ap.add_argument("--no-eager", action="store_true", help="leave out SkewAdam's eager torch-ops kernel")
    ap.add_argument("--no-tests", action="store_true", help="do not run tests/test_triton.py afterwards")
    ap.add_argument("--train-memory", action="store_true",
                    help="peak allocated memory of training steps, the regular step and the step inside backward")
    ap.add_argument("--batch", type=int, default=8, help="--train-memory: sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="--train-memory: tokens per sequence")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides (ints)")
    ap.add_argument("--out", help="also write the JSON summary to this file")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------- SkewAdam on Triton
def transient_bytes_planned(opt) -> int:
    """What `skewadam.kernels.triton.step_transient_bytes` says a step of ``opt`` (a SkewAdam) allocates, given each
    parameter's state and group, per parameter dtype."""
    from skewadam.kernels import triton as tk
    from skewadam.state import state_flags

    by_dtype: dict[Any, list] = {}
    for index, g in enumerate(opt.param_groups):
        spec = state_flags(g)
        for p in g["params"]:
            by_dtype.setdefault(p.dtype, []).append((*spec.planned(p.shape, p.dtype), index))
    return sum(tk.step_transient_bytes(t, d) for d, t in by_dtype.items())


# ---------------------------------------------------------------------------------------------- the measurement
def build_model(model: dict, dtype, device, grads: bool = True):
    import torch

    from skewadam.bench.models import MoETransformer, get_config

    torch.manual_seed(0)
    with torch.device(device):
        m = MoETransformer(get_config(model["preset"], **model["overrides"])).to(dtype)
    if not grads:
        return m
    gen = torch.Generator(device=device).manual_seed(1)
    for p in m.parameters():
        p.grad = (torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 1e-3).to(dtype)
    return m


def optimizers(model, args) -> dict[str, Any]:
    import torch

    from skewadam import SkewAdam
    from skewadam.groups import param_groups

    lr = 1e-4
    params = list(model.parameters())
    opts = {
        "SkewAdam triton": SkewAdam(param_groups(model, log=False), lr=lr, impl="triton",
                                    momentum_dtype=args.momentum_dtype),
        "AdamW fused": torch.optim.AdamW(params, lr=lr, fused=True),
        "AdamW foreach": torch.optim.AdamW(params, lr=lr, foreach=True),
        "Adafactor": torch.optim.Adafactor(params, lr=lr),
    }
    if not args.no_eager:
        opts["SkewAdam eager"] = SkewAdam(param_groups(model, log=False), lr=lr, impl="eager",
                                          momentum_dtype=args.momentum_dtype)
    return opts


def _timer(device) -> Callable[[Callable[[], None]], Callable[[], float]]:
    """``start(fn)`` runs fn and returns a function giving its time in seconds (CUDA events on a GPU)."""
    import torch

    if device.type == "cuda":
        def start(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            return lambda: a.elapsed_time(b) / 1e3
        return start

    def start_cpu(fn):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return lambda: dt
    return start_cpu


def transient_bytes(opt, device) -> Optional[int]:
    """Peak bytes allocated during one step beyond those held before it (CUDA only)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def modeled_bytes(opt) -> dict[str, int]:
    """Bytes a step of ``opt`` (SkewAdam on Triton) moves per pass (`skewadam.kernels.traffic.triton`)."""
    from skewadam.kernels import traffic
    from skewadam.state import state_flags

    out = dict.fromkeys(traffic.PASSES, 0)
    for g in opt.param_groups:
        flags = state_flags(g)
        for p in g["params"]:
            for ps in traffic.triton(tuple(p.shape), p.dtype, flags, relative_step=g["relative_step"]).passes:
                out[ps.name] += ps.read + ps.written
    return out


class Stream:
    """``a.add_(b)`` over ``n`` elements: a plain stream's bandwidth, stepped like an optimizer."""

    def __init__(self, n: int, dtype, device) -> None:
        import torch

        from skewadam.kernels import traffic

        self.a, self.b = torch.zeros(n, dtype=dtype, device=device), torch.ones(n, dtype=dtype, device=device)
        self.bytes = traffic.stream(n, dtype).bytes

    def step(self) -> None:
        self.a.add_(self.b)


def measure(dtype_name: str, args, device, model_spec: dict) -> dict[str, Any]:
    import torch

    from skewadam.kernels import traffic

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = build_model(model_spec, dtype, device)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opts = optimizers(model, args)
    opts["stream a.add_(b)"] = stream = Stream(1 << (28 if device.type == "cuda" else 12), dtype, device)
    passes = modeled_bytes(opts["SkewAdam triton"])
    moved = {"SkewAdam triton": sum(passes.values()), "AdamW fused": traffic.adamw(n, dtype).bytes,
             "stream a.add_(b)": stream.bytes}
    names = list(opts)
    for name in names:
        for _ in range(args.warmup):
            opts[name].step()
    memory = {name: transient_bytes(opts[name], device) for name in names}
    start = _timer(device)
    times: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        pending = {name: [start(opts[name].step) for _ in range(args.steps)] for name in order}
        if device.type == "cuda":
            torch.cuda.synchronize()
        per_round = {name: statistics.median(f() for f in fs) for name, fs in pending.items()}
        for name in names:
            times[name] += [f() for f in pending[name]]
            ratios[name].append(per_round[name] / per_round["AdamW fused"])
    skipped = opts["SkewAdam triton"].skipped_steps  # (a device counter: read once, here)
    results = {}
    for name in names:
        t = memory[name]
        results[name] = {"median_ms": statistics.median(times[name]) * 1e3,
                         "vs_adamw_fused": statistics.median(ratios[name]),
                         "transient_bytes": t, "transient_fraction": None if t is None else t / param_bytes}
        if name in moved:
            results[name].update(bytes=moved[name], gb_s=moved[name] / statistics.median(times[name]) / 1e9)
    skew = results["SkewAdam triton"]
    skew["transient_bytes_planned"] = transient_bytes_planned(opts["SkewAdam triton"])
    skew["bytes_per_pass"] = passes
    skew["efficiency_vs_adamw_fused"] = skew["gb_s"] / results["AdamW fused"]["gb_s"]
    skew["efficiency_vs_stream"] = skew["gb_s"] / results["stream a.add_(b)"]["gb_s"]
    shapes: dict[str, int] = {}
    for p in params:
        shapes[str(tuple(p.shape))] = shapes.get(str(tuple(p.shape)), 0) + 1
    out = {"params": n, "param_bytes": param_bytes, "tensors": len(params), "shapes": shapes, "results": results,
           "skewadam_skipped_steps": skipped}
    del opts, model, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_tests(dry_run: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_triton.py")]
    if dry_run:
        cmd += ["-k", "rounding"]  # the interpreter is slow: the script's path to the tests, not the tests
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else str(e.stdout)
    lines = [line for line in out.splitlines() if line.strip()]
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
            "summary": lines[-1] if lines else "", "tail": lines[-15:] if rc not in (0,) else lines[-1:]}


# ---------------------------------------------------------------------------------------------- training steps
def _takes(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


def train_memory(dtype_name: str, args, device, model_spec: dict) -> dict[str, Any]:
    """Peak allocated bytes of ``args.steps`` training steps after ``args.warmup`` (state allocated, kernels
    compiled), per step mode, with the bytes held before them (parameters and state), the gradient bytes and the
    losses; the planner's peak for the same model, batch and kernel."""
    import torch

    from skewadam import SkewAdam
    from skewadam.bench.planner import plan
    from skewadam.groups import param_groups

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    arm = {"fp32": "skewadam", "bf16": "skewadam-bf16m", "int8": "skewadam-lean"}[args.momentum_dtype]
    cuda = device.type == "cuda"
    modes = {"regular": {}}
    if _takes(SkewAdam, "in_backward"):  # the step inside backward, where this build has it
        modes["in_backward"] = {"in_backward": True}
    out: dict[str, Any] = {}
    for mode, kw in modes.items():
        model = build_model(model_spec, dtype, device, grads=False)
        opt = SkewAdam(param_groups(model, log=False), lr=1e-4, impl="triton", momentum_dtype=args.momentum_dtype, **kw)
        T = min(args.seq, model.config.block_size)
        gen = torch.Generator(device=device).manual_seed(2)
        tokens = [torch.randint(model.config.vocab_size, (args.batch, T + 1), generator=gen, device=device)
                  for _ in range(args.warmup + args.steps)]
        losses, held, peak = [], None, None
        for i, batch in enumerate(tokens):
            if i == args.warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
            loss = model(batch[:, :-1], batch[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        planned = None
        if not kw or _takes(plan, "in_backward"):
            planned = plan(model, batch=args.batch, seq=T, param_dtype=dtype_name, optimizers=[arm], impl="triton",
                           device="cuda", **kw)[arm].peak  # (the GPU's plan, for a dry run too)
        out[mode] = {"held_bytes": held, "peak_bytes": peak, "planned_peak_bytes": planned,
                     "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                     "losses": [float(x) for x in losses]}
        del model, opt, tokens, losses
        if cuda:
            torch.cuda.empty_cache()
    if "in_backward" in out:
        a, b = out["regular"], out["in_backward"]
        out["losses_equal"] = a["losses"] == b["losses"]
        if cuda:
            out["peak_drop_of_grad_bytes"] = (a["peak_bytes"] - b["peak_bytes"]) / a["grad_bytes"]
    else:
        out["in_backward"] = "SkewAdam does not take in_backward in this build"
    return out


# ---------------------------------------------------------------------------------------------- compile only
def _signature(a) -> str:
    import torch

    if isinstance(a, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.int64: "i64",
                      torch.int32: "i32", torch.int8: "i8", torch.bool: "i1"}[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2**31 <= a < 2**31 else "i64"
    return "fp32"


def compile_only(arch: int, model_spec: dict) -> dict[str, Any]:
    """Record every kernel launch of steps over the benchmark's parameters and a coverage set (every dtype, first
    moment format, eps mode, lr as a float and a tensor, the three passes with and without a skip flag, Adafactor's
    relative step and beta2 decay), on CPU
    tensors without launching, then compile each distinct configuration for ``arch`` (Triton's whole pipeline to a
    cubin; no GPU is used)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from skewadam.kernels import triton as tk

    if tk.interpreted():
        raise SystemExit("--compile-only compiles the kernels: run it without TRITON_INTERPRET=1")
    seen: dict[tuple, tuple] = {}

    def record(kernel, grid, *args, warps=4, **meta):
        if not all(grid):
            return
        sig = {name: _signature(a) for name, a in zip(kernel.arg_names, args)}
        sig.update({k: "constexpr" for k in meta})
        key = (kernel.__name__, tuple(sig.items()), tuple((k, str(v)) for k, v in meta.items()), warps)
        seen.setdefault(key, (kernel, sig, dict(meta), warps))

    from skewadam import SkewAdam
    from skewadam.kernels.triton import entry, tables

    saved = entry.launch, tables.interpreted
    entry.launch, tables.interpreted = record, lambda: True  # record, and take CPU tensors as the interpreter does
    try:
        for dtype in ("fp32", "bf16"):
            m = build_model(DRY_MODEL, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], torch.device("cpu"))
            SkewAdam(_groups(m), lr=1e-3, impl="triton").step()
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for momentum in ("fp32", "bf16", "int8"):
                if momentum == "bf16" and dtype == torch.float64:
                    continue
                for eps_mode, lr in (("add", 1e-3), ("floor", torch.tensor(1e-3))):
                    opt = SkewAdam(_coverage(dtype), lr=lr, momentum_dtype=momentum, eps_mode=eps_mode,
                                   eps=1e-8 if eps_mode == "floor" else 1e-30, impl="triton")
                    opt.step()
                    for i in range(len(opt.param_groups)):  # the three passes, the seam's path
                        _, g = opt._init_group(opt.param_groups[i], i, 0, True)
                        for skip in (None, torch.zeros((), dtype=torch.bool)):
                            tk.apply_updates_(g, tk.update_moments_(g, tk.grad_stats(g), skip=skip), skip=skip)
                        adafactor = g._replace(relative_step=True, beta2_decay=-0.8)  # Adafactor's options
                        tk.step_([adafactor], skip_nonfinite=True)
                        tk.apply_updates_(adafactor, tk.update_moments_(adafactor, tk.grad_stats(adafactor)))
        tk.stochastic_round_bf16(torch.zeros(3), 1)
    finally:
        entry.launch, tables.interpreted = saved
    target = GPUTarget("cuda", arch, 32)
    failures, t0 = [], time.perf_counter()
    for (name, _, consts, warps), (kernel, sig, meta, _) in seen.items():
        try:
            triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=meta), target=target,
                           options={"num_warps": warps, "enable_fp_fusion": False})
        except Exception as e:  # report every failure, not the first
            failures.append({"kernel": name, "constexprs": dict(consts), "error": str(e).splitlines()[-1][:300]})
    return {"arch": arch, "configurations": len(seen), "kernels": sorted({k[0] for k in seen}), "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1)}


def _groups(model):
    from skewadam.groups import param_groups

    return param_groups(model, log=False)


def _coverage(dtype) -> list[dict[str, Any]]:
    """Tensors of every kind a step buckets: factored (aligned and not), full (flat and int8 rows), banks, 0-d."""
    import torch

    def p(*shape):
        t = torch.zeros(shape, dtype=dtype)
        t.grad = torch.zeros(shape, dtype=dtype)
        return t

    return [{"params": [p(), p(7), p(5, 9), p(64, 64), p(2, 3, 4, 5)], "tier": "backbone"},
            {"params": [p(3, 5, 9), p(4, 8, 256)], "tier": "expert"},
            {"params": [p(4, 6), p(8, 64)], "tier": "router"}]


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    t0 = time.perf_counter()
    import torch
    import triton

    model_spec = DRY_MODEL if args.dry_run else dict(BENCH_MODEL)
    if args.set:
        model_spec = {**model_spec, "overrides": {**model_spec["overrides"],
                                                  **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)}}}
    summary: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__}
    if args.compile_only:
        summary["compile"] = compile_only(args.arch, model_spec)
        print(json.dumps(summary, indent=1))
        return 1 if summary["compile"]["failures"] else 0
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU: use --dry-run (CPU, interpreter) or --compile-only")
    if args.dry_run:
        args.rounds, args.steps, args.warmup, args.batch, args.seq = 1, 1, 1, 2, 16
    summary["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    summary["model"] = model_spec
    if args.train_memory:
        summary["train_memory"] = {d: train_memory(d, args, device, model_spec) for d in args.dtypes.split(",")}
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        return _emit(summary, args.out)
    summary["results"] = {d: measure(d, args, device, model_spec) for d in args.dtypes.split(",")}
    goals = {}
    for d, res in summary["results"].items():
        r = res["results"]["SkewAdam triton"]
        goals[f"{d}: SkewAdam/AdamW fused <= {GOALS[d]}"] = {"measured": round(r["vs_adamw_fused"], 3),
                                                             "met": r["vs_adamw_fused"] <= GOALS[d]}
        frac = r["transient_fraction"]
        goals[f"{d}: transient < 1% of the parameters"] = {"measured": frac,
                                                          "met": None if frac is None else frac < 0.01}
    summary["goals"] = goals
    if not args.no_tests:
        summary["tests"] = run_tests(args.dry_run)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    return _emit(summary, args.out)


def _emit(summary: dict[str, Any], out: Optional[str]) -> int:
    """Print the JSON summary (and write it to ``out``)."""
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if out:
        Path(out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
