"""The ``skewadam`` command (also ``python -m skewadam``): every argument parser and every printed line lives here.

Subcommands: ``tiers`` (`skewadam.classify`), ``plan`` (`skewadam.bench.planner`, ``--measure``:
`skewadam.bench.measure`), ``bench`` and ``report`` (`skewadam.bench`), ``bench-step`` (`skewadam.bench.bench_step`);
``--impl`` chooses among `skewadam.kernels.BACKENDS`; optimizer names are the arms of `skewadam.bench.arms`.

A user's mistake (a bad value, a missing file, malformed JSON, a missing optional package) is one line on stderr and
exit status 1; ``--debug`` or ``SKEWADAM_DEBUG=1`` shows its traceback. Anything else (a bug) keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from .bench import arms

__all__ = ["main", "build_parser", "parse_optimizers", "parse_lrs", "parse_sets"]


def _arm(text: str) -> str:
    """argparse type of an optimizer name: its arm's name, or a one-line error listing the arms."""
    try:
        return arms.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_sets(items: Sequence[str], *, json_values: bool = True) -> dict[str, Any]:
    """``KEY=VALUE`` overrides of a model config; a VALUE is parsed as JSON (``json_values``) or as an int or a
    float, else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. --set n_experts=64")
        out[key] = value
        for parse in (json.loads,) if json_values else (int, float):
            try:
                out[key] = parse(value)
                break
            except ValueError:  # json.JSONDecodeError is one
                continue
    return out


def _load_model(command: str, spec: str, overrides: dict[str, Any] | None = None):
    """The model of a preset name or a Hugging Face ``config.json``, on the meta device (`skewadam.bench.presets`)."""
    from .bench.presets import load_model

    try:
        return load_model(spec, device="meta", overrides=overrides)
    except (ValueError, OSError, ImportError) as e:
        raise SystemExit(f"skewadam {command}: {e}") from None


# ----------------------------------------------------------------------------------------------------- tiers
def _add_tiers(sub) -> None:
    p = sub.add_parser(
        "tiers",
        help="print the SkewAdam tier census of a model (config.json or preset), built on the meta device",
        description="Label a model's parameters backbone/expert/router and print per-tier counts and optimizer state. "
        "The model is built on the meta device, so any size costs no memory.",
    )
    p.add_argument("config", metavar="CONFIG", help="a Hugging Face config.json (or its folder), or a preset name")
    p.add_argument("--json", action="store_true", help="print the census as JSON")
    p.add_argument("--rule", action="append", default=[], metavar="PATTERN=TIER",
                   help="user rule (regex on parameter names), first match wins; repeatable")
    p.add_argument("--list", action="store_true", help="also list every parameter with its tier")
    p.set_defaults(func=_tiers)


def _tiers(args: argparse.Namespace) -> int:
    from .classify import classify
    from .groups import describe

    rules = []
    for r in args.rule:
        pattern, sep, tier = r.rpartition("=")
        if not sep:
            raise SystemExit(f"--rule {r!r}: expected PATTERN=TIER, e.g. --rule '\\.router\\.=router'")
        rules.append((pattern, tier))
    model = _load_model("tiers", args.config)
    labels = classify(model, rules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        census = describe(model, labels=labels)
    if args.json:
        out = census.to_dict()
        out["warnings"] = [str(w.message) for w in caught]
        if args.list:
            out["labels"] = labels
        print(json.dumps(out, indent=2))
    else:
        print(census.table())
        for w in caught:
            print(f"warning: {w.message}")
        if args.list:
            for name, tier in labels.items():
                print(f"{tier:<9} {name}")
    return 0


# ------------------------------------------------------------------------------------------------------ plan
def _add_plan(sub) -> None:
    from .bench.planner import DTYPES
    from .kernels import BACKENDS, BACKEND_CHOICES

    p = sub.add_parser(
        "plan",
        help="bytes of parameters, gradients, master weights and optimizer state, and an estimated peak, per optimizer",
        description="Plan the memory of training MODEL with AdamW, 8-bit AdamW, Adafactor, SkewAdam and its tier "
        "ablations. MODEL is a preset or a Hugging Face config.json (built on the meta device). The peak is an "
        "estimate; its assumptions are printed.",
    )
    p.add_argument("model", metavar="MODEL", help="a preset (e.g. paper-6.78b, mixtral-8x7b) or a config.json path")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: context length, <= 4096)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32", help="parameter/activation dtype")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: from the config)")
    p.add_argument("--impl", choices=BACKEND_CHOICES, default="auto",
                   help="SkewAdam's backend, for its step temporaries: " + "; ".join(
                       f"{b.name}: {b.summary}" for b in BACKENDS.values()) + " (default auto: the one SkewAdam "
                   "runs on --device, also what --measure steps with)")
    p.add_argument("--shards", type=int, default=1,
                   help="FSDP2 ranks (Shard(0)): also print the bytes SkewAdam's statistics all-reduce and an "
                   "orthogonal tier gathers, per rank and step")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=None,
                   help="DeepSpeed ZeRO stage over --shards ranks (skewadam.integrations.deepspeed): print SkewAdam's "
                   "weights, master, gradients and state per rank and the bytes it all-reduces per step")
    p.add_argument("--in-backward", action="store_true",
                   help="SkewAdam steps each tensor inside backward (in_backward=True): count the gradients in flight "
                   "(the largest one backward produces at once), not all of them; --measure steps so too")
    p.add_argument("--optimizer", action="append", type=_arm, default=None, metavar="NAME",
                   help="plan only these (repeatable; default: " + ", ".join(arms.PLAN_DEFAULT) + "; any of "
                   + ", ".join(arms.names(planned=True)) + ")")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override a config value (VALUE parsed as JSON), e.g. --set num_hidden_layers=4; repeatable")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    p.add_argument("--measure", metavar="OPTIMIZER", type=_arm, default=None,
                   help="also train real steps with OPTIMIZER (adamw, adafactor, skewadam...) and print the measured "
                   "peak beside the estimate (allocates the model!)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model would train: the backend --impl auto plans, and the device of --measure")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from .bench.planner import plan
    from .kernels import BACKENDS, resolve_backend
    from .state import format_bytes

    overrides = parse_sets(args.set)
    model = _load_model("plan", args.model, overrides)
    optimizers = args.optimizer
    if args.measure and args.measure not in (optimizers or arms.PLAN_DEFAULT):  # its row in the table
        optimizers = [*(optimizers or arms.PLAN_DEFAULT), args.measure]
    try:  # --measure: planned with the backend its steps run (resolving builds it), else from the registry alone
        impl = resolve_backend(args.impl, args.device).name if args.measure else args.impl
        result = plan(model, batch=args.batch, seq=args.seq, param_dtype=args.param_dtype, top_k=args.top_k,
                      optimizers=optimizers, impl=impl, device=args.device, shards=args.shards,
                      in_backward=args.in_backward, zero=args.zero)
        result = dataclasses.replace(result, model=args.model)
        measured = None
        if args.measure:
            from .bench.measure import measure_peak

            print(f"skewadam plan: measuring {args.measure} on {args.device}: {args.model} built for real, 2 "
                  f"training steps in a fresh process", file=sys.stderr, flush=True)
            measured = measure_peak(args.model, optimizer=args.measure, batch=args.batch, seq=result.seq,
                                    param_dtype=args.param_dtype, device=args.device, overrides=overrides,
                                    impl=result.backend, in_backward=args.in_backward,
                                    progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    except ValueError as e:
        raise SystemExit(f"skewadam plan: {e}") from None
    if args.json:
        out = result.to_dict()
        if measured:
            out["measured"] = measured
        print(json.dumps(out, indent=2))
    else:
        print(result)
        if measured:
            print(f"\nmeasured: {args.measure} on {args.device} with {BACKENDS[measured['impl']].summary}, "
                  f"{measured['method']}: {format_bytes(measured['measured'])} ({measured['measured']:,} B), vs the "
                  f"estimate in the table (row {args.measure}, column peak, --impl {measured['impl']}): "
                  f"{format_bytes(measured['estimate'])}; measured / estimate = {measured['ratio']:.3f}")
    return 0


# ----------------------------------------------------------------------------------------------------- bench
# flag -> RunConfig field, for the flags that override the preset's shared settings
_RUN_FLAGS = ("model", "data", "steps", "batch_size", "block_size", "eval_interval", "eval_batches", "warmup_frac",
              "grad_clip", "device", "threads")


def parse_optimizers(text: str) -> tuple[str, ...]:
    """``"adamw,skewadam"`` -> arm names; ``all`` = every arm the bench trains, ``default`` = the default five."""
    from .bench.config import ALL, DEFAULT_OPTIMIZERS

    names: list[str] = []
    for token in text.replace(" ", ",").split(","):
        if token == "all":
            names += ALL
        elif token == "default":
            names += DEFAULT_OPTIMIZERS
        elif token:
            try:
                names.append(arms.get(token).name)
            except ValueError:
                raise ValueError(f"unknown optimizer {token!r} in --optimizers: use any of {', '.join(ALL)}, "
                                 f"'default' or 'all'") from None
    return tuple(dict.fromkeys(names))


def parse_lrs(specs: list[str], optimizers: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """``--lrs`` specs -> lrs per optimizer. A spec is ``1e-4,3e-4`` (every optimizer), ``NAME=1e-4,3e-4`` (one),
    or ``x0.3,x1,x3`` (multiples of each optimizer's default lr). Later specs override earlier ones."""
    out: dict[str, tuple[float, ...]] = {}
    for spec in specs:
        name, _, values = spec.rpartition("=")
        try:
            targets = [arms.get(name).name] if name else optimizers
        except ValueError as e:
            raise ValueError(f"--lrs {spec!r}: {e}") from None
        for opt in targets:
            try:
                lrs = tuple(arms.get(opt).lr * float(v[1:]) if v.startswith("x") else float(v)
                            for v in values.split(",") if v)
            except ValueError:
                raise ValueError(f"--lrs {spec!r}: expected numbers like 1e-4,3e-4 or multipliers like x0.3,x1,x3")
            if not lrs or any(lr <= 0 for lr in lrs):
                raise ValueError(f"--lrs {spec!r}: learning rates must be positive")
            out[opt] = lrs
    return out


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence, whole, on one line."""
    text = " ".join(doc.split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".") + "."


def _preset_runs(bench) -> str:
    """What a preset runs, from its settings: ``(adamw, muon; 2 runs of 60 steps)``."""
    return f"({', '.join(bench.optimizers)}; {len(bench.runs())} runs of {bench.base.steps} steps)"


def _preset_defaults(presets: dict[str, Any], field: str) -> str:
    """What each preset sets ``field`` to, for a flag's help: ``default: the preset's: 60 (default), 2 (smoke)``."""
    by_value: dict[str, list[str]] = {}
    for name, bench in presets.items():
        value = getattr(bench.base, field)
        by_value.setdefault("the model's" if value is None else str(value), []).append(name)
    if len(by_value) == 1:
        return f"default: {next(iter(by_value))}, every preset's"
    return "default: the preset's: " + ", ".join(f"{v} ({', '.join(names)})" for v, names in by_value.items())


def _add_bench(sub) -> None:
    from .bench import run
    from .bench.config import ALL, DEFAULT_OPTIMIZERS, PRESETS

    p = sub.add_parser(
        "bench", help="compare optimizers training the reference MoE (memory, speed, quality), with plots",
        description=run.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="optimizers: " + ", ".join(ALL) + "\npresets:\n" + "\n".join(
            f"  {k}: {_first_sentence(v.__doc__)} {_preset_runs(v())}" for k, v in PRESETS.items()))
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="starting settings (default: default)")
    p.add_argument("--optimizers", metavar="LIST",
                   help="comma-separated names, 'default' or 'all' (default: the preset's; default preset: "
                        + ",".join(DEFAULT_OPTIMIZERS) + ")")
    p.add_argument("--lrs", nargs="+", metavar="SPEC", default=[],
                   help="learning rates: '1e-4,3e-4' (all), 'adamw=1e-4,3e-4' (one) or 'x0.3,x1,x3' (multiples "
                        "of each default)")
    p.add_argument("--seeds", type=int, help="repeat each run with seeds 0..N-1 (default 1)")
    p.add_argument("--model", help="what `skewadam plan` takes: a reference preset (tiny, cpu, paper-6.78b), a "
                                   "Transformers MoE preset (mixtral-8x7b, qwen3-30b-a3b, olmoe-1b-7b, ...) or a "
                                   "config.json path; built from the config with the corpus's vocabulary, nothing "
                                   "downloaded (default: cpu)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="the model config's own keys, to scale it (VALUE parsed as JSON), e.g. --set hidden_size=128 "
                        "num_hidden_layers=2 num_local_experts=8; repeatable")
    p.add_argument("--data", help="a UTF-8 text file, or a folder: every UTF-8 text file under it, judged by content "
                                  "(a source tree works; binary files are skipped and counted) (default: the "
                                  "embedded Shakespeare)")
    presets = {name: make() for name, make in PRESETS.items()}
    for flag, kind, what in (("steps", int, "training steps"), ("batch-size", int, "sequences per step"),
                             ("block-size", int, "tokens per sequence"),
                             ("eval-interval", int, "steps between evaluations"),
                             ("eval-batches", int, "fixed validation batches"),
                             ("warmup-frac", float, "linear warm-up fraction of the steps, then cosine to 0"),
                             ("grad-clip", float, "max global grad norm, 0 = off")):
        p.add_argument(f"--{flag}", type=kind, help=f"{what} ({_preset_defaults(presets, flag.replace('-', '_'))})")
    p.add_argument("--device", choices=("cpu", "cuda"), help="cuda: bf16 weights (default cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads per run (default: the preset's; default 1, "
                                                 "study and smoke: torch's)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time, each its own process (default: cores / threads, e.g. 2 single-threaded runs "
                        "on 2 cores; 1 when threads is torch's default or on cuda); timings of runs at once share "
                        "the CPU")
    p.add_argument("--out", type=Path, help="run directory; an existing one is resumed (default: "
                                            "bench-runs/<date-time>)")
    p.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard event files under DIR")
    p.add_argument("--no-plots", action="store_true", help="write results.md only, no PNG plots (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars or lines")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from .bench.run import BenchError, run_bench
    from .bench.config import BenchConfig, get_preset

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        bench = get_preset(args.preset)
        overrides = {f: getattr(args, f) for f in _RUN_FLAGS if getattr(args, f) is not None}
        if args.set:
            overrides["overrides"] = parse_sets(args.set)
        base = dataclasses.replace(bench.base, **overrides)
        optimizers = parse_optimizers(args.optimizers) if args.optimizers else bench.optimizers
        lrs = {**{k: v for k, v in bench.lrs.items() if k in optimizers}, **parse_lrs(args.lrs, optimizers)}
        bench = BenchConfig(base=base, optimizers=optimizers, lrs=lrs,
                            seeds=args.seeds if args.seeds is not None else bench.seeds,
                            jobs=args.jobs if args.jobs is not None else bench.jobs)
    except ValueError as e:
        raise SystemExit(f"skewadam bench: {e}")
    out = args.out or Path("bench-runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        failed = run_bench(bench, out, tensorboard=args.tensorboard, progress=not args.no_progress,
                           plots=not args.no_plots, echo=functools.partial(print, flush=True))
    except (ValueError, BenchError) as e:
        raise SystemExit(f"skewadam bench: {e}") from None
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished runs are kept. Resume with the same command and --out {out}", file=sys.stderr)
        return 130
    diverged = []
    if any((out / "runs").glob("*.json")):
        from .bench.logs import load_runs
        from .bench.report import divergence, render

        print()
        print(render(out, plots=not args.no_plots))
        diverged = [f"{r['name']} ({why})" for r in load_runs(out)[0] if (why := divergence(r))]
    if diverged:
        print(f"{len(diverged)} run(s) diverged: {'; '.join(diverged)}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    wall = time.perf_counter() - t0
    print(f"skewadam bench: {wall // 60:.0f} min {wall % 60:02.0f} s wall time (1-min load average {load0:.1f} at "
          f"the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs); results in {out}", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------- report
def _add_report(sub) -> None:
    from .bench import report

    p = sub.add_parser("report", help="re-render the table and plots of a `skewadam bench` run directory",
                       description=report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `skewadam bench` (--out)")
    p.add_argument("--baseline", default="adamw", help="optimizer the ratios are taken to (default: adamw)")
    p.add_argument("--no-plots", action="store_true", help="write results.md only")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from .bench.report import render

    if not Path(args.run_dir).is_dir():
        raise SystemExit(f"skewadam report: {args.run_dir}: no such directory (a `skewadam bench --out` directory)")
    print(render(args.run_dir, arms.get(args.baseline).name, plots=not args.no_plots))
    return 0


# ------------------------------------------------------------------------------------------------ bench-step
def _add_bench_step(sub) -> None:
    from .bench import bench_step
    from .bench.planner import DTYPES
    from .kernels import BACKENDS, BACKEND_CHOICES

    first, *others = arms.BENCH_STEP_DEFAULT
    p = sub.add_parser(
        "bench-step", help="time one optimizer step: SkewAdam vs fused/foreach AdamW and Adafactor, with memory",
        description=bench_step.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="cpu",
                   help="model preset of skewadam.bench.models: tiny, cpu, ... (default: cpu)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override model config fields, e.g. --set n_layer=18 d_ff=512 d_expert=384; repeatable")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype (default: fp32)")
    p.add_argument("--optimizers", nargs="+", type=_arm, metavar="NAME",
                   help=f"compared with {first} (default: {', '.join(others)}; any of "
                        f"{', '.join(arms.names(buildable=True))})")
    p.add_argument("--impl", choices=BACKEND_CHOICES, default="auto",
                   help="SkewAdam's backend: " + "; ".join(f"{b.name}: {b.summary}" for b in BACKENDS.values())
                   + " (default auto: the one SkewAdam picks on CPU)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: 15)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per optimizer per round (default: 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1, the measure that stays steady on a shared machine)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                   help="the process's CPU time (default; steady under load with 1 thread) or wall time")
    p.add_argument("--flush-mb", type=int, default=0, metavar="MiB",
                   help="write a buffer of this many MiB before each timed step, so the step starts with cold caches")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of every optimizer (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and gradients (default: 0)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences of the batch whose forward and backward "
                   "is timed beside the steps (default: 16, the bench's; 0: none)")
    p.add_argument("--roofline", action="store_true", help="instead: SkewAdam, fused AdamW and a.add_(b) per tier "
                   "and C++ path on fixed tensors, as GB/s of the bytes each moves (skewadam.bench.roofline)")
    p.add_argument("--momentum", choices=("fp32", "bf16", "int8"), default="fp32", help="with --roofline: its momentum")
    p.add_argument("--deepspeed", action="store_true", help="with --roofline: also time DeepSpeedCPUAdam")
    p.add_argument("--unchecked", action="store_true", help="with --roofline: SkewAdam(skip_nonfinite=False)")
    p.set_defaults(func=_bench_step)


def _bench_step(args: argparse.Namespace) -> int:
    import torch

    from .bench.bench_step import bench_step, format_report

    for flag in ("rounds", "steps", "threads"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"skewadam bench-step: --{flag} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0 or args.flush_mb < 0 or args.batch_size < 0:
        raise SystemExit("skewadam bench-step: --warmup, --flush-mb and --batch-size must be >= 0")
    torch.set_num_threads(args.threads)
    if args.roofline:
        return _roofline(args)
    if args.deepspeed or args.unchecked or args.momentum != "fp32":
        raise SystemExit("skewadam bench-step: --momentum, --deepspeed and --unchecked go with --roofline")
    first, *others = arms.BENCH_STEP_DEFAULT
    names = tuple(dict.fromkeys((first, *(args.optimizers or others))))
    try:
        res = bench_step(
            preset=args.preset, overrides=parse_sets(args.set, json_values=False), dtype=args.dtype,
            optimizers=names, rounds=args.rounds, steps=args.steps, warmup=args.warmup, impl=args.impl,
            clock=args.clock, flush_mb=args.flush_mb, lr=args.lr, seed=args.seed, batch_size=args.batch_size,
        )
    except ValueError as e:
        raise SystemExit(f"skewadam bench-step: {e}") from None
    print(format_report(res))
    return 0


def _roofline(args: argparse.Namespace) -> int:
    from .bench.roofline import format_roofline, roofline

    if args.optimizers or args.set or args.flush_mb or args.preset != "cpu":
        raise SystemExit("skewadam bench-step: --roofline times its own tensors against fused AdamW and a stream; "
                         "drop --preset, --optimizers, --set and --flush-mb")
    print(format_roofline(roofline(dtype=args.dtype, momentum_dtype=args.momentum, rounds=args.rounds,
                                   steps=args.steps, warmup=args.warmup, impl=args.impl, clock=args.clock,
                                   deepspeed=args.deepspeed, skip_nonfinite=not args.unchecked, seed=args.seed)))
    return 0


# ------------------------------------------------------------------------------------------------------ main
_SUBCOMMANDS = (_add_tiers, _add_plan, _add_bench, _add_report, _add_bench_step)


#: What a user's mistake raises (a bad value, a missing or unreadable file, malformed JSON, a bad regex, a missing
#: optional package): one line, not a traceback.
_USER_ERRORS = (ValueError, OSError, ImportError, re.error)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skewadam", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    for p in (parser, *sub.choices.values()):  # before or after the command
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (also SKEWADAM_DEBUG=1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _USER_ERRORS as e:
        if getattr(args, "debug", False) or os.environ.get("SKEWADAM_DEBUG", "") not in ("", "0"):
            raise
        print(f"skewadam {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, as a shell reports it
        print(f"\nskewadam {args.command}: interrupted", file=sys.stderr)
        return 130
