"""The clip's ``sum u^2`` of a factored unit without momentum (`tables.Bucket.weighted`: fp32 statistics) from
weighted column sums, with no pass over its gradient:

``sum_ij (g_ij * rinv_i * c * cinv_j)^2 = c^2 * rm * sum_j cinv_j^2 * t_j``, ``t_j = sum_i g_ij^2 / row_var_i``,

as ``rinv_i^2 = rm / row_var_i`` wherever no row's ratio to the row mean ``rm`` is floored (the C++ kernel's identity,
docs/guide/kernels.md). `step_`'s pass 1 (`passes.stats_tiles`) adds the ``t_j`` up right after each group of rows'
sums, with the row_var the unit gets if it steps, the rows still in cache; the three passes' pass 2 adds them up from
the stored row_var (`weighted_tiles`); `weighted_usq` turns them into ``sum u^2``, or marks a unit for pass 2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import (HDR_ADD, HDR_FLOOR, ITEM_B, ITEM_NROWS, ITEM_ROW0, ITEM_T, ITEM_U, ITEM_WCOL, ITEM_WIDTH, TAB_C,
                     TAB_CG, TAB_CINV, TAB_CORR, TAB_G, TAB_RG, TAB_RINV, TAB_RV, TAB_USQ, UNIT_ITEM0, UNIT_NITEMS,
                     UNIT_T, UNIT_U, UNIT_WIDTH, addr, big, hyper, inv_sqrt, load8, row_mean, second_moment_beta,
                     tensor_row, updated)

# The least weighted column sum kept: float32 is normal there, and an unweighted column's contribution to sum u^2 can
# be up to ~ t_j / eps (its cinv^2), so what float32 would lose below it can matter.
SAFE_MIN = tl.constexpr(2.0 ** -100)


@triton.jit
def weighted_columns(g, wcol, rows, rm, first, C, w, BC: tl.constexpr):
    """Rows ``rows`` (mask ``rm``) of a factored gradient, weighted by ``w`` (float64, 1 / row_var after the step),
    added column by column to the float32 weighted column sums at ``wcol``: ``t_j += sum_i g_ij^2 * w_i``, the
    group's terms summed in float64 and added to ``t_j`` there, rounded once (set, not added, when ``first``). A sum
    that would lie below `SAFE_MIN` becomes -inf, so that `weighted_usq` sends its unit to pass 2. The one definition
    behind both places that compute them (`stats_tiles` in the one-process step, `weighted_tiles` in the three
    passes), hence the same bits."""
    for c in range(0, C, BC):
        cols = c + tl.arange(0, BC)
        cm = cols < C
        x = tl.load(g + rows[:, None] * C + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float64)
        t = tl.load(wcol + cols, mask=tl.where(first, False, cm), other=0.0).to(tl.float64)
        t = t + tl.sum(x * x * w[:, None], 0)
        t = tl.where((t > 0) & (t < SAFE_MIN), float("-inf"), t)
        tl.store(wcol + cols, t.to(tl.float32), mask=cm)


@triton.jit
def weighted_tiles(tab, items, wbuf, skip, PD: tl.constexpr, T: tl.constexpr, HAS_SKIP: tl.constexpr,
                   ALIGNED: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr):
    """Per item of an updated unit, in the three passes (a factored bucket without momentum): its weighted column
    sums (`weighted_columns`, into ``wbuf``), the rows weighted by row_var after `factored_moments`, in the groups
    of RB rows of `stats_tiles` (the one-process step's, hence its bits)."""
    it = items + tl.program_id(0) * ITEM_WIDTH
    row = tensor_row(tab, tl.load(it + ITEM_T))
    go = updated(row, tl.load(it + ITEM_U), skip, HAS_SKIP)
    g = big(row, TAB_G, PD, ALIGNED)
    rv = addr(row, TAB_RV, T)
    C = load8(row + TAB_C, ALIGNED)
    wcol = wbuf + tl.load(it + ITEM_WCOL)
    r0 = tl.load(it + ITEM_ROW0)
    r1 = r0 + tl.where(go, tl.load(it + ITEM_NROWS), 0)
    for r in range(r0, r1, RB):
        rows = r + tl.arange(0, RB)
        rm = rows < r1
        w = 1.0 / tl.load(rv + rows, mask=rm, other=1.0).to(tl.float64)
        weighted_columns(g, wcol, rows, rm, r == r0, C, w, BC)
        tl.debug_barrier()  # this group's sums are stored before the next group reads them


@triton.jit
def weighted_usq(tab, units, items, wbuf, T: tl.constexpr, EPS_ADD: tl.constexpr, DECAY: tl.constexpr,
                 BLK: tl.constexpr):
    """Per unit of a factored bucket without momentum, after `factored_moments`: its ``sum u^2`` from its weighted
    column sums ``t_j = sum_i g_ij^2 / row_var_i`` (per item, at ``wbuf``): ``corr^2 * sum_items rm * sum_j cinv_j^2
    * t_j``, as ``rinv_i^2 = rm / row_var_i`` where no row's ratio to the mean ``rm`` is floored, in float64 (the
    identity holds to T's rounding of rinv), into u_sumsq; NaN there (`direction_tiles` then sums ``u^2`` itself)
    where a row's rinv is at the floor's value (floor mode: ``1 / sqrt(eps)``), or the sum is not finite in T (as
    when `weighted_columns` marked a column sum -inf)."""
    un = units + tl.program_id(0) * UNIT_WIDTH
    row = tensor_row(tab, tl.load(un + UNIT_T))
    u = tl.load(un + UNIT_U)
    C = tl.load(row + TAB_C)
    Rg = tl.load(row + TAB_RG).to(tl.float64)
    Cg = tl.load(row + TAB_CG).to(tl.float64)
    add = hyper(tab, HDR_ADD)
    b2, w2 = second_moment_beta(tab, row, u, DECAY)
    floor = hyper(tab, HDR_FLOOR)
    top = inv_sqrt(floor, floor, tl.float64, False).to(T)  # a floored row's rinv
    rinv = addr(row, TAB_RINV, T)
    total = tl.full([], 0.0, tl.float64)
    floored = tl.full([], 0, tl.int32)  # a row at the floor (add mode: an infinite rinv)
    for k in range(tl.load(un + UNIT_ITEM0), tl.load(un + UNIT_ITEM0) + tl.load(un + UNIT_NITEMS)):
        it = items + k * ITEM_WIDTH
        b = tl.load(it + ITEM_B)
        rm = row_mean(tab, row, b, Rg, Cg, add, b2, w2)
        r0 = tl.load(it + ITEM_ROW0)
        r1 = r0 + tl.load(it + ITEM_NROWS)
        mx = tl.zeros([BLK], T)
        for i in range(r0, r1, BLK):
            rows = i + tl.arange(0, BLK)
            mx = tl.maximum(mx, tl.load(rinv + rows, mask=rows < r1, other=0.0))
        if EPS_ADD:
            floored = tl.maximum(floored, (tl.max(mx, 0) * 0.0 != 0.0).to(tl.int32))
        else:
            floored = tl.maximum(floored, (tl.max(mx, 0) >= top).to(tl.int32))
        cinv = addr(row, TAB_CINV, T) + b * C
        wcol = wbuf + tl.load(it + ITEM_WCOL)
        acc = tl.zeros([BLK], tl.float64)
        for j in range(0, C, BLK):
            cols = j + tl.arange(0, BLK)
            ci = tl.load(cinv + cols, mask=cols < C, other=0.0).to(tl.float64)
            acc += ci * ci * tl.load(wcol + cols, mask=cols < C, other=0.0).to(tl.float64)
        total += rm * tl.sum(acc, 0)
    corr = tl.load(addr(row, TAB_CORR, T) + u).to(tl.float64)
    usq = (corr * corr * total).to(T)
    tl.static_assert(T == tl.float32, "weighted column sums are for fp32 statistics (fp32 and bf16 weights)")
    nan = tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    tl.store(addr(row, TAB_USQ, T) + u, tl.where((usq * 0.0 == 0.0) & (floored == 0), usq, nan))
