"""The JSON logs of a bench directory, checked before anything counts them: by schema and by identity.

A run's log (``RUN_DIR/runs/<run>.json``, written by `skewadam.bench.train`) counts as done only when it matches
`LOG_SCHEMA` (every value the report reads is there, of its type: no null, no string where a number belongs) and is
the run it is named for (`identity_problem`: its name, optimizer, lr, seed, and every other setting by its config
hash). `skewadam bench` runs anything else again, saying why in one line; `skewadam report` lists it and skips it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .config import IGNORED_BY_HASH, config_hash, run_name_of, with_defaults

__all__ = ["NUMBER", "LOG_SCHEMA", "BENCH_SCHEMA", "read_log", "schema_problem", "identity_problem", "load_runs",
           "bench_order", "balance_floor"]

NUMBER = (int, float)  # NaN and inf included: a diverged run logs them
#: What a complete run log (`skewadam.bench.train`) holds, as far as the report reads it: a dict is an object with
#: those keys, a list a non-empty array of such items, ``(str, NUMBER)`` an object of numbers by name.
LOG_SCHEMA: dict[str, Any] = {
    "name": str,
    "config": {"optimizer": str, "lr": NUMBER, "seed": int, "model": str, "steps": int, "batch_size": int,
               "device": str},
    "model": {"params": int, "params_by_tier": (str, int), "block_size": int},
    "data": {"name": str},
    "init_checksum": NUMBER,
    "threads": int,
    "summary": {"state_bytes": int, "state_bytes_by_tier": (str, int), "train_peak_memory_bytes": int,
                "memory_kind": str, "tokens_per_s": NUMBER, "opt_time_s": NUMBER, "best_val_ppl": NUMBER,
                "final_val_ppl": NUMBER, "final_val_balance_loss": NUMBER, "diverged": bool},
    "evals": [{"step": int, "val_ppl": NUMBER}],
    "steps": [{"step": int, "loss": NUMBER, "balance_loss": NUMBER}],
}


#: What a bench directory's ``bench.json`` holds: the settings its runs share, and the optimizers in report order.
BENCH_SCHEMA: dict[str, Any] = {"base": {"steps": int}, "optimizers": [str]}


def balance_floor(model: dict[str, Any]) -> Optional[float]:
    """The balance loss of perfectly uniform routing, from a log's ``model``: its ``balance_floor``, or for logs
    that predate it the reference model's (each MoE layer gives exactly ``balance_coef``); None if unknown."""
    floor = model.get("balance_floor")
    if floor is None and isinstance(model.get("balance_coef"), NUMBER) and isinstance(model.get("n_layer"), int):
        floor = model["balance_coef"] * (model["n_layer"] // 2)
    return floor if isinstance(floor, NUMBER) and floor > 0 else None


def _type_name(kind) -> str:
    if kind == NUMBER:
        return "a number"
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true/false"}[k] for k in kinds)


def schema_problem(value: Any, schema: Any = LOG_SCHEMA, where: str = "") -> Optional[str]:
    """Why ``value`` does not match ``schema`` (`LOG_SCHEMA`'s notation), naming the key; None if it does."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where or 'the log'} is not an object"
        for key, sub in schema.items():
            if key not in value:
                return f"no {where + '.' if where else ''}{key!r}"
            problem = schema_problem(value[key], sub, f"{where}.{key}" if where else key)
            if problem:
                return problem
        return None
    if isinstance(schema, list):
        if not isinstance(value, list) or not value:
            return f"{where} is not a non-empty list"
        return next((p for i, item in enumerate(value) if (p := schema_problem(item, schema[0], f"{where}[{i}]"))),
                    None)
    if isinstance(schema, tuple) and len(schema) == 2 and schema[0] is str:  # an object of numbers by name
        if not isinstance(value, dict):
            return f"{where} is not an object"
        return next((p for k, v in value.items() if (p := schema_problem(v, schema[1], f"{where}.{k}"))), None)
    kinds = schema if isinstance(schema, tuple) else (schema,)
    if value is None or (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        return f"{where} is {json.dumps(value)[:40]}, not {_type_name(schema)}"
    return None


def read_log(path: str | Path, schema: Any = LOG_SCHEMA) -> dict[str, Any]:
    """The JSON object in ``path``, which must match ``schema`` (default `LOG_SCHEMA`); ValueError naming the file
    and the problem if it is not UTF-8, not JSON (a truncated write, say) or not such an object (a null or a string
    where a number belongs)."""
    try:
        obj = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    problem = schema_problem(obj, schema)
    if problem:
        raise ValueError(f"{path}: not a complete log ({problem})")
    return obj


def identity_problem(log: dict[str, Any], expected: dict[str, Any]) -> Optional[str]:
    """Why ``log`` is not the run whose settings are ``expected`` (`skewadam.bench.config.run_identity`), or None:
    its name, optimizer, lr and seed, then every other setting by its config hash (`config_hash`)."""
    name = run_name_of(expected)
    if log["name"] != name:
        return f"it is the log of {log['name']}, not of {name}"
    for key in ("optimizer", "lr", "seed"):
        if log["config"][key] != expected[key]:
            return f"its {key} is {log['config'][key]!r}, not {expected[key]!r}"
    stored = log.get("config_hash")
    if stored is not None and stored != config_hash(log["config"]):
        return "its config hash does not match its config (edited?)"
    if config_hash(log["config"]) != config_hash(expected):
        logged = with_defaults(log["config"])
        diff = [f"{k}: {logged.get(k)!r} there, {v!r} now" for k, v in expected.items()
                if k not in IGNORED_BY_HASH and logged.get(k) != v]
        return f"it ran other settings ({'; '.join(diff) or 'settings this version does not know'})"
    return None


def load_runs(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every valid run log under ``run_dir/runs`` and, one line each, the logs skipped and why: damaged, not of the
    run its file names, another setup's than the bench directory's (``bench.json``), or a second copy of a run."""
    files = sorted(Path(run_dir, "runs").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no run logs in {Path(run_dir, 'runs')}: is {run_dir} a `skewadam bench` output?")
    bench_file = Path(run_dir, "bench.json")
    base = _bench_base(bench_file)
    runs, skipped, seen = [], [], {}
    for f in files:
        try:
            log = read_log(f)
        except ValueError as e:
            skipped.append(str(e))
            continue
        problem = identity_problem(log, {**log["config"], **(base or {})}) if log["name"] == f.stem else \
            f"it is the log of {log['name']}, not of {f.stem}"
        if problem is None and run_name_of(log["config"]) != log["name"]:
            problem = f"its name {log['name']} is not its config's run ({run_name_of(log['config'])})"
        key = (log["config"]["optimizer"], log["config"]["lr"], log["config"]["seed"])
        if problem is None and key in seen:
            problem = f"a second copy of {seen[key]}"
        if problem:
            skipped.append(f"{f}: {problem}")
            continue
        seen[key] = f.name
        runs.append(log)
    return runs, skipped


def _bench_base(bench_file: Path) -> Optional[dict[str, Any]]:
    """The settings every run of a bench directory shares (``bench.json``'s ``base``), if it has a readable one."""
    try:
        base = read_log(bench_file, BENCH_SCHEMA)["base"] if bench_file.exists() else None
    except ValueError:
        return None
    return base


def bench_order(run_dir: str | Path) -> Optional[list[str]]:
    """The optimizers of a bench directory in report order (``bench.json``), if it has a readable one."""
    bench_file = Path(run_dir, "bench.json")
    try:
        return read_log(bench_file, BENCH_SCHEMA)["optimizers"] if bench_file.exists() else None
    except ValueError:
        return None
