"""SkewAdam's update as a C++ kernel for CPU tensors, with the same pass functions as `skewadam.kernels.eager`.

The kernel (``csrc/skewadam_cpu.cpp``) runs the three passes of `skewadam.kernels.eager` over blocks of rows on
ATen's thread pool, with the same math in the same dtype, so the distributed seam (reductions between passes) works
unchanged. For one process, `step_` runs the whole step in one call and fuses passes 2 and 3: a bank slice or tensor
that fits in a core's L2 cache is read from memory once for both; the result is bitwise equal to the three passes.
Partial sums are added in a fixed block order, so results do not depend on the number of threads.

What is bitwise eager's, on any x86-64 (both compute it with the same IEEE operations, each rounded on its own: the
kernel is built with ``-ffp-contract=off``, eager avoids the fused ``torch.lerp``, and the int8 code takes a correctly
rounded square root on both): the step counts, the first moment in every storage (fp32/fp64 values, bf16 values,
int8 codes and scales) and the full second moment ``exp_avg_sq``; bf16 parameters and momentum are rounded with
exactly the bits of `skewadam.kernels.rounding`. The factored statistics and the weights depend on sums, which the
two add in different orders: they agree to rounding (within a few ULPs; the fp64 reference to 1e-12).

The extension is compiled on first use with `torch.utils.cpp_extension.load` (``-O3 -march=native -fopenmp``, about
a minute; the time is printed once) and cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
in a folder named by a hash of the source, the flags (the constants it takes from quant.py, rounding.py and types.py
are ``-D`` flags), the torch version and the CPU, so later processes load it in milliseconds. `available()` says
whether it could be built; `skewadam.SkewAdam` falls back to the eager path with a one-line warning when it cannot
(no compiler, no ninja). The kernel reads `skewadam.kernels.types`' records field by field; loading checks that the
extension's list of fields is types.py's.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import quant, rounding
from .types import ROW_MEAN_FLOOR, GradStats, Group, Moments, check, stat_dims, unit_dims

__all__ = [
    "GradStats", "Moments", "grad_stats", "update_moments_", "apply_updates_", "step_", "unit_dims", "stat_dims",
    "load", "available", "stochastic_round_bf16", "SKIP_ON_HOST",
]

SKIP_ON_HOST = True  # ``skip`` is a CPU tensor, read by the kernel (free on the CPU)

_SOURCE = Path(__file__).with_name("csrc") / "skewadam_cpu.cpp"


def _defines() -> list[str]:
    """The constants the kernel shares with the Python modules that define them, as -D flags (hashed into the build)."""
    return [
        f"-DSKEWADAM_QBLOCK={quant.BLOCK}",
        f"-DSKEWADAM_QMAX={float(quant.QMAX).hex()}",
        f"-DSKEWADAM_MOMENTUM_STREAM={quant.MOMENTUM_STREAM:#x}u",
        f"-DSKEWADAM_MUL1={rounding._MUL1:#x}u",
        f"-DSKEWADAM_MUL2={rounding._MUL2:#x}u",
        f"-DSKEWADAM_GOLDEN={rounding._GOLDEN:#x}u",
        f"-DSKEWADAM_ROW_MEAN_FLOOR={float(ROW_MEAN_FLOOR).hex()}",
    ]


# -fopenmp: at::parallel_for is OpenMP in torch's CPU wheels, and the link resolves to the libgomp.so.1 torch has
# already loaded (same soname), so there is one thread pool. -fno-math-errno lets sqrt vectorise. -ffp-contract=off:
# no fused multiply-add where eager's torch ops round twice (the element-wise state is bitwise eager's).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *_defines()]
_LDFLAGS = ["-fopenmp"]
_lib = None
_error: Optional[str] = None
_warned = False


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _check_fields(lib) -> None:
    """The extension reads the records positionally: its field lists must be types.py's."""
    from . import types

    for name, fields in lib.fields().items():
        ours = getattr(types, name)._fields
        if tuple(fields) != ours:
            raise RuntimeError(f"the C++ kernel reads {name} as {tuple(fields)}, but skewadam.kernels.types defines "
                               f"{ours}: update csrc/skewadam_cpu.cpp's records with types.py")


