"""Update kernels: pure functions over the records of `skewadam.kernels.types` (one `Group` per param group), one
module per implementation, the same passes in each (the protocol is in `types`).

- `eager`: torch ops, on any device (the reference path).
- `cpu`: a C++ kernel for CPU tensors, compiled on first use and cached. It also offers ``step_``, the whole step of
  one process in one call; the optimizer uses it when nothing needs reducing between passes.
- `triton`: Triton kernels for CUDA tensors, a few launches per group and pass and no host sync (step counts, the
  skip flag and a tensor lr are read on the device). Under ``TRITON_INTERPRET=1`` (set before triton is first
  imported) they also run on CPU tensors, slowly: that is how they are tested without a GPU.

`SkewAdam` (argument ``impl``) picks one with `select`: ``"eager"``, ``"cpp"``, ``"triton"``, or ``"auto"`` (the
default), which is the ``SKEWADAM_IMPL`` environment variable when set, else the C++ kernel for CPU tensors when it
builds (one warning line when it cannot) and eager otherwise, and the Triton kernel for CUDA tensors when triton
imports, eager otherwise.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from . import eager

__all__ = ["eager", "IMPLS", "impls", "select"]

IMPLS = ("auto", "eager", "cpp", "triton")


def _triton() -> Optional[ModuleType]:
    """The Triton kernel module, or None when triton does not import."""
    try:
        from . import triton
    except ImportError:
        return None
    return triton


def impls(interpreted: bool = False) -> list[str]:
    """The implementations that run on CPU tensors here: ``eager``, and ``cpp`` when the C++ kernel builds; with
    ``interpreted``, also ``triton`` when its kernels run in Triton's interpreter (``TRITON_INTERPRET=1``:
    tests/conftest.py sets it without a GPU), minutes per test on the shapes the other kernels' tests use."""
    from . import cpu

    out = ["eager", "cpp"] if cpu.available() else ["eager"]
    if interpreted and os.environ.get("TRITON_INTERPRET") == "1":  # (triton is not imported otherwise)
        tk = _triton()
        if tk is not None and tk.available("cpu"):
            out.append("triton")
    return out


def select(impl: str, device: torch.device) -> ModuleType:
    """The kernel module for tensors on ``device`` under the choice ``impl`` (``auto``, ``eager``, ``cpp`` or
    ``triton``).

    Example:
        >>> select("auto", torch.device("cpu"))  # skewadam.kernels.cpu, or eager (with a warning) without a compiler
        >>> select("auto", torch.device("cuda"))  # skewadam.kernels.triton, or eager where triton does not import
    """
    if impl == "auto":
        impl = os.environ.get("SKEWADAM_IMPL", "auto")
        if impl not in IMPLS:
            raise ValueError(f"SKEWADAM_IMPL={impl!r} is not a kernel implementation: use one of {IMPLS}")
    if impl == "eager":
        return eager
    if impl == "triton":
        tk = _triton()
        if tk is None:
            raise ValueError("impl='triton' needs the triton package (pip install triton): use impl='auto' or "
                             "impl='eager'")
        if not tk.available(device):
            raise ValueError(
                f"impl='triton' runs on CUDA tensors, got tensors on {device}: use impl='auto' (C++ on CPU, Triton on "
                "CUDA) or impl='eager' (to test the Triton kernels on CPU, set TRITON_INTERPRET=1 before triton is "
                "first imported)")
        return tk
    if device.type != "cpu":
        if impl == "cpp":
            raise ValueError(
                f"impl='cpp' runs on CPU tensors, got tensors on {device}: use impl='auto' (C++ on CPU, Triton on "
                "CUDA) or impl='eager'"
            )
        tk = _triton() if device.type == "cuda" else None
        return tk if tk is not None and tk.available(device) else eager
    from . import cpu

    if impl == "cpp":
        cpu.load()
        return cpu
    return cpu if cpu.available(warn=True) else eager
