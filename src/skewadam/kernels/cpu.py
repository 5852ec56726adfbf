"""SkewAdam's update as a C++ kernel for CPU tensors, with the same pass functions as `skewadam.kernels.eager`.

The kernel (``csrc/skewadam_cpu.cpp`` and the headers it includes) runs the three passes of
`skewadam.kernels.eager` over blocks of rows on ATen's thread pool, with the same math in the same dtype, so the
distributed seam (reductions between passes) works unchanged. For one process, `step_` runs the whole step in one
call, each unit's passes scheduled so that a pass finds in a core's L2 cache what the pass before it read
(`skewadam.kernels.traffic` has the bytes); the result is bitwise equal to the three passes. Partial sums are added
in a fixed block order, so results depend neither on the number of threads nor on the schedule.

What is bitwise eager's, on any x86-64 (both compute it with the same IEEE operations, each rounded on its own: the
kernel is built with ``-ffp-contract=off``, eager avoids the fused ``torch.lerp``, and the int8 code takes a correctly
rounded square root on both): the step counts, the first moment in every storage (fp32/fp64 values, bf16 values,
int8 codes and scales) and the full second moment ``exp_avg_sq`` (its EMA in double, one rounding); bf16 parameters and
momentum are rounded with exactly the bits of `skewadam.kernels.rounding`. The factored statistics and the weights
depend on sums, which the two add in different orders: they agree to rounding (within a few ULPs; the fp64 reference
to 1e-12). Pass 1's sums are float64 tensors as eager's, with eager's range (`skewadam.kernels.eager`: the largest
gradient that steps exactly): a block of fp32 or bf16 elements is added in float where all its sums are safely in
range, else in double (`skewadam.kernels.types`' order of operations).

The extension is compiled on first use with `torch.utils.cpp_extension.load` (``-O3 -march=native -fopenmp``, about
a minute; a line on stderr before and after) and cached under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) in a folder named by a hash of everything the build depends on (`_build_dir`: the
source, the flags, among them the constants it takes from quant.py, rounding.py and types.py as ``-D`` flags, the
compiler, the torch installation, the Python and the CPU), so later processes load it in milliseconds and environments
sharing the cache keep their own builds. `available()` says whether it could be built; `skewadam.SkewAdam` falls back
to the eager path with a one-line warning when it cannot (no compiler, no ninja). The kernel reads
`skewadam.kernels.types`' records field by field; loading checks that the extension's list of fields is types.py's.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ..state import state_dtype_for
from . import quant, rounding
from .types import (RELATIVE_STEP_EPS, ROW_MEAN_FLOOR, GradStats, Group, Moments, MomFmt, ParamTensors, check,
                    planned, stat_dims, unit_dims)

__all__ = [
    "GradStats", "Moments", "grad_stats", "update_moments_", "apply_updates_", "step_", "unit_dims", "stat_dims",
    "load", "available", "built", "stochastic_round_bf16",
]


_CSRC = Path(__file__).with_name("csrc")
#: The kernel's files: one translation unit, skewadam_cpu.cpp, and the headers it includes (csrc/*.h).
_SOURCES = (_CSRC / "skewadam_cpu.cpp", *sorted(_CSRC.glob("*.h")))


#: Elements per work item (a run of rows of one matrix, or of elements of one unit). A block's passes walk it as one
#: to four runs (kStreams, kP1Streams); runs shorter than a quarter of 1 << 17 elements (64 KiB of bf16) restarted
#: the hardware prefetcher often enough to slow the expert step (docs/guide/kernels.md).
BLOCK = 1 << 17
#: Rows per block at least: bounds pass 1's column partials of a matrix at 1/64 of its elements.
MIN_BLOCK_ROWS = 64
#: A core's L2 cache where the OS does not say (`cache_bytes`): 1 MiB, the smallest of current server cores.
DEFAULT_CACHE = 1 << 20
#: The largest bf16 unit (bytes of its gradient) whose clip comes from pass 1's weighted column sums (`weighted`):
#: a larger one (split) would keep them at 4 bytes per column and block of rows, up to 3% of its weights' bytes
#: beside the step, to save a pass 2 that reads 2 bytes a parameter. A fixed size, so that results do not depend on
#: the machine.
WEIGHTED_BF16_MAX = DEFAULT_CACHE


def _defines() -> list[str]:
    """The constants the kernel shares with the Python modules that define them, as -D flags (hashed into the build)."""
    return [
        f"-DSKEWADAM_BLOCK={BLOCK}",
        f"-DSKEWADAM_WEIGHTED_BF16_MAX={WEIGHTED_BF16_MAX}",
        f"-DSKEWADAM_MIN_BLOCK_ROWS={MIN_BLOCK_ROWS}",
        f"-DSKEWADAM_QBLOCK={quant.BLOCK}",
        f"-DSKEWADAM_QMAX={float(quant.QMAX).hex()}",
        f"-DSKEWADAM_MOMENTUM_STREAM={quant.MOMENTUM_STREAM:#x}u",
        f"-DSKEWADAM_MUL1={rounding._MUL1:#x}u",
        f"-DSKEWADAM_MUL2={rounding._MUL2:#x}u",
        f"-DSKEWADAM_GOLDEN={rounding._GOLDEN:#x}u",
        f"-DSKEWADAM_ROW_MEAN_FLOOR={float(ROW_MEAN_FLOOR).hex()}",
        f"-DSKEWADAM_RELATIVE_STEP_EPS={float(RELATIVE_STEP_EPS).hex()}",
        *(f"-DSKEWADAM_MOM_{fmt.name}={fmt.value}" for fmt in MomFmt),
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


def _build_dir() -> tuple[str, str]:
    """The extension's name and build folder, keyed on everything the build depends on: the source, the flags and
    the compiler, the torch installation (version and path: ``build.ninja`` holds its include and library paths),
    the Python (interpreter and headers) and the CPU (``-march=native``). Environments that share
    ``$TORCH_EXTENSIONS_DIR`` then never overwrite each other's build."""
    import sysconfig

    from torch.utils import cpp_extension

    parts = [*(x for f in _SOURCES for x in (f.name, f.read_bytes())), " ".join(_CFLAGS + _LDFLAGS),
             os.environ.get("CXX", "c++"), torch.__version__, os.path.dirname(os.path.realpath(torch.__file__)),
             os.path.realpath(sys.executable), sys.version, sysconfig.get_paths()["include"], _cpu_id()]
    digest = hashlib.sha256(b"\0".join(x if isinstance(x, bytes) else x.encode() for x in parts)).hexdigest()[:16]
    name = f"skewadam_cpu_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return name, os.path.join(root, name)


