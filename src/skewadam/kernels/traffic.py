"""Memory traffic of a SkewAdam step: the bytes each pass reads and writes per tensor, as the kernels implement them.

The one definition behind the traffic tables of docs/guide/kernels.md, ``skewadam bench-step --roofline`` (attained
bandwidth: these bytes over the measured time) and benchmarks/gpu_step.py (per launch). Counted: every element-sized
tensor a pass streams from or to memory, the gradient, the weight, the first moment (with its int8 scales) and the
full second moment, an in-place update as one read and one write. Not counted: statistics of O(rows + columns) per
matrix, step counts, and what a pass finds in a core's L2 cache because an earlier pass of the same unit just read
or wrote it, which is what the C++ kernel's schedules are for (``cache``: a core's L2, `cpu.cache_bytes`):

- ``early``: a factored unit without momentum whose gradient fits the cache takes its clip from pass 1
  (`cpu.weighted`), else does pass 2 right after its pass 1, on the gradient in cache; pass 3, after the non-finite
  check, reads the gradient again.
- ``whole``: such a unit of fp32 or fp64 weights without the non-finite check (``skip_nonfinite=False``): pass 3 too
  right after, finding the gradient in cache.
- ``fused``: another unit whose pass-2 streams (gradient, first moment, full second moment) fit the cache does
  passes 2 and 3 back to back, pass 3 finding the first (else the gradient) and full second moment in cache.
- ``split`` (larger units) and every Triton launch: each pass reads what it needs from memory, except that a factored
  unit without momentum has no pass 2 in the C++ kernel where `cpu.weighted` names it (fp32 weights; bf16 up to
  `cpu.WEIGHTED_BF16_MAX`) and in the Triton kernel for fp32 and bf16 weights: its clip comes from pass 1's weighted
  column sums (the Triton kernel reads each group of rows twice, the second time from cache, not counted).

Fused AdamW (torch's ``fused=True``, `adamw`) moves 7 element-sized streams (reads p, g, m, v; writes p, m, v): 28
bytes a parameter in fp32 and 14 in bf16 (its state is in the parameter's dtype); a plain stream ``a.add_(b)``
(`stream`) moves 3. Reads and writes are kept apart (`Traffic.read`): one core of an AMD EPYC (Zen 4) takes the same
time for ``a.add_(b)`` as for ``torch.dot(a, b)``, an in-place write costing next to nothing beside the reads
(benchmarks/streams.py), so there the reads bound a step's time.

Example:
    >>> from skewadam.state import state_flags
    >>> t = cpp((32, 1024, 256), torch.float32, state_flags({"tier": "expert"}), cache=1 << 20)
    >>> t.schedule, t.bytes / (32 * 1024 * 256), t.read / adamw(32 * 1024 * 256, torch.float32).read
    ('early', 16.0, 0.75)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ..state import TierSpec
from . import cpu

__all__ = ["Pass", "Traffic", "cpp", "triton", "adamw", "stream", "PASSES"]

PASSES = ("pass 1", "pass 2", "pass 3")


class Pass(NamedTuple):
    name: str  # "pass 1" (statistics), "pass 2" (moments, sum of u^2), "pass 3" (the weights)
    read: int  # bytes
    written: int


class Traffic(NamedTuple):
    """One tensor's traffic in one step."""

    schedule: str  # the C++ kernel's "early", "whole", "fused" or "split"; "triton"; "adamw", "stream"
    passes: tuple[Pass, ...]

    @property
    def bytes(self) -> int:
        return sum(p.read + p.written for p in self.passes)

    @property
    def read(self) -> int:
        return sum(p.read for p in self.passes)


class _Sizes(NamedTuple):
    g: int  # gradient bytes (= weight bytes)
    m: int  # first moment bytes with its int8 scales (0: none)
    v: int  # full second moment bytes (0: factored)
    factored: bool
    unit: tuple[int, int]  # a unit's gradient bytes, and what its pass 2 streams (as the C++ kernel sizes them)


