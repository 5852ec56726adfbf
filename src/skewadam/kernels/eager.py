"""SkewAdam's update as pure functions over `skewadam.kernels.types` records, written with eager torch ops (any device).

Shape legend: ``E`` bank (dim 0 of a stacked expert tensor, one slice per expert), ``...`` batch dims,
``R`` rows (dim -2), ``C`` columns (dim -1). A *unit* is what gets its own RMS clip and step count: a bank slice, or the
whole tensor. Math runs in the state dtype: fp32 for bf16 parameters, the parameter's dtype otherwise.

The step is three passes over the gradients, with a seam between them where the distributed layer sums partial
statistics across shards (nothing here calls torch.distributed):

1. `grad_stats`: sums of ``g^2`` per unit, per batch matrix, per row and per column, and the current row-statistic
   sums. Reads state, writes nothing, so a step found non-finite here can be skipped with no trace.
2. `update_moments_`: step counts, the second-moment EMAs (factored or full), momentum, the denominators, and the
   per-unit sum of ``u^2`` for the RMS clip.
3. `apply_updates_`: ``p = p*(1 - lr*wd) - lr * u / max(1, rms(u))``, rounded stochastically for bf16 parameters.

Adafactor's options (`skewadam.kernels.types.Group`) live inside these passes, per unit: ``relative_step`` adds the sum
of ``p^2`` to pass 1 and scales the update term by ``max(RELATIVE_STEP_EPS, rms(p))`` (pass 2 folds it into
``Moments.corr``; the weight decay keeps ``lr``); ``beta2_decay`` gives every second-moment EMA of a unit its own
``1 - t**d`` and drops the second moment's bias correction. An idle bank slice is left untouched either way.

Means use the *global* shapes passed in, so a shard divides its partial sums by the full row or column count.
The row-statistic mean is carried as a sum updated by linearity, ``sum_i row_i' = b2*sum_i row_i + (1-b2)*sum_i
rowmean_i``, so a row-sharded tensor needs no extra collective (exact up to summation order).

EMAs are ``s * beta + x * (1 - beta)``, each operation rounded on its own (`ema`), not ``torch.lerp``, whose CPU kernel
fuses a multiply-add or not depending on the CPU's vector unit: the element-wise state (momentum in every storage, the
full second moment, step counts) is then bitwise the C++ kernel's on any CPU. Sums (the factored statistics, the
clip) are added in another order, so weights agree to rounding. The exact order of operations is
`skewadam.kernels.types`' (what the Triton kernels match).

Range: pass 1 sums squares in float64 (`GradStats`), where no finite fp32 or bf16 gradient overflows them, so only
inf/NaN gradients are non-finite; the second-moment EMAs are float64 too, rounded once into the fp32 state. A step is
exact while that state holds ``beta2 * v + (1 - beta2) * mean(g^2)``: from a zero state up to ``|g| = sqrt(FLT_MAX /
(1 - beta2))`` (5.8e20 at beta2 = 0.999); held at G, the state tends to G^2, so gradients sustained above
``sqrt(FLT_MAX)`` (1.8e19) overflow it. Beyond, the second moment holds inf and the update of what it covers vanishes
(as fp32 AdamW's does: only the weight decay applies). fp64 parameters: their float64 squares overflow near
1.3e154 / sqrt(numel) (the step counts as non-finite) and underflow below 1.5e-162, so a unit's activity is its max
``|g|``.

Memory: a tensor is processed along dim 0, a chunk of whole dim-0 slices (rows of a matrix, bank slices) of at most
`CHUNK_NUMEL` elements at a time (at least one slice), so the fp32 temporaries of a pass (about ten in a bf16 step)
are chunk-sized, not tensor-sized. Results do not depend on the chunking: its sums are taken per *block* of
`BLOCK_NUMEL` elements of whole slices (fixed by the shape alone; a chunk holds whole blocks), each block by its own
reduction, and the block partials are added once at the end. Small tensors are one block, one chunk.

Host syncs: none but the documented one, reading the finite check in `step_` (and ``skip`` where it is a tensor). A
bank's step counts and bias corrections stay on its device and its rounding keys are computed there; a non-bank
tensor's step count is a host scalar, as in torch's optimizers.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from ..state import state_dtype_for
from .quant import load_momentum, store_momentum_
from .rounding import rounding_key, stochastic_round_bf16
from .types import (RELATIVE_STEP_EPS, ROW_MEAN_FLOOR, GradStats, Group, Moments, ParamTensors, active_units,
                    all_finite, check, check_lr, planned, stat_dims, unit_dims, unit_numel)

__all__ = ["GradStats", "Moments", "grad_stats", "update_moments_", "apply_updates_", "step_", "unit_dims",
           "stat_dims", "chunk_slices", "ema", "step_key", "CHUNK_NUMEL", "BLOCK_NUMEL",
           "step_transient_bytes"]

CHUNK_NUMEL = 1 << 24  # 64 MiB of fp32: tensors above this are processed a chunk of whole dim-0 slices at a time
BLOCK_NUMEL = 1 << 20  # sums are taken per block of whole dim-0 slices of about this many elements

Scalar = Union[float, Tensor]
Beta = Union[float, tuple[Tensor, Tensor]]  # an EMA's beta: a float, or per-slice coefficients (beta, 1 - beta)


def _compute(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _coefficients(beta: Beta) -> tuple[Scalar, Scalar]:
    return beta if isinstance(beta, tuple) else (beta, 1.0 - beta)


def ema(s: Tensor, x: Tensor, beta: Beta) -> Tensor:
    """``s * beta + x * (1 - beta)``, every operation rounded on its own (no fused multiply-add, which torch.lerp's CPU
    kernel uses or not depending on the CPU's vector unit), the coefficients rounded from float64 (a float ``beta``,
    or per-slice ``(beta, 1 - beta)`` tensors already rounded)."""
    b, w = _coefficients(beta)
    return torch.mul(x, w).add_(torch.mul(s, b))


def _ema_(s: Tensor, x: Tensor, beta: Beta, active: Optional[Tensor] = None) -> None:
    """``s = ema(s, x, beta)`` in place; with ``active`` (a bank's live slices) only where it holds."""
    if active is None:
        b, w = _coefficients(beta)
        s.mul_(b).add_(torch.mul(x, w))
    else:
        s.copy_(torch.where(active, ema(s, x, beta), s))


def _ema64_(s: Tensor, x: Tensor, beta: Beta) -> None:
    """A second moment's EMA: ``s = ema(s, x, beta)`` computed in float64 from the float64 ``x`` (overwritten), the
    coefficients float64, rounded once into ``s`` (a bank's idle slices have coefficients (1, 0): left as they are)."""
    b, w = _coefficients(beta)
    s.copy_(x.mul_(w).add_(s.to(torch.float64, copy=True).mul_(b)))


def _slices(shape: Sequence[int]) -> tuple[int, int]:
    """``(dim-0 slices, elements per slice)``; a 0-d tensor is one slice of one element."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def _block_slices(shape: Sequence[int]) -> int:
    """Dim-0 slices per summation block: whole slices up to `BLOCK_NUMEL` elements (at least one)."""
    return max(1, BLOCK_NUMEL // max(1, _slices(shape)[1]))


def chunk_slices(shape: Sequence[int], bank: bool = False) -> int:
    """Slices of dim 0 the eager kernels process at a time: whole summation blocks up to `CHUNK_NUMEL` elements (at
    least one block), all of dim 0 for smaller tensors. The same rule for banks and other tensors (``bank`` is
    accepted for callers that pass it).

    Example:
        >>> chunk_slices((50304, 768))  # 21,845 rows (16.8M elements) per chunk: 3 chunks
        21845
    """
    n0, per_slice = _slices(shape)
    block = _block_slices(shape)
    per = max(1, CHUNK_NUMEL // (block * max(1, per_slice))) * block
    return max(1, min(n0, per))


def _chunks(shape: Sequence[int]) -> list[slice]:
    n0 = _slices(shape)[0]
    per = chunk_slices(shape)
    if not len(shape) or per >= n0:
        return [slice(None)]
    return [slice(a, min(a + per, n0)) for a in range(0, n0, per)]


def _blocks(rows: int, per: int) -> list[slice]:
    """Summation blocks of a chunk of ``rows`` dim-0 slices (chunks hold whole blocks but the last)."""
    if rows <= per:
        return [slice(None)]
    return [slice(a, min(a + per, rows)) for a in range(0, rows, per)]


def _at(t, sl: slice, n0: int):
    """Rows ``sl`` of ``t`` when its dim 0 runs along the parameter's dim 0 (size ``n0``); other tensors (a 2-D
    matrix's ``[1, C]`` column statistics, floats, None) are the same for every chunk."""
    if sl == slice(None) or not isinstance(t, Tensor) or t.ndim == 0 or t.shape[0] != n0:
        return t
    return t[sl]


def _cat(parts: list) -> Optional[Tensor]:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _unit_sums(x: Tensor, bank: bool, per_block: int, reduce=torch.sum) -> list[Tensor]:
    """Per summation block of ``x`` (a chunk): its sum (or other ``reduce``) over each unit's dims (a bank: one per
    slice), keepdim."""
    if x.ndim == 0:
        return [x]
    dims = unit_dims(x.ndim, bank)
    return [reduce(x[b], dims, keepdim=True) for b in _blocks(x.shape[0], per_block)]


def _total(parts: list[Tensor], bank: bool, reduce=torch.sum) -> Tensor:
    """The per-unit sums (or other ``reduce``) from `_unit_sums`' block parts: a bank's per-slice ones joined, other
    tensors' combined."""
    if len(parts) == 1 or bank:
        return _cat(parts)
    return reduce(torch.cat(parts), 0, keepdim=True)


def _amax(x: Tensor, dims, keepdim: bool = True) -> Tensor:
    """``x.amax(dims)``, 0 over dims that hold no element (a unit without elements is never stepped)."""
    return x.amax(dims, keepdim=keepdim) if x.numel() else x.sum(dims, keepdim=keepdim)


def _square64(x: Tensor) -> Tensor:
    """``x^2`` in float64 (exact for fp32 and bf16 values), in place on the copy the conversion makes."""
    y = x.to(torch.float64)
    return y.square_() if y is not x else y.square()


def _dtype(pt: ParamTensors) -> torch.dtype:
    return (pt.row_var if pt.row_var is not None else pt.exp_avg_sq).dtype


def step_key(seed: int, pt: ParamTensors):
    """The rounding key of this step, from the step counts after it: on their device where they live beside the
    parameter (a bank's; any under the Triton kernel), with no host sync; else from the host count."""
    on_host = not pt.bank and pt.step.device.type == "cpu"
    step = int(pt.step.item()) if on_host else pt.step.sum(dtype=torch.int64)
    return rounding_key(seed, pt.stream, step)


# ------------------------------------------------------------------------------------------------------------ pass 1
def grad_stats(group: Group) -> list[GradStats]:
    """Pass 1: sums of g^2 (nothing is written), and with ``group.relative_step`` each unit's sum of p^2 in float64.
    Raises ValueError naming a parameter whose gradient or state does not fit it (`skewadam.kernels.types.check`), or
    for a tensor lr of more than one element, before any pass writes."""
    check_lr(group.lr)
    for pt in group.params:
        check(pt)
    return [_grad_stats(pt, group.relative_step) for pt in group.params]


def _grad_stats(pt: ParamTensors, relative_step: bool) -> GradStats:
    g, row_var, bank = pt.grad, pt.row_var, pt.bank
    per_block = _block_slices(g.shape)
    n0 = _slices(g.shape)[0]
    fp64 = g.dtype == torch.float64  # squares below 1e-162 underflow: a unit's activity needs max |g|
    sums, rows, cols, psq, maxes = [], [], [], [], []
    for sl in _chunks(g.shape):
        if relative_step:
            psq += _unit_sums(_square64(_at(pt.param, sl, n0)), bank, per_block)
        gc = _at(g, sl, n0)
        if fp64:
            maxes += _unit_sums(gc.abs(), bank, per_block, _amax)
        sq = _square64(gc)
        if row_var is None:
            sums += _unit_sums(sq, bank, per_block)
            continue
        for b in _blocks(sq.shape[0], per_block):
            rows.append(sq[b].sum(-1, keepdim=True))
            cols.append(sq[b].sum(-2, keepdim=True))
    p_sumsq = _total(psq, bank) if relative_step else None
    absmax = _total(maxes, bank, _amax) if fp64 else None
    if row_var is None:
        return GradStats(_total(sums, bank), None, None, None, None, p_sumsq, absmax)
    row = _cat(rows)
    col = _cat(cols)
    if g.ndim == 2 and len(cols) > 1:  # dim 0 is the matrix's rows: the blocks hold partial column sums
        col = col.sum(0, keepdim=True)
    rc = row.sum(-2, keepdim=True)
    return GradStats(rc.sum(unit_dims(g.ndim, bank), keepdim=True), rc, row, col,
                     row_var.sum(-2, keepdim=True, dtype=torch.float64), p_sumsq, absmax)


# ------------------------------------------------------------------------------------------------------------ pass 2
def _bias_correction(step: Tensor, bank: bool, beta1: Optional[float], beta2: Optional[float], dtype) -> Scalar:
    """sqrt(1 - beta2^t) / (1 - beta1^t), in float64 (1 - beta in float32 is off by ~1e-5 relative); a factor is 1
    where its beta is None (no momentum; beta2_decay's second moment, an unbiased average)."""
    if not bank:
        t = step.item()  # a host scalar
        c = math.sqrt(1.0 - beta2**t) if beta2 is not None else 1.0
        return c / (1.0 - beta1**t) if beta1 is not None else c
    t = step.double().clamp(min=1.0)  # idle slices (t = 0) are masked out; clamp keeps them finite
    c = (1.0 - torch.pow(beta2, t)).sqrt() if beta2 is not None else torch.ones_like(t)
    if beta1 is not None:
        c = c / (1.0 - torch.pow(beta1, t))
    return c.to(dtype)


def _beta2(step: Tensor, active: Optional[Tensor], group: Group) -> Beta:
    """The second moment's beta: the group's, or with ``beta2_decay`` d ``1 - t**d`` at each unit's new step count t
    in float64 by the host's libm (as the C++ kernel computes it: a bank's counts are read on the host, one sync on a
    GPU). A bank's (``active``: its live slices) as per-slice float64 coefficients ``(beta, 1 - beta)``, ``(1, 0)``
    on idle slices, whose EMAs (of finite inputs: their gradient is zero) then leave them exactly as they are."""
    d = group.beta2_decay
    if active is None:
        return group.beta2 if d is None else 1.0 - step.item() ** d
    if d is None:
        b = torch.full_like(active, group.beta2, dtype=torch.float64)
        w = torch.full_like(active, 1.0 - group.beta2, dtype=torch.float64)
    else:
        betas = [1.0 - max(t, 1.0) ** d for t in step.tolist()]
        b, w = (torch.tensor(c, dtype=torch.float64).to(step.device).view(active.shape)
                for c in (betas, [1.0 - x for x in betas]))
    return torch.where(active, b, 1.0), torch.where(active, w, 0.0)


def _zero_moments(pt: ParamTensors, st: GradStats) -> Moments:
    """What pass 2 returns for a skipped step or a parameter with no elements: nothing to clip or write."""
    dtype = _dtype(pt)
    z = torch.zeros_like(st.sumsq, dtype=dtype)
    return Moments(z, z.clone() if pt.bank else 0.0, None if st.row is None else torch.zeros_like(st.row, dtype=dtype),
                   None if st.col is None else torch.zeros_like(st.col, dtype=dtype),
                   torch.zeros_like(st.sumsq, dtype=torch.bool) if pt.bank else None)


def update_moments_(group: Group, stats: Sequence[GradStats], *, skip: Optional[Tensor] = None) -> list[Moments]:
    """Pass 2: update step counts, second moments and momentum in place; return what the clip needs.

    floor: ``denom = sqrt(max(row/max(mean(row),1e-15), eps)) * sqrt(max(col, eps))`` or ``sqrt(max(v, eps))``.
    add:   ``g^2 + eps`` is accumulated instead and ``denom = sqrt(row/mean(row)) * sqrt(col)`` or ``sqrt(v)``.
    ``u = m * corr / denom`` (``g`` without momentum), ``corr = sqrt(1 - beta2^t) / (1 - beta1^t)``; with
    ``group.beta2_decay`` every second-moment EMA uses the unit's ``1 - t**beta2_decay`` and ``corr`` drops its
    ``sqrt(1 - beta2^t)``; with ``group.relative_step`` the returned ``corr`` (pass 3's scale of u, not this pass's)
    is multiplied by ``max(RELATIVE_STEP_EPS, sqrt(p_sumsq / n))``.

    A compact first moment (int8 with its scales, or bf16: `skewadam.kernels.quant`) is decoded, updated in the
    compute dtype and stored back here; ``u`` is then formed from the stored value, as pass 3 will read it.
    ``skip`` (read on the host): when True, nothing is written and the moments are zeros.
    """
    if skip is not None and bool(skip):
        return [_zero_moments(pt, st) for pt, st in zip(group.params, stats)]
    return [_update_moments(pt, st, group) for pt, st in zip(group.params, stats)]


def _update_moments(pt: ParamTensors, st: GradStats, group: Group) -> Moments:
    g, step, m, bank = pt.grad, pt.step, pt.exp_avg, pt.bank
    dtype = _dtype(pt)
    n_unit = unit_numel(pt.shape, bank)
    active = None
    if bank:
        active = active_units(st) if n_unit else torch.zeros_like(st.sumsq, dtype=torch.bool)
        step.add_(active.view(-1))  # an expert that saw no token has an all-zero slice: leave it untouched
    elif n_unit == 0:
        return _zero_moments(pt, st)
    else:
        step.add_(1)
    decayed = group.beta2_decay is not None
    corr = _bias_correction(step, bank, group.beta1 if m is not None else None, None if decayed else group.beta2,
                            dtype)
    if bank:
        corr = corr.view(-1, *([1] * (g.ndim - 1)))
    beta2 = _beta2(step, active, group)
    add = group.eps if group.eps_mode == "add" else 0.0
    floor = group.eps if group.eps_mode == "floor" else 0.0
    rinv = cinv = None
    if pt.row_var is not None:  # the factored EMAs and denominators: row- and column-sized, done whole
        R, C = pt.shape[-2], pt.shape[-1]
        _ema64_(pt.row_var, st.row / max(C, 1) + add, beta2)  # (an empty dim's sums are 0: keep x finite)
        _ema64_(pt.col_var, st.col / max(R, 1) + add, beta2)
        b2, w2 = _coefficients(beta2)
        rmean = (st.row_var_sum * b2 + (st.rc_sumsq / C + R * add) * w2) / R
        # rinv in float64, rounded once (a row's ratio to the mean can be below fp32's range where rinv is not)
        if group.eps_mode == "floor":
            rinv = (pt.row_var / rmean.clamp(min=ROW_MEAN_FLOOR)).clamp_(min=floor).rsqrt_().to(dtype)
            cinv = pt.col_var.clamp(min=floor).rsqrt()
        else:
            rinv = (pt.row_var / rmean.clamp(min=torch.finfo(torch.float64).tiny)).rsqrt_().to(dtype)
            cinv = pt.col_var.rsqrt()
    key = 0  # only a bf16 first moment draws rounding bits
    if m is not None and m.dtype == torch.bfloat16 and dtype != torch.bfloat16:
        key = step_key(group.seed, pt)
    n0, per_slice = _slices(g.shape)
    per_block = _block_slices(g.shape)
    sums = []
    for sl in _chunks(g.shape):
        u = _moments_chunk(*(_at(t, sl, n0) for t in (g, m, pt.exp_avg_scale, pt.exp_avg_sq, rinv, cinv, active,
                                                       corr)),
                           dtype=dtype, beta1=group.beta1,
                           beta2=tuple(_at(c, sl, n0) for c in beta2) if isinstance(beta2, tuple) else beta2,
                           add=add, floor=floor, key=key, offset=(sl.start or 0) * per_slice)
        sums += _unit_sums(u.square(), bank, per_block)
    if group.relative_step:  # pass 3 scales u by the unit's max(eps2, rms(p)); weight decay keeps lr
        corr = (corr * (st.p_sumsq / n_unit).sqrt_().clamp_(min=RELATIVE_STEP_EPS)).to(dtype)
    return Moments(_total(sums, bank), corr, rinv, cinv, active)


def _moments_chunk(g, m, scale, v, rinv, cinv, active, corr, *, dtype, beta1, beta2, add, floor, key,
                   offset) -> Tensor:
    """Momentum and full second moment of one chunk, in place; returns the chunk's u."""
    g = _compute(g, dtype)
    if v is not None:
        _ema64_(v, _square64(g).add_(add) if add else _square64(g), beta2)
    src = g
    if m is not None and m.dtype == dtype:
        _ema_(m, g, beta1, active)
        src = m
    elif m is not None:
        m32 = load_momentum(m, scale, dtype)
        new = ema(m32, g, beta1)
        store_momentum_(m, scale, new if active is None else torch.where(active, new, m32), key, offset)
        src = load_momentum(m, scale, dtype)
    return _direction(src, corr, rinv, cinv, v, floor)


def _direction(src: Tensor, c: Scalar, rinv: Optional[Tensor], cinv: Optional[Tensor], v: Optional[Tensor],
               floor: float) -> Tensor:
    """The update direction scaled by ``c``, from its source (momentum, else gradient): factored ``src * (rinv_i * c)
    * cinv_j``, full ``src * c / sqrt(max(v, floor))`` (pass 2: ``c`` the bias correction; pass 3: also the clip)."""
    if rinv is not None:
        return src * (rinv * c) * cinv
    return src * c / (v.clamp(min=floor) if floor else v).sqrt()


# ------------------------------------------------------------------------------------------------------------ pass 3
def apply_updates_(group: Group, moments: Sequence[Moments], *, skip: Optional[Tensor] = None) -> None:
    """Pass 3: ``p = p*(1 - lr*wd) - lr * u / max(1, rms(u))``, in the state dtype; bf16 written back unbiased.

    ``group.lr`` may be a 0-d (or 1-element) tensor on any device: it is used as a tensor (no host read). ``skip``
    (read on the host): when True, nothing is written.
    """
    if skip is not None and bool(skip):
        return
    lr = group.lr
    if isinstance(lr, Tensor):
        lr = lr.detach().reshape(()).to(torch.float64)  # 1 - lr*wd in float64, as for a Python float
    decay = 1.0 - lr * group.weight_decay if group.weight_decay else None
    floor = group.eps if group.eps_mode == "floor" else 0.0
    for pt, mo in zip(group.params, moments):
        _apply_updates(pt, mo, lr=lr, decay=decay, floor=floor, seed=group.seed)


def _apply_updates(pt: ParamTensors, mo: Moments, *, lr: Scalar, decay: Optional[Scalar], floor: float,
                   seed: int) -> None:
    p, bank = pt.param, pt.bank
    n_unit = unit_numel(pt.shape, bank)
    if n_unit == 0:
        return  # no elements: nothing to write
    dtype = mo.u_sumsq.dtype
    if isinstance(lr, Tensor):  # the values a Python float is cast to (a 0-d tensor would promote a 0-d parameter)
        lr = lr.to(dtype)
        decay = decay.to(dtype) if decay is not None else None
    cc = mo.corr * (mo.u_sumsq / n_unit).sqrt_().clamp_(min=1.0).reciprocal_()  # corr / max(1, rms(u))
    key = step_key(seed, pt) if p.dtype == torch.bfloat16 else 0
    n0, per_slice = _slices(p.shape)
    for sl in _chunks(p.shape):
        _apply_chunk(*(_at(t, sl, n0) for t in (p, pt.grad, pt.exp_avg, pt.exp_avg_scale, pt.exp_avg_sq, mo.rinv,
                                                 mo.cinv, mo.active, cc)),
                     dtype=dtype, lr=lr, decay=decay, floor=floor, key=key, offset=(sl.start or 0) * per_slice)


def _apply_chunk(p, g, m, scale, v, rinv, cinv, active, cc, *, dtype, lr, decay, floor, key, offset) -> None:
    src = load_momentum(m, scale, dtype) if m is not None else _compute(g, dtype)
    u = _direction(src, cc, rinv, cinv, v, floor)
    p32 = _compute(p, dtype)
    new = torch.sub(p32 * decay if decay is not None else p32, u.mul_(lr))
    if active is not None:
        new = torch.where(active, new, p32)
    if p.dtype == torch.bfloat16:
        new = stochastic_round_bf16(new, key, offset)
    p.copy_(new)


def step_transient_bytes(tensors: Sequence[Sequence[Any]], param_dtype: torch.dtype) -> int:
    """Peak bytes a step of ``[(shape, bank), ...]`` (or `skewadam.kernels.types.Planned` records, whose state
    changes nothing here) allocates beyond parameters, gradients and state: copies of the largest chunk
    (`chunk_slices`) in the compute dtype, 4 for fp32 parameters and 9 for bf16 ones (the rounding's fp32 weights and
    random bits), as measured on torch 2.13 CPU."""
    largest = max((chunk_slices(t.shape, t.bank) * math.prod(t.shape[1:]) if t.shape else 1
                   for t in planned(tensors)), default=0)
    return (9 if param_dtype == torch.bfloat16 else 4) * largest * state_dtype_for(param_dtype).itemsize


# ------------------------------------------------------------------------------------------------------ one process
def step_(groups: Sequence[Group], *, skip_nonfinite: bool) -> Tensor:
    """Passes 1-3 of every group, for one process (nothing to reduce between the passes).

    Returns:
        A 0-d bool tensor on the parameters' device: True if the step was skipped (``skip_nonfinite`` and some
        gradient holds inf or NaN; nothing was written). Reading the finite check is this step's one host sync.
    """
    stats = [grad_stats(group) for group in groups]
    device = groups[0].params[0].param.device
    if skip_nonfinite:
        skipped = ~all_finite([s.sumsq for st in stats for s in st]).to(device)
        if bool(skipped):  # the one host sync of an eager step
            return skipped
    else:
        skipped = torch.zeros((), dtype=torch.bool, device=device)
    moments = [update_moments_(group, st) for group, st in zip(groups, stats)]
    for group, mo in zip(groups, moments):
        apply_updates_(group, mo)
    return skipped
