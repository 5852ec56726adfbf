"""Issue 9's study, reproducible with one command: which SkewAdam settings train best, against the usual optimizers.

    python examples/study.py --out runs/study          # resumable: finished runs (runs/<name>.json) are skipped

It runs `skewadam bench` phases into ONE run directory (same model, data, steps and batches; `skewadam.harness.bench`
checks that on resume), in priority order, then writes ``results.md`` and the plots (`skewadam report`) and
``study.md`` / ``study.json``: per optimizer x lr the number of seeds and the mean, std, min and max of the best
validation perplexity, with state bytes and step times.

The design, sized to fit one hour of 2 shared CPU cores (~70-100 s per 200-step run): every optimizer gets a
learning-rate sweep at seed 0 that brackets its best lr (extended where the best was at an edge); the top arms
(SkewAdam floor/add/int8 momentum, AdamW) then get seeds 1 and 2 at their best lr; the tier ablations and bf16
momentum run once, at skewadam-add's best lr. `skewadam bench --preset study` is the full
grid the issue asks for (every optimizer x 3 lrs x 3 seeds, ~90 runs); into the same ``--out`` it resumes this
directory and completes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

from skewadam.harness.bench import run_bench
from skewadam.harness.config import BenchConfig, get_preset
from skewadam.harness.report import load_runs, render

#: the learning-rate ladder (half-decades); each sweep is 3 neighbouring rungs, extended while its best is at an edge
LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
#: arms in priority order: (optimizer, its first lrs, seeds at its best lr, max extensions of the lr sweep); the
#: ablations and bf16 momentum are run at skewadam-add's best lr only, to fit the hour
ARMS = [
    ("skewadam-floor", (3e-4, 1e-3, 3e-3), 3, 2),
    ("skewadam-add", (3e-4, 1e-3, 3e-3), 3, 2),
    ("adamw", (3e-4, 1e-3, 3e-3), 3, 2),
    ("skewadam-int8", (3e-4, 1e-3, 3e-3), 3, 2),
    ("adafactor", (3e-3, 1e-2, 3e-2), 1, 2),
    ("muon", (3e-4, 1e-3, 3e-3), 1, 2),
    ("skewadam-expert-momentum", (1e-3,), 1, 0),
    ("skewadam-factored-router", (1e-3,), 1, 0),
    ("skewadam-uniform", (1e-3,), 1, 0),
    ("skewadam-bf16m", (1e-3,), 1, 0),
]


def _seed0_ppl(out: Path, optimizer: str) -> dict[float, float]:
    return {r["config"]["lr"]: r["summary"]["best_val_ppl"] for r in _logs(out)
            if r["config"]["optimizer"] == optimizer and r["config"]["seed"] == 0}


def _logs(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((out / "runs").glob("*.json"))]


def sweep(out: Path, base, optimizer: str, lrs: tuple[float, ...], max_extensions: int = 2) -> float:
    """Seed-0 runs of ``optimizer`` at ``lrs``, extended along `LADDER` while the best is at an edge; its best lr."""
    lrs = list(lrs)
    for _ in range(max_extensions + 1):
        run_bench(BenchConfig(base=base, optimizers=(optimizer,), lrs={optimizer: tuple(lrs)}), out,
                  progress=False, plots=False)
        ppl = _seed0_ppl(out, optimizer)
        best = min(ppl, key=ppl.get)
        i = LADDER.index(best)
        if best == min(ppl) and i > 0 and LADDER[i - 1] not in ppl:
            lrs = [LADDER[i - 1]]
        elif best == max(ppl) and i + 1 < len(LADDER) and LADDER[i + 1] not in ppl:
            lrs = [LADDER[i + 1]]
        else:
            return best
    return best


def study_table(runs: list[dict]) -> tuple[str, list[dict]]:
    """Markdown table and records: per (optimizer, lr), best val ppl over seeds (mean, std, min, max), state, timing."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["config"]["optimizer"], r["config"]["lr"]), []).append(r)
    records = []
    for (opt, lr), rs in groups.items():
        ppl = [r["summary"]["best_val_ppl"] for r in rs]
        finite = all(math.isfinite(p) for p in ppl)
        records.append({
            "optimizer": opt, "lr": lr, "seeds": sorted(r["config"]["seed"] for r in rs),
            "best_val_ppl": ppl, "mean": statistics.fmean(ppl) if finite else math.inf,
            "std": statistics.stdev(ppl) if finite and len(ppl) > 1 else 0.0, "min": min(ppl), "max": max(ppl),
            "state_bytes": rs[0]["summary"]["state_bytes"],
            "opt_step_ms": statistics.median(r["summary"]["opt_time_s"] for r in rs) * 1e3,
            "train_step_ms": statistics.median(r["summary"]["step_time_s"] for r in rs) * 1e3,
        })
    order = [a[0] for a in ARMS] + sorted({r["config"]["optimizer"] for r in runs} - {a[0] for a in ARMS})
    records.sort(key=lambda rec: (order.index(rec["optimizer"]), rec["lr"]))
    best = {}
    for rec in records:
        if rec["optimizer"] not in best or rec["mean"] < best[rec["optimizer"]]["mean"]:
            best[rec["optimizer"]] = rec
    lines = ["| optimizer | lr | seeds | best val ppl mean ± std | min .. max | optimizer state | opt step "
             "| train step |", "|---|---|---|---|---|---|---|---|"]
    for rec in records:
        mark = "**" if best[rec["optimizer"]] is rec else ""
        lines.append(
            f"| {rec['optimizer']} | {mark}{rec['lr']:g}{mark} | {len(rec['seeds'])} | "
            f"{mark}{rec['mean']:.3f}" + (f" ± {rec['std']:.3f}" if len(rec["seeds"]) > 1 else "") + f"{mark} | "
            f"{rec['min']:.3f} .. {rec['max']:.3f} | "
            f"{rec['state_bytes'] / 2**20:.2f} MiB | {rec['opt_step_ms']:.1f} ms | {rec['train_step_ms']:.0f} ms |")
    return "\n".join(lines), records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/study"), help="run directory (resumed if it exists)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads per run (default 2)")
    p.add_argument("--report-only", action="store_true", help="only re-render the tables and plots")
    args = p.parse_args()
    base = dataclasses.replace(get_preset("study").base, threads=args.threads)
    if not args.report_only:
        best = {opt: sweep(args.out, base, opt, lrs, ext) for opt, lrs, seeds, ext in ARMS if seeds > 1}
        for opt, _, seeds, _ in ARMS:  # more seeds for the top arms, at their best lr
            if seeds > 1:
                run_bench(BenchConfig(base=base, optimizers=(opt,), lrs={opt: (best[opt],)}, seeds=seeds), args.out,
                          progress=False, plots=False)
        for opt, lrs, seeds, ext in ARMS:
            if seeds == 1:
                sweep(args.out, base, opt, lrs, ext)
    render(args.out)
    table, records = study_table(load_runs(args.out))
    (args.out / "study.json").write_text(json.dumps(records, indent=1))
    (args.out / "study.md").write_text(
        f"# Study: best validation perplexity per optimizer and learning rate\n\n{base.steps} steps of the "
        f"`{base.model}` model on Shakespeare; bold: the lr of the best mean.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