def _sizes(shape: Sequence[int], dtype: torch.dtype, flags: TierSpec) -> _Sizes:
    spec = flags.spec(shape, dtype)
    size = {k: math.prod(s.shape) * s.dtype.itemsize for k, s in spec.items()}
    numel = math.prod(shape)
    view = flags.view_shape(shape)
    units = view[0] if flags.is_bank(len(view)) and view else 1
    unit_numel = numel // units if units else 0
    m = size.get("exp_avg", 0) + size.get("exp_avg_scale", 0)
    per_element = dtype.itemsize + sum(spec[k].dtype.itemsize for k in ("exp_avg", "exp_avg_sq") if k in spec)
    return _Sizes(numel * dtype.itemsize, m, size.get("exp_avg_sq", 0), "row_var" in spec,
                  (unit_numel * dtype.itemsize, unit_numel * per_element))


def cpp(shape: Sequence[int], dtype: torch.dtype, flags: TierSpec, *, relative_step: bool = False,
        skip_nonfinite: bool = True, cache: Optional[int] = None) -> Traffic:
    """The C++ kernel's one-process step (`skewadam.kernels.cpu.step_`) of a tensor of ``shape`` and ``dtype`` in a
    group of state ``flags`` (`skewadam.state.state_flags`), its units scheduled for a core's cache of ``cache``
    bytes (default: this machine's, `cpu.cache_bytes`)."""
    s = _sizes(shape, dtype, flags)
    cache = cpu.cache_bytes() if cache is None else cache
    p1 = Pass("pass 1", s.g * (1 + relative_step), 0)
    if s.factored and not s.m and s.unit[0] <= cache:
        if not skip_nonfinite and dtype != torch.bfloat16:
            return Traffic("whole", (p1, Pass("pass 2", 0, 0), Pass("pass 3", s.g, s.g)))
        return Traffic("early", (p1, Pass("pass 2", 0, 0), Pass("pass 3", 2 * s.g, s.g)))
    if s.factored and not s.m and cpu.weighted(dtype, s.unit[0] // dtype.itemsize):
        return Traffic("split", (p1, Pass("pass 2", 0, 0), Pass("pass 3", 2 * s.g, s.g)))
    p2 = Pass("pass 2", s.g + s.m + s.v, s.m + s.v)
    if s.unit[1] <= cache:
        return Traffic("fused", (p1, p2, Pass("pass 3", s.g, s.g)))
    return Traffic("split", (p1, p2, Pass("pass 3", s.g + (s.m or s.g) + s.v, s.g)))


def triton(shape: Sequence[int], dtype: torch.dtype, flags: TierSpec, *, relative_step: bool = False) -> Traffic:
    """The Triton kernel's one-process step (`step_`) of a tensor (`cpp`'s arguments), per pass, each one launch per
    bucket: ``stats_tiles`` (pass 1), ``direction_tiles`` (passes 2 and 3; no pass 2 for a factored tensor without
    momentum of fp32 or bf16 weights, `Bucket.weighted`, where no row's rinv is floored); its other launches move
    statistics only."""
    s = _sizes(shape, dtype, flags)
    weighted = s.factored and not s.m and dtype in (torch.float32, torch.bfloat16)
    return Traffic("triton", (Pass("pass 1", s.g * (1 + relative_step), 0),
                              Pass("pass 2", 0, 0) if weighted else Pass("pass 2", s.g + s.m + s.v, s.m + s.v),
                              Pass("pass 3", s.g + (s.m or s.g) + s.v, s.g)))


def adamw(numel: int, dtype: torch.dtype) -> Traffic:
    """Fused AdamW's step over ``numel`` parameters of ``dtype`` (state in the parameter's dtype): one pass reading
    p, g, m and v, writing p, m and v."""
    n = numel * dtype.itemsize
    return Traffic("adamw", (Pass("step", 4 * n, 3 * n),))


def stream(numel: int, dtype: torch.dtype) -> Traffic:
    """``a.add_(b)`` over ``numel`` elements of ``dtype``: reads a and b, writes a."""
    n = numel * dtype.itemsize
    return Traffic("stream", (Pass("add_", 2 * n, n),))
