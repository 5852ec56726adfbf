"""SkewAdam's update as a C++ kernel for CPU tensors, with the same pass functions as `skewadam.kernels.eager`.

The kernel (``csrc/skewadam_cpu.cpp``) runs the three passes of `skewadam.kernels.eager` over blocks of rows on
ATen's thread pool, with the same math in the same dtype, so the distributed seam (reductions between passes) works
unchanged. For one process, `step_` runs the whole step in one call and fuses passes 2 and 3: a bank slice or tensor
that fits in a core's L2 cache is read from memory once for both; the result is bitwise equal to the three passes.
Partial sums are added in a fixed block order, so results do not depend on the number of threads. bf16 parameters
are rounded with exactly the bits of `skewadam.kernels.rounding`. A compact first moment (bf16 or int8,
`skewadam.kernels.quant`) is decoded and encoded in the kernel with quant.py's operations in its order, so the stored
momentum bytes and scales are eager's.

The extension is compiled on first use with `torch.utils.cpp_extension.load` (``-O3 -march=native -fopenmp``, about
a minute; a line on stderr before and after) and cached under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) in a folder named by a hash of everything the build depends on (`_build_dir`), so
later processes load it in milliseconds and environments sharing the cache keep their own builds. `available()` says
whether it could be built; `skewadam.SkewAdam` falls back to the eager path with a one-line warning when it cannot (no
compiler, no ninja).
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

from .eager import GradStats, Moments, stat_dims, unit_dims

__all__ = [
    "GradStats", "Moments", "grad_stats", "update_moments_", "apply_updates_", "step_", "unit_dims", "stat_dims",
    "load", "available", "built", "stochastic_round_bf16",
]

_SOURCE = Path(__file__).with_name("csrc") / "skewadam_cpu.cpp"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU wheels, and the link resolves to the libgomp.so.1 torch has
# already loaded (same soname), so there is one thread pool. -fno-math-errno lets sqrt vectorise.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
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


def _build_dir() -> tuple[str, str]:
    """The extension's name and build folder, keyed on everything the build depends on: the source, the flags and
    the compiler, the torch installation (version and path: ``build.ninja`` holds its include and library paths),
    the Python (interpreter and headers) and the CPU (``-march=native``). Environments that share
    ``$TORCH_EXTENSIONS_DIR`` then never overwrite each other's build."""
    import sysconfig

    from torch.utils import cpp_extension

    parts = [_SOURCE.read_bytes(), " ".join(_CFLAGS + _LDFLAGS), os.environ.get("CXX", "c++"), torch.__version__,
             os.path.dirname(os.path.realpath(torch.__file__)), os.path.realpath(sys.executable), sys.version,
             sysconfig.get_paths()["include"], _cpu_id()]
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
    # Compile a copy kept in the build folder: build.ninja then names no checkout, so a worktree, a reinstall or a
    # branch switch (which touches the source's mtime) reuses the build instead of recompiling.
    source = Path(build_dir, _SOURCE.name)
    if not source.exists():  # its content is part of the folder's name: an existing copy is the same source
        tmp = source.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(_SOURCE.read_bytes())
        try:
            os.link(tmp, source)  # atomic, and never replaces (a newer mtime would make ninja rebuild)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    cached = built()
    if not cached:
        print(f"skewadam: compiling SkewAdam's C++ kernel, once per environment, ~1 min (into {build_dir})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    lib = cpp_extension.load(name, [str(source)], extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
                             build_directory=build_dir)  # copies: torch appends its own flags to the lists
    if not cached:
        print(f"skewadam: compiled the C++ kernel in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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


def grad_stats(
    grads: Sequence[Tensor],
    row_vars: Sequence[Optional[Tensor]],
    *,
    banks: Sequence[bool],
    dtypes: Sequence[torch.dtype],
) -> list[GradStats]:
    """Pass 1 (`skewadam.kernels.eager.grad_stats`): sums of g^2, nothing written."""
    return [GradStats(*s) for s in _ext().grad_stats(grads, row_vars, banks, dtypes)]


def update_moments_(
    grads: Sequence[Tensor],
    steps: Sequence[Tensor],
    exp_avgs: Sequence[Optional[Tensor]],
    exp_avg_sqs: Sequence[Optional[Tensor]],
    row_vars: Sequence[Optional[Tensor]],
    col_vars: Sequence[Optional[Tensor]],
    stats: Sequence[GradStats],
    *,
    banks: Sequence[bool],
    shapes: Sequence[torch.Size],
    beta1: float,
    beta2: float,
    eps: float,
    eps_mode: str,
    exp_avg_scales: Optional[Sequence[Optional[Tensor]]] = None,
    seed: int = 0,
    param_ids: Optional[Sequence[int]] = None,
) -> list[Moments]:
    """Pass 2 (`skewadam.kernels.eager.update_moments_`): step counts, moments, per-unit sum of u^2.

    A compact first moment (bf16, or int8 with ``exp_avg_scales``) is decoded, updated and stored back with the
    bytes `skewadam.kernels.quant` writes; ``seed`` and ``param_ids`` key a bf16 one's stochastic rounding.
    """
    n = len(grads)
    out = _ext().update_moments(
        grads, steps, exp_avgs, exp_avg_sqs, row_vars, col_vars, stats, banks, shapes, beta1, beta2, eps,
        eps_mode == "add", list(exp_avg_scales) if exp_avg_scales is not None else [None] * n, seed & 0xFFFFFFFF,
        list(param_ids) if param_ids is not None else list(range(n)),
    )
    return [Moments(u, corr_t if corr_t is not None else corr_f, rinv, cinv, active)
            for u, corr_t, corr_f, rinv, cinv, active in out]


def apply_updates_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    steps: Sequence[Tensor],
    exp_avgs: Sequence[Optional[Tensor]],
    exp_avg_sqs: Sequence[Optional[Tensor]],
    moments: Sequence[Moments],
    *,
    banks: Sequence[bool],
    shapes: Sequence[torch.Size],
    lr: float,
    weight_decay: float,
    eps: float,
    eps_mode: str,
    seed: int,
    param_ids: Sequence[int],
    exp_avg_scales: Optional[Sequence[Optional[Tensor]]] = None,
) -> None:
    """Pass 3 (`skewadam.kernels.eager.apply_updates_`): clip, decay, write; bf16 rounded stochastically."""
    corr = [mo.corr for mo in moments]
    _ext().apply_updates(
        params, grads, steps, exp_avgs, exp_avg_sqs, [mo.u_sumsq for mo in moments],
        [c if isinstance(c, Tensor) else None for c in corr], [0.0 if isinstance(c, Tensor) else c for c in corr],
        [mo.rinv for mo in moments], [mo.cinv for mo in moments], [mo.active for mo in moments],
        banks, shapes, lr, weight_decay, eps, eps_mode == "add", seed & 0xFFFFFFFF, param_ids,
        list(exp_avg_scales) if exp_avg_scales is not None else [None] * len(params),
    )


