"""The Triton kernels of the three passes (launched by `skewadam.kernels.triton.entry`), over the tables of
`skewadam.kernels.triton_layout` and the tensor table (`device`'s ``TAB_*`` columns).

1. `stats_tiles`, `stats_matrices`, `unit_sums`: sums of ``g^2`` per row and column (per item, then per matrix in
   strip order), per matrix and per unit; fixed orders, deterministic. In the one-process step, a factored bucket
   without momentum also gets its weighted column sums here (`weighted.weighted_columns`).
2. `count_steps`, `factored_moments`, `direction_tiles` (pass 2), `unit_sums`: step counts and bias corrections, the
   factored EMAs and ``rinv``/``cinv``, the first and full second moments and ``sum u^2``. A factored unit without
   momentum takes ``sum u^2`` from its weighted column sums (`weighted.weighted_usq`; in the three passes
   `weighted.weighted_tiles` computes them), and `direction_tiles` reads its gradient only where they do not hold it.
3. `prepare_apply`, `direction_tiles` (pass 3): the clips, then the weights.

`direction_tiles` is the one definition of the update direction both passes 2 and 3 use.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import (HDR_ADD, HDR_B1, HDR_B2, HDR_FLOOR, HDR_LR, HDR_LR_ADDR, HDR_W1, HDR_WD, ITEM_B, ITEM_COLP,
                     ITEM_E0, ITEM_N, ITEM_NROWS, ITEM_ROW0, ITEM_T, ITEM_U, ITEM_WCOL, ITEM_WIDTH, MAT_B, MAT_COLP,
                     MAT_S, MAT_T, MAT_U, MAT_WIDTH, MOMENTUM_STREAM, RELATIVE_STEP_EPS, TAB_ACT, TAB_AMAX, TAB_BANK,
                     TAB_C, TAB_CG, TAB_CINV, TAB_COL, TAB_CORR, TAB_CV, TAB_E, TAB_G, TAB_KBASE, TAB_M, TAB_MS, TAB_NB,
                     TAB_NG, TAB_P, TAB_PSQ, TAB_R, TAB_RC, TAB_RG, TAB_RINV, TAB_ROW, TAB_RV, TAB_RVS, TAB_SCALE,
                     TAB_STEP, TAB_SUMSQ, TAB_UNIT0, TAB_USQ, TAB_V, UNIT_ITEM0, UNIT_MAT0, UNIT_NITEMS, UNIT_NMATS,
                     UNIT_T, UNIT_U, UNIT_WIDTH, addr, big, div, factor_ema, factor_new, first_moment, full_direction,
                     hyper, inv_sqrt, load8, mix32, powi, round_bf16, row_mean, second_moment_beta, sqrt, tensor_row,
                     updated, write_param)
from .weighted import weighted_columns


# ================================================================================================ pass 1
@triton.jit
def _tile(g, p, rows, rm, cols, cm, C, pacc, RELATIVE: tl.constexpr):
    """A [rows, cols] tile of a factored item's gradient in float64; RELATIVE: its weights' squares added to pacc."""
    offs = rows[:, None] * C + cols[None, :]
    mask = rm[:, None] & cm[None, :]
    if RELATIVE:
        xp = tl.load(p + offs, mask=mask, other=0.0).to(tl.float64)
        pacc += xp * xp
    return tl.load(g + offs, mask=mask, other=0.0).to(tl.float64), pacc


@triton.jit
def stats_tiles(tab, items, scratch, part0, amax0, pbuf, wsums, PD: tl.constexpr, T: tl.constexpr,
                FACTORED: tl.constexpr, RELATIVE: tl.constexpr, AMAX: tl.constexpr, WEIGHTED: tl.constexpr,
                WSUMS: tl.constexpr, DECAY: tl.constexpr, ALIGNED: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr,
                BLOCK: tl.constexpr):
    """Per item, in float64 (the square of an fp32 or bf16 value is exact there): factored, its rows' sums of g^2 and
    its column partials; otherwise its sum of g^2 (a partial, at ``scratch + part0``). AMAX (fp64 parameters, whose
    squares can underflow): also its max |g| (at ``scratch + amax0``). RELATIVE (a relative step): also its sum of
    p^2 (into ``pbuf``). WEIGHTED (a factored bucket without momentum, `Bucket.weighted`): groups of RB rows
    outer, and with WSUMS (the one-process step) each group's weighted column sums right after its sums, while its
    rows are still in cache (`weighted.weighted_columns`, at ``wsums``, with the row_var the unit gets if it
    steps)."""
    pid = tl.program_id(0)
    it = items + pid * ITEM_WIDTH
    row = tensor_row(tab, tl.load(it + ITEM_T))
    g = big(row, TAB_G, PD, ALIGNED)
    p = big(row, TAB_P, PD, ALIGNED)
    if FACTORED:
        C = load8(row + TAB_C, ALIGNED)
        r0 = tl.load(it + ITEM_ROW0)
        r1 = r0 + tl.load(it + ITEM_NROWS)
        colp = tl.load(it + ITEM_COLP)
        row_out = addr(row, TAB_ROW, tl.float64)
        if colp < 0:
            col_out = addr(row, TAB_COL, tl.float64) + tl.load(it + ITEM_B) * C
        else:
            col_out = scratch + colp
        if WSUMS:
            wcol = wsums + tl.load(it + ITEM_WCOL)
            rv = addr(row, TAB_RV, T)
            Cg = tl.maximum(tl.load(row + TAB_CG).to(tl.float64), 1.0)
            add = hyper(tab, HDR_ADD)
            b2, w2 = second_moment_beta(tab, row, tl.load(it + ITEM_U), DECAY, True)
        pacc = tl.zeros([RB, BC], tl.float64)  # (RELATIVE)
        if WEIGHTED:
            # rows outer: a group's row sums are whole after its columns, for its weights, while its rows are in
            # cache (each column adds the groups in row order, each row its chunks in column order: the bits of
            # columns outer)
            tl.static_assert(not AMAX, "weighted column sums are for fp32 statistics")
            for r in range(r0, r1, RB):
                rows = r + tl.arange(0, RB)
                rm = rows < r1
                rs = tl.zeros([RB], tl.float64)
                for c in range(0, C, BC):
                    cols = c + tl.arange(0, BC)
                    cm = cols < C
                    x, pacc = _tile(g, p, rows, rm, cols, cm, C, pacc, RELATIVE)
                    sq = x * x
                    rs += tl.sum(sq, 1)
                    prev = tl.load(col_out + cols, mask=tl.where(r == r0, False, cm), other=0.0)
                    tl.store(col_out + cols, prev + tl.sum(sq, 0), mask=cm)
                tl.store(row_out + rows, rs, mask=rm)
                if WSUMS:
                    old = tl.load(rv + rows, mask=rm, other=1.0)
                    w = 1.0 / factor_new(old, rs, Cg, add, b2, w2, T).to(tl.float64)
                    weighted_columns(g, wcol, rows, rm, r == r0, C, w, BC)
                tl.debug_barrier()  # this group's column sums are stored before the next group reads them
        else:
            if AMAX:
                mx = tl.zeros([RB, BC], tl.float64)
            for c in range(0, C, BC):
                cols = c + tl.arange(0, BC)
                cm = cols < C
                acc = tl.zeros([BC], tl.float64)
                for r in range(r0, r1, RB):
                    rows = r + tl.arange(0, RB)
                    rm = rows < r1
                    x, pacc = _tile(g, p, rows, rm, cols, cm, C, pacc, RELATIVE)
                    sq = x * x
                    acc += tl.sum(sq, 0)
                    prev = tl.load(row_out + rows, mask=rm, other=0.0)  # the rows' sums so far (zero-initialised)
                    tl.store(row_out + rows, prev + tl.sum(sq, 1), mask=rm)
                    if AMAX:
                        mx = tl.maximum(mx, tl.abs(x))
                tl.store(col_out + cols, acc, mask=cm)
                tl.debug_barrier()  # this chunk's row sums are stored before the next chunk reads them
    else:
        e0 = load8(it + ITEM_E0, ALIGNED)
        e1 = e0 + tl.load(it + ITEM_N)
        acc = tl.zeros([BLOCK], tl.float64)
        if RELATIVE:
            pacc = tl.zeros([BLOCK], tl.float64)
        if AMAX:
            mx = tl.zeros([BLOCK], tl.float64)
        for s in range(e0, e1, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            x = tl.load(g + offs, mask=offs < e1, other=0.0).to(tl.float64)
            acc += x * x
            if AMAX:
                mx = tl.maximum(mx, tl.abs(x))
            if RELATIVE:
                xp = tl.load(p + offs, mask=offs < e1, other=0.0).to(tl.float64)
                pacc += xp * xp
        tl.store(scratch + part0 + pid, tl.sum(acc, 0))
    if AMAX:
        tl.store(scratch + amax0 + pid, tl.max(mx))
    if RELATIVE:
        tl.store(pbuf + pid, tl.sum(pacc))


@triton.jit
def _matrix_chunk(tab, mats):
    """What a per-(matrix, chunk) program works on: its matrix's row of the matrix table, the chunk k, the tensor's
    row of the tensor table, the matrix's index b in the tensor, and its rows R and columns C."""
    x = mats + tl.program_id(0) * MAT_WIDTH
    row = tensor_row(tab, tl.load(x + MAT_T))
    return x, tl.program_id(1), row, tl.load(x + MAT_B), tl.load(row + TAB_R), tl.load(row + TAB_C)


