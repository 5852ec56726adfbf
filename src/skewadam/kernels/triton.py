"""SkewAdam's update as Triton kernels: the passes of `skewadam.kernels.eager` for GPU tensors, with no host sync.

The math is eager's, operation for operation, in the state dtype ``T`` (fp32 for bf16 parameters, the parameter's
dtype otherwise): EMAs as `eager.ema` (``x * (1 - beta) + s * beta``, the coefficients float64 rounded to T), the
write as ``p * decay - u * lr`` (lr and decay float64 rounded to T), the int8 code as `quant.quantize_` (the ratio
rounded to fp32, its correctly rounded root, times 127, rint), every operation IEEE-rounded on its own in eager's order
(kernels are compiled with ``enable_fp_fusion=False``: no FMA; divisions and square roots round to nearest). What
differs from eager is only the order of summation. So, as eager and the C++ kernel promise each other, the element-wise
state is bitwise eager's: step counts, the first moment in every storage (fp32/fp64 values, bf16 values, int8 codes
and scales) and the full second moment; bf16 parameters and momentum are rounded with exactly the bits of
`skewadam.kernels.rounding`. The factored statistics and the weights depend on sums: they agree to rounding. (Against
eager run on CUDA an int8 code can differ by one: torch's CUDA division by the scalar 127 multiplies by its
reciprocal.)

Launch structure. A param group is split into *buckets* by (parameter dtype, factored or not, first-moment format),
the values that change the compiled code; each pass is a few launches per bucket, whatever its number of tensors
(as torch's fused multi-tensor optimizers do). The tensors' addresses and sizes go to the kernels in a small device
table (one int64 row per tensor, `_tensor_table`, uploaded from pinned memory without a sync). The work is cut into
*items* (one program each, ~`_TARGET` elements): a strip of whole rows of one matrix (factored), a strip of rows of
one unit (full second moment with int8 momentum, whose blocks lie along rows), or a run of one unit's elements
(otherwise). Items, matrices and units are listed in three more int64 tables that depend only on the shapes (cached).
Every index is int64; every load and store is masked by the sizes in the tables, which are checked on the host
against the tensors before any launch.

Passes (eager's, with the distributed seam between them):

1. `grad_stats`: per item, the rows' sums of ``g^2`` (complete: an item holds whole rows) and the columns' partial
   sums (its own slot, or the column sums themselves for a one-strip matrix); then per matrix the column partials
   added in strip order, ``rc`` and the row-statistic sum; then per unit ``sum g^2``. Fixed orders: deterministic.
2. `update_moments_`: per tensor, the step counts (a bank slice advances only if its gradient is non-zero), the bias
   corrections (float64 on the device) and the rounding keys; per matrix, the factored EMAs and ``rinv``/``cinv``;
   per item, the momentum and full second moment in place and its partial ``sum u^2``; per unit, ``sum u^2``.
3. `apply_updates_`: per tensor, each unit's clip ``1/max(1, rms(u))`` and the rounding key; per item,
   ``p = p*(1 - lr*wd) - lr * u * clip``, rounded stochastically for bf16.

`step_` runs the three passes of every group back to back. Its finite check is pass 1's: the per-unit sums of
``g^2`` set a device flag (an atomic max) that every later kernel reads, writing nothing when it is set (as fused
AdamW's ``found_inf``); the returned ``skipped`` is that flag, on the device.

Step counts live on the device, beside the parameter, for banks and single tensors alike (the kernels read and
advance them; a host step would need a sync to skip; `DEVICE_STEPS` tells the optimizer): the rounding key
``rounding_key(seed, stream, sum of steps)`` and the bias corrections are computed from them in the kernels. A unit
with no elements in the global shape is left untouched, its step count included. The group's hyperparameters travel
as float64 in the table's header row; ``lr`` may be a float or a one-element float tensor (read in the kernel if on
the parameters' device; a CPU tensor's value is read on the host, which is no device sync). A ``skip`` flag is read
on the device too (`SKIP_ON_HOST` is False).

Checks, on the host before any launch, from shapes and metadata only (no device read): `types.check` on every record
(the sizes every index is computed from, naming the parameter), `types.check_lr`, then the dtypes, devices and
contiguity the tables assume; statistics and moments handed back between passes are checked against the shapes
the next pass indexes.

Memory traffic per element of an expert bank (factored, no momentum): ``g`` read by pass 1, by pass 2 (``sum u^2``),
and by pass 3 with ``p`` read and written: 20 bytes in fp32 (fused AdamW: 28), 10 in bf16. Transient memory: the
statistics (rows, columns, units), the column partials of matrices cut into several strips (at most numel / 512 per
tensor: strips hold >= `_MIN_ROWS` rows), one float per item, and the tables (`step_transient_bytes`: 0.24% of the
paper's 6.78B model in fp32, 0.49% in bf16); in `step_` ``rinv``/``cinv`` overwrite the row and column sums they
are computed from. A non-contiguous parameter or gradient is also copied (and the parameter written back).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors, slowly, which is how
they are tested without a GPU.

Shape legend: ``E`` units (bank slices, dim 0; 1 for a single tensor), ``B`` matrices ``[R, C]`` of a factored tensor
(all dims but the last two), ``R`` rows, ``C`` columns, ``M`` rows of the ``[M, C]`` view of a tensor.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import quant, rounding
from .rounding import mix32
from .types import ROW_MEAN_FLOOR, GradStats, Group, Moments, ParamTensors, check, check_lr, stat_dims, unit_dims

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised only where triton is absent
    raise ImportError(
        "skewadam.kernels.triton needs the triton package (pip install triton); use impl='eager' without it"
    ) from e

__all__ = ["grad_stats", "update_moments_", "apply_updates_", "step_", "step_transient_bytes", "available",
           "interpreted", "stochastic_round_bf16", "unit_dims", "stat_dims", "SKIP_ON_HOST", "DEVICE_STEPS"]

SKIP_ON_HOST = False  # a ``skip`` tensor is read by the kernels on the device (no host sync)
DEVICE_STEPS = True  # every step count (a non-bank tensor's too) lives on the parameter's device

_TARGET = 1 << 18  # elements per work item
_MIN_ROWS = 512  # rows per strip of a matrix cut into several: bounds its column partials at numel / 512
_TILE = 4096  # elements per tile of the item kernels
_MAT_BLOCK = 1024  # rows or columns per program of the per-matrix kernels
_SMALL_BLOCK = 256  # units per loop of the per-tensor and per-unit kernels
_M32 = 0xFFFFFFFF
# The other kernels' constants, as the kernels here see them (globals of a Triton kernel must be constexpr).
_QMAX = tl.constexpr(quant.QMAX)  # int8 momentum: the largest code
_MOMENTUM_STREAM = tl.constexpr(quant.MOMENTUM_STREAM)  # bf16 momentum's rounding key: mix32(key + this)
_MUL1, _MUL2, _GOLDEN = (tl.constexpr(c) for c in (rounding._MUL1, rounding._MUL2, rounding._GOLDEN))
_MOM_NONE, _MOM_PLAIN, _MOM_BF16, _MOM_INT8 = 0, 1, 2, 3

# Columns of the tensor table: addresses, then sizes. Addresses of absent tensors are 0 (never dereferenced).
_P, _G, _M, _MS, _V, _RV, _CV, _STEP = (tl.constexpr(i) for i in range(8))
_SUMSQ, _RC, _RVS, _ROW, _COL = (tl.constexpr(i) for i in range(8, 13))
_USQ, _CORR, _RINV, _CINV, _ACT = (tl.constexpr(i) for i in range(13, 18))
_E, _R, _C, _NB, _RG, _CG, _NG, _BANK, _KBASE, _UNIT0 = (tl.constexpr(i) for i in range(18, 28))
_NT = tl.constexpr(28)
# Row 0 of the tensor table holds the group's hyperparameters (float64 bits; the lr tensor's address or 0), the
# tensors' rows follow: kernel arguments would reach the interpreter as untyped floats (fp32 constants).
_H_W1, _H_W2, _H_B1, _H_B2, _H_ADD, _H_FLOOR, _H_RM_FLOOR, _H_LR, _H_WD, _H_LR_ADDR = (
    tl.constexpr(i) for i in range(10))
# Items: tensor, unit, matrix (factored), first row and rows (rows layouts), first element and elements, and the
# offset of the item's column partials in the scratch (-1: the column sums themselves).
_I_T, _I_U, _I_B, _I_ROW0, _I_NROWS, _I_E0, _I_N, _I_COLP = (tl.constexpr(i) for i in range(8))
_NI = tl.constexpr(8)
# Matrices (factored): tensor, unit, matrix, offset of its column partials (-1: one strip), strips.
_X_T, _X_U, _X_B, _X_COLP, _X_S = (tl.constexpr(i) for i in range(5))
_NX = tl.constexpr(5)
# Units: tensor, unit, first item and items, first matrix and matrices.
_U_T, _U_U, _U_ITEM0, _U_NITEMS, _U_MAT0, _U_NMATS = (tl.constexpr(i) for i in range(6))
_NU = tl.constexpr(6)

_TL = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
       torch.int8: tl.int8}
_LR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # a tensor lr's, read in the kernel


# ================================================================================================ device helpers
@triton.jit
def _addr(row, col: tl.constexpr, dtype: tl.constexpr):
    """The address in column ``col`` of a tensor-table row, as a pointer to ``dtype``."""
    return tl.load(row + col).to(tl.pointer_type(dtype))


@triton.jit
def _big(row, col: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """`_addr` of a parameter-sized tensor; ALIGNED: the host checked it is 16-byte aligned (vector accesses)."""
    p = tl.load(row + col).to(tl.pointer_type(dtype))
    if ALIGNED:  # (on the pointer: a hint on the integer does not survive the cast)
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _load8(ptr, ALIGNED: tl.constexpr):
    """A size from a table, known a multiple of 8 when ALIGNED (row lengths, item starts: the host checked). The
    hint is on the load (a hint on an argument of a helper is lost when it is inlined)."""
    x = tl.load(ptr)
    if ALIGNED:
        x = tl.multiple_of(x, 8)
    return x


@triton.jit
def _row(tab, t):
    """Tensor t's row of the tensor table."""
    return tab + (t + 1) * _NT


