"""Device math of the Triton kernels: the tables' columns, and the element operations every pass shares (rounding,
EMAs, the first moment in each storage format, the full second moment).

Each operation is IEEE-rounded on its own in eager's order (the kernels are compiled with ``enable_fp_fusion=False``:
no FMA; fp32 divisions and square roots round to nearest), which is what makes the element-wise state bitwise eager's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import quant, rounding, types
from ..triton_layout import TABLE_WIDTH
from ..types import MomFmt

# Globals of a Triton kernel must be constexpr: the other modules' constants as the kernels see them.
QMAX = tl.constexpr(quant.QMAX)  # int8 momentum: the largest code
RELATIVE_STEP_EPS = tl.constexpr(types.RELATIVE_STEP_EPS)  # the floor of rms(p) that scales a relative step
MOMENTUM_STREAM = tl.constexpr(quant.MOMENTUM_STREAM)  # bf16 momentum's rounding key: mix32(key + this)
MUL1, MUL2, GOLDEN = (tl.constexpr(c) for c in (rounding._MUL1, rounding._MUL2, rounding._GOLDEN))
MOM_PLAIN, MOM_BF16, MOM_INT8, MOM_NONE = (tl.constexpr(f.value) for f in
                                           (MomFmt.PLAIN, MomFmt.BF16, MomFmt.INT8, MomFmt.NONE))

# Columns of the tensor table (one row per tensor): addresses, then sizes. Addresses of absent tensors are 0 (never
# dereferenced). Statistics (float64): sumsq, rc, rvs, row, col, psq (a relative step's sum of p^2), amax (fp64
# parameters: max |g|); moments (T): u_sumsq, corr (pass 2's scale of u), scale (pass 3's: corr, times max(eps2,
# rms(p)) for a relative step), rinv, cinv, active.
(TAB_P, TAB_G, TAB_M, TAB_MS, TAB_V, TAB_RV, TAB_CV, TAB_STEP,
 TAB_SUMSQ, TAB_RC, TAB_RVS, TAB_ROW, TAB_COL, TAB_PSQ, TAB_AMAX,
 TAB_USQ, TAB_CORR, TAB_SCALE, TAB_RINV, TAB_CINV, TAB_ACT,
 TAB_E, TAB_R, TAB_C, TAB_NB, TAB_RG, TAB_CG, TAB_NG, TAB_BANK, TAB_KBASE, TAB_UNIT0) = (
    tl.constexpr(i) for i in range(TABLE_WIDTH))
TAB_WIDTH = tl.constexpr(TABLE_WIDTH)
# Row 0 of the tensor table holds the group's hyperparameters (float64 bits; the lr tensor's address or 0), the
# tensors' rows follow: kernel arguments would reach the interpreter as untyped floats (fp32 constants).
HDR_W1, HDR_W2, HDR_B1, HDR_B2, HDR_ADD, HDR_FLOOR, HDR_RM_FLOOR, HDR_LR, HDR_WD, HDR_DECAY, HDR_LR_ADDR = (
    tl.constexpr(i) for i in range(11))
# Items (`triton_layout.Layout.items`): tensor, unit, matrix (factored), first row and rows (rows layouts), first
# element and elements, the offset of the item's column partials in the scratch (-1: the column sums themselves) and
# of its weighted column sums (factored; in `step_`'s workspace of T, `triton_layout.workspace_numel`).
ITEM_T, ITEM_U, ITEM_B, ITEM_ROW0, ITEM_NROWS, ITEM_E0, ITEM_N, ITEM_COLP, ITEM_WCOL = (
    tl.constexpr(i) for i in range(9))
ITEM_WIDTH = tl.constexpr(9)
# Matrices (factored): tensor, unit, matrix, offset of its column partials (-1: one strip), strips.
MAT_T, MAT_U, MAT_B, MAT_COLP, MAT_S = (tl.constexpr(i) for i in range(5))
MAT_WIDTH = tl.constexpr(5)
# Units: tensor, unit, first item and items, first matrix and matrices.
UNIT_T, UNIT_U, UNIT_ITEM0, UNIT_NITEMS, UNIT_MAT0, UNIT_NMATS = (tl.constexpr(i) for i in range(6))
UNIT_WIDTH = tl.constexpr(6)


@triton.jit
def addr(row, col: tl.constexpr, dtype: tl.constexpr):
    """The address in column ``col`` of a tensor-table row, as a pointer to ``dtype``."""
    return tl.load(row + col).to(tl.pointer_type(dtype))


@triton.jit
def big(row, col: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """`addr` of a parameter-sized tensor; ALIGNED: the host checked it is 16-byte aligned (vector accesses)."""
    p = tl.load(row + col).to(tl.pointer_type(dtype))
    if ALIGNED:  # (on the pointer: a hint on the integer does not survive the cast)
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def load8(ptr, ALIGNED: tl.constexpr):
    """A size from a table, known a multiple of 8 when ALIGNED (row lengths, item starts: the host checked). The
    hint is on the load (a hint on an argument of a helper is lost when it is inlined)."""
    x = tl.load(ptr)
    if ALIGNED:
        x = tl.multiple_of(x, 8)
    return x


@triton.jit
def tensor_row(tab, t):
    """Tensor t's row of the tensor table."""
    return tab + (t + 1) * TAB_WIDTH