@triton.jit
def stats_matrices(tab, mats, scratch, T: tl.constexpr, BLK: tl.constexpr, SB: tl.constexpr):
    """Per (matrix, chunk k), in float64: the column sums of chunk k from the strips' partials in strip order; chunk
    0 also ``rc`` (sum of the row sums) and the sum of row_var (T) before the step."""
    x, k, row, b, R, C = _matrix_chunk(tab, mats)
    if k == 0:
        rows_in = addr(row, TAB_ROW, tl.float64) + b * R
        rv = addr(row, TAB_RV, T) + b * R
        acc_rc = tl.zeros([BLK], tl.float64)
        acc_rv = tl.zeros([BLK], tl.float64)
        for i in range(0, R, BLK):
            offs = i + tl.arange(0, BLK)
            acc_rc += tl.load(rows_in + offs, mask=offs < R, other=0.0)
            acc_rv += tl.load(rv + offs, mask=offs < R, other=0.0).to(tl.float64)
        tl.store(addr(row, TAB_RC, tl.float64) + b, tl.sum(acc_rc, 0))
        tl.store(addr(row, TAB_RVS, tl.float64) + b, tl.sum(acc_rv, 0))
    colp = tl.load(x + MAT_COLP)
    if colp >= 0:
        S = tl.load(x + MAT_S)
        cols = k * BLK + tl.arange(0, BLK)
        cm = cols < C
        acc = tl.zeros([BLK], tl.float64)
        for s in range(0, S, SB):
            strips = s + tl.arange(0, SB)
            part = tl.load(scratch + colp + strips[:, None] * C + cols[None, :],
                           mask=(strips < S)[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(part, 0)
        tl.store(addr(row, TAB_COL, tl.float64) + b * C + cols, acc, mask=cm)


@triton.jit
def unit_sums(tab, units, scratch, part0, flag, DST: tl.constexpr, T: tl.constexpr, FROM_MATS: tl.constexpr,
              MAX: tl.constexpr, HAS_FLAG: tl.constexpr, TMAX: tl.constexpr, ONLY_NAN: tl.constexpr,
              BLOCK: tl.constexpr):
    """Per unit, in T: the sum of its matrices' ``rc`` (FROM_MATS) or of its items' partials (MAX: their maximum),
    into column DST (ONLY_NAN: where it holds NaN, `weighted.weighted_usq`'s mark); with a flag, raise it if the sum
    is not finite."""
    un = units + tl.program_id(0) * UNIT_WIDTH
    row = tensor_row(tab, tl.load(un + UNIT_T))
    if FROM_MATS:
        src = addr(row, TAB_RC, T) + tl.load(un + UNIT_MAT0)
        n = tl.load(un + UNIT_NMATS)
    else:
        src = scratch + part0 + tl.load(un + UNIT_ITEM0)
        n = tl.load(un + UNIT_NITEMS)
    acc = tl.zeros([BLOCK], T)
    for k in range(0, n, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        if MAX:
            acc = tl.maximum(acc, tl.load(src + offs, mask=offs < n, other=0.0))
        else:
            acc += tl.load(src + offs, mask=offs < n, other=0.0)
    if MAX:
        total = tl.max(acc, 0)
    else:
        total = tl.sum(acc, 0)
    dst = addr(row, DST, T) + tl.load(un + UNIT_U)
    if ONLY_NAN:
        now = tl.load(dst)
        tl.store(dst, total, mask=now != now)
    else:
        tl.store(dst, total)
    if HAS_FLAG:
        tl.atomic_max(flag, ((total != total) | (tl.abs(total) > TMAX)).to(tl.int32))


# ================================================================================================ pass 2
@triton.jit
def count_steps(tab, keys, skip, n_tensors, T: tl.constexpr, HAS_MOM: tl.constexpr, HAS_SKIP: tl.constexpr,
                RELATIVE: tl.constexpr, DECAY: tl.constexpr, UB: tl.constexpr):
    """Per tensor: which units are active (bank: a gradient with a nonzero element, ``sum g^2 > 0``, or for fp64
    parameters, whose squares can underflow, ``max |g| > 0`` and ``sum g^2`` not NaN: `types.active_units`), step
    counts advanced, the bias corrections
    ``corr = sqrt(1 - beta2^t) [/ (1 - beta1^t)]`` in float64 (a beta2 decay, DECAY: no ``sqrt(1 - beta2^t)``), pass
    3's ``scale`` (``corr``; a relative step, RELATIVE: ``corr * max(eps2, sqrt(sum p^2 / n))``, rounded once), and
    the rounding keys of the weight and of a bf16 momentum."""
    t = tl.program_id(0)
    row = tensor_row(tab, t)
    E = tl.load(row + TAB_E)
    bank = tl.load(row + TAB_BANK)
    ng = tl.load(row + TAB_NG)
    sumsq = addr(row, TAB_SUMSQ, tl.float64)
    amax = addr(row, TAB_AMAX, tl.float64)
    step = addr(row, TAB_STEP, tl.float32)
    corr = addr(row, TAB_CORR, T)
    scale = addr(row, TAB_SCALE, T)
    beta1 = hyper(tab, HDR_B1)
    beta2 = hyper(tab, HDR_B2)
    total = tl.zeros([UB], tl.int64)
    for u0 in range(0, E, UB):
        us = u0 + tl.arange(0, UB)
        um = us < E
        # (a block and a scalar are combined with tl.where: the interpreter mistypes `block & scalar`); a unit
        # without elements in the global shape (NG = 0) is left untouched, its step count included
        sq = tl.load(sumsq + us, mask=um, other=0.0)
        if T == tl.float64:
            live = (tl.load(amax + us, mask=um, other=0.0) > 0) & (sq == sq)
        else:
            live = sq > 0
        active = tl.where(bank != 0, live, tl.where(ng > 0, um, False))
        new = tl.load(step + us, mask=um, other=0.0) + active.to(tl.float32)
        write = um
        if HAS_SKIP:
            write = tl.where(tl.load(skip) == 0, um, False)
        tl.store(step + us, new, mask=write)
        tl.store(addr(row, TAB_ACT, tl.int1) + us, active, mask=tl.where(bank != 0, um, False))
        tt = tl.maximum(new.to(tl.int64), 1)  # idle bank slices (t = 0) are masked out later: keep them finite
        if DECAY:
            c = tl.full([UB], 1.0, tl.float64)
        else:
            c = tl.sqrt(1.0 - powi(beta2, tt))
        if HAS_MOM:
            c = c / (1.0 - powi(beta1, tt))
        tl.store(corr + us, c.to(T), mask=um)
        if RELATIVE:
            n = tl.maximum(ng, 1).to(tl.float64)
            c = c * tl.maximum(tl.sqrt(tl.load(addr(row, TAB_PSQ, tl.float64) + us, mask=um, other=0.0) / n),
                               RELATIVE_STEP_EPS)
        tl.store(scale + us, c.to(T), mask=um)
        total += tl.where(um, new.to(tl.int64), 0)
    key = mix32(((tl.load(row + TAB_KBASE) + tl.sum(total, 0)) & 0xFFFFFFFF).to(tl.uint32))
    tl.store(keys + t, key.to(tl.int64))
    tl.store(keys + n_tensors + t, mix32(key + MOMENTUM_STREAM).to(tl.int64))


@triton.jit
def factored_moments(tab, mats, skip, T: tl.constexpr, EPS_ADD: tl.constexpr, HAS_SKIP: tl.constexpr,
                     DECAY: tl.constexpr, BLK: tl.constexpr):
    """Per (matrix, chunk k): the row and column EMAs of chunk k (active units only; `factor_ema`: float64, rounded
    once into the state) and ``rinv``/``cinv`` in T: floor: ``rinv = 1/sqrt(max(row_var / max(mean_i row_var,
    1e-15), eps))``, ``cinv = 1/sqrt(max(col_var, eps))``; add: ``rinv = 1/sqrt(row_var / max(mean_i row_var,
    tiny))``, ``cinv = 1/sqrt(col_var)``; ``rinv`` in float64 rounded once into T, ``cinv`` in T. The row mean is
    carried as a float64 sum: ``(b2 * sum_i row_var + (rc / C + R * add) * (1 - b2)) / R``, ``b2`` the unit's
    (`second_moment_beta`)."""
    x, k, row, b, R, C = _matrix_chunk(tab, mats)
    u = tl.load(x + MAT_U)
    Rg = tl.load(row + TAB_RG).to(tl.float64)
    Cg = tl.load(row + TAB_CG).to(tl.float64)
    active = updated(row, u, skip, False)
    write = updated(row, u, skip, HAS_SKIP)
    add = hyper(tab, HDR_ADD)
    b2, w2 = second_moment_beta(tab, row, u, DECAY)
    f = hyper(tab, HDR_FLOOR).to(T)
    rm = row_mean(tab, row, b, Rg, Cg, add, b2, w2)
    rows = k * BLK + tl.arange(0, BLK)
    rmask = rows < R
    rv = factor_ema(addr(row, TAB_RV, T) + b * R, addr(row, TAB_ROW, tl.float64) + b * R, rows, rmask,
                    tl.maximum(Cg, 1.0), add, b2, w2, write, active, T)
    # rinv in float64, rounded once (a row's ratio to the mean can be below T's range where rinv is not)
    tl.store(addr(row, TAB_RINV, T) + b * R + rows,
             inv_sqrt(rv.to(tl.float64) / rm, hyper(tab, HDR_FLOOR), tl.float64, EPS_ADD).to(T), mask=rmask)
    cols = k * BLK + tl.arange(0, BLK)
    cmask = cols < C
    cv = factor_ema(addr(row, TAB_CV, T) + b * C, addr(row, TAB_COL, tl.float64) + b * C, cols, cmask,
                    tl.maximum(Rg, 1.0), add, b2, w2, write, active, T)
    tl.store(addr(row, TAB_CINV, T) + b * C + cols, inv_sqrt(cv, f, T, EPS_ADD), mask=cmask)


# ================================================================================================ passes 2 and 3
@triton.jit
def direction_tiles(tab, items, scratch, part0, clips, keys, skip, n_tensors, PD: tl.constexpr, T: tl.constexpr,
                    MD: tl.constexpr, FACTORED: tl.constexpr, FLAT: tl.constexpr, MOM: tl.constexpr,
                    EPS_ADD: tl.constexpr, HAS_SKIP: tl.constexpr, DECAY: tl.constexpr, APPLY: tl.constexpr,
                    LR_PTR: tl.constexpr, LRD: tl.constexpr, ALIGNED: tl.constexpr, RB: tl.constexpr,
                    BC: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr):
    """Per item of an updated unit, the update direction ``u = src * (rinv_i * scale) * cinv_j`` (factored) or
    ``src * scale / sqrt(v)`` (`full_direction`), with ``src`` the first moment (`first_moment`) and ``scale`` the
    bias correction (`count_steps`'s corr). Pass 2 (not APPLY): the first moment and the full second moment advanced
    in place, and the item's partial ``sum u^2``. Pass 3 (APPLY): ``scale`` is count_steps' times the unit's clip, and
    ``p = p * (1 - lr*wd) - u * lr`` (eager's operations, each rounded; lr and the decay float64 rounded to T, a
    tensor lr read here on the device), rounded stochastically for bf16 parameters. WEIGHTED (pass 2): only units
    whose u_sumsq `weighted.weighted_usq` left NaN."""
    pid = tl.program_id(0)
    it = items + pid * ITEM_WIDTH
    t = tl.load(it + ITEM_T)
    row = tensor_row(tab, t)
    u = tl.load(it + ITEM_U)
    go = updated(row, u, skip, HAS_SKIP)
    if WEIGHTED:
        have = tl.load(addr(row, TAB_USQ, T) + u)
        go = go & (have != have)
    g = big(row, TAB_G, PD, ALIGNED)
    m = big(row, TAB_M, MD, ALIGNED)
    ms = addr(row, TAB_MS, tl.float32)
    v = big(row, TAB_V, T, ALIGNED)
    b1 = hyper(tab, HDR_B1).to(T)
    w1 = hyper(tab, HDR_W1).to(T)
    b2, w2 = second_moment_beta(tab, row, u, DECAY)  # (the full second moment's EMA is float64)
    add = hyper(tab, HDR_ADD)
    floor = hyper(tab, HDR_FLOOR).to(T)
    if APPLY:
        p = big(row, TAB_P, PD, ALIGNED)
        if LR_PTR:
            lr64 = tl.load(tl.load(tab + HDR_LR_ADDR).to(tl.pointer_type(LRD))).to(tl.float64)
        else:
            lr64 = hyper(tab, HDR_LR)
        decay = (1.0 - lr64 * hyper(tab, HDR_WD)).to(T)
        lr = lr64.to(T)
        scale = tl.load(addr(row, TAB_SCALE, T) + u) * tl.load(clips + tl.load(row + TAB_UNIT0) + u)
        key = tl.load(keys + t).to(tl.uint32)
    else:
        scale = tl.load(addr(row, TAB_CORR, T) + u)
        key = tl.load(keys + n_tensors + t).to(tl.uint32)  # the bf16 momentum's
    if FLAT:
        e0 = load8(it + ITEM_E0, ALIGNED)
        e1 = e0 + tl.where(go, tl.load(it + ITEM_N), 0)
        acc = tl.zeros([BLOCK], T)
        for s in range(e0, e1, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            mask = offs < e1
            x, src = first_moment(g, m, ms, offs, mask, offs, mask, b1, w1, key, T, MOM, APPLY)
            uu = full_direction(src, x, v, offs, mask, scale, b2, w2, add, floor, T, EPS_ADD, APPLY)
            if APPLY:
                write_param(p, offs, mask, uu, decay, lr, key, PD, T)
            else:
                acc += tl.where(mask, uu * uu, 0.0)
    else:
        C = load8(row + TAB_C, ALIGNED)
        NB = tl.load(row + TAB_NB)
        r0 = tl.load(it + ITEM_ROW0)
        r1 = r0 + tl.where(go, tl.load(it + ITEM_NROWS), 0)
        rinv = addr(row, TAB_RINV, T)
        cinv = addr(row, TAB_CINV, T) + tl.load(it + ITEM_B) * C
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
                x, src = first_moment(g, m, ms, offs, mask, rows * NB + c // BC, rm, b1, w1, key, T, MOM, APPLY)
                if FACTORED:
                    sc = tl.load(rinv + rows, mask=rm, other=0.0) * scale
                    uu = src * sc[:, None] * ci[None, :]
                else:
                    uu = full_direction(src, x, v, offs, mask, scale, b2, w2, add, floor, T, EPS_ADD, APPLY)
                if APPLY:
                    write_param(p, offs, mask, uu, decay, lr, key, PD, T)
                else:
                    acc += tl.where(mask, uu * uu, 0.0)
    if not APPLY:
        tl.store(scratch + part0 + pid, tl.sum(acc))


# ================================================================================================ pass 3
@triton.jit
def prepare_apply(tab, clips, keys, T: tl.constexpr, UB: tl.constexpr):
    """Per tensor: each unit's clip ``1 / max(1, sqrt(sum u^2 / n))`` and the weight's rounding key."""
    t = tl.program_id(0)
    row = tensor_row(tab, t)
    E = tl.load(row + TAB_E)
    n = tl.load(row + TAB_NG).to(T)
    usq = addr(row, TAB_USQ, T)
    step = addr(row, TAB_STEP, tl.float32)
    unit0 = tl.load(row + TAB_UNIT0)
    total = tl.zeros([UB], tl.int64)
    for u0 in range(0, E, UB):
        us = u0 + tl.arange(0, UB)
        um = us < E
        rms = sqrt(div(tl.load(usq + us, mask=um, other=0.0), n, T), T)
        tl.store(clips + unit0 + us, div(1.0, tl.maximum(rms, 1.0), T), mask=um)
        total += tl.where(um, tl.load(step + us, mask=um, other=0.0).to(tl.int64), 0)
    key = mix32(((tl.load(row + TAB_KBASE) + tl.sum(total, 0)) & 0xFFFFFFFF).to(tl.uint32))
    tl.store(keys + t, key.to(tl.int64))


@triton.jit
def round_kernel(x, out, n, offset, key, BLOCK: tl.constexpr):
    """`skewadam.kernels.triton.stochastic_round_bf16`: ``out = round_bf16(x)`` for elements ``offset + i``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, round_bf16(tl.load(x + offs, mask=mask, other=0.0), offs + offset, key.to(tl.uint32)),
             mask=mask)
