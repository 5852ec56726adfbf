"""Which bytes a step's time pays for on this machine: torch ops that read and write whole tensors, timed side by side.

`skewadam.kernels.traffic` counts the bytes each pass reads and writes. Whether a written byte costs as much time as a
read one depends on the machine: one core of a server CPU keeps a limited number of reads in flight, and a write into
a cache line it has just read (an in-place update) may add no time at all, while a write to another tensor first reads
the line it overwrites. This script times ops over tensors of ``--numel`` fp32 elements (default 12.6M, 50 MB each:
far larger than the L3 cache), rounds interleaved in a rotated order, medians, CPU time with 1 thread (wall time
with more), and prints each op's time, its time per read stream, and its attained GB/s counting its reads only and
counting all its bytes. Then ``a.add_(b)``'s time over ``torch.dot(a, b)``'s, both reading the same two tensors:
1.0 where a write in place costs nothing beside the reads (the reads bound a step: SkewAdam's over AdamW's is then
`Traffic.read`'s ratio), 1.5 where every byte costs alike (`Traffic.bytes`' ratio).

    python benchmarks/streams.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from skewadam.bench.bench_step import cpu_info, page_size
from skewadam.kernels import traffic


def ops(numel: int) -> dict[str, tuple[int, int, Callable[[], object]]]:
    """Per op: element-sized streams read, written, and the op."""
    a, b, c, d = (torch.randn(numel) for _ in range(4))
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    adamw = torch.optim.AdamW([p], lr=1e-3, fused=True)
    size = torch.float32.itemsize * numel

    def streams(t: traffic.Traffic) -> tuple[int, int]:
        return t.read // size, (t.bytes - t.read) // size

    return {
        "vector_norm(a)": (1, 0, lambda: torch.linalg.vector_norm(a)),
        "dot(a, b)": (2, 0, lambda: torch.dot(a, b)),
        "b.mul_(s)": (1, 1, lambda: b.mul_(1.0)),
        "a.add_(b)": (*streams(traffic.stream(numel, torch.float32)), lambda: a.add_(b)),
        "a.addcmul_(b, c)": (3, 1, lambda: a.addcmul_(b, c)),
        "fused AdamW": (*streams(traffic.adamw(numel, torch.float32)), adamw.step),
        "d.copy_(c)": (1, 1, lambda: d.copy_(c)),  # d's lines are read before they are overwritten
    }


def measure(table: dict[str, tuple[int, int, Callable[[], object]]], rounds: int, steps: int,
            clock: Callable[[], float]) -> dict[str, float]:
    """Per op of `ops`: its median time over ``rounds`` rotated rounds of ``steps`` calls."""
    names = list(table)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:
        table[name][2]()
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            f = table[name][2]
            t0 = clock()
            for _ in range(steps):
                f()
            times[name].append((clock() - t0) / steps)
    return {n: statistics.median(times[n]) for n in names}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--numel", type=int, default=12_600_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.numel < 1 or args.rounds < 1 or args.steps < 1:
        ap.error("--threads, --numel, --rounds and --steps must be at least 1")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    table = ops(args.numel)
    med = measure(table, args.rounds, args.steps, clock)
    size = 4 * args.numel
    print(f"benchmarks/streams.py: {args.numel:,} fp32 elements a tensor ({size / 1e6:.1f} MB); CPU: {cpu_info()[0]}, "
          f"{page_size()} pages; "
          f"{args.threads} thread{'s' if args.threads != 1 else ''}, {'CPU' if args.threads == 1 else 'wall'} time, "
          f"{args.rounds} interleaved rounds x {args.steps}, medians")
    print(f"{'op':<18} {'reads':>5} {'writes':>6} {'ms':>7} {'ms/read':>7} {'GB/s reads':>10} {'GB/s all':>8}")
    for name, t in med.items():
        reads, writes = table[name][:2]
        print(f"{name:<18} {reads:>5} {writes:>6} {t * 1e3:>7.2f} {t * 1e3 / reads:>7.2f} "
              f"{reads * size / t / 1e9:>10.1f} {(reads + writes) * size / t / 1e9:>8.1f}")
    print(f"a.add_(b) / dot(a, b): {med['a.add_(b)'] / med['dot(a, b)']:.2f} (1.00: an in-place write costs no time "
          f"beside the reads; 1.50: every byte costs alike)")


if __name__ == "__main__":
    main()