@triton.jit
def hyper(tab, col: tl.constexpr):
    """A float64 hyperparameter from the table's header row."""
    return tl.load(tab + col).to(tl.float64, bitcast=True)


@triton.jit
def div(a, b, T: tl.constexpr):
    """a / b rounded to nearest (Triton's fp32 ``/`` is approximate)."""
    if T == tl.float32:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def sqrt(x, T: tl.constexpr):
    """sqrt(x) rounded to nearest."""
    if T == tl.float32:
        return tl.math.sqrt_rn(x)
    return tl.sqrt(x)


@triton.jit
def tiny(T: tl.constexpr):
    """torch.finfo(T).tiny."""
    if T == tl.float32:
        t = tl.full([], 0x00800000, tl.int32).to(tl.float32, bitcast=True)
    else:
        t = tl.full([], 0x0010000000000000, tl.int64).to(tl.float64, bitcast=True)
    return t


@triton.jit
def ema(s, x, b, w):
    """`skewadam.kernels.eager.ema`: ``x * (1 - beta) + s * beta``, each operation rounded on its own (no FMA: the
    kernels are compiled with ``enable_fp_fusion=False``); ``b`` and ``w`` are beta and 1 - beta, each rounded from
    float64 to the statistics dtype, as torch rounds a Python float scalar."""
    return x * w + s * b


@triton.jit
def mix32(x):
    """`skewadam.kernels.rounding.mix32` on uint32."""
    x ^= x >> 16
    x *= MUL1
    x ^= x >> 15
    x *= MUL2
    x ^= x >> 16
    return x


@triton.jit
def round_bf16(x, idx, key):
    """fp32 ``x`` rounded to bf16 with the bits `rounding.stochastic_round_bf16` draws for element ``idx`` (int64)
    under ``key`` (uint32): one hash of (key, idx // 2), low half for even and high half for odd indices; a NaN as
    c10::BFloat16 writes it (0x7FC0), whatever its sign and payload."""
    h = mix32((idx >> 1).to(tl.uint32) * GOLDEN + key)
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
def powi(b, t):
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
def updated(row, u, skip, HAS_SKIP: tl.constexpr):
    """Whether unit ``u`` of a tensor is updated: not skipped, with elements in the global shape, and for a bank, a
    slice with a non-zero gradient."""
    act = tl.load(addr(row, TAB_ACT, tl.int1) + u, mask=tl.load(row + TAB_BANK) != 0, other=1) != 0
    act = act & (tl.load(row + TAB_NG) > 0)
    if HAS_SKIP:
        act = act & (tl.load(skip) == 0)
    return act