@triton.jit
def _hyper(tab, col: tl.constexpr):
    """A float64 hyperparameter from the table's header row."""
    return tl.load(tab + col).to(tl.float64, bitcast=True)


@triton.jit
def _div(a, b, T: tl.constexpr):
    """a / b rounded to nearest (Triton's fp32 ``/`` is approximate)."""
    if T == tl.float32:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def _sqrt(x, T: tl.constexpr):
    """sqrt(x) rounded to nearest."""
    if T == tl.float32:
        return tl.math.sqrt_rn(x)
    return tl.sqrt(x)


@triton.jit
def _ema(s, x, b, w):
    """`skewadam.kernels.eager.ema`: ``x * (1 - beta) + s * beta``, each operation rounded on its own (no FMA: the
    kernels are compiled with ``enable_fp_fusion=False``); ``b`` and ``w`` are beta and 1 - beta, each rounded from
    float64 to the statistics dtype, as torch rounds a Python float scalar."""
    return x * w + s * b


@triton.jit
def _mix32(x):
    """`skewadam.kernels.rounding.mix32` on uint32."""
    x ^= x >> 16
    x *= _MUL1
    x ^= x >> 15
    x *= _MUL2
    x ^= x >> 16
    return x


@triton.jit
def _round_bf16(x, idx, key):
    """fp32 ``x`` rounded to bf16 with the bits `rounding.stochastic_round_bf16` draws for element ``idx`` (int64)
    under ``key`` (uint32): one hash of (key, idx // 2), low half for even and high half for odd indices; a NaN as
    c10::BFloat16 writes it (0x7FC0), whatever its sign and payload."""
    h = _mix32((idx >> 1).to(tl.uint32) * _GOLDEN + key)
    r = tl.where((idx & 1) == 1, h >> 16, h & 0xFFFF)
    b = x.to(tl.uint32, bitcast=True)
    t = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, (b + r) & 0xFFFF0000)
    return (t >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _rint(y):
    """Round half to even (torch.round) of 0 <= y < 2^23, by comparisons only."""
    r = y.to(tl.int32)
    f = r.to(y.dtype)
    half = f + 0.5
    up = (y > half) | ((y == half) & ((r & 1) == 1))
    return tl.where(up, f + 1.0, f)


@triton.jit
def _powi(b, t):
    """b ** t for float64 ``b`` and int64 ``t >= 0``, by binary exponentiation (multiplications only: exact to a few
    ulps for the step counts float32 holds, and portable, unlike a float64 pow)."""
    r = tl.zeros(t.shape, tl.float64) + 1.0
    x = tl.zeros(t.shape, tl.float64) + b
    while tl.max(t, 0) > 0:
        r = tl.where((t & 1) == 1, r * x, r)
        x = x * x
        t = t >> 1
    return r


@triton.jit
def _go(row, u, skip, HAS_SKIP: tl.constexpr):
    """Whether unit ``u`` of a tensor is updated: not skipped, with elements in the global shape, and for a bank, a
    slice with a non-zero gradient."""
    act = tl.load(_addr(row, _ACT, tl.int1) + u, mask=tl.load(row + _BANK) != 0, other=1) != 0
    act = act & (tl.load(row + _NG) > 0)
    if HAS_SKIP:
        act = act & (tl.load(skip) == 0)
    return act


@triton.jit
def _decode_int8(q, scale, T: tl.constexpr):
    """quant.dequantize: ``(|c| * c) * scale`` with ``c = q / 127``, for a [rows, one block] tile of codes."""
    c = _div(q.to(T), _QMAX, T)
    return tl.abs(c) * c * scale.to(T)[:, None]


@triton.jit
def _stored_momentum(g, m, ms, offs, mask, sidx, smask, T: tl.constexpr, MOM: tl.constexpr):
    """What pass 3 multiplies: the gradient (no momentum) or the stored first moment decoded to T."""
    if MOM == 0:
        src = tl.load(g + offs, mask=mask, other=0.0).to(T)
    elif MOM == 3:
        src = _decode_int8(tl.load(m + offs, mask=mask, other=0), tl.load(ms + sidx, mask=smask, other=0.0), T)
    else:
        src = tl.load(m + offs, mask=mask, other=0.0).to(T)
    return src


@triton.jit
def _update_momentum(x, m, ms, offs, mask, sidx, smask, b1, w1, key, T: tl.constexpr, MOM: tl.constexpr):
    """Pass 2's first moment of one tile: ``ema(m, g, beta1)`` stored in its format (quant.store_momentum_'s
    operations); returns the stored value in T (what pass 3 reads), or ``g`` without momentum."""
    if MOM == 0:
        src = x
    elif MOM == 1:
        src = _ema(tl.load(m + offs, mask=mask, other=0.0), x, b1, w1)
        tl.store(m + offs, src, mask=mask)
    elif MOM == 2:
        new = _ema(tl.load(m + offs, mask=mask, other=0.0).to(T), x, b1, w1)
        bits = _round_bf16(new, offs, key)
        tl.store(m + offs, bits, mask=mask)
        src = bits.to(T)
    else:  # int8 (quant.quantize_): the tile's columns are one block of quant.BLOCK per row, its scale at sidx
        old = _decode_int8(tl.load(m + offs, mask=mask, other=0), tl.load(ms + sidx, mask=smask, other=0.0), T)
        new = tl.where(mask, _ema(old, x, b1, w1), 0.0)  # zero-padded like quant._blocked
        absmax = tl.max(tl.abs(new), 1)
        # the code in fp32 whatever T: |x| / absmax rounded to fp32, its correctly rounded root, times 127, rint
        ratio = _div(tl.abs(new), tl.maximum(absmax, _tiny(T))[:, None], T).to(tl.float32)
        code = _rint(tl.math.sqrt_rn(ratio) * _QMAX)
        code = tl.where(new < 0, -code, code)  # copysign (a -0.0 code is the byte 0 too)
        q = code.to(tl.int8)
        scale = absmax.to(tl.float32)
        tl.store(m + offs, q, mask=mask)
        tl.store(ms + sidx, scale, mask=smask)
        src = _decode_int8(q, scale, T)
    return src


@triton.jit
def _tiny(T: tl.constexpr):
    """torch.finfo(T).tiny."""
    if T == tl.float32:
        tiny = tl.full([], 0x00800000, tl.int32).to(tl.float32, bitcast=True)
    else:
        tiny = tl.full([], 0x0010000000000000, tl.int64).to(tl.float64, bitcast=True)
    return tiny


# ================================================================================================ pass 1
@triton.jit
def _stats_tiles(tab, items, scratch, part0, PD: tl.constexpr, T: tl.constexpr, FACTORED: tl.constexpr,
                 ALIGNED: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
    """Per item: factored, its rows' sums of g^2 and its column partials; otherwise its sum of g^2 (a partial)."""
    pid = tl.program_id(0)
    it = items + pid * _NI
    row = _row(tab, tl.load(it + _I_T))
    g = _big(row, _G, PD, ALIGNED)
    if FACTORED:
        C = _load8(row + _C, ALIGNED)
        r0 = tl.load(it + _I_ROW0)
        r1 = r0 + tl.load(it + _I_NROWS)
        colp = tl.load(it + _I_COLP)
        row_out = _addr(row, _ROW, T)
        if colp < 0:
            col_out = _addr(row, _COL, T) + tl.load(it + _I_B) * C
        else:
            col_out = scratch + colp
        for c in range(0, C, BC):
            cols = c + tl.arange(0, BC)
            cm = cols < C
            acc = tl.zeros([BC], T)
            for r in range(r0, r1, RB):
                rows = r + tl.arange(0, RB)
                rm = rows < r1
                x = tl.load(g + rows[:, None] * C + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(T)
                sq = x * x
                acc += tl.sum(sq, 0)
                prev = tl.load(row_out + rows, mask=rm, other=0.0)  # the rows' sums so far (zero-initialised)
                tl.store(row_out + rows, prev + tl.sum(sq, 1), mask=rm)
            tl.store(col_out + cols, acc, mask=cm)
            tl.debug_barrier()  # this chunk's row sums are stored before the next chunk reads them
    else:
        e0 = _load8(it + _I_E0, ALIGNED)
        e1 = e0 + tl.load(it + _I_N)
        acc = tl.zeros([BLOCK], T)
        for s in range(e0, e1, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            x = tl.load(g + offs, mask=offs < e1, other=0.0).to(T)
            acc += x * x
        tl.store(scratch + part0 + pid, tl.sum(acc, 0))


@triton.jit
def _stats_matrices(tab, mats, scratch, T: tl.constexpr, BLK: tl.constexpr, SB: tl.constexpr):
    """Per (matrix, chunk k): the column sums of chunk k from the strips' partials in strip order; chunk 0 also
    ``rc`` (sum of the row sums) and the sum of row_var before the step."""
    x = mats + tl.program_id(0) * _NX
    k = tl.program_id(1)
    row = _row(tab, tl.load(x + _X_T))
    b = tl.load(x + _X_B)
    R = tl.load(row + _R)
    C = tl.load(row + _C)
    if k == 0:
        rows_in = _addr(row, _ROW, T) + b * R
        rv = _addr(row, _RV, T) + b * R
        acc_rc = tl.zeros([BLK], T)
        acc_rv = tl.zeros([BLK], T)
        for i in range(0, R, BLK):
            offs = i + tl.arange(0, BLK)
            acc_rc += tl.load(rows_in + offs, mask=offs < R, other=0.0)
            acc_rv += tl.load(rv + offs, mask=offs < R, other=0.0)
        tl.store(_addr(row, _RC, T) + b, tl.sum(acc_rc, 0))
        tl.store(_addr(row, _RVS, T) + b, tl.sum(acc_rv, 0))
    colp = tl.load(x + _X_COLP)
    if colp >= 0:
        S = tl.load(x + _X_S)
        cols = k * BLK + tl.arange(0, BLK)
        cm = cols < C
        acc = tl.zeros([BLK], T)
        for s in range(0, S, SB):
            strips = s + tl.arange(0, SB)
            part = tl.load(scratch + colp + strips[:, None] * C + cols[None, :],
                           mask=(strips < S)[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(part, 0)
        tl.store(_addr(row, _COL, T) + b * C + cols, acc, mask=cm)


@triton.jit
def _unit_sums(tab, units, scratch, part0, flag, DST: tl.constexpr, T: tl.constexpr, FROM_MATS: tl.constexpr,
               HAS_FLAG: tl.constexpr, TMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Per unit: the sum of its matrices' ``rc`` (FROM_MATS) or of its items' partials, into column DST; with a flag,
    raise it if the sum is not finite."""
    un = units + tl.program_id(0) * _NU
    row = _row(tab, tl.load(un + _U_T))
    if FROM_MATS:
        src = _addr(row, _RC, T) + tl.load(un + _U_MAT0)
        n = tl.load(un + _U_NMATS)
    else:
        src = scratch + part0 + tl.load(un + _U_ITEM0)
        n = tl.load(un + _U_NITEMS)
    acc = tl.zeros([BLOCK], T)
    for k in range(0, n, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0)
    total = tl.sum(acc, 0)
    tl.store(_addr(row, DST, T) + tl.load(un + _U_U), total)
    if HAS_FLAG:
        tl.atomic_max(flag, ((total != total) | (tl.abs(total) > TMAX)).to(tl.int32))


# ================================================================================================ pass 2
@triton.jit
def _count_steps(tab, keys, skip, n_tensors, T: tl.constexpr,
                 HAS_MOM: tl.constexpr, HAS_SKIP: tl.constexpr, UB: tl.constexpr):
    """Per tensor: which units are active (bank: a non-zero gradient), step counts advanced, the bias corrections
    ``sqrt(1 - beta2^t) [/ (1 - beta1^t)]`` in float64, and the rounding keys of the weight and of a bf16 momentum."""
    t = tl.program_id(0)
    row = _row(tab, t)
    E = tl.load(row + _E)
    bank = tl.load(row + _BANK)
    ng = tl.load(row + _NG)
    sumsq = _addr(row, _SUMSQ, T)
    step = _addr(row, _STEP, tl.float32)
    corr = _addr(row, _CORR, T)
    beta1 = _hyper(tab, _H_B1)
    beta2 = _hyper(tab, _H_B2)
    total = tl.zeros([UB], tl.int64)
    for u0 in range(0, E, UB):
        us = u0 + tl.arange(0, UB)
        um = us < E
        # (a block and a scalar are combined with tl.where: the interpreter mistypes `block & scalar`); a unit
        # without elements in the global shape (NG = 0) is left untouched, its step count included
        active = tl.where(bank != 0, tl.load(sumsq + us, mask=um, other=0.0) > 0, tl.where(ng > 0, um, False))
        new = tl.load(step + us, mask=um, other=0.0) + active.to(tl.float32)
        write = um
        if HAS_SKIP:
            write = tl.where(tl.load(skip) == 0, um, False)
        tl.store(step + us, new, mask=write)
        tl.store(_addr(row, _ACT, tl.int1) + us, active, mask=tl.where(bank != 0, um, False))
        tt = tl.maximum(new.to(tl.int64), 1)  # idle bank slices (t = 0) are masked out later: keep them finite
        c = tl.sqrt(1.0 - _powi(beta2, tt))
        if HAS_MOM:
            c = c / (1.0 - _powi(beta1, tt))
        tl.store(corr + us, c.to(T), mask=um)
        total += tl.where(um, new.to(tl.int64), 0)
    key = _mix32(((tl.load(row + _KBASE) + tl.sum(total, 0)) & 0xFFFFFFFF).to(tl.uint32))
    tl.store(keys + t, key.to(tl.int64))
    tl.store(keys + n_tensors + t, _mix32(key + _MOMENTUM_STREAM).to(tl.int64))


@triton.jit
def _factored_moments(tab, mats, skip, T: tl.constexpr, EPS_ADD: tl.constexpr, HAS_SKIP: tl.constexpr, BLK: tl.constexpr):
    """Per (matrix, chunk k): the row and column EMAs of chunk k (active units only) and ``rinv``/``cinv``:
    floor: ``rinv = 1/sqrt(max(row_var / max(mean_i row_var, 1e-15), eps))``, ``cinv = 1/sqrt(max(col_var, eps))``;
    add: ``rinv = 1/sqrt(row_var / max(mean_i row_var, tiny))``, ``cinv = 1/sqrt(col_var)``. The row mean is carried
    as a sum: ``b2 * sum_i row_var + (rc / C + R * add) * (1 - b2)``."""
    x = mats + tl.program_id(0) * _NX
    k = tl.program_id(1)
    row = _row(tab, tl.load(x + _X_T))
    u = tl.load(x + _X_U)
    b = tl.load(x + _X_B)
    R = tl.load(row + _R)
    C = tl.load(row + _C)
    Rg = tl.load(row + _RG).to(T)
    Cg = tl.load(row + _CG).to(T)
    active = _go(row, u, skip, False)
    write = _go(row, u, skip, HAS_SKIP)
    add = _hyper(tab, _H_ADD)
    b2 = _hyper(tab, _H_B2).to(T)
    w2 = _hyper(tab, _H_W2).to(T)
    a = add.to(T)
    f = _hyper(tab, _H_FLOOR).to(T)
    rvs = tl.load(_addr(row, _RVS, T) + b)
    rc = tl.load(_addr(row, _RC, T) + b)
    radd = (tl.load(row + _RG).to(tl.float64) * add).to(T)
    rsum = rvs * b2 + (_div(rc, Cg, T) + radd) * w2
    rsum = tl.where(active, rsum, rvs)
    rm = tl.maximum(_div(rsum, Rg, T), _hyper(tab, _H_RM_FLOOR).to(T))
    rows = k * BLK + tl.arange(0, BLK)
    rmask = rows < R
    rv_p = _addr(row, _RV, T) + b * R + rows
    rv = tl.load(rv_p, mask=rmask, other=1.0)
    new = _ema(rv, _div(tl.load(_addr(row, _ROW, T) + b * R + rows, mask=rmask, other=0.0), Cg, T) + a, b2, w2)
    tl.store(rv_p, new, mask=tl.where(write, rmask, False))
    rv = tl.where(active, new, rv)
    if EPS_ADD:
        rinv = _div(1.0, _sqrt(_div(rv, rm, T), T), T)
    else:
        rinv = _div(1.0, _sqrt(tl.maximum(_div(rv, rm, T), f), T), T)
    tl.store(_addr(row, _RINV, T) + b * R + rows, rinv, mask=rmask)
    cols = k * BLK + tl.arange(0, BLK)
    cmask = cols < C
    cv_p = _addr(row, _CV, T) + b * C + cols
    cv = tl.load(cv_p, mask=cmask, other=1.0)
    new = _ema(cv, _div(tl.load(_addr(row, _COL, T) + b * C + cols, mask=cmask, other=0.0), Rg, T) + a, b2, w2)
    tl.store(cv_p, new, mask=tl.where(write, cmask, False))
    cv = tl.where(active, new, cv)
    if EPS_ADD:
        cinv = _div(1.0, _sqrt(cv, T), T)
    else:
        cinv = _div(1.0, _sqrt(tl.maximum(cv, f), T), T)
    tl.store(_addr(row, _CINV, T) + b * C + cols, cinv, mask=cmask)


@triton.jit
def _full_u(src, x, v, offs, mask, scale, b2, w2, add, floor, T: tl.constexpr, EPS_ADD: tl.constexpr,
            WRITE: tl.constexpr):
    """Full second moment of one tile: ``v = ema(v, g^2 [+ eps], beta2)`` (stored if WRITE), and
    ``u = src * scale / sqrt(v)`` (floor: ``sqrt(max(v, eps))``)."""
    vv = tl.load(v + offs, mask=mask, other=1.0)
    if WRITE:
        if EPS_ADD:
            vv = _ema(vv, x * x + add, b2, w2)
        else:
            vv = _ema(vv, x * x, b2, w2)
        tl.store(v + offs, vv, mask=mask)
    if not EPS_ADD:
        vv = tl.maximum(vv, floor)
    return _div(src * scale, _sqrt(vv, T), T)


@triton.jit
def _moments_tiles(tab, items, scratch, part0, keys, skip, n_tensors, PD: tl.constexpr,
                   T: tl.constexpr, MD: tl.constexpr, FACTORED: tl.constexpr, FLAT: tl.constexpr, MOM: tl.constexpr,
                   EPS_ADD: tl.constexpr, HAS_SKIP: tl.constexpr,
                   ALIGNED: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
    """Per item of an updated unit: the first moment (and the full second moment) in place, and the item's partial
    ``sum u^2`` with ``u = src * rinv_i * corr * cinv_j`` (factored) or ``src * corr / sqrt(v)``."""
    pid = tl.program_id(0)
    it = items + pid * _NI
    t = tl.load(it + _I_T)
    row = _row(tab, t)
    u = tl.load(it + _I_U)
    go = _go(row, u, skip, HAS_SKIP)
    g = _big(row, _G, PD, ALIGNED)
    m = _big(row, _M, MD, ALIGNED)
    ms = _addr(row, _MS, tl.float32)
    v = _big(row, _V, T, ALIGNED)
    corr = tl.load(_addr(row, _CORR, T) + u)
    mkey = tl.load(keys + n_tensors + t).to(tl.uint32)
    b1t = _hyper(tab, _H_B1).to(T)
    w1t = _hyper(tab, _H_W1).to(T)
    b2t = _hyper(tab, _H_B2).to(T)
    w2t = _hyper(tab, _H_W2).to(T)
    at = _hyper(tab, _H_ADD).to(T)
    ft = _hyper(tab, _H_FLOOR).to(T)
    if FLAT:
        e0 = _load8(it + _I_E0, ALIGNED)
        e1 = e0 + tl.where(go, tl.load(it + _I_N), 0)
        acc = tl.zeros([BLOCK], T)
        for s in range(e0, e1, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            mask = offs < e1
            x = tl.load(g + offs, mask=mask, other=0.0).to(T)
            src = _update_momentum(x, m, ms, offs, mask, offs, mask, b1t, w1t, mkey, T, MOM)
            uu = _full_u(src, x, v, offs, mask, corr, b2t, w2t, at, ft, T, EPS_ADD, True)
            acc += tl.where(mask, uu * uu, 0.0)
    else:
        C = _load8(row + _C, ALIGNED)
        NB = tl.load(row + _NB)
        r0 = tl.load(it + _I_ROW0)
        r1 = r0 + tl.where(go, tl.load(it + _I_NROWS), 0)
        rinv = _addr(row, _RINV, T)
        cinv = _addr(row, _CINV, T) + tl.load(it + _I_B) * C
        acc = tl.zeros([RB, BC], T)
        for c in range(0, C, BC):
            cols = c + tl.arange(0, BC)
            cm = cols < C
            if FACTORED:
                ci = tl.load(cinv + cols, mask=cm, other=0.0)
            for r in range(r0, r1, RB):
                rows = r + tl.arange(0, RB)
                rm = rows < r1
                offs = rows[:, None] * C + cols[None, :]
                mask = rm[:, None] & cm[None, :]
                x = tl.load(g + offs, mask=mask, other=0.0).to(T)
                src = _update_momentum(x, m, ms, offs, mask, rows * NB + c // BC, rm, b1t, w1t, mkey, T, MOM)
                if FACTORED:
                    sc = tl.load(rinv + rows, mask=rm, other=0.0) * corr
                    uu = src * sc[:, None] * ci[None, :]
                else:
                    uu = _full_u(src, x, v, offs, mask, corr, b2t, w2t, at, ft, T, EPS_ADD, True)
                acc += tl.where(mask, uu * uu, 0.0)
    tl.store(scratch + part0 + pid, tl.sum(acc))


# ================================================================================================ pass 3
@triton.jit
def _prepare_apply(tab, clips, keys, T: tl.constexpr, UB: tl.constexpr):
    """Per tensor: each unit's clip ``1 / max(1, sqrt(sum u^2 / n))`` and the weight's rounding key."""
    t = tl.program_id(0)
    row = _row(tab, t)
    E = tl.load(row + _E)
    n = tl.load(row + _NG).to(T)
    usq = _addr(row, _USQ, T)
    step = _addr(row, _STEP, tl.float32)
    unit0 = tl.load(row + _UNIT0)
    total = tl.zeros([UB], tl.int64)
    for u0 in range(0, E, UB):
        us = u0 + tl.arange(0, UB)
        um = us < E
        rms = _sqrt(_div(tl.load(usq + us, mask=um, other=0.0), n, T), T)
        tl.store(clips + unit0 + us, _div(1.0, tl.maximum(rms, 1.0), T), mask=um)
        total += tl.where(um, tl.load(step + us, mask=um, other=0.0).to(tl.int64), 0)
    key = _mix32(((tl.load(row + _KBASE) + tl.sum(total, 0)) & 0xFFFFFFFF).to(tl.uint32))
    tl.store(keys + t, key.to(tl.int64))


@triton.jit
def _apply_tiles(tab, items, clips, keys, skip, PD: tl.constexpr,
                 T: tl.constexpr, MD: tl.constexpr, FACTORED: tl.constexpr, FLAT: tl.constexpr, MOM: tl.constexpr,
                 EPS_ADD: tl.constexpr, HAS_SKIP: tl.constexpr, LR_PTR: tl.constexpr, LRD: tl.constexpr,
                 ALIGNED: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
    """Per item of an updated unit: ``p = p * (1 - lr*wd) - (u * clip) * lr`` (eager's operations, each rounded; lr
    and the decay are float64 rounded to T, a tensor lr read here on the device), rounded stochastically for bf16
    parameters."""
    pid = tl.program_id(0)
    it = items + pid * _NI
    t = tl.load(it + _I_T)
    row = _row(tab, t)
    u = tl.load(it + _I_U)
    go = _go(row, u, skip, HAS_SKIP)
    p = _big(row, _P, PD, ALIGNED)
    g = _big(row, _G, PD, ALIGNED)
    m = _big(row, _M, MD, ALIGNED)
    ms = _addr(row, _MS, tl.float32)
    v = _big(row, _V, T, ALIGNED)
    if LR_PTR:
        lr64 = tl.load(tl.load(tab + _H_LR_ADDR).to(tl.pointer_type(LRD))).to(tl.float64)
    else:
        lr64 = _hyper(tab, _H_LR)
    decay = (1.0 - lr64 * _hyper(tab, _H_WD)).to(T)
    lr = lr64.to(T)
    cc = tl.load(_addr(row, _CORR, T) + u) * tl.load(clips + tl.load(row + _UNIT0) + u)
    key = tl.load(keys + t).to(tl.uint32)
    ft = _hyper(tab, _H_FLOOR).to(T)
    if FLAT:
        e0 = _load8(it + _I_E0, ALIGNED)
        e1 = e0 + tl.where(go, tl.load(it + _I_N), 0)
        for s in range(e0, e1, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            mask = offs < e1
            src = _stored_momentum(g, m, ms, offs, mask, offs, mask, T, MOM)
            uu = _full_u(src, src, v, offs, mask, cc, 0.0, 0.0, 0.0, ft, T, EPS_ADD, False)
            _write(p, offs, mask, uu, decay, lr, key, PD, T)
    else:
        C = _load8(row + _C, ALIGNED)
        NB = tl.load(row + _NB)
        r0 = tl.load(it + _I_ROW0)
        r1 = r0 + tl.where(go, tl.load(it + _I_NROWS), 0)
        rinv = _addr(row, _RINV, T)
        cinv = _addr(row, _CINV, T) + tl.load(it + _I_B) * C
        for c in range(0, C, BC):
            cols = c + tl.arange(0, BC)
            cm = cols < C
            if FACTORED:
                ci = tl.load(cinv + cols, mask=cm, other=0.0)
            for r in range(r0, r1, RB):
                rows = r + tl.arange(0, RB)
                rm = rows < r1
                offs = rows[:, None] * C + cols[None, :]
                mask = rm[:, None] & cm[None, :]
                src = _stored_momentum(g, m, ms, offs, mask, rows * NB + c // BC, rm, T, MOM)
                if FACTORED:
                    sc = tl.load(rinv + rows, mask=rm, other=0.0) * cc
                    uu = src * sc[:, None] * ci[None, :]
                else:
                    uu = _full_u(src, src, v, offs, mask, cc, 0.0, 0.0, 0.0, ft, T, EPS_ADD, False)
                _write(p, offs, mask, uu, decay, lr, key, PD, T)


@triton.jit
def _write(p, offs, mask, uu, decay, lr, key, PD: tl.constexpr, T: tl.constexpr):
    new = tl.load(p + offs, mask=mask, other=0.0).to(T) * decay - uu * lr
    if PD == tl.bfloat16:
        tl.store(p + offs, _round_bf16(new, offs, key), mask=mask)
    else:
        tl.store(p + offs, new.to(PD), mask=mask)


@triton.jit
def _round_kernel(x, out, n, offset, key, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, _round_bf16(tl.load(x + offs, mask=mask, other=0.0), offs + offset, key.to(tl.uint32)),
             mask=mask)


# ================================================================================================ work decomposition
class _Layout:
    """How one bucket's tensors are cut into work, and where their statistics sit in a workspace: a function of the
    tensors' local shapes, bank flags and kind only (cached by `_layout`).

    ``kind``: ``"factored"`` (row strips of matrices), ``"rows"`` (full second moment with int8 momentum: row strips
    of units, so that int8 blocks never straddle two items) or ``"flat"`` (runs of a unit's elements).
    """

    def __init__(self, specs: tuple[tuple[tuple[int, ...], bool], ...], kind: str) -> None:
        self.kind = kind
        self.items: list[list[int]] = []
        self.mats: list[list[int]] = []
        self.units: list[list[int]] = []
        self.dims: list[tuple[int, int, int, int]] = []  # per tensor: E, R, C, NB
        self.unit0: list[int] = []  # per tensor: index of its first unit in the bucket
        self.stats: list[tuple[int, ...]] = []  # per tensor: offsets of sumsq, rc, rvs, row, col (elements)
        self.moments: list[tuple[int, ...]] = []  # per tensor: offsets of u_sumsq, corr (all tensors' first), rinv,
        # cinv
        self.act: list[int] = []  # per tensor: offset in the bank-activity buffer (-1: not a bank)
        self.n_units = self.colp = self.stats_numel = self.moments_numel = self.act_numel = 0
        self.max_c = self.max_rc = 1  # the longest row, the most rows or columns of a matrix
        self.aligned8 = True  # every item starts, and (rows layouts) every row holds, a multiple of 8 elements
        self._tables: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self._rc_sizes: list[tuple[int, int]] = []
        for t, (shape, bank) in enumerate(specs):
            self._add(t, shape, bank)
        start = 2 * self.n_units  # u_sumsq and corr of every tensor, then rinv and cinv (`step_` keeps only these)
        for t, (rows, cols) in enumerate(self._rc_sizes):
            unit0, E = self.unit0[t], self.dims[t][0]
            self.moments.append((2 * unit0, 2 * unit0 + E) + ((start, start + rows) if self.kind == "factored" else ()))
            start += rows + cols
        self.moments_numel = start

    def _add(self, t: int, shape: tuple[int, ...], bank: bool) -> None:
        numel = math.prod(shape)
        E = shape[0] if bank else 1
        C = shape[-1] if shape else 1
        M = math.prod(shape[:-1]) if shape else 1
        factored = self.kind == "factored"
        R = shape[-2] if factored else 0
        B = math.prod(shape[:-2]) if factored else 0
        self.dims.append((E, R, C, quant.num_blocks(C)))
        self.unit0.append(self.n_units)
        per_unit = [[len(self.items), 0] for _ in range(E)]  # first item, items

        def item(u, b, row0, nrows, e0, n, colp=-1):
            if per_unit[u][1] == 0:
                per_unit[u][0] = len(self.items)
            per_unit[u][1] += 1
            self.items.append([t, u, b, row0, nrows, e0, n, colp])
            self.aligned8 = self.aligned8 and e0 % 8 == 0 and (self.kind == "flat" or C % 8 == 0)

        if factored:
            mpu = B // E if E else 0
            rows = max(1, min(R, max(_MIN_ROWS, -(-_TARGET // max(C, 1)))))
            S = -(-R // rows)
            self.max_rc = max(self.max_rc, R, C)
            for b in range(B):
                u = b // mpu if bank else 0
                colp = self.colp if S > 1 else -1
                self.mats.append([t, u, b, colp, S])
                for s in range(S if C else 0):
                    nr = min(rows, R - s * rows)
                    item(u, b, b * R + s * rows, nr, (b * R + s * rows) * C, nr * C, colp + s * C if S > 1 else -1)
                if S > 1:
                    self.colp += S * C
            mats = [(u * mpu, mpu) for u in range(E)] if bank else [(0, B)]
        elif self.kind == "rows":
            rpu = M // E if E else 0
            rows = max(1, min(rpu, -(-_TARGET // max(C, 1))))
            for u in range(E if C else 0):
                for r in range(0, rpu, rows):
                    nr = min(rows, rpu - r)
                    item(u, -1, u * rpu + r, nr, (u * rpu + r) * C, nr * C)
            mats = [(0, 0)] * E
        else:
            nu = numel // E if E else 0
            for u in range(E):
                for e in range(0, nu, _TARGET):
                    item(u, -1, 0, 0, u * nu + e, min(_TARGET, nu - e))
            mats = [(0, 0)] * E
        if numel:
            self.max_c = max(self.max_c, C)
        for u, ((first, count), (mat0, nmats)) in enumerate(zip(per_unit, mats)):
            self.units.append([t, u, first, count, mat0, nmats])
        self.n_units += E
        sizes = (E, B, B, B * R, B * C) if factored else (E,)
        self.stats.append(_offsets(self.stats_numel, sizes))
        self.stats_numel += sum(sizes)
        self._rc_sizes.append((B * R, B * C))
        self.act.append(self.act_numel if bank else -1)
        self.act_numel += E if bank else 0

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The item, matrix and unit tables on ``device`` (uploaded once)."""
        if device not in self._tables:
            self._tables[device] = tuple(_upload(rows, device) for rows in (self.items, self.mats, self.units))
        return self._tables[device]


def _offsets(start: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in sizes:
        out.append(start)
        start += n
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _layout(specs: tuple[tuple[tuple[int, ...], bool], ...], kind: str) -> _Layout:
    return _Layout(specs, kind)


def _upload(rows: list[list[int]], device: torch.device) -> Tensor:
    """An int64 table on ``device``; on CUDA copied from pinned memory, asynchronously (no sync)."""
    host = torch.tensor(rows or [[0]], dtype=torch.int64, pin_memory=device.type == "cuda")
    return torch.empty(host.shape, dtype=torch.int64, device=device).copy_(host, non_blocking=True)


# ================================================================================================ buckets and checks
class _Bucket(NamedTuple):
    """Tensors of one group that share the compiled code: parameter dtype, kind, first-moment format."""

    index: list[int]  # positions in the group
    layout: _Layout
    pd: torch.dtype  # parameter (and gradient) dtype
    T: torch.dtype  # math and statistics dtype
    mom: int  # _MOM_*
    md: torch.dtype  # first-moment storage dtype (T when absent)

    @property
    def factored(self) -> bool:
        return self.layout.kind == "factored"

    def tiles(self) -> dict[str, int]:
        """Tile shapes of the item kernels: [RB, BC] (rows layouts; BC one int8 block for int8 momentum) or [BLOCK],
        from a few sizes only (each is a compiled variant)."""
        widths = (16, 64, 256)
        bc = quant.BLOCK if self.mom == _MOM_INT8 else next(w for w in widths if w >= min(self.layout.max_c, 256))
        return dict(RB=_TILE // bc, BC=bc, BLOCK=_TILE)


class _Work(NamedTuple):
    """One group's call: its buckets, and the tensors the kernels read and write (contiguous)."""

    group: Group
    buckets: list[_Bucket]
    params: list[Tensor]  # contiguous: the parameter itself or a copy written back by `_written`
    grads: list[Tensor]
    device: torch.device


def _prepare(group: Group, *, write: bool) -> _Work:
    """Check every record of ``group`` (`skewadam.kernels.types.check`: the sizes the kernels index with; then the
    dtypes, devices and layouts they assume) and the lr, then bucket the tensors. Nothing is launched before."""
    if not isinstance(group, Group):
        raise TypeError(f"the Triton kernel takes a skewadam.kernels.types.Group, got {type(group).__name__}")
    if group.eps_mode not in ("add", "floor"):
        raise ValueError(f"eps_mode must be 'add' or 'floor', got {group.eps_mode!r}")
    check_lr(group.lr)
    if isinstance(group.lr, Tensor) and group.lr.dtype not in _LR_DTYPES:
        raise TypeError(f"a tensor lr must be floating point, got {group.lr.dtype}")
    params = list(group.params)
    for pt in params:
        check(pt)
    device = params[0].param.device if params else torch.device("cpu")
    if params:
        _check_device(device)
    keyed: dict[tuple, list[int]] = {}
    for i, pt in enumerate(params):
        keyed.setdefault(_check(pt, i, device), []).append(i)
    buckets = []
    for (pd, T, kind, mom, md), index in keyed.items():
        specs = tuple((tuple(params[i].param.shape), bool(params[i].bank)) for i in index)
        buckets.append(_Bucket(index, _layout(specs, kind), pd, T, mom, md))
    works = [pt.param if pt.param.is_contiguous() or not write else pt.param.contiguous() for pt in params]
    grads = [pt.grad.contiguous() for pt in params]
    return _Work(group, buckets, works, grads, device)


def _on(device: torch.device):
    """Launch on ``device``: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_STATE = ("step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var")


def _written(work: _Work, *, state: bool, params: bool) -> None:
    """After the launches that write them: bump the version counters of the state (``state``) and write back the
    parameters updated through a contiguous copy, bumping the others' (``params``), as torch's in-place ops do, so
    autograd refuses a backward through a tensor the step changed (the kernels write through raw addresses)."""
    bump = []
    if state:
        bump += [t for pt in work.group.params for t in (getattr(pt, k) for k in _STATE) if t is not None]
    if params:
        for pt, p in zip(work.group.params, work.params):
            if p is not pt.param:
                pt.param.copy_(p)  # (an in-place op: it bumps the version itself)
            else:
                bump.append(p)
    if bump:
        torch.autograd.graph.increment_version(bump)


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return
    if device.type == "cpu":
        raise ValueError("the Triton kernel runs on CUDA tensors; for CPU tensors use impl='eager' or 'cpp' (or, to "
                         "test it, set TRITON_INTERPRET=1 before triton is first imported)")
    raise ValueError(f"the Triton kernel runs on CUDA tensors, got tensors on {device}; use impl='eager'")


def _check(pt: ParamTensors, i: int, device: torch.device) -> tuple:
    """The bucket key of one parameter whose sizes `check` has accepted, after checking the dtypes, devices and
    layouts the kernels assume (a table row holds addresses of contiguous tensors on one device)."""
    p = pt.param
    where = pt.name or f"parameter {i} of its group"
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise TypeError(f"{where}: the Triton kernel takes float32, bfloat16 or float64 parameters, got {p.dtype}")
    T = torch.float32 if p.dtype == torch.bfloat16 else p.dtype

    def state(name: str, t: Tensor, dtype: torch.dtype) -> None:
        if t.dtype != dtype:
            raise ValueError(f"{where}: state {name!r} has dtype {t.dtype}, the Triton kernel needs {dtype}")
        if t.device != device:
            raise ValueError(
                f"{where}: {name} is on {t.device}, the parameters on {device}; the Triton kernel reads and writes "
                "all state on the parameters' device (step counts included: it advances them there, with no host "
                "sync, so keep state['step'] on the parameter's device)")
        if not t.is_contiguous():
            raise ValueError(f"{where}: state {name!r} must be contiguous")

    for name, t in (("the parameter", p), ("the gradient", pt.grad)):
        if t.device != device:
            raise ValueError(f"{where}: {name} is on {t.device}, other parameters of the group on {device}")
    state("step", pt.step, torch.float32)
    factored = pt.row_var is not None
    for name in ("row_var", "col_var") if factored else ("exp_avg_sq",):
        state(name, getattr(pt, name), T)
    m = pt.exp_avg
    if m is None:
        mom, md = _MOM_NONE, T
    elif m.dtype == torch.int8:
        state("exp_avg", m, torch.int8)
        state("exp_avg_scale", pt.exp_avg_scale, torch.float32)
        mom, md = _MOM_INT8, torch.int8
    elif m.dtype == torch.bfloat16 and T == torch.float32:
        state("exp_avg", m, torch.bfloat16)
        mom, md = _MOM_BF16, torch.bfloat16
    else:
        state("exp_avg", m, T)
        mom, md = _MOM_PLAIN, T
    kind = "factored" if factored else "rows" if mom == _MOM_INT8 else "flat"
    return p.dtype, T, kind, mom, md


def _key_base(seed: int, stream: int) -> int:
    """``rounding_key(seed, stream, step) == mix32(base + step)``: the part that does not depend on the step."""
    return mix32(mix32(seed) ^ stream)


def _addrs(base: Tensor, offsets: Sequence[int]) -> list[int]:
    """Addresses of elements ``offsets`` of ``base``."""
    p, size = base.data_ptr(), base.element_size()
    return [p + o * size for o in offsets]


def _ptr(t: Optional[Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


class _Table(NamedTuple):
    tensor: Tensor  # the header row, then one row per tensor of the bucket
    aligned: bool  # parameter-sized tensors 16-byte aligned, rows and items multiples of 8 elements


def _tensor_table(b: _Bucket, work: _Work, stats: list[list[int]], moments: list[list[int]]) -> _Table:
    """The hyperparameters, then one row per tensor of the bucket: addresses (``stats``: sumsq, rc, rvs, row,
    col; ``moments``: u_sumsq, corr, rinv, cinv, active; absent ones 0), then sizes."""
    rows = [_header(work.group, b.T, work.device)]
    L, seed = b.layout, work.group.seed
    for j, i in enumerate(b.index):
        pt = work.group.params[i]
        E, R, C, NB = L.dims[j]
        shape = pt.shape
        ng = math.prod(shape[1:] if pt.bank else shape)
        rows.append([
            work.params[i].data_ptr(), work.grads[i].data_ptr(), _ptr(pt.exp_avg), _ptr(pt.exp_avg_scale),
            _ptr(pt.exp_avg_sq), _ptr(pt.row_var), _ptr(pt.col_var), pt.step.data_ptr(), *stats[j], *moments[j],
            E, R, C, NB, shape[-2] if b.factored else 1, shape[-1] if shape else 1, ng, int(bool(pt.bank)),
            _key_base(seed, pt.stream), L.unit0[j],
        ])
    aligned = L.aligned8 and all(r[c] % 16 == 0 for r in rows[1:] for c in (_P, _G, _M, _V))
    return _Table(_upload(rows, work.device), aligned)


def _header(group: Group, T: torch.dtype, device: torch.device) -> list[int]:
    """Row 0 of a tensor table: the group's hyperparameters as float64 bits (and the lr tensor's address: the
    kernel reads it on the device; a tensor elsewhere, on the host, is read here, which is no device sync)."""
    lr, lr_addr = group.lr, 0
    if isinstance(lr, Tensor):
        if lr.device == device:
            lr_addr, lr = lr.data_ptr(), 0.0
        else:
            lr = float(lr)
    add, floor = (group.eps, 0.0) if group.eps_mode == "add" else (0.0, group.eps)
    rm_floor = ROW_MEAN_FLOOR if group.eps_mode == "floor" else torch.finfo(T).tiny
    values = [1.0 - group.beta1, 1.0 - group.beta2, group.beta1, group.beta2, add, floor, rm_floor, float(lr),
              group.weight_decay]
    bits = [struct.unpack("<q", struct.pack("<d", float(v)))[0] for v in values]
    return bits + [lr_addr] + [0] * (int(_NT) - len(bits) - 1)


# ================================================================================================ launches
def _launch(kernel, grid: tuple[int, ...], *args, warps: int = 4, **meta) -> None:
    if all(grid):
        kernel[grid](*args, num_warps=warps, enable_fp_fusion=False, **meta)


def _pass1(b: _Bucket, table: _Table, scratch: Tensor, flag: Optional[Tensor]) -> None:
    L, T, tab = b.layout, _TL[b.T], table.tensor
    items, mats, units = L.tables(tab.device)
    tiles = b.tiles()
    _launch(_stats_tiles, (len(L.items),), tab, items, scratch, L.colp, PD=_TL[b.pd], T=T, FACTORED=b.factored,
            ALIGNED=table.aligned, warps=8, **tiles)
    _launch(_stats_matrices, (len(L.mats), triton.cdiv(L.max_rc, _MAT_BLOCK)), tab, mats, scratch, T=T,
            BLK=_MAT_BLOCK, SB=8)
    _launch(_unit_sums, (L.n_units,), tab, units, scratch, L.colp, flag if flag is not None else tab, DST=_SUMSQ,
            T=T, FROM_MATS=b.factored, HAS_FLAG=flag is not None, TMAX=torch.finfo(b.T).max,
            BLOCK=_SMALL_BLOCK)


def _pass2(b: _Bucket, group: Group, table: _Table, scratch: Tensor, keys: Tensor, skip: Optional[Tensor]) -> None:
    L, T, tab = b.layout, _TL[b.T], table.tensor
    items, mats, units = L.tables(tab.device)
    skip_arg = skip if skip is not None else tab
    nt = len(b.index)
    flags = dict(EPS_ADD=group.eps_mode == "add", HAS_SKIP=skip is not None)
    _launch(_count_steps, (nt,), tab, keys, skip_arg, nt, T=T, HAS_MOM=b.mom != _MOM_NONE, HAS_SKIP=skip is not None,
            UB=_SMALL_BLOCK)
    if b.factored:
        _launch(_factored_moments, (len(L.mats), triton.cdiv(L.max_rc, _MAT_BLOCK)), tab, mats, skip_arg, T=T,
                BLK=_MAT_BLOCK, **flags)
    _launch(_moments_tiles, (len(L.items),), tab, items, scratch, L.colp, keys, skip_arg, nt, PD=_TL[b.pd], T=T,
            MD=_TL[b.md], FACTORED=b.factored, FLAT=L.kind == "flat", MOM=b.mom, ALIGNED=table.aligned, warps=8, **flags, **b.tiles())
    _launch(_unit_sums, (L.n_units,), tab, units, scratch, L.colp, tab, DST=_USQ, T=T, FROM_MATS=False,
            HAS_FLAG=False, TMAX=0.0, BLOCK=_SMALL_BLOCK)


def _pass3(b: _Bucket, group: Group, table: _Table, clips: Tensor, keys: Tensor, skip: Optional[Tensor]) -> None:
    L, T, tab = b.layout, _TL[b.T], table.tensor
    items, _, _ = L.tables(tab.device)
    _launch(_prepare_apply, (len(b.index),), tab, clips, keys, T=T,
            UB=_SMALL_BLOCK)
    lr = group.lr
    lr_ptr = isinstance(lr, Tensor) and lr.device == tab.device
    _launch(_apply_tiles, (len(L.items),), tab, items, clips, keys, skip if skip is not None else tab, PD=_TL[b.pd],
            T=T, MD=_TL[b.md], FACTORED=b.factored, FLAT=L.kind == "flat", MOM=b.mom, EPS_ADD=group.eps_mode == "add",
            HAS_SKIP=skip is not None, LR_PTR=lr_ptr, LRD=_TL[lr.dtype] if lr_ptr else tl.float32,
            ALIGNED=table.aligned, warps=8, **b.tiles())


# ================================================================================================ the protocol
def _keepdim(shape: Sequence[int], bank: bool) -> tuple[int, ...]:
    """The per-unit keepdim shape: [E, 1, ...] for a bank, [1, ...] otherwise (() for a 0-d tensor)."""
    return tuple(shape[0] if (bank and d == 0) else 1 for d in range(len(shape)))


def _stat_shapes(pt: ParamTensors, factored: bool) -> list[tuple[int, ...]]:
    """Shapes of sumsq, rc, rvs, row, col (`GradStats`); u_sumsq, corr, rinv, cinv are the 1st, 1st, 4th, 5th."""
    shape, unit = tuple(pt.param.shape), _keepdim(pt.param.shape, pt.bank)
    if not factored:
        return [unit]
    return [unit, shape[:-2] + (1, 1), shape[:-2] + (1, 1), shape[:-1] + (1,), shape[:-2] + (1, shape[-1])]


def _view(buf: Tensor, offset: int, shape: tuple[int, ...]) -> Tensor:
    return buf[offset: offset + math.prod(shape)].view(shape)


def _checked(name: str, t, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, i: int) -> int:
    """The address of a statistic handed back to the kernel, after checking it is what the kernel indexes."""
    if not isinstance(t, Tensor):
        raise TypeError(f"skewadam Triton kernel, parameter {i}: {name} must be a tensor (from this kernel's "
                        f"previous pass), got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"skewadam Triton kernel, parameter {i}: {name} must be a contiguous {dtype} tensor of "
                         f"shape {shape} on {device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return t.data_ptr()


def _check_skip(skip: Optional[Tensor], device: torch.device) -> None:
    if skip is not None and (not isinstance(skip, Tensor) or skip.numel() != 1 or skip.device != device):
        raise ValueError(f"skip must be None or a one-element tensor on {device}, got {skip!r}")


def grad_stats(group: Group) -> list[GradStats]:
    """Pass 1: sums of g^2 per unit, per matrix, per row and per column, and the row statistics' sums; nothing of
    the state is written. Returns one `GradStats` per parameter (views of one buffer per bucket)."""
    work = _prepare(group, write=False)
    with _on(work.device):
        return _grad_stats(work)


def _grad_stats(work: _Work) -> list[GradStats]:
    group = work.group
    out: list[Optional[GradStats]] = [None] * len(work.grads)
    for b in work.buckets:
        L = b.layout
        stats = torch.zeros(L.stats_numel, dtype=b.T, device=work.device)
        scratch = torch.empty(L.colp + len(L.items), dtype=b.T, device=work.device)
        tab = _tensor_table(b, work, [_addrs(stats, o) + [0] * (5 - len(o)) for o in L.stats],
                            [[0] * 5] * len(b.index))
        _pass1(b, tab, scratch, None)
        for j, i in enumerate(b.index):
            v = [_view(stats, o, s) for o, s in zip(L.stats[j], _stat_shapes(group.params[i], b.factored))]
            v += [None] * (5 - len(v))
            out[i] = GradStats(sumsq=v[0], rc_sumsq=v[1], row_var_sum=v[2], row=v[3], col=v[4])
    return out


def update_moments_(group: Group, stats: Sequence[GradStats], *, skip: Optional[Tensor] = None) -> list[Moments]:
    """Pass 2: step counts, second moments and momentum in place (nothing if ``skip`` holds True); returns what the
    clip needs, one `Moments` per parameter (``corr`` a tensor shaped like ``u_sumsq``)."""
    work = _prepare(group, write=False)
    _check_skip(skip, work.device)
    if len(stats) != len(group.params):
        raise ValueError(f"got {len(stats)} GradStats for {len(group.params)} parameters")
    with _on(work.device):
        out = _update_moments(work, stats, skip)
    _written(work, state=True, params=False)
    return out


def _update_moments(work: _Work, stats: Sequence[GradStats], skip: Optional[Tensor]) -> list[Moments]:
    group = work.group
    out: list[Optional[Moments]] = [None] * len(work.grads)
    for b in work.buckets:
        L = b.layout
        moments = torch.empty(L.moments_numel, dtype=b.T, device=work.device)
        active = torch.empty(L.act_numel, dtype=torch.bool, device=work.device)
        scratch = torch.empty(L.colp + len(L.items), dtype=b.T, device=work.device)
        keys = torch.empty(2 * len(b.index), dtype=torch.int64, device=work.device)
        stat_addrs = []
        for j, i in enumerate(b.index):
            st = stats[i]
            fields = (st.sumsq, st.rc_sumsq, st.row_var_sum, st.row, st.col)
            names = ("sumsq", "rc_sumsq", "row_var_sum", "row", "col")
            shapes = _stat_shapes(group.params[i], b.factored)
            stat_addrs.append([_checked(n, f, s, b.T, work.device, i) for n, f, s in zip(names, fields, shapes)]
                              + [0] * (5 - len(shapes)))
        tab = _tensor_table(b, work, stat_addrs, [_moment_addrs(moments, active, L, j) for j in range(len(b.index))])
        _pass2(b, group, tab, scratch, keys, skip)
        for j, i in enumerate(b.index):
            pt = group.params[i]
            shapes = _stat_shapes(pt, b.factored)
            usq, corr, *rc = [_view(moments, o, s) for o, s in zip(L.moments[j], [shapes[0], shapes[0]] + shapes[3:])]
            act = _view(active, L.act[j], shapes[0]) if pt.bank else None
            out[i] = Moments(usq, corr, rc[0] if rc else None, rc[1] if rc else None, act)
    return out


def _moment_addrs(moments: Tensor, active: Tensor, L: _Layout, j: int) -> list[int]:
    """Addresses of u_sumsq, corr, rinv, cinv and active of tensor j of a bucket (0 where absent)."""
    a = _addrs(moments, L.moments[j])
    return a + [0] * (4 - len(a)) + [_addrs(active, [L.act[j]])[0] if L.act[j] >= 0 else 0]


def apply_updates_(group: Group, moments: Sequence[Moments], *, skip: Optional[Tensor] = None) -> None:
    """Pass 3: ``p = p*(1 - lr*wd) - lr * u / max(1, rms(u))`` per unit, bf16 rounded stochastically; idle bank
    slices and a skipped step (``skip`` True) write nothing."""
    work = _prepare(group, write=True)
    _check_skip(skip, work.device)
    if len(moments) != len(group.params):
        raise ValueError(f"got {len(moments)} Moments for {len(group.params)} parameters")
    with _on(work.device):
        _apply_updates(work, moments, skip)
    _written(work, state=False, params=True)


def _apply_updates(work: _Work, moments: Sequence[Moments], skip: Optional[Tensor]) -> None:
    group = work.group
    for b in work.buckets:
        L = b.layout
        clips = torch.empty(L.n_units, dtype=b.T, device=work.device)
        keys = torch.empty(len(b.index), dtype=torch.int64, device=work.device)
        addrs = []
        for j, i in enumerate(b.index):
            mo, pt = moments[i], group.params[i]
            shapes = _stat_shapes(pt, b.factored)
            a = [_checked("u_sumsq", mo.u_sumsq, shapes[0], b.T, work.device, i),
                 _checked("corr", mo.corr, shapes[0], b.T, work.device, i)]
            if b.factored:
                a += [_checked("rinv", mo.rinv, shapes[3], b.T, work.device, i),
                      _checked("cinv", mo.cinv, shapes[4], b.T, work.device, i)]
            else:
                a += [0, 0]
            a.append(_checked("active", mo.active, shapes[0], torch.bool, work.device, i) if pt.bank else 0)
            addrs.append(a)
        tab = _tensor_table(b, work, [[0] * 5] * len(b.index), addrs)
        _pass3(b, group, tab, clips, keys, skip)


def step_(groups: Sequence[Group], *, skip_nonfinite: bool) -> Tensor:
    """Passes 1-3 of every group, for one process (nothing to reduce between passes), with no host sync.

    Returns:
        A 0-d bool tensor on the parameters' device: True if ``skip_nonfinite`` and some gradient holds inf or NaN,
        in which case nothing was written (weights, state and step counts are as before).
    """
    works = [_prepare(g, write=True) for g in groups if len(g.params)]
    if not works:
        return torch.zeros((), dtype=torch.bool)
    device = works[0].device
    if any(w.device != device for w in works):
        raise ValueError("step_ takes groups on one device; call it once per device")
    with _on(device):
        return _step(works, device, skip_nonfinite)


def _step(works: list[_Work], device: torch.device, skip_nonfinite: bool) -> Tensor:
    flag = torch.zeros(1, dtype=torch.int32, device=device) if skip_nonfinite else None
    runs = []
    for work in works:
        for b in work.buckets:
            runs.append((work, b, *_workspace(work, b)))
    for work, b, tab, ws, active, keys in runs:
        _pass1(b, tab, ws[b.layout.stats_numel + 2 * b.layout.n_units:], flag)
    for work, b, tab, ws, active, keys in runs:
        _pass2(b, work.group, tab, ws[b.layout.stats_numel + 2 * b.layout.n_units:], keys, flag)
    for work, b, tab, ws, active, keys in runs:
        L = b.layout
        _pass3(b, work.group, tab, ws[ws.numel() - L.n_units:], keys, flag)
    for work in works:
        _written(work, state=True, params=True)
    return flag[0] != 0 if flag is not None else torch.zeros((), dtype=torch.bool, device=device)


def _workspace_numel(L: _Layout) -> int:
    """Elements of T one bucket's `step_` uses: statistics, u_sumsq and corr, column and item partials, clips (rinv
    and cinv overwrite the row and column sums)."""
    return L.stats_numel + 2 * L.n_units + L.colp + len(L.items) + L.n_units


def _workspace(work: _Work, b: _Bucket) -> tuple[_Table, Tensor, Tensor, Tensor]:
    """One bucket's scratch for `step_` (statistics zeroed) and its tensor table."""
    L = b.layout
    ws = torch.empty(_workspace_numel(L), dtype=b.T, device=work.device)
    ws[: L.stats_numel].zero_()
    active = torch.empty(L.act_numel, dtype=torch.bool, device=work.device)
    keys = torch.empty(2 * len(b.index), dtype=torch.int64, device=work.device)
    stats = [_addrs(ws, o) + [0] * (5 - len(o)) for o in L.stats]
    moments = []
    for j, st in enumerate(stats):
        usq, corr = _addrs(ws, [L.stats_numel + o for o in L.moments[j][:2]])
        act = _addrs(active, [L.act[j]])[0] if L.act[j] >= 0 else 0
        moments.append([usq, corr, st[3], st[4], act])  # rinv, cinv: over the row and column sums
    return _tensor_table(b, work, stats, moments), ws, active, keys


def step_transient_bytes(tensors: Sequence[tuple[Sequence[int], bool]], param_dtype: torch.dtype) -> int:
    """Bytes `step_` allocates for parameters ``[(shape, bank), ...]`` of one group: the workspace, the activity of
    bank slices, the rounding keys, the tensor table and the finite flag. An upper bound where the state is unknown:
    a tensor whose slices have >= 2 dims is counted factored (the larger workspace). Not counted: contiguous copies
    of non-contiguous parameters or gradients, and the item, matrix and unit tables (cached across steps; 64 bytes
    per ~2^18 elements)."""
    T = torch.float32 if param_dtype == torch.bfloat16 else param_dtype
    itemsize = torch.empty((), dtype=T).element_size()
    by_kind: dict[str, list] = {"factored": [], "flat": []}
    for shape, bank in tensors:
        shape = tuple(int(s) for s in shape)
        by_kind["factored" if len(shape) - bool(bank) >= 2 else "flat"].append((shape, bool(bank)))
    total = 4 + 1 if tensors else 0  # the finite flag and the skipped result
    for kind, specs in by_kind.items():
        if specs:
            L = _layout(tuple(specs), kind)
            total += _workspace_numel(L) * itemsize + L.act_numel + 2 * len(specs) * 8 + (len(specs) + 1) * int(_NT) * 8
    return total


# ================================================================================================ helpers
def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` was set before ``triton`` was first
    imported (Triton decorates its own library then) and before this module was."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_stats_tiles, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the kernels can run on tensors on ``device``: CUDA with a GPU, or CPU under the interpreter."""
    device = torch.device(device)
    if device.type == "cpu":
        return interpreted()
    return device.type == "cuda" and torch.cuda.is_available()


def stochastic_round_bf16(x: Tensor, key: int, offset: int = 0) -> Tensor:
    """The kernels' rounding of an fp32 tensor to bf16 (`skewadam.kernels.rounding.stochastic_round_bf16`'s bits).

    Example:
        >>> stochastic_round_bf16(torch.full((4,), 1.0 + 2**-10, device="cuda"), key=1)
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes a float32 tensor, got {x.dtype}")
    _check_device(x.device)
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    with _on(x.device):
        _launch(_round_kernel, (triton.cdiv(src.numel(), 1024),), src, out, src.numel(), offset, key & _M32,
                BLOCK=1024)
    return out
