"""The plots of a bench run directory (matplotlib, imported only here): validation perplexity, memory, balance.

Each optimizer is drawn at its best lr (`skewadam.bench.report.best_by_optimizer`), as the mean over seeds with the
min..max band.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

from ..state import format_bytes
from .logs import balance_floor

__all__ = ["plot"]

_MiB = 2**20


def _curves(runs, best, x_key: str, series: str, y_key: str):
    """Per optimizer at its best lr: (xs, mean ys, min ys, max ys) over seeds, on the steps all seeds logged."""
    out = {}
    for opt, (lr, _) in best.items():
        seqs = [r[series] for r in runs if r["config"]["optimizer"] == opt and r["config"]["lr"] == lr]
        n = min(len(s) for s in seqs)
        xs = [rec[x_key] for rec in seqs[0][:n]]
        cols = [[s[i][y_key] for s in seqs] for i in range(n)]
        out[opt] = (xs, [statistics.fmean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols])
    return out


def _smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(run_dir: Path, runs: list[dict[str, Any]], best: dict[str, tuple[float, dict[str, Any]]],
         full: Optional[tuple[str, dict[str, int]]] = None) -> list[Path]:
    """Write val_ppl.png, memory.png, balance.png into ``run_dir`` for each optimizer at its best lr (``best``,
    `skewadam.bench.report.best_by_optimizer`, in plot order); return their paths. ``full``: (what was planned, the
    planner's peak per optimizer) for the full-size model, drawn beside the measured peaks: at the bench's size the
    activations dominate, at full size the optimizer state does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {opt: plt.cm.tab10(i % 10) for i, opt in enumerate(best)}
    label = {opt: f"{opt} (lr {lr:g})" for opt, (lr, _) in best.items()}
    seeds = max(row["seeds"] for _, row in best.values())
    band = f", band = min..max over {seeds} seeds" if seeds > 1 else ""
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    curves = _curves(runs, best, "step", "evals", "val_ppl")
    for ax, zoom in zip(axes, (False, True)):
        for opt, (xs, mean, lo, hi) in curves.items():
            i = sum(x < xs[-1] / 2 for x in xs) if zoom else 0  # steps ascend: the zoom is a suffix
            ax.plot(xs[i:], mean[i:], marker="o", ms=3, color=colors[opt], label=label[opt])
            if seeds > 1:
                ax.fill_between(xs[i:], lo[i:], hi[i:], color=colors[opt], alpha=0.2)
        ax.grid(alpha=0.3, which="both")
    axes[0].set(xlabel="step", ylabel="validation perplexity (per byte)", yscale="log",
                title=f"Validation perplexity{band}")
    for ticks in (axes[0].yaxis.set_major_formatter, axes[0].yaxis.set_minor_formatter):
        ticks(matplotlib.ticker.FormatStrFormatter("%g"))  # the log axis labelled in plain numbers
    axes[1].set(xlabel="step", title="Second half of training")
    axes[0].legend(fontsize=8)
    paths.append(_save(fig, run_dir / "val_ppl.png"))

    panels = 3 if full else 2
    fig, (ax1, ax2, *ax3) = plt.subplots(1, panels, figsize=(5.5 * panels, 0.6 * len(best) + 2), sharey=True)
    names = list(best)
    tiers = (("backbone", "tab:blue"), ("expert", "tab:orange"), ("router", "tab:green"))
    height = 0.8 / len(tiers)
    for j, (tier, color) in enumerate(tiers):  # one bar per tier on a log axis: a KiB router beside MiB backbones
        vals = [statistics.fmean(r["summary"]["state_bytes_by_tier"].get(tier, 0) for r in runs
                                 if r["config"]["optimizer"] == o and r["config"]["lr"] == best[o][0]) for o in names]
        ys = [i + (j - 1) * height for i in range(len(names))]
        ax1.barh(ys, [v / _MiB if v else float("nan") for v in vals], height=height, color=color, label=tier)
        for y, v in zip(ys, vals):
            ax1.annotate(format_bytes(v), (v / _MiB if v else 1e-3, y), xytext=(3, 0), textcoords="offset points",
                         va="center", fontsize=7)
    ax1.set(xlabel="optimizer state (MiB, log scale)", title="Optimizer state by tier", xscale="log",
            yticks=range(len(names)), yticklabels=names)
    ax1.set_xlim(right=ax1.get_xlim()[1] * 20)  # room for the labels
    ax1.legend(fontsize=8, loc="lower right")
    ax1.invert_yaxis()
    peak = [best[o][1]["train_peak_memory_bytes"][0] for o in names]
    ax2.barh(range(len(names)), [v / _MiB for v in peak], color=[colors[o] for o in names])
    for i, v in enumerate(peak):
        ax2.annotate(format_bytes(v), (v / _MiB, i), xytext=(3, 0), textcoords="offset points", va="center",
                     fontsize=7)
    ax2.set_xlim(right=ax2.get_xlim()[1] * 1.2)
    kind = runs[0]["summary"]["memory_kind"]
    ax2.set(xlabel="peak memory above the loaded model (MiB)", title=f"Training peak ({kind})")
    if full:
        what, peaks = full
        planned = [peaks.get(o) for o in names]
        ax3[0].barh(range(len(names)), [v / 2**30 if v else float("nan") for v in planned],
                    color=[colors[o] for o in names])
        for i, v in enumerate(planned):
            ax3[0].annotate(format_bytes(v) if v else "not planned", (v / 2**30 if v else 0, i), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=7)
        ax3[0].set_xlim(right=ax3[0].get_xlim()[1] * 1.25)
        ax3[0].set(xlabel="planned peak (GiB), skewadam plan", title=f"Planned peak at full size\n{what}")
        ax3[0].title.set_fontsize(9)
    for ax in (ax1, ax2, *ax3):
        ax.grid(alpha=0.3, axis="x")
    paths.append(_save(fig, run_dir / "memory.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = _curves(runs, best, "step", "steps", "balance_loss")
    window = max(1, max(len(c[0]) for c in curves.values()) // 20)
    floor = balance_floor(runs[0]["model"])
    for opt, (xs, mean, _, _) in curves.items():
        ys = _smooth(mean, window)
        ax.plot(xs, [100 * (y / floor - 1) for y in ys] if floor else ys, color=colors[opt], label=label[opt])
    if floor:
        ax.axhline(0, color="k", ls="--", lw=1, label=f"uniform routing (loss {floor:g})")
    ax.set(xlabel="step", ylabel="balance loss above uniform routing (%)" if floor else "balance loss",
           title=f"Training load-balancing loss, sum over MoE layers (moving average of {window} steps)")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, run_dir / "balance.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