@triton.jit
def second_moment_beta(tab, row, u, DECAY: tl.constexpr, AHEAD: tl.constexpr = False):
    """``(beta2, 1 - beta2)`` of unit ``u``'s second-moment EMAs, in float64: the group's, or with a beta2 decay
    ``d`` (DECAY), ``1 - t**d`` at the unit's (new) step count ``t >= 1``, with ``t**d`` as ``exp(d * log(t))``
    (Triton has no float64 pow on every target: within a few ulps of the host's). AHEAD: before `count_steps`, at
    the count the unit has if it steps."""
    if DECAY:
        t = tl.load(addr(row, TAB_STEP, tl.float32) + u)
        if AHEAD:
            t = t + 1.0
        t = tl.maximum(t.to(tl.float64), 1.0)  # (idle: masked out)
        b = 1.0 - tl.exp(hyper(tab, HDR_DECAY) * tl.log(t))
        w = 1.0 - b
    else:
        b = hyper(tab, HDR_B2)
        w = hyper(tab, HDR_W2)
    return b, w


@triton.jit
def _decode_int8(q, scale, T: tl.constexpr):
    """quant.dequantize: ``(|c| * c) * scale`` with ``c = q / 127``, for a [rows, one block] tile of codes."""
    c = div(q.to(T), QMAX, T)
    return tl.abs(c) * c * scale.to(T)[:, None]


@triton.jit
def first_moment(g, m, ms, offs, mask, sidx, smask, b1, w1, key, T: tl.constexpr, MOM: tl.constexpr,
                 STORED: tl.constexpr):
    """``(g, src)`` of one tile: ``src`` is what multiplies the update, the first moment (the gradient without
    momentum) in T. STORED (pass 3): as stored, decoded from its format (``g`` is then ``src``). Else (pass 2):
    ``ema(m, g, beta1)`` stored in its format (quant.store_momentum_'s operations: bf16 rounded stochastically under
    ``key``; int8 with the tile's columns one block of quant.BLOCK per row, its scale at ``sidx``), and ``src`` the
    stored value (what pass 3 reads)."""
    if STORED:
        if MOM == MOM_NONE:
            src = tl.load(g + offs, mask=mask, other=0.0).to(T)
        elif MOM == MOM_INT8:
            src = _decode_int8(tl.load(m + offs, mask=mask, other=0), tl.load(ms + sidx, mask=smask, other=0.0), T)
        else:
            src = tl.load(m + offs, mask=mask, other=0.0).to(T)
        x = src
    else:
        x = tl.load(g + offs, mask=mask, other=0.0).to(T)
        if MOM == MOM_NONE:
            src = x
        elif MOM == MOM_PLAIN:
            src = ema(tl.load(m + offs, mask=mask, other=0.0), x, b1, w1)
            tl.store(m + offs, src, mask=mask)
        elif MOM == MOM_BF16:
            new = ema(tl.load(m + offs, mask=mask, other=0.0).to(T), x, b1, w1)
            bits = round_bf16(new, offs, key)
            tl.store(m + offs, bits, mask=mask)
            src = bits.to(T)
        else:
            old = _decode_int8(tl.load(m + offs, mask=mask, other=0), tl.load(ms + sidx, mask=smask, other=0.0), T)
            new = tl.where(mask, ema(old, x, b1, w1), 0.0)  # zero-padded like quant._blocked
            absmax = tl.max(tl.abs(new), 1)
            # the code in fp32 whatever T: |x| / absmax rounded to fp32, its correctly rounded root, times 127, rint
            ratio = div(tl.abs(new), tl.maximum(absmax, tiny(T))[:, None], T).to(tl.float32)
            code = _rint(tl.math.sqrt_rn(ratio) * QMAX)
            code = tl.where(new < 0, -code, code)  # copysign (a -0.0 code is the byte 0 too)
            q = code.to(tl.int8)
            scale = absmax.to(tl.float32)
            tl.store(m + offs, q, mask=mask)
            tl.store(ms + sidx, scale, mask=smask)
            src = _decode_int8(q, scale, T)
    return x, src


