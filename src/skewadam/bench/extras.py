"""The optional dependencies (pip extras): which are missing, found before any work starts, and quiet imports.

`missing` looks packages up with `importlib.util.find_spec` (nothing is imported), so a command can say once, before
its first run, everything it lacks and the one ``pip install`` that fixes it. `quiet_imports` silences, for the
duration of an import we make, the lines third-party packages log while loading (torchao's "Failed to load
_C_*.so" on CPU-only builds and the pytree deprecations its enums cause): their loggers are lowered to ERROR and
restored after, so warnings of the user's own code, and later ones, still show.

Example:
    >>> missing({"matplotlib": "the plots"})   # [] when installed
    >>> with quiet_imports():
    ...     import transformers
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from typing import Iterator, Mapping

__all__ = ["missing", "quiet_imports", "NOISY_LOGGERS"]

#: Loggers that print while a package loads, not because anything is wrong for us: torchao (its CUDA extensions on a
#: CPU build) and torch's pytree (torchao registers Enum constants, deprecated in torch 2.13).
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def missing(needs: Mapping[str, str]) -> list[str]:
    """The ``{module: what it is for}`` entries that are not installed, as ``"module (what it is for)"``."""
    out = []
    for module, purpose in needs.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a stub in sys.modules
            found = False
        if not found:
            out.append(f"{module} ({purpose})")
    return out


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, `NOISY_LOGGERS` log errors only; their levels are restored after."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