def built() -> bool:
    """Whether this environment's build of the extension exists (loading it then takes milliseconds, not a build)."""
    name, build_dir = _build_dir()
    return os.path.exists(os.path.join(build_dir, f"{name}.so"))


def _load():
    """Build (once per environment) or load the extension; raise on failure. A build says so on stderr before it
    starts and how long it took after."""
    from torch.utils import cpp_extension

    name, build_dir = _build_dir()
    os.makedirs(build_dir, exist_ok=True)
    # Compile copies kept in the build folder: build.ninja then names no checkout, so a worktree, a reinstall or a
    # branch switch (which touches the sources' mtimes) reuses the build instead of recompiling.
    for src in _SOURCES:
        copy = Path(build_dir, src.name)
        if not copy.exists():  # its content is part of the folder's name: an existing copy is the same file
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(src.read_bytes())
            try:
                os.link(tmp, copy)  # atomic, and never replaces (a newer mtime would make ninja rebuild)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
    cached = built()
    if not cached:
        print(f"skewadam: compiling SkewAdam's C++ kernel, once per environment, ~1 min (into {build_dir})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    lib = cpp_extension.load(name, [str(Path(build_dir, _SOURCES[0].name))], extra_cflags=list(_CFLAGS),
                             extra_ldflags=list(_LDFLAGS),
                             build_directory=build_dir)  # copies: torch appends its own flags to the lists
    if not cached:
        print(f"skewadam: compiled the C++ kernel in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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
    """Run extension function ``fn``; a record the extension cannot convert (its TypeError names the field: a step
    that is a Python number, a missing gradient) is explained by `skewadam.kernels.types.check` where it can."""
    try:
        return getattr(_ext(), fn)(*args)
    except TypeError:
        for group in groups:
            for pt in group.params if isinstance(group.params, (list, tuple)) else ():
                if isinstance(pt, ParamTensors):
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


def step_(groups: Sequence[Group], *, skip_nonfinite: bool, cache: Optional[int] = None) -> Tensor:
    """The whole step of one process (no reduction seam), in one call: passes 1-3 of every group.

    Bitwise equal to `grad_stats`, `update_moments_` and `apply_updates_` run in turn, but the statistics never become
    tensors, and each unit's passes are scheduled by what fits in a core's L2 cache of ``cache`` bytes (default
    `cache_bytes`): a factored unit without momentum whose gradient fits does pass 2 right after its pass 1, other
    units whose pass-2 streams fit do passes 2 and 3 back to back (`skewadam.kernels.traffic` has the bytes each
    schedule moves). Pass 1 keeps every factored parameter's row and column sums, so a gradient is read from memory
    twice, not three times.

    Returns:
        A 0-d bool tensor: True, having written nothing, if ``skip_nonfinite`` and some gradient holds inf or NaN.
    """
    return _call("step", groups, [_seeded(g) for g in groups], skip_nonfinite, cache or cache_bytes())


@functools.lru_cache(maxsize=None)
def cache_bytes() -> int:
    """The L2 cache of one core (Linux: ``/sys/devices/system/cpu/cpu0/cache``), else `DEFAULT_CACHE`."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2" and (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip()  # e.g. "1024K"
                return int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
        except (OSError, ValueError):
            break
    return DEFAULT_CACHE


def stochastic_round_bf16(x: Tensor, key: int) -> Tensor:
    """The kernel's rounding of an fp32 tensor to bf16: bit-identical to `skewadam.kernels.rounding`'s."""
    return _ext().stochastic_round_bf16(x, key & 0xFFFFFFFF)


def weighted(param_dtype: torch.dtype, unit_numel: int) -> bool:
    """Whether a factored unit without momentum of ``unit_numel`` elements takes its clip's sum of u^2 from pass 1's
    weighted column sums (t_j = sum_i g_ij^2 / row_var_i, added right after each group of rows' sums, the rows still
    in L1), not from a pass 2 that reads its gradient again: fp32 units, and bf16 ones up to `WEIGHTED_BF16_MAX`
    bytes, where weighting costs less than that read, even from cache (docs/guide/kernels.md). fp64 keeps pass 2."""
    return param_dtype == torch.float32 or (param_dtype == torch.bfloat16 and 2 * unit_numel <= WEIGHTED_BF16_MAX)


def step_transient_bytes(tensors: Sequence[Sequence[Any]], param_dtype: torch.dtype) -> int:
    """Bytes `step_` allocates for parameters ``[(shape, bank), ...]`` or ``[(shape, bank, state, group), ...]``
    (`skewadam.kernels.types.Planned`; an upper bound, closer given the states): the row and column statistics
    pass 1 keeps for the factored parameters, per matrix ``[R, C]`` ``3 + R + C`` sums in float64 (plus ``C`` per
    block of rows when it has several), ``R + C`` denominators in the statistics dtype and, for a parameter without
    momentum whose units take their clip from them (`weighted`), ``C`` weighted column sums per block of rows in
    float32, each parameter's 64-byte aligned; 64 bytes for the result and empty buffers. Not counted: row- and
    unit-sized scratch outside torch's allocator (~0.02 MiB per step measured) and contiguous copies of
    non-contiguous tensors."""
    itemsize = state_dtype_for(param_dtype).itemsize
    kept = 0
    for t in planned(tensors):
        if not t.factored:
            continue
        R, C = t.shape[-2:]
        blocks = -(-R // max(1, min(R, max(MIN_BLOCK_ROWS, BLOCK // max(C, 1)))))
        per_matrix = 8 * (3 + R + C + (blocks * C if blocks > 1 else 0)) + itemsize * (R + C)  # bytes
        unit = R * C if t.bank else math.prod(t.shape)  # elements of a unit: a bank slice, else the tensor
        per_matrix += 4 * blocks * C if t.momentum is None and weighted(param_dtype, unit) else 0
        kept += -(-math.prod(t.shape[:-2]) * per_matrix // 64) * 64
    return kept + (64 if tensors else 0)