@triton.jit
def row_mean(tab, row, b, Rg, Cg, add, b2, w2):
    """Matrix ``b``'s mean row_var after the step, in float64, floored (``rm``, what rinv is relative to): from its
    sums ``(b2 * sum_i row_var + (rc / C + R * add) * (1 - b2)) / R`` (float64 statistics of pass 1)."""
    rvs = tl.load(addr(row, TAB_RVS, tl.float64) + b)
    rc = tl.load(addr(row, TAB_RC, tl.float64) + b)
    return tl.maximum((rvs * b2 + (rc / Cg + Rg * add) * w2) / Rg, hyper(tab, HDR_RM_FLOOR))


@triton.jit
def factor_new(old, sums, n, add, b2, w2, T: tl.constexpr):
    """A factored statistic's new value from its old one (in T) and the gradient's float64 sums: ``ema(old, sums / n
    + eps, beta2)`` in float64 (``n``, ``add`` and the coefficients float64), rounded once into T."""
    return ema(old.to(tl.float64), sums / n + add, b2, w2).to(T)


@triton.jit
def factor_ema(var, sums, idx, mask, n, add, b2, w2, write, active, T: tl.constexpr):
    """A chunk ``idx`` of a factored statistic (row_var or col_var at ``var``, in T, from the gradient's float64 sums
    at ``sums``): `factor_new`, stored if ``write``; returns the value the step uses (the stored one for an idle
    unit)."""
    old = tl.load(var + idx, mask=mask, other=1.0)
    new = factor_new(old, tl.load(sums + idx, mask=mask, other=0.0), n, add, b2, w2, T)
    tl.store(var + idx, new, mask=tl.where(write, mask, False))
    return tl.where(active, new, old)


@triton.jit
def inv_sqrt(x, floor, T: tl.constexpr, EPS_ADD: tl.constexpr):
    """``1 / sqrt(x)``; floor mode: ``1 / sqrt(max(x, eps))``."""
    if EPS_ADD:
        r = div(1.0, sqrt(x, T), T)
    else:
        r = div(1.0, sqrt(tl.maximum(x, floor), T), T)
    return r


@triton.jit
def full_direction(src, x, v, offs, mask, scale, b2, w2, add, floor, T: tl.constexpr, EPS_ADD: tl.constexpr,
                   STORED: tl.constexpr):
    """The update direction with a full second moment, of one tile: ``u = src * scale / sqrt(v)`` (floor:
    ``sqrt(max(v, eps))``), in T; unless STORED (pass 3), ``v = ema(v, g^2 [+ eps], beta2)`` is advanced first, in
    float64 from the gradient ``x`` (T: its square is exact there) with float64 ``add`` and coefficients, rounded
    once into the state."""
    vv = tl.load(v + offs, mask=mask, other=1.0)
    if not STORED:
        x64 = x.to(tl.float64)
        sq = x64 * x64
        if EPS_ADD:
            sq = sq + add
        vv = ema(vv.to(tl.float64), sq, b2, w2).to(T)
        tl.store(v + offs, vv, mask=mask)
    if not EPS_ADD:
        vv = tl.maximum(vv, floor)
    return div(src * scale, sqrt(vv, T), T)


@triton.jit
def write_param(p, offs, mask, uu, decay, lr, key, PD: tl.constexpr, T: tl.constexpr):
    """``p = p * decay - u * lr`` in T, stored in the parameter's dtype (bf16: rounded stochastically under
    ``key``)."""
    new = tl.load(p + offs, mask=mask, other=0.0).to(T) * decay - uu * lr
    if PD == tl.bfloat16:
        tl.store(p + offs, round_bf16(new, offs, key), mask=mask)
    else:
        tl.store(p + offs, new.to(PD), mask=mask)