def _load():
    """Build (once per machine) or load the extension; raise on failure."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
                    _cpu_id().encode()])
    ).hexdigest()[:16]
    name = f"skewadam_cpu_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    cached = os.path.exists(os.path.join(build_dir, f"{name}.so"))
    start = time.perf_counter()
    lib = cpp_extension.load(
        name, [str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, build_directory=build_dir
    )
    if not cached:
        print(f"skewadam: compiled the C++ CPU kernel in {time.perf_counter() - start:.1f} s (cached in {build_dir})",
              file=sys.stderr)
    _check_fields(lib)
    return lib


def _ext():
    global _lib, _error
    if _lib is None and _error is None:
        try:
            _lib = _load()
        except Exception as e:  # no compiler, no ninja, a compile error: the caller falls back to eager
            _error = _reason(e)
    if _lib is None:
        raise RuntimeError(f"the skewadam C++ CPU kernel could not be built ({_error})")
    return _lib


def _reason(e: Exception) -> str:
    """One line from a build failure: the compiler's first error, else the first line naming an error, else the last."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    compiler = [line for line in lines if ": error:" in line or "fatal error" in line]
    named = [line for line in lines if "error" in line.lower() and not line.startswith(("ninja:", "FAILED"))]
    return f"{type(e).__name__}: {(compiler or named or lines[-1:])[0][:300]}"


def load() -> None:
    """Build (first use on this machine: about a minute) or load the extension; RuntimeError says why it cannot."""
    _ext()


def available(warn: bool = False) -> bool:
    """Whether the C++ kernel builds (or is cached) here; with ``warn``, say why not in one warning line, once."""
    try:
        _ext()
        return True
    except RuntimeError as e:
        global _warned
        if warn and not _warned:
            _warned = True
            warnings.warn(f"{e}; using the eager PyTorch path (set SKEWADAM_IMPL=eager to silence)", stacklevel=2)
        return False


def _seeded(group: Group) -> Group:
    """The group with its seed reduced to the 32 bits the rounding keys use (the kernel takes an int64)."""
    return group if 0 <= group.seed <= 0xFFFFFFFF else group._replace(seed=group.seed & 0xFFFFFFFF)


def _call(fn: str, groups: Sequence[Group], *args):
    """Run extension function ``fn``; a record the extension cannot even convert (pybind's TypeError: a step that is
    a Python number, a missing gradient) is explained by `skewadam.kernels.types.check`."""
    try:
        return getattr(_ext(), fn)(*args)
    except TypeError:
        for group in groups:
            for pt in group.params:
                check(pt)
        raise


def grad_stats(group: Group) -> list[GradStats]:
    """Pass 1 (`skewadam.kernels.eager.grad_stats`): sums of g^2, nothing written."""
    return [GradStats(*s) for s in _call("grad_stats", [group], _seeded(group))]


def update_moments_(group: Group, stats: Sequence[GradStats], *, skip: Optional[Tensor] = None) -> list[Moments]:
    """Pass 2 (`skewadam.kernels.eager.update_moments_`): step counts, moments, per-unit sum of u^2. A compact first
    moment is decoded, updated and stored back with the bytes `skewadam.kernels.quant` writes. ``skip`` True: nothing
    written, zeros returned."""
    return [Moments(*m) for m in _call("update_moments", [group], _seeded(group), list(stats), skip)]


def apply_updates_(group: Group, moments: Sequence[Moments], *, skip: Optional[Tensor] = None) -> None:
    """Pass 3 (`skewadam.kernels.eager.apply_updates_`): clip, decay, write; bf16 rounded stochastically."""
    _call("apply_updates", [group], _seeded(group), list(moments), skip)


def step_(groups: Sequence[Group], *, skip_nonfinite: bool) -> Tensor:
    """The whole step of one process (no reduction seam), in one call: passes 1-3 of every group.

    Bitwise equal to `grad_stats`, `update_moments_` and `apply_updates_` run in turn, but the statistics never become
    tensors, and passes 2 and 3 run back to back on each unit that fits in a core's L2 cache.

    Returns:
        A 0-d bool tensor: True, having written nothing, if ``skip_nonfinite`` and some gradient holds inf or NaN.
    """
    return _call("step", groups, [_seeded(g) for g in groups], skip_nonfinite)


def stochastic_round_bf16(x: Tensor, key: int) -> Tensor:
    """The kernel's rounding of an fp32 tensor to bf16: bit-identical to `skewadam.kernels.rounding`'s."""
    return _ext().stochastic_round_bf16(x, key & 0xFFFFFFFF)


def step_transient_bytes(tensors: Sequence[tuple[Sequence[int], bool]], param_dtype: torch.dtype) -> int:
    """No tensor-sized scratch: the kernel's scratch is row/column-sized (0.02-0.04 MiB per step measured), not
    counted."""
    return 0
