"""Tables and plots of a bench run directory, computed only from its JSON logs (``RUN_DIR/runs/*.json``).

``skewadam report RUN_DIR`` re-renders ``RUN_DIR/results.md`` and the plots ``val_ppl.png``, ``memory.png`` and
``balance.png``; `skewadam bench` calls the same code when its runs finish.

Per optimizer the table shows the learning rate with the best mean validation perplexity; each figure is the mean over
seeds (``± std`` with several seeds) and, in parentheses, its ratio to the baseline optimizer (AdamW) at its own best
lr. Only logs `skewadam.bench.logs` accepts count; the others are listed, skipped.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from ..state import BINARY_UNITS, format_bytes
from .logs import NUMBER, bench_order, load_runs

__all__ = ["divergence", "opt_share", "summarize", "best_by_optimizer", "results_table", "sweep_table", "render"]

# (column title, summary key, formatter of the value)
COLUMNS = [
    ("optimizer state", "state_bytes", format_bytes),
    ("train peak mem", "train_peak_memory_bytes", format_bytes),
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("opt step", "opt_time_s", lambda v: f"{v * 1e3:.1f} ms"),
    ("opt share", "opt_share", lambda v: f"{v:.0%}"),
    ("NS FLOPs", "newton_schulz_flops", lambda v: f"{v:.3g}" if v else "0"),
    ("best val ppl", "best_val_ppl", lambda v: f"{v:.3f}"),
    ("val balance loss", "final_val_balance_loss", lambda v: f"{v:.4f}"),
]


#: Columns without a ratio to the baseline: a share of the step, and FLOPs (none for AdamW).
NO_RATIO = {"opt_share", "newton_schulz_flops"}

#: A run diverged when its final validation perplexity is above this multiple of its best (or its loss non-finite).
DIVERGED_RATIO = 2.0

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


def _mean_std(values: list[Optional[float]]) -> Optional[tuple[float, float]]:
    """Mean and std; ``(inf, 0)`` if a value is not finite (a diverged run); None if one is missing (an older log)."""
    if any(v is None for v in values):
        return None
    if any(not math.isfinite(v) for v in values):
        return math.inf, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def opt_share(run: dict[str, Any]) -> Optional[float]:
    """The optimizer's share of the training step, measured: its step's time over the training step's (forward,
    backward, clip and step), summed over the run's steps after the first 2 (warm-up); None without step times."""
    steps = [s for s in run["steps"][2:] if isinstance(s.get("opt_time_s"), NUMBER)
             and isinstance(s.get("step_time_s"), NUMBER)]
    total = sum(s["step_time_s"] for s in steps)
    return sum(s["opt_time_s"] for s in steps) / total if total > 0 else None


