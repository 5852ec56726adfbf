"""Tables and plots of a bench run directory, computed only from its JSON logs (``RUN_DIR/runs/*.json``).

``skewadam report RUN_DIR`` re-renders ``RUN_DIR/results.md`` and the plots ``val_ppl.png``, ``memory.png`` and
``balance.png``; `skewadam bench` calls the same code when its runs finish.

Per optimizer the table shows the learning rate with the best mean validation perplexity; each figure is the mean over
seeds (``± std`` with several seeds) and, in parentheses, its ratio to the baseline optimizer (AdamW) at its own best lr.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from ..state import BINARY_UNITS, format_bytes

__all__ = ["load_runs", "read_log", "divergence", "summarize", "best_by_optimizer", "results_table", "sweep_table",
           "render"]

# (column title, summary key, formatter of the value)
_MiB = 2**20
COLUMNS = [
    ("optimizer state", "state_bytes", format_bytes),
    ("train peak mem", "train_peak_memory_bytes", format_bytes),
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("opt step", "opt_time_s", lambda v: f"{v * 1e3:.1f} ms"),
    ("best val ppl", "best_val_ppl", lambda v: f"{v:.3f}"),
    ("val balance loss", "final_val_balance_loss", lambda v: f"{v:.4f}"),
]


#: The keys of a complete run log (`skewadam.bench.train`).
RUN_KEYS = ("name", "config", "model", "summary", "evals", "steps")
#: A run diverged when its final validation perplexity is above this multiple of its best (or its loss non-finite).
DIVERGED_RATIO = 2.0


def read_log(path: str | Path, keys: tuple[str, ...] = RUN_KEYS) -> dict[str, Any]:
    """The JSON object in ``path``, which must hold ``keys``; ValueError naming the file if it is not UTF-8, not
    JSON (a truncated write, say) or not such an object."""
    try:
        obj = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    absent = [k for k in keys if not isinstance(obj, dict) or k not in obj]
    if absent:
        raise ValueError(f"{path}: not a complete log (no {', '.join(map(repr, absent))})")
    return obj


def load_runs(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every run log under ``run_dir/runs``; ValueError naming every damaged one (rerun the bench to redo them)."""
    files = sorted(Path(run_dir, "runs").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no run logs in {Path(run_dir, 'runs')}: is {run_dir} a `skewadam bench` output?")
    runs, damaged = [], []
    for f in files:
        try:
            runs.append(read_log(f))
        except ValueError as e:
            damaged.append(str(e))
    if damaged:
        raise ValueError(f"{len(damaged)} damaged run log(s): {'; '.join(damaged)}. `skewadam bench` with the same "
                         f"--out runs them again")
    return runs


def divergence(run: dict[str, Any]) -> Optional[str]:
    """Why ``run`` (a log) diverged, or None: a non-finite loss, or a final validation perplexity above
    `DIVERGED_RATIO` x its best (the model ended worse than it had been: a too-high lr, a sign flipped)."""
    s = run["summary"]
    if s["diverged"]:
        return f"non-finite loss at step {run['steps'][-1]['step']}"
    best, final = s["best_val_ppl"], s["final_val_ppl"]
    if not math.isfinite(final):
        return "non-finite validation loss"
    if final > DIVERGED_RATIO * best:
        return f"final val ppl {final:,.1f} is {final / best:.1f}x its best ({best:.3f})"
    return None


def _mean_std(values: list[float]) -> tuple[float, float]:
    if any(not math.isfinite(v) for v in values):
        return math.inf, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """``{(optimizer, lr): {"seeds": n, "diverged": n, key: (mean, std) for each table column}}``."""
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for run in runs:
        groups[(run["config"]["optimizer"], run["config"]["lr"])].append(run)
    out = {}
    for key, members in groups.items():
        summaries = [r["summary"] for r in members]
        row: dict[str, Any] = {"seeds": len(summaries), "diverged": sum(divergence(r) is not None for r in members)}
        for _, metric, _ in COLUMNS:
            row[metric] = _mean_std([s[metric] for s in summaries])
        out[key] = row
    return out


def best_by_optimizer(summary: dict[tuple[str, float], dict[str, Any]]) -> dict[str, tuple[float, dict[str, Any]]]:
    """``{optimizer: (lr, row)}`` at the lr of lowest mean best validation perplexity, in first-seen order."""
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for (opt, lr), row in summary.items():
        if opt not in best or row["best_val_ppl"][0] < best[opt][1]["best_val_ppl"][0]:
            best[opt] = (lr, row)
    return best


def _cell(fmt, mean_std: tuple[float, float], base: Optional[tuple[float, float]]) -> str:
    mean, std = mean_std
    if not math.isfinite(mean):
        return "diverged"
    text = fmt(mean)
    if std:  # in the mean's unit
        unit = text.split()[-1]
        scale = dict(BINARY_UNITS).get(unit)
        text += f" ± {std / scale:.2f}" if scale and fmt is format_bytes else f" ± {fmt(std).split()[0]}"
    if base is not None and math.isfinite(base[0]) and base[0] > 0:
        text += f" ({mean / base[0]:.2f}x)"
    return text


def results_table(summary, baseline: str = "adamw", order: Optional[list[str]] = None) -> str:
    """Markdown table: one row per optimizer at its best lr; ratios to ``baseline`` when it was run."""
    best = best_by_optimizer(summary)
    names = _ordered(list(best), order)
    base = best.get(baseline, (None, None))[1]
    header = ["optimizer", "lr", "seeds"] + [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for opt in names:
        lr, row = best[opt]
        cells = [opt, f"{lr:g}", str(row["seeds"]) + (f" ({row['diverged']} diverged)" if row["diverged"] else "")]
        cells += [_cell(fmt, row[key], base[key] if base else None) for _, key, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ordered(names, order: Optional[list[str]]) -> list[str]:
    """``names`` in ``order`` first, then the rest in their own order."""
    return [o for o in (order or []) if o in names] + [o for o in names if o not in (order or [])]


def sweep_table(summary, order: Optional[list[str]] = None) -> Optional[str]:
    """Markdown table of best validation perplexity per optimizer x lr, or None when no optimizer has several lrs."""
    lrs_by_opt: dict[str, list[float]] = defaultdict(list)
    for opt, lr in summary:
        lrs_by_opt[opt].append(lr)
    if all(len(v) == 1 for v in lrs_by_opt.values()):
        return None
    best = best_by_optimizer(summary)
    width = max(len(v) for v in lrs_by_opt.values())
    lines = ["| optimizer | " + " | ".join(f"lr {i + 1}" for i in range(width)) + " |", "|---|" + "---|" * width]
    for opt in _ordered(list(lrs_by_opt), order):
        lrs, cells = lrs_by_opt[opt], []
        for lr in sorted(lrs):
            mean, std = summary[(opt, lr)]["best_val_ppl"]
            mark = "**" if lr == best[opt][0] else ""
            n = summary[(opt, lr)]["seeds"]
            value = "diverged" if not math.isfinite(mean) else f"{mean:.3f}" + (f" ± {std:.3f}" if std else "")
            cells.append(f"{mark}{lr:g}: {value}{mark}" + (f" ({n} seeds)" if n > 1 else ""))
        lines.append(f"| {opt} | " + " | ".join(cells + [""] * (width - len(cells))) + " |")
    edges = [f"{opt} (best {best[opt][0]:g}, tried {min(lrs):g} to {max(lrs):g})"
             for opt, lrs in lrs_by_opt.items() if len(lrs) > 1 and best[opt][0] in (min(lrs), max(lrs))]
    if edges:
        lines += ["", "Not bracketed (best lr at an edge of the lrs tried; extend with `--lrs NAME=...` into the same "
                  "`--out`): " + "; ".join(edges) + "."]
    return "\n".join(lines)


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


def plot(run_dir: Path, runs, summary, order: Optional[list[str]] = None) -> list[Path]:
    """Write val_ppl.png, memory.png, balance.png into ``run_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    best = best_by_optimizer(summary)
    best = {o: best[o] for o in _ordered(list(best), order)}
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

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.6 * len(best) + 2), sharey=True)
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
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="x")
    paths.append(_save(fig, run_dir / "memory.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = _curves(runs, best, "step", "steps", "balance_loss")
    window = max(1, max(len(c[0]) for c in curves.values()) // 20)
    model = runs[0]["model"]
    floor = model["balance_coef"] * (model["n_layer"] // 2)  # uniform routing gives each MoE layer exactly coef
    for opt, (xs, mean, _, _) in curves.items():
        ax.plot(xs, [100 * (y / floor - 1) for y in _smooth(mean, window)], color=colors[opt], label=label[opt])
    ax.axhline(0, color="k", ls="--", lw=1, label=f"uniform routing (loss {floor:g})")
    ax.set(xlabel="step", ylabel="balance loss above uniform routing (%)",
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


def _load_range(runs) -> str:
    loads = [x for r in runs for x in r["summary"].get("loadavg_1min", [])]
    return f"{min(loads):.1f} to {max(loads):.1f}" if loads else "not logged"


def _same_init(runs) -> str:
    by_seed = defaultdict(set)
    for r in runs:
        by_seed[r["config"]["seed"]].add(r["init_checksum"])
    if all(len(v) == 1 for v in by_seed.values()):
        return "Runs of one seed started from identical weights (checksums match)."
    return "WARNING: runs of one seed started from different weights (checksums differ): not a fair comparison."


def render(run_dir: str | Path, baseline: str = "adamw", plots: bool = True) -> str:
    """Write ``results.md`` (and the plots) for ``run_dir`` from its logs; return the markdown."""
    run_dir = Path(run_dir)
    runs = load_runs(run_dir)
    bench_file = run_dir / "bench.json"
    order = read_log(bench_file, ("optimizers",))["optimizers"] if bench_file.exists() else None
    summary = summarize(runs)
    first = runs[0]
    cfg, model = first["config"], first["model"]
    seeds = sorted({r["config"]["seed"] for r in runs})
    lines = [
        f"# skewadam bench: {run_dir.name}",
        "",
        f"Model `{cfg['model']}` ({model['params']:,} parameters: "
        + ", ".join(f"{t} {n:,}" for t, n in model["params_by_tier"].items())
        + f"), data {first['data']['name']}, {cfg['steps']} steps of {cfg['batch_size']} x {model['block_size']} "
        f"tokens, device {cfg['device']}, {' or '.join(map(str, sorted({r['threads'] for r in runs})))} threads, "
        f"seeds {seeds}. "
        f"Machine load (1-min average) during the runs: {_load_range(runs)}. {_same_init(runs)}",
        "",
        results_table(summary, baseline, order),
        "",
        f"Per optimizer, the lr with the best mean validation perplexity; mean ± std over seeds; "
        f"(x) = ratio to {baseline} at its best lr. Memory: {first['summary']['memory_kind']}, above the "
        "process's peak once the model and data were loaded. tokens/s and opt step exclude evaluation; "
        "opt step is the median optimizer.step() time.",
    ]
    diverged = [(r["name"], why) for r in runs if (why := divergence(r))]
    if diverged:
        lines += ["", f"**{len(diverged)} run(s) diverged** (a non-finite loss, or a final validation perplexity above "
                  f"{DIVERGED_RATIO:g}x its best; counted in the seeds column): "
                  + "; ".join(f"{name}: {why}" for name, why in diverged) + "."]
    sweep = sweep_table(summary, order)
    if sweep:
        lines += ["", "## Learning-rate sweep: best validation perplexity (bold: best lr)", "", sweep]
    if plots:
        paths = plot(run_dir, runs, summary, order)
        lines += ["", "Plots: " + ", ".join(f"[{p.name}]({p.name})" for p in paths)]
    text = "\n".join(lines) + "\n"
    (run_dir / "results.md").write_text(text)
    return text
