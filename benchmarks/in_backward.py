"""The step inside backward (``SkewAdam(..., in_backward=True)``) against the regular step: peak memory and step time.

Three measurements, each printing its figures and one JSON summary line at the end:

``memory`` (CPU): the peak RSS of real training steps of a 68M-parameter fp32 MoE (the reference model,
`skewadam.bench.models`, 8 layers, 4 of them with 64 experts: the gradients are 260 MiB, the largest one bank of
20 MiB), regular vs inside backward, each in a fresh process (`skewadam.bench.measure.measure_peak`, with
``MALLOC_MMAP_THRESHOLD_`` fixed so that glibc returns freed blocks), in pairs whose order alternates, beside the
planner's estimate for each. Goals: the drop is >= 75% of the gradient bytes; each estimate within 5% of its measure.

``time`` (CPU): the wall time of a training step (forward, backward, ``step()``, ``zero_grad()``) of the bench model
(`skewadam bench`'s: preset ``cpu``, batch 16 x 128 tokens), regular vs inside backward, two copies of the model with
the same weights side by side: rounds that time each ``--steps`` times in an order that rotates (load falls on both
alike), 1 thread. The ratio is the median over rounds of (inside backward's median / the regular step's median),
with its spread; also in CPU time (``--clock cpu``). Goal: <= 1.1.

``check`` (CPU): what the step inside backward does once per backward (`skewadam.backward.BackwardSteps._classify`:
one walk of the Python stack, the check of the backward's roots for a GradScaler's product, the end-of-backward
callback) and the root check alone (`skewadam.backward._scaled`), in CPU time per backward, beside the training step
of the bench model (as ``time``: forward, backward, ``step()``, ``zero_grad()``), for a plain loss and for
``loss * 0.5`` (a GradScaler's graph, no GradScaler alive); and the number of graph searches (one per optimizer).

``gpu`` (CUDA): ``torch.cuda.max_memory_allocated`` over a few training steps of the reference model at the paper's
widths (``--set`` scales it to the device) with the Triton kernel, regular vs inside backward, and the step time
(CUDA events), beside the planner's estimate. ``--dry-run`` runs its logic on CPU tensors with the tiny model
(Triton's interpreter), measuring nothing.

Usage (from the repository root):
    python benchmarks/in_backward.py memory
    python benchmarks/in_backward.py time --rounds 7 --steps 3
    python benchmarks/in_backward.py check --steps 10
    python benchmarks/in_backward.py gpu                 # on a GPU
    python benchmarks/in_backward.py gpu --dry-run       # CPU: the GPU script's logic
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))  # children

MEMORY_MODEL = dict(vocab_size=8192, block_size=128, n_layer=8, d_model=256, n_head=4, n_kv_head=2, d_ff=512,
                    d_expert=320, n_experts=64)
GPU_MODEL = dict(n_layer=4, d_expert=1024)  # the paper's widths, 4 layers, 1024-wide experts: ~2.6B parameters


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["memory", "time", "check", "gpu"])
    ap.add_argument("--pairs", type=int, default=2, help="memory: regular/in-backward pairs, order alternating")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (memory: 2, time: 16, gpu: 8)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7, help="time: rounds of interleaved steps")
    ap.add_argument("--steps", type=int, default=3, help="time: timed steps per arm and round; memory, gpu: steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="time: wall time or this process's CPU")
    ap.add_argument("--impl", default="auto", help="SkewAdam's backend")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="gpu: model config overrides (ints)")
    ap.add_argument("--dry-run", action="store_true", help="gpu: CPU tensors, Triton's interpreter, the tiny model")
    return ap.parse_args(argv)


def memory(args: argparse.Namespace) -> dict[str, Any]:
    from skewadam.bench.measure import measure_peak

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    batch = args.batch or 2
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(args.pairs):
        for in_backward in ((False, True) if i % 2 == 0 else (True, False)):
            r = measure_peak("cpu", optimizer="skewadam", batch=batch, seq=args.seq, steps=args.steps,
                             overrides=MEMORY_MODEL, impl=args.impl, in_backward=in_backward)
            runs[in_backward].append(r)
            print(f"{'in backward' if in_backward else 'regular    '}: peak RSS growth {r['measured'] / 2**20:8.1f} MiB, "
                  f"planned {r['estimate'] / 2**20:8.1f} MiB (x{r['ratio']:.3f}), {r['impl']} kernel, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    from skewadam.bench.presets import load_model

    grads = sum(p.numel() for p in load_model("cpu", overrides=MEMORY_MODEL).parameters()) * 4
    regular = statistics.median(r["measured"] for r in runs[False])
    inside = statistics.median(r["measured"] for r in runs[True])
    return {"what": "memory", "model": MEMORY_MODEL, "batch": batch, "seq": args.seq, "steps": args.steps,
            "gradient_bytes": grads, "regular": regular, "in_backward": inside,
            "drop_over_gradients": (regular - inside) / grads,
            "ratios_regular": [r["ratio"] for r in runs[False]], "ratios_in_backward": [r["ratio"] for r in runs[True]],
            "impl": runs[False][0]["impl"], "malloc_mmap_threshold": 128 * 1024}


def _clock(kind: str):
    return time.process_time if kind == "cpu" else time.perf_counter


def step_time(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from skewadam import kernels
    from skewadam.bench import arms
    from skewadam.bench.presets import lm_losses, load_model

    torch.set_num_threads(args.threads)
    batch = args.batch or 16
    torch.manual_seed(0)
    model = load_model("cpu", device="cpu", dtype=torch.float32)
    models = {"regular": model, "in_backward": copy.deepcopy(model)}
    opts = {"regular": arms.get("skewadam").build(models["regular"], impl=args.impl),
            "in_backward": arms.get("skewadam-in-backward").build(models["in_backward"], impl=args.impl)}
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size if hasattr(model, "config") else 256
    clock = _clock(args.clock)

    def one(name: str) -> float:
        idx = torch.randint(0, vocab, (batch, args.seq), generator=gen)
        t0 = clock()
        lm_losses(models[name], idx, idx.roll(-1, 1)).loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return clock() - t0

    names = list(opts)
    for _ in range(args.warmup):
        for name in names:
            one(name)
    ratios, times = [], {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % 2:] + names[:r % 2]
        per = {n: [] for n in names}
        for _ in range(args.steps):
            for name in order:
                per[name].append(one(name))
        for n in names:
            times[n] += per[n]
        ratios.append(statistics.median(per["in_backward"]) / statistics.median(per["regular"]))
        print(f"round {r + 1}: regular {1e3 * statistics.median(per['regular']):7.1f} ms, in backward "
              f"{1e3 * statistics.median(per['in_backward']):7.1f} ms, ratio {ratios[-1]:.3f}, load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"what": "time", "model": "cpu", "batch": batch, "seq": args.seq, "threads": args.threads,
            "clock": args.clock, "impl": kernels.resolve_backend(args.impl, "cpu").name, "rounds": args.rounds,
            "steps": args.steps,
            "regular_ms": 1e3 * statistics.median(times["regular"]),
            "in_backward_ms": 1e3 * statistics.median(times["in_backward"]),
            "ratio": statistics.median(ratios), "ratio_iqr": [q[0], q[2]], "ratio_range": [min(ratios), max(ratios)]}


def check(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from skewadam import backward
    from skewadam.bench import arms
    from skewadam.bench.presets import lm_losses, load_model

    torch.set_num_threads(args.threads)
    batch = args.batch or 16
    torch.manual_seed(0)
    model = load_model("cpu", device="cpu", dtype=torch.float32)
    opt = arms.get("skewadam-in-backward").build(model, impl=args.impl)
    spent = {"classify": 0, "roots": 0, "searches": 0}

    def timed(name, fn):
        def run(*a):
            t0 = time.process_time_ns()
            try:
                return fn(*a)
            finally:
                spent[name] += time.process_time_ns() - t0
        return run

    def counted(roots):
        spent["searches"] += 1
        return search(roots)

    classify, scaled, search = backward.BackwardSteps._classify, backward._scaled, backward._has_reentrant_segment
    backward.BackwardSteps._classify, backward._scaled = timed("classify", classify), timed("roots", scaled)
    backward._has_reentrant_segment = counted
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"what": "check", "model": "cpu", "batch": batch, "seq": args.seq, "threads": args.threads}
    try:
        for loss_form in ("loss", "loss * 0.5"):
            per: dict[str, list[float]] = {"step": [], "classify": [], "roots": []}
            for step in range(args.warmup + args.steps):
                spent.update(classify=0, roots=0)
                idx = torch.randint(0, 256, (batch, args.seq), generator=gen)
                t0 = time.process_time_ns()
                loss = lm_losses(model, idx, idx.roll(-1, 1)).loss
                (loss if loss_form == "loss" else loss * 0.5).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= args.warmup:
                    per["step"].append(time.process_time_ns() - t0)
                    per["classify"].append(spent["classify"])
                    per["roots"].append(spent["roots"])
            row = {k: statistics.median(v) / 1e3 for k, v in per.items()}  # microseconds
            out[loss_form] = {"step_ms": row["step"] / 1e3, "classify_us": row["classify"], "roots_us": row["roots"],
                              "classify_over_step": row["classify"] / row["step"]}
            print(f"{loss_form:>10}: step {row['step'] / 1e3:7.1f} ms, per-backward check {row['classify']:6.1f} us "
                  f"({row['classify'] / row['step']:.1e} of the step), of which the root check {row['roots']:5.1f} us",
                  flush=True)
    finally:
        backward.BackwardSteps._classify, backward._scaled, backward._has_reentrant_segment = classify, scaled, search
    out["graph_searches"] = spent["searches"]
    print(f"graph searches: {spent['searches']} in {2 * (args.warmup + args.steps)} backwards", flush=True)
    return out


def gpu(args: argparse.Namespace) -> dict[str, Any]:
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from skewadam import plan
    from skewadam.bench.presets import lm_losses, load_model

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu: no CUDA device here (--dry-run runs the logic on CPU)")
    preset, overrides = ("tiny", {}) if args.dry_run else ("paper-6.78b", dict(GPU_MODEL))
    for kv in args.set:
        key, value = kv.split("=")
        overrides[key] = int(value)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    batch = args.batch or (2 if args.dry_run else 8)
    seq = 16 if args.dry_run else args.seq
    impl = "triton"
    out: dict[str, Any] = {"what": "gpu", "preset": preset, "overrides": overrides, "batch": batch, "seq": seq,
                           "dtype": str(dtype), "dry_run": args.dry_run}
    for in_backward in (False, True):
        from skewadam.bench import arms

        torch.manual_seed(0)
        if device.type == "cuda":  # (before the model: the estimate counts its weights)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        model = load_model(preset, device=device, dtype=dtype, overrides=overrides)
        opt = arms.get("skewadam").build(model, impl=impl)
        opt.in_backward = in_backward
        vocab = 256 if args.dry_run else model.config.vocab_size
        gen = torch.Generator(device="cpu").manual_seed(0)
        times = []
        for _ in range(args.steps + 1):
            idx = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            lm_losses(model, idx, idx.roll(-1, 1)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        key = "in_backward" if in_backward else "regular"
        n = sum(p.numel() for p in model.parameters())
        estimate = plan(load_model(preset, overrides=overrides), batch=batch, seq=seq,
                        param_dtype="fp32" if args.dry_run else "bf16", optimizers=["skewadam"], impl=impl,
                        in_backward=in_backward)["skewadam"].peak
        entry = {"params": n, "estimate": estimate, "skipped_steps": opt.skipped_steps}
        if device.type == "cuda":
            entry.update(peak=torch.cuda.max_memory_allocated() - base, step_s=statistics.median(times[1:]))
            entry["ratio"] = entry["peak"] / estimate
        out[key] = entry
        print(f"{key}: {json.dumps(entry)}", flush=True)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: Optional[list[str]] = None) -> None:
    args = _parse(argv)
    result = {"memory": memory, "time": step_time, "check": check, "gpu": gpu}[args.what](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
