"""ZeRO-Offload's CPU step: SkewAdam stepping DeepSpeed's flat fp32 partitions (`skewadam.integrations.deepspeed`,
the C++ kernel) against `DeepSpeedCPUAdam`, the optimizer DeepSpeed offloads to, and torch's fused AdamW.

Under ``"offload_optimizer": {"device": "cpu"}`` each rank steps its fp32 partition of every param group on the CPU.
This script builds issue 34's MoE-shaped parameters (14,164,480 in 12 tensors: a [4096, 256] token table, attention
and dense FFN matrices, two expert banks of 32 experts [1024, 256] and [256, 512], a router [32, 256]), flattens each of
SkewAdam's tier groups into one fp32 partition as ZeRO does (one rank holding it all: the partition a rank steps is
its share of these), and times one step of each optimizer over the same partitions and gradients: CPU time, rounds
interleaved (each round runs the optimizers in a rotated order), medians. It prints the time per step, SkewAdam's
ratio to each other one (paired per round), and the CPU memory of each one's state.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/zero_offload_step.py --rounds 15

DeepSpeedCPUAdam builds its C++ op on first use (about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from skewadam import SkewAdam  # noqa: E402
from skewadam.bench.roofline import MOE  # noqa: E402
from skewadam.pieces import Layout, TensorLayout  # noqa: E402
from skewadam.state import format_bytes, measure_state, state_flags  # noqa: E402
from skewadam.zero import Partition, ZeroSteps  # noqa: E402

#: Issue 34's parameters, the roofline's: (name, shape, tier).
PARAMS = [(name, shape, tier) for name, shape, tier, _ in MOE]
TIERS = ("backbone", "expert", "router")


def partitions(seed: int = 0) -> list[tuple[str, list[tuple[str, tuple[int, ...]]], torch.Tensor]]:
    """Per tier: its tensors and their fp32 flat partition, with a gradient, as ZeRO hands it one rank."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for tier in TIERS:
        members = [(n, s) for n, s, t in PARAMS if t == tier]
        numel = sum(torch.Size(s).numel() for _, s in members)
        flat = torch.nn.Parameter(torch.randn(numel, generator=gen) * 0.02)
        flat.grad = torch.randn(numel, generator=gen) * 1e-3
        out.append((tier, members, flat))
    return out


def skewadam_on(parts, impl: str) -> SkewAdam:
    """SkewAdam with one group per tier, each group's tensors swapped for its flat partition, registered as one rank's
    partition holding them all (what `skewadam.integrations.deepspeed.attach` registers from DeepSpeed's
    bookkeeping)."""
    opt = SkewAdam([{"params": [torch.nn.Parameter(torch.empty(s)) for _, s in members], "tier": tier,
                     "param_names": [n for n, _ in members]} for tier, members, _ in parts], lr=1e-3, impl=impl)
    zero, first = ZeroSteps(), 0
    for group, (_, members, flat) in zip(opt.param_groups, parts):
        layouts = [TensorLayout.for_spec(s, state_flags(group)) for _, s in members]
        offsets = [sum(t.numel for t in layouts[:i]) for i in range(len(layouts))]
        runs = [[(i, 0, t.numel, offsets[i]) for i, t in enumerate(layouts)]]
        zero.add(Partition(flat, Layout(layouts, runs), 0, None, first, group["param_names"]), group)
        group["params"] = [flat]
        first += len(members)
    opt._zero = zero
    return opt


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return measure_state(opt).total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5, help="steps timed per optimizer and round (their median counts)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impl", default="cpp", help="SkewAdam's backend (default: the C++ kernel)")
    args = p.parse_args()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    copies = {name: partitions() for name in ("skewadam", "DeepSpeedCPUAdam", "AdamW (torch, fused)")}
    opts = {
        "skewadam": skewadam_on(copies["skewadam"], args.impl),
        "DeepSpeedCPUAdam": DeepSpeedCPUAdam([f for _, _, f in copies["DeepSpeedCPUAdam"]], lr=1e-3,
                                             adamw_mode=True),
        "AdamW (torch, fused)": torch.optim.AdamW([f for _, _, f in copies["AdamW (torch, fused)"]], lr=1e-3,
                                                  fused=True),
    }
    names = list(opts)
    for opt in opts.values():
        for _ in range(args.warmup):
            opt.step()
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        per_round = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            ts = []
            for _ in range(args.steps):
                t0 = time.process_time()
                opts[name].step()
                ts.append(time.process_time() - t0)
            per_round[name] = statistics.median(ts)
            times[name].append(per_round[name])
        for name in names:
            ratios[name].append(per_round["skewadam"] / per_round[name])
    n = sum(torch.Size(s).numel() for _, s, _ in PARAMS)
    print(f"ZeRO-Offload CPU step, {n:,} fp32 parameters in {len(PARAMS)} tensors (3 flat partitions), "
          f"{torch.get_num_threads()} thread(s), CPU time, {args.rounds} rounds x {args.steps} steps, "
          f"SkewAdam's backend: {args.impl}")
    print(f"{'optimizer':<22} {'step (ms)':>10} {'SkewAdam / this':>16} {'state':>11}")
    for name in names:
        print(f"{name:<22} {1e3 * statistics.median(times[name]):>10.2f} {statistics.median(ratios[name]):>16.3f} "
              f"{format_bytes(state_bytes(opts[name])):>11}")


if __name__ == "__main__":
    main()