def summarize(runs: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """``{(optimizer, lr): {"seeds": n, "diverged": n, key: (mean, std) for each table column}}``."""
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for run in runs:
        groups[(run["config"]["optimizer"], run["config"]["lr"])].append(run)
    out = {}
    for key, members in groups.items():
        summaries = [{**r["summary"], "opt_share": opt_share(r)} for r in members]
        row: dict[str, Any] = {"seeds": len(summaries), "diverged": sum(divergence(r) is not None for r in members)}
        for _, metric, _ in COLUMNS:  # (the columns `LOG_SCHEMA` does not require may be absent, or of any type)
            row[metric] = _mean_std([s.get(metric) if isinstance(s.get(metric), NUMBER) else None for s in summaries])
        out[key] = row
    return out


def best_by_optimizer(summary: dict[tuple[str, float], dict[str, Any]]) -> dict[str, tuple[float, dict[str, Any]]]:
    """``{optimizer: (lr, row)}`` at the lr of lowest mean best validation perplexity, in first-seen order."""
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for (opt, lr), row in summary.items():
        if opt not in best or row["best_val_ppl"][0] < best[opt][1]["best_val_ppl"][0]:
            best[opt] = (lr, row)
    return best


def _cell(fmt, mean_std: Optional[tuple[float, float]], base: Optional[tuple[float, float]]) -> str:
    if mean_std is None:
        return "n/a"
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
        cells += [_cell(fmt, row[key], base[key] if base and key not in NO_RATIO else None) for _, key, fmt in COLUMNS]
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


def _load_range(runs) -> str:
    logged = [r["summary"].get("loadavg_1min") for r in runs]
    loads = [x for ls in logged if isinstance(ls, list) for x in ls if isinstance(x, NUMBER)]
    return f"{min(loads):.1f} to {max(loads):.1f}" if loads else "not logged"


#: How the memory plot plans the full-size model: as one trains it, bf16 weights on a GPU, one sequence per step.
FULL_SIZE_PLAN = dict(param_dtype="bf16", device="cuda", batch=1)


def full_size_peaks(model: str, optimizers: list[str]) -> tuple[Optional[tuple[str, dict[str, int]]], str]:
    """The planner's peak per optimizer for the full-size model of a bench's ``model`` (`presets.full_size`:
    paper-6.78b for the reference presets, a Transformers config without the bench's ``--set``), planned as
    `FULL_SIZE_PLAN`: ``((what, {optimizer: bytes}), "")``, or ``(None, why not)``."""
    from . import arms
    from .planner import plan
    from .presets import full_size

    spec = full_size(model)
    planned = [o for o in optimizers if o in arms.ARMS and arms.ARMS[o].state is not None]
    if not planned:
        return None, "no optimizer of this bench has a memory model"
    try:
        p = plan(spec, optimizers=planned, **FULL_SIZE_PLAN)
    except (ValueError, OSError, ImportError) as e:
        return None, f"{spec} could not be planned ({e})"
    peaks = {o: row.peak for o, row in p.optimizers.items() if row.peak is not None}
    what = f"{spec} ({p.params / 1e9:.2f}B), bf16, batch 1 x {p.seq}, {p.backend} backend"
    return (what, peaks), ""


def _overrides(cfg: dict[str, Any]) -> str:
    sets = cfg.get("overrides")
    return f" with `--set {' '.join(f'{k}={json.dumps(v)}' for k, v in sets.items())}`" if isinstance(sets, dict) \
        and sets else ""


def _threads(runs) -> str:
    counts = sorted({r["threads"] for r in runs})
    return f"{' or '.join(map(str, counts))} thread{'s' if counts != [1] else ''}"


def _same_init(runs) -> str:
    by_seed = defaultdict(set)
    for r in runs:
        by_seed[r["config"]["seed"]].add(r["init_checksum"])
    if all(len(v) == 1 for v in by_seed.values()):
        return "Runs of one seed started from identical weights (checksums match)."
    return "WARNING: runs of one seed started from different weights (checksums differ): not a fair comparison."


def render(run_dir: str | Path, baseline: str = "adamw", plots: bool = True) -> str:
    """Write ``results.md`` (and the plots) for ``run_dir`` from its valid logs, listing those skipped and why
    (`load_runs`); return the markdown. ValueError if no log is valid."""
    run_dir = Path(run_dir)
    runs, skipped = load_runs(run_dir)
    if not runs:
        raise ValueError(f"no valid run log in {run_dir / 'runs'} ({len(skipped)} skipped: {'; '.join(skipped)}); "
                         f"`skewadam bench` with the same --out runs them again")
    order = bench_order(run_dir)
    summary = summarize(runs)
    first = runs[0]
    cfg, model = first["config"], first["model"]
    seeds = sorted({r["config"]["seed"] for r in runs})
    lines = [
        f"# skewadam bench: {run_dir.name}",
        "",
        f"Model `{cfg['model']}`{_overrides(cfg)} ({model['params']:,} parameters: "
        + ", ".join(f"{t} {n:,}" for t, n in model["params_by_tier"].items())
        + f"), data {first['data']['name']}, {cfg['steps']} steps of {cfg['batch_size']} x {model['block_size']} "
        f"tokens, device {cfg['device']}, {_threads(runs)}, "
        f"seeds {seeds}. "
        f"Machine load (1-min average) during the runs: {_load_range(runs)}. {_same_init(runs)}",
        "",
        results_table(summary, baseline, order),
        "",
        f"Per optimizer, the lr with the best mean validation perplexity; mean ± std over seeds; "
        f"(x) = ratio to {baseline} at its best lr. Memory: {first['summary']['memory_kind']}, above the "
        "process's peak once the model and data were loaded. tokens/s and opt step exclude evaluation; "
        "opt step is the median optimizer.step() time; opt share its share of the training step (forward, "
        "backward, clip, step: summed over the steps after the first 2, wall clock); NS FLOPs the Newton-Schulz "
        "matmul FLOPs per step (`skewadam.groups.orthogonal_flops`, on average over an interval; n/a: an older log).",
    ]
    diverged = [(r["name"], why) for r in runs if (why := divergence(r))]
    if diverged:
        lines += ["", f"**{len(diverged)} run(s) diverged** (a non-finite loss, or a final validation perplexity above "
                  f"{DIVERGED_RATIO:g}x its best; counted in the seeds column): "
                  + "; ".join(f"{name}: {why}" for name, why in diverged) + "."]
    if skipped:
        lines += ["", f"**{len(skipped)} run log(s) skipped** (`skewadam bench` with the same --out runs them "
                  "again): " + "; ".join(skipped) + "."]
    sweep = sweep_table(summary, order)
    if sweep:
        lines += ["", "## Learning-rate sweep: best validation perplexity (bold: best lr)", "", sweep]
    if plots:
        from .plots import plot

        best = best_by_optimizer(summary)
        full, why = full_size_peaks(cfg["model"], list(best))
        paths = plot(run_dir, runs, {o: best[o] for o in _ordered(list(best), order)}, full)
        if why:
            lines += ["", f"The memory plot has no full-size panel: {why}."]
        lines += ["", "Plots: " + ", ".join(f"[{p.name}]({p.name})" for p in paths)]
    text = "\n".join(lines) + "\n"
    (run_dir / "results.md").write_text(text)
    return text
