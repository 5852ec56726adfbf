"""Same bits: SkewAdam's C++ step over many configurations, its weights and state saved, or compared bitwise with a
saved run (another checkout's kernel: a change that keeps the math must keep every bit).

Each configuration steps its own parameters ``--steps`` times with seeded gradients: every tier and momentum storage,
fp32 / bf16 / fp64 weights, eps modes, Adafactor's options, 1 and 2 threads, the one-process call (its units
scheduled for this machine's L2 cache, for a 1 KiB one, where every unit is split, and for a 1 GiB one, where none
is: `skewadam.kernels.cpu.step_`) and the three passes of the distributed seam; bank slices
that are idle on odd steps; rows of huge and of tiny gradients (pass 1's float sums re-run in double); a step with a
NaN gradient (skipped). The result is every parameter and state tensor after the last step.

Usage (from the repository root):
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/same_bits.py --save /tmp/before.pt
    PYTHONPATH=src python benchmarks/same_bits.py --against /tmp/before.pt
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from skewadam import SkewAdam
from skewadam.kernels import cpu

# (shape, tier, overrides): fused units, split units (their momentum or gradient beyond a core's L2), full and 1-D
SPECS = [
    ((4, 1024, 256), "expert", {}),
    ((3, 256, 512), "expert", {}),
    ((2, 600, 600), "expert", {}),
    ((3, 70, 130), "expert", {"use_momentum": True}),
    ((1536, 256), "backbone", {}),
    ((256, 256), "backbone", {}),
    ((1100, 700), "expert", {"bank": False}),
    ((96, 33), "backbone", {}),
    ((256,), "backbone", {}),
    ((5,), "backbone", {}),
    ((32, 256), "router", {}),
    ((300, 1000), "backbone", {"use_factored": False}),
    ((2, 40, 50), "expert", {"use_factored": False}),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
OPTIONS = {"plain": {}, "relative_step": {"relative_step": True}, "beta2_decay": {"beta2_decay": -0.8}}
# the one-process step with a cache size (None: this machine's), or the three passes (no step_: "three-pass")
CACHES = {"one-process": None, "one-process 1 KiB cache": 1 << 10, "one-process 1 GiB cache": 1 << 30,
          "three-pass": "three-pass"}
MACHINE = getattr(cpu, "cache_bytes", None)


def configurations():
    for dtype, momentum, eps_mode, option, threads, passes in itertools.product(
            DTYPES, ("fp32", "bf16", "int8"), ("add", "floor"), OPTIONS, (1, 2), CACHES):
        if (momentum == "bf16" and dtype == "fp64") or (option != "plain" and momentum != "fp32"):
            continue
        yield f"{dtype} {momentum}-momentum {eps_mode} {option} {threads}t {passes}", (
            DTYPES[dtype], momentum, eps_mode, OPTIONS[option], threads, CACHES[passes])


def gradients(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for shape, tier, overrides in SPECS:
        g = torch.randn(shape, generator=gen, dtype=torch.float64) * 1e-3
        if len(shape) >= 2:
            g[..., 0, :] *= 1e24  # a row whose float sum of squares overflows
            g[..., 1, :] *= 1e-27  # and one whose float sum underflows
        if len(shape) == 3 and step % 2:
            g[0] = 0  # an idle bank slice
        out.append(g.to(dtype))
    if step == 2:
        out[-3].view(-1)[7] = float("nan")  # a skipped step
    return out


def run(dtype, momentum, eps_mode, options, threads, cache, steps) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen, dtype=torch.float64) * 0.02).to(dtype))
              for s, _, _ in SPECS]
    groups = [{"params": [p], "tier": tier, "momentum_dtype": momentum, **overrides}
              for p, (_, tier, overrides) in zip(params, SPECS)]
    opt = SkewAdam(groups, lr=0.01, weight_decay=0.1, eps_mode=eps_mode, seed=5, impl="cpp", **options)
    if cache == "three-pass":
        opt._reducer = lambda items: None  # the three passes, the identity between them
    # (a checkout whose step_ schedules nothing by cache ignores it)
    cpu.cache_bytes = MACHINE if cache in (None, "three-pass") else (lambda: cache)
    torch.set_num_threads(threads)
    for step in range(steps):
        for p, g in zip(params, gradients(step, dtype)):
            p.grad = g
        opt.step()
    return [t for p in params for t in (p.detach(), *opt.state[p].values())]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))  # NaNs compared by their bits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", metavar="FILE", help="save every configuration's tensors to FILE")
    what.add_argument("--against", metavar="FILE", help="compare bitwise with a run saved with --save")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    results = {name: run(*config, args.steps) for name, config in configurations()}
    if args.save:
        torch.save(results, args.save)
        print(f"saved {len(results)} configurations, {sum(map(len, results.values()))} tensors to {args.save}")
        return 0
    saved = torch.load(args.against)
    differ = [name for name in saved if name not in results or len(results[name]) != len(saved[name])
              or not all(same(a, b) for a, b in zip(results[name], saved[name]))]
    differ += [name for name in results if name not in saved]
    tensors = sum(map(len, results.values()))
    print(f"{len(results)} configurations, {tensors} tensors after {args.steps} steps: "
          f"{'all bitwise the same' if not differ else f'{len(differ)} configurations differ'}")
    for name in differ:
        print(f"  differs: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
