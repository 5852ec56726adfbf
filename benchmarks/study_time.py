"""Tables of a study's bench logs: quality per (arm, lr) over seeds, and quality at equal training time.

Reads the run logs of ``skewadam bench`` run directories (``DIR/runs/*.json``) and prints markdown tables:

- per (arm, lr): the seeds, best validation perplexity per seed and mean ± std, optimizer state, median training
  step and optimizer step, and the optimizer's share of the step (median over steps of step / training step);
- at equal time: each (arm, lr)'s validation perplexity at the last evaluation within a time budget, the time being
  either the logged one (the sum of the training steps' wall times, evaluations excluded: load-dependent) or, with
  ``--cost ARM=SECONDS``, steps x that arm's cost per step (e.g. CPU times measured apart, paired).

A run's lr schedule is its own (cosine to its last step), so at a budget shorter than its run an arm is compared
mid-schedule, before its lr has annealed: that favours the arm whose run the budget ends.

Example:
    python benchmarks/study_time.py runs/s20m --cost adamw=1.17 muon=1.27 --budgets 600,1200 --plot ppl_time.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path


def load(dirs: list[str]) -> list[dict]:
    runs = []
    for d in dirs:
        for f in sorted(Path(d, "runs").glob("*.json")):
            log = json.loads(f.read_text())
            if "summary" in log:
                runs.append(log)
    if not runs:
        raise SystemExit(f"no complete run logs under {', '.join(d + '/runs' for d in dirs)}")
    return runs


def _key(run: dict) -> tuple[str, float]:
    return run["config"]["optimizer"], run["config"]["lr"]


def _mean_std(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def elapsed(run: dict, cost: dict[str, float]) -> list[tuple[float, float]]:
    """``[(seconds, val_ppl)]`` at each evaluation: logged step times, or steps x the arm's ``cost``."""
    per_step = cost.get(run["config"]["optimizer"])
    cum, t = {0: 0.0}, 0.0
    for rec in run["steps"]:
        t += rec["step_time_s"]
        cum[rec["step"]] = t
    return [((e["step"] * per_step) if per_step else cum[e["step"]], e["val_ppl"]) for e in run["evals"]]


def quality_table(runs: list[dict]) -> str:
    groups = defaultdict(list)
    for r in runs:
        groups[_key(r)].append(r)
    rows = ["| arm | lr | seeds | best val ppl per seed | mean ± std | optimizer state | training step | "
            "optimizer step | optimizer's share | 1-min load |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for (opt, lr), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["config"]["seed"])
        best = [r["summary"]["best_val_ppl"] for r in rs]
        share = statistics.median(s["opt_time_s"] / s["step_time_s"] for r in rs for s in r["steps"][2:])
        loads = [x for r in rs for x in r["summary"]["loadavg_1min"]]
        rows.append(
            f"| {opt} | {lr:g} | {', '.join(str(r['config']['seed']) for r in rs)} | "
            f"{', '.join(f'{b:.3f}' for b in best)} | {_mean_std(best)} | "
            f"{rs[0]['summary']['state_bytes'] / 2**20:.2f} MiB | "
            f"{statistics.fmean(r['summary']['step_time_s'] for r in rs):.2f} s | "
            f"{statistics.fmean(r['summary']['opt_time_s'] for r in rs) * 1e3:.0f} ms | {share:.0%} | "
            f"{min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(rows)


def equal_time_table(runs: list[dict], budgets: list[float], cost: dict[str, float]) -> str:
    groups = defaultdict(list)
    for r in runs:
        groups[_key(r)].append(elapsed(r, cost))
    what = "steps x cost per step" if cost else "logged training-step time"
    rows = [f"| arm | lr | " + " | ".join(f"{b:,.0f} s" for b in budgets) + " |",
            "|---|---|" + "---|" * len(budgets)]
    for (opt, lr), curves in sorted(groups.items()):
        cells = []
        for b in budgets:
            at = [min((p for t, p in c if t <= b), default=math.inf) for c in curves]
            reached = all(c[-1][0] <= b for c in curves)
            cells.append(("—" if math.isinf(max(at)) else _mean_std(at)) + ("" if reached else "*"))
        rows.append(f"| {opt} | {lr:g} | " + " | ".join(cells) + " |")
    note = (f"Best validation perplexity reached within each budget of {what} (mean ± std over seeds); * = the run "
            f"had not finished its schedule by then.")
    return "\n".join(rows) + "\n\n" + note


def plot(runs: list[dict], cost: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    colors = {}
    for r in sorted(runs, key=_key):
        opt, lr = _key(r)
        color = colors.setdefault((opt, lr), plt.cm.tab10(len(colors) % 10))
        label = f"{opt} {lr:g}" if r["config"]["seed"] == 0 else None
        steps = [e["step"] for e in r["evals"]]
        axes[0].plot(steps, [e["val_ppl"] for e in r["evals"]], color=color, label=label, lw=1)
        ts, ps = zip(*elapsed(r, cost))
        axes[1].plot([t / 60 for t in ts], ps, color=color, lw=1)
    axes[0].set(xlabel="step", ylabel="validation perplexity (per byte)", yscale="log")
    axes[1].set(xlabel="minutes of training steps" + (" (steps x cost per step)" if cost else " (logged)"))
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.set_ylim(top=min(60, ax.get_ylim()[1]))
        for ticks in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            ticks(matplotlib.ticker.FormatStrFormatter("%g"))  # the log axis in plain numbers
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", help="bench run directories")
    p.add_argument("--cost", nargs="*", default=[], metavar="ARM=SECONDS", help="seconds per training step")
    p.add_argument("--budgets", default="", help="comma-separated seconds for the equal-time table")
    p.add_argument("--plot", help="write val ppl against step and against time to this PNG")
    args = p.parse_args()
    runs = load(args.dirs)
    cost = {k: float(v) for k, v in (c.split("=", 1) for c in args.cost)}
    print(quality_table(runs))
    if args.budgets:
        print()
        print(equal_time_table(runs, [float(b) for b in args.budgets.split(",")], cost))
    if args.plot:
        plot(runs, cost, args.plot)


if __name__ == "__main__":
    main()
