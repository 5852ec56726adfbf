"""Update kernels: pure functions over the records of `skewadam.kernels.types` (one `Group` per param group), one
module per implementation, the same passes in each (the protocol is in `types`).

- `eager`: torch ops, on any device (the reference path).
- `cpu`: a C++ kernel for CPU tensors, compiled on first use and cached. It also offers ``step_``, the whole step of
  one process in one call; the optimizer uses it when nothing needs reducing between passes.

`SkewAdam` (argument ``impl``) picks one with `select`: ``"eager"``, ``"cpp"``, or ``"auto"`` (the default), which
is the ``SKEWADAM_IMPL`` environment variable when set, else the C++ kernel for CPU tensors when it builds (one
warning line when it cannot) and eager otherwise.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import eager

__all__ = ["eager", "IMPLS", "impls", "select"]

IMPLS = ("auto", "eager", "cpp")


def impls() -> list[str]:
    """The implementations that run on CPU tensors here: ``eager``, and ``cpp`` when the C++ kernel builds."""
    from . import cpu

    return ["eager", "cpp"] if cpu.available() else ["eager"]


def select(impl: str, device: torch.device) -> ModuleType:
    """The kernel module for tensors on ``device`` under the choice ``impl`` (``auto``, ``eager`` or ``cpp``).

    Example:
        >>> select("auto", torch.device("cpu"))  # skewadam.kernels.cpu, or eager (with a warning) without a compiler
    """
    if impl == "auto":
        impl = os.environ.get("SKEWADAM_IMPL", "auto")
        if impl not in IMPLS:
            raise ValueError(f"SKEWADAM_IMPL={impl!r} is not a kernel implementation: use one of {IMPLS}")
    if impl == "eager":
        return eager
    from . import cpu

    if device.type != "cpu":
        if impl == "cpp":
            raise ValueError(
                f"impl='cpp' runs on CPU tensors, got tensors on {device}: use impl='auto' (C++ on CPU, eager "
                "elsewhere) or impl='eager'"
            )
        return eager
    if impl == "cpp":
        cpu.load()
        return cpu
    return cpu if cpu.available(warn=True) else eager
