"""Launching the multi-process tests: ``torchrun --standalone --nproc_per_node=2`` on CPU (gloo), judged by what the
launch wrote, not by its exit status alone.

torch 2.13's gloo now and then aborts a worker at process exit, after its work is done ("terminate called without an
active exception": 3 of 28 plain-PyTorch FSDP2 launches on this project's machine, DeepSpeed stage-3 runs too;
`../shared/notes/deepspeed.md`). So `torchrun` accepts a launch that exited with that abort when the results file it
names is complete (written whole: `checks.run_checks` writes it atomically), retries a launch that aborted so before
its results were complete (up to `ATTEMPTS` launches), and fails on any other error at once, with the output's tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # process startup alone can take over a minute on a loaded machine
ATTEMPTS = 3
GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun(*args: str, result: Optional[Path] = None, env: Optional[Mapping[str, str]] = None,
             timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 ARGS`` on CPU from the repository root (one thread per rank,
    ``GLOO_SOCKET_IFNAME=lo`` on Linux); ``result``: the JSON file whose complete presence proves the work done."""
    full = dict(os.environ if env is None else env)
    full.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        full.setdefault("GLOO_SOCKET_IFNAME", "lo")  # hosts whose name does not resolve to a reachable address
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return launch(cmd, result=result, env=full, timeout=timeout)


def launch(cmd: Sequence[str], *, result: Optional[Path] = None, env: Optional[Mapping[str, str]] = None,
           timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``cmd`` until it succeeds or fails for a reason other than gloo's abort at exit (`module docstring`);
    `pytest.fail` with the output's tail when it does not succeed."""
    tails = []
    for attempt in range(1, ATTEMPTS + 1):
        if result is not None:
            result.unlink(missing_ok=True)  # a stale file from an earlier attempt proves nothing
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        if proc.returncode == 0:
            return proc
        output = proc.stdout + proc.stderr
        aborted = GLOO_EXIT_ABORT in output
        if aborted and result is not None and complete(result):
            return proc
        tails.append(f"attempt {attempt} (exit {proc.returncode}):\n{output[-6000:]}")
        if not aborted:
            break
    pytest.fail(f"{' '.join(cmd[-3:])} failed:\n" + "\n".join(tails))


def complete(path: Path) -> bool:
    """Whether ``path`` holds a whole JSON document."""
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True
