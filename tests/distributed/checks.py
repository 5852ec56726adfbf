"""What the torchrun workers (``worker.py``, ``orthogonal_worker.py``, ``torchtitan_worker.py``) share: a gloo process
group around a dict of named checks, and their figures gathered into ``OUT_DIR/results.json`` for the pytest side.

A worker script is run as ``torchrun ... tests/distributed/<worker>.py``, so this folder is first on its ``sys.path``
and ``from checks import run_checks`` finds this module.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

Checks = dict[str, Callable[[], dict]]


def run_checks(make_checks: Callable[[], Checks], out_dir: Path, only: Iterable[str] = (),
               timeout: timedelta | None = None) -> None:
    """Initialise the gloo process group (``timeout`` None: torch's default), build the checks (``make_checks`` runs
    once the group exists: device meshes), run each one named in ``only`` (every one if empty) and record its figures,
    or ``{"error": traceback}`` if it raised (one failure does not hide the others); gather every rank's results,
    rank 0 writing ``OUT_DIR/results.json`` as ``{check: {"rank0": figures, "rank1": figures, ...}}``; destroy the
    group."""
    dist.init_process_group("gloo", timeout=timeout)
    only = set(only)
    results = {}
    for name, fn in make_checks().items():
        if only and name not in only:
            continue
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {name: {f"rank{r}": per_rank[name] for r, per_rank in enumerate(gathered)} for name in results}
        partial = out_dir / "results.json.partial"  # renamed when whole: a launch is judged by this file
        partial.write_text(json.dumps(merged, indent=1))
        partial.replace(out_dir / "results.json")
    dist.destroy_process_group()
