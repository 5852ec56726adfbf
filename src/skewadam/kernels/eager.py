"""SkewAdam's update as pure functions over tensor lists, written with eager torch ops (the portable path).

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

Means use the *global* shapes passed in, so a shard divides its partial sums by the full row or column count.
The row-statistic mean is carried as a sum updated by linearity, ``sum_i row_i' = b2*sum_i row_i + (1-b2)*sum_i
rowmean_i``, so a row-sharded tensor needs no extra collective (exact up to summation order).

Temporaries: each pass allocates a few fp32 tensors the size of what it processes. A bank larger than
`CHUNK_NUMEL` elements is processed a group of whole slices at a time (its units are slices, so nothing crosses a
chunk and the results are bitwise those of the whole tensor), which bounds the transient memory of a huge expert
bank by a few times `CHUNK_NUMEL` instead of a few times the bank.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .quant import load_momentum, store_momentum_
from .rounding import rounding_key, stochastic_round_bf16

__all__ = ["GradStats", "Moments", "grad_stats", "update_moments_", "apply_updates_", "unit_dims", "stat_dims",
           "chunk_slices"]

_ROW_MEAN_FLOOR = 1e-15  # the paper's guard on mean(row) in eps_mode="floor"
CHUNK_NUMEL = 1 << 24  # 64 MiB of fp32: banks above this are processed in groups of slices


class GradStats(NamedTuple):
    """Pass-1 sums of g^2. Each field pairs with the dims it sums over (`stat_dims`) for the distributed seam."""

    sumsq: Tensor  # per unit, keepdim: [E, 1, ...] or [1, ...]
    rc_sumsq: Optional[Tensor]  # factored: per batch matrix [..., 1, 1]
    row: Optional[Tensor]  # factored: sum_j g^2, [..., R, 1]
    col: Optional[Tensor]  # factored: sum_i g^2, [..., 1, C]
    row_var_sum: Optional[Tensor]  # factored: sum_i row_var before this step, [..., 1, 1]


class Moments(NamedTuple):
    """Pass-2 results that pass 3 needs (all small: no parameter-sized tensor)."""

    u_sumsq: Tensor  # per unit, keepdim
    corr: Tensor | float  # bias correction per unit
    rinv: Optional[Tensor]  # factored: [..., R, 1]
    cinv: Optional[Tensor]  # factored: [..., 1, C]
    active: Optional[Tensor]  # bank: which slices had a non-zero gradient, [E, 1, ...]


def unit_dims(ndim: int, bank: bool) -> tuple[int, ...]:
    """The dims one unit (clip, step count) spans: all of them, or all but the bank dim."""
    return tuple(range(1 if bank else 0, ndim))


def stat_dims(stats: GradStats, ndim: int, bank: bool) -> list[tuple[Tensor, tuple[int, ...]]]:
    """Pair each present statistic with the parameter dims it sums over (what a shard must all-reduce)."""
    dims = [unit_dims(ndim, bank), (ndim - 2, ndim - 1), (ndim - 1,), (ndim - 2,), (ndim - 2,)]
    return [(t, d) for t, d in zip(stats, dims) if t is not None]


def _compute(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def chunk_slices(shape: Sequence[int], bank: bool) -> int:
    """Slices of dim 0 the kernels process at a time: whole slices up to `CHUNK_NUMEL` elements for a large bank
    (at least one), all of dim 0 otherwise."""
    n0 = shape[0] if shape else 1
    numel = math.prod(shape)
    if not bank or numel <= CHUNK_NUMEL or n0 <= 1:
        return n0
    return max(1, CHUNK_NUMEL // max(1, numel // n0))


def _chunks(t: Tensor, bank: bool) -> list[slice]:
    """Slice ranges along dim 0 that split a large bank into groups of whole slices (one range otherwise)."""
    n0 = t.shape[0] if t.ndim else 1
    per = chunk_slices(t.shape, bank)
    if per >= n0:
        return [slice(None)]
    return [slice(a, min(a + per, n0)) for a in range(0, n0, per)]


def _at(t, sl: slice):
    """``t[sl]`` for tensors (None and floats pass through)."""
    return t[sl] if isinstance(t, Tensor) and sl != slice(None) else t


def _cat(parts: list):
    """Join per-chunk results along dim 0 (None and floats pass through)."""
    if len(parts) == 1 or not isinstance(parts[0], Tensor):
        return parts[0]
    return torch.cat(parts)


def grad_stats(
    grads: Sequence[Tensor],
    row_vars: Sequence[Optional[Tensor]],
    *,
    banks: Sequence[bool],
    dtypes: Sequence[torch.dtype],
) -> list[GradStats]:
    """Pass 1: sums of g^2 (nothing is written)."""
    out = []
    for g, row_var, bank, dtype in zip(grads, row_vars, banks, dtypes):
        parts = [_stats_one(_at(g, sl), _at(row_var, sl), bank, dtype) for sl in _chunks(g, bank)]
        out.append(GradStats(*(_cat(list(f)) for f in zip(*parts))))
    return out


def _stats_one(g: Tensor, row_var: Optional[Tensor], bank: bool, dtype: torch.dtype) -> GradStats:
    sq = _compute(g, dtype).square()
    dims = unit_dims(g.ndim, bank)
    if row_var is None:
        return GradStats(sq.sum(dims, keepdim=True) if dims else sq, None, None, None, None)
    row = sq.sum(-1, keepdim=True)
    col = sq.sum(-2, keepdim=True)
    rc = row.sum(-2, keepdim=True)
    return GradStats(rc.sum(dims, keepdim=True), rc, row, col, row_var.sum(-2, keepdim=True))


def _bias_correction(step: Tensor, bank: bool, beta1: Optional[float], beta2: float, dtype) -> Tensor | float:
    """sqrt(1 - beta2^t) / (1 - beta1^t), in float64 (1 - beta in float32 is off by ~1e-5 relative)."""
    if not bank:
        t = step.item()
        c = math.sqrt(1.0 - beta2**t)
        return c / (1.0 - beta1**t) if beta1 is not None else c
    t = step.double().clamp(min=1.0)  # idle slices (t = 0) are masked out; clamp keeps them finite
    c = (1.0 - torch.pow(beta2, t)).sqrt()
    if beta1 is not None:
        c = c / (1.0 - torch.pow(beta1, t))
    return c.to(dtype)


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
    """Pass 2: update step counts, second moments and momentum in place; return what the clip needs.

    floor: ``denom = sqrt(max(row/max(mean(row),1e-15), eps)) * sqrt(max(col, eps))`` or ``sqrt(max(v, eps))``.
    add:   ``g^2 + eps`` is accumulated instead and ``denom = sqrt(row/mean(row)) * sqrt(col)`` or ``sqrt(v)``.

    A compact first moment (int8 with ``exp_avg_scales``, or bf16: `skewadam.kernels.quant`) is decoded, updated in
    the compute dtype and stored back here; ``u`` is then formed from the stored value, as pass 3 will read it.
    ``seed`` and ``param_ids`` key the stochastic rounding of a bf16 first moment.
    """
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps, eps_mode=eps_mode)
    out = []
    for i, (g, step, st, bank, shape) in enumerate(zip(grads, steps, stats, banks, shapes)):
        m, v, row_var, col_var = exp_avgs[i], exp_avg_sqs[i], row_vars[i], col_vars[i]
        scale = exp_avg_scales[i] if exp_avg_scales is not None else None
        dtype = (row_var if row_var is not None else v).dtype
        active = None
        if bank:
            active = st.sumsq > 0  # an expert that saw no token has an all-zero slice: leave it untouched
            step.add_(active.view(-1))
        else:
            step.add_(1)
        corr = _bias_correction(step, bank, beta1 if m is not None else None, beta2, dtype)
        if bank:
            corr = corr.view(-1, *([1] * (g.ndim - 1)))
        key = 0  # only a bf16 first moment draws rounding bits: read the step (a host sync on GPU) only then
        if m is not None and m.dtype == torch.bfloat16 and dtype != torch.bfloat16:
            key = rounding_key(seed, param_ids[i] if param_ids is not None else i, int(step.sum().item()))
        unit = math.prod(g.shape[1:]) if bank else 0
        parts = [
            _moments_one(_at(g, sl), _at(m, sl), _at(scale, sl), _at(v, sl), _at(row_var, sl), _at(col_var, sl),
                         GradStats(*(_at(t, sl) for t in st)), _at(active, sl), _at(corr, sl), bank, shape, dtype,
                         key=key, offset=(sl.start or 0) * unit, **hyper)
            for sl in _chunks(g, bank)
        ]
        out.append(Moments(*(_cat(list(f)) for f in zip(*parts))))
    return out


def _moments_one(g, m, scale, v, row_var, col_var, st, active, corr, bank, shape, dtype, *,
                 beta1, beta2, eps, eps_mode, key, offset) -> Moments:
    add = eps if eps_mode == "add" else 0.0
    floor = eps if eps_mode == "floor" else 0.0
    g = _compute(g, dtype)

    def ema_(state: Tensor, target: Tensor) -> None:
        if active is None:
            state.lerp_(target, 1.0 - beta2)
        else:
            state.copy_(torch.where(active, state.lerp(target, 1.0 - beta2), state))

    rinv = cinv = None
    if row_var is not None:
        R, C = shape[-2], shape[-1]
        ema_(row_var, st.row / C + add)
        ema_(col_var, st.col / R + add)
        rsum = st.row_var_sum * beta2 + (st.rc_sumsq / C + R * add) * (1.0 - beta2)
        if active is not None:
            rsum = torch.where(active, rsum, st.row_var_sum)
        rmean = rsum / R
        if eps_mode == "floor":
            rinv = (row_var / rmean.clamp(min=_ROW_MEAN_FLOOR)).clamp_(min=floor).rsqrt_()
            cinv = col_var.clamp(min=floor).rsqrt()
        else:
            rinv = (row_var / rmean.clamp(min=torch.finfo(dtype).tiny)).rsqrt_()
            cinv = col_var.rsqrt()
    else:
        ema_(v, g.square() + add if add else g.square())
    src = g
    if m is not None and m.dtype == dtype:
        if active is None:
            m.lerp_(g, 1.0 - beta1)
        else:
            m.copy_(torch.where(active, m.lerp(g, 1.0 - beta1), m))
        src = m
    elif m is not None:
        m32 = load_momentum(m, scale, dtype)
        new = m32.lerp(g, 1.0 - beta1)
        if active is not None:
            new = torch.where(active, new, m32)
        store_momentum_(m, scale, new, key, offset)
        src = load_momentum(m, scale, dtype)
    if row_var is not None:
        u = src * (rinv * corr) * cinv
    else:
        u = src * corr / (v.clamp(min=floor) if floor else v).sqrt()
    dims = unit_dims(g.ndim, bank)
    return Moments(u.square().sum(dims, keepdim=True) if dims else u.square(), corr, rinv, cinv, active)


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
    """Pass 3: ``p = p*(1 - lr*wd) - lr * u / max(1, rms(u))``, in the state dtype; bf16 written back unbiased."""
    floor = eps if eps_mode == "floor" else 0.0
    decay = 1.0 - lr * weight_decay
    for i, (p, g, step, mo, bank, shape) in enumerate(zip(params, grads, steps, moments, banks, shapes)):
        m, v = exp_avgs[i], exp_avg_sqs[i]
        scale = exp_avg_scales[i] if exp_avg_scales is not None else None
        n = math.prod(shape[1:] if bank else shape)
        clip = (mo.u_sumsq / n).sqrt_().clamp_(min=1.0).reciprocal_()
        key = rounding_key(seed, param_ids[i], int(step.sum().item())) if p.dtype == torch.bfloat16 else 0
        unit = math.prod(p.shape[1:]) if bank else 0
        for sl in _chunks(p, bank):
            _apply_one(_at(p, sl), _at(g, sl), _at(m, sl), _at(scale, sl), _at(v, sl), Moments(*(_at(t, sl) for t in mo)),
                       _at(clip, sl), lr=lr, decay=decay, floor=floor, key=key, offset=(sl.start or 0) * unit)


def _apply_one(p, g, m, scale, v, mo: Moments, clip, *, lr, decay, floor, key, offset) -> None:
    dtype = mo.u_sumsq.dtype
    src = load_momentum(m, scale, dtype) if m is not None else _compute(g, dtype)
    if mo.rinv is not None:
        u = src * (mo.rinv * (mo.corr * clip)) * mo.cinv
    else:
        u = src * (mo.corr * clip) / (v.clamp(min=floor) if floor else v).sqrt()
    p32 = _compute(p, dtype)
    new = torch.add(p32 * decay if decay != 1.0 else p32, u, alpha=-lr)
    if mo.active is not None:
        new = torch.where(mo.active, new, p32)
    if p.dtype == torch.bfloat16:
        new = stochastic_round_bf16(new, key, offset)
    p.copy_(new)


def step_transient_bytes(tensors: Sequence[tuple[Sequence[int], bool]], param_dtype: torch.dtype) -> int:
    """Peak bytes a step of ``[(shape, bank), ...]`` allocates beyond parameters, gradients and state: copies of the
    largest chunk (`chunk_slices`) in the compute dtype, 4 for fp32 parameters and 9 for bf16 ones (the rounding's
    fp32 weights and random bits), as measured on torch 2.13 CPU."""
    largest = max((chunk_slices(s, bank) * math.prod(s[1:]) if len(s) else 1 for s, bank in tensors), default=0)
    compute = torch.float32 if param_dtype == torch.bfloat16 else param_dtype
    return (9 if param_dtype == torch.bfloat16 else 4) * largest * compute.itemsize