def step_(
    params: Sequence[Sequence[Tensor]],
    grads: Sequence[Sequence[Tensor]],
    steps: Sequence[Sequence[Tensor]],
    exp_avgs: Sequence[Sequence[Optional[Tensor]]],
    exp_avg_sqs: Sequence[Sequence[Optional[Tensor]]],
    row_vars: Sequence[Sequence[Optional[Tensor]]],
    col_vars: Sequence[Sequence[Optional[Tensor]]],
    *,
    banks: Sequence[Sequence[bool]],
    shapes: Sequence[Sequence[torch.Size]],
    param_ids: Sequence[Sequence[int]],
    betas: Sequence[tuple[float, float]],
    eps: Sequence[float],
    eps_mode: Sequence[str],
    lr: Sequence[float],
    weight_decay: Sequence[float],
    seed: Sequence[int],
    skip_nonfinite: bool,
    exp_avg_scales: Optional[Sequence[Sequence[Optional[Tensor]]]] = None,
) -> bool:
    """The whole step of one process (no reduction seam), in one call: passes 1-3 of every param group.

    Lists are per param group (the tensor lists of the three pass functions, and each group's hyperparameters).
    ``exp_avg_scales`` holds the int8 momentum's scales (None where the first moment is not int8, or omitted).
    Bitwise equal to `grad_stats`, `update_moments_` and `apply_updates_` run in turn, but the statistics never
    become tensors, and passes 2 and 3 run back to back on each unit that fits in a core's L2 cache.

    Returns:
        False, having written nothing, if ``skip_nonfinite`` and some gradient holds inf or NaN; True otherwise.
    """
    hypers = [_ext().Hyper(b[0], b[1], e, m == "add", l, w, s & 0xFFFFFFFF)
              for b, e, m, l, w, s in zip(betas, eps, eps_mode, lr, weight_decay, seed)]
    if exp_avg_scales is None:
        exp_avg_scales = [[None] * len(ps) for ps in params]
    return _ext().step(params, grads, steps, exp_avgs, exp_avg_scales, exp_avg_sqs, row_vars, col_vars, banks, shapes,
                       param_ids, hypers, skip_nonfinite)


def stochastic_round_bf16(x: Tensor, key: int) -> Tensor:
    """The kernel's rounding of an fp32 tensor to bf16: bit-identical to `skewadam.kernels.rounding`'s."""
    return _ext().stochastic_round_bf16(x, key & 0xFFFFFFFF)


def step_transient_bytes(tensors: Sequence[tuple[Sequence[int], bool]], param_dtype: torch.dtype) -> int:
    """No tensor-sized scratch: the kernel's scratch is row/column-sized (0.02-0.04 MiB per step measured), not
    counted."""
    return 0
