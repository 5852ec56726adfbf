"""The Triton kernel's protocol functions (`skewadam.kernels.types`): the launches of each pass over a group's
buckets, and the entry points `grad_stats`, `update_moments_`, `apply_updates_`, `step_` and
`stochastic_round_bf16`. Every launch goes through `launch`."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_layout import Layout, workspace_numel
from ..types import GradStats, Group, Moments, MomFmt, ParamTensors
from .passes import (count_steps, direction_tiles, factored_moments, prepare_apply, round_kernel, stats_matrices,
                     stats_tiles, unit_sums)
from .device import TAB_AMAX, TAB_PSQ, TAB_SUMSQ, TAB_USQ
from .tables import TL, Bucket, Table, Work, addrs, check_device, on, prepare, tensor_table, written
from .weighted import weighted_tiles, weighted_usq

_MAT_BLOCK = 1024  # rows or columns per program of the per-matrix kernels
_SMALL_BLOCK = 256  # units per loop of the per-tensor and per-unit kernels
_M32 = 0xFFFFFFFF


def launch(kernel, grid: tuple[int, ...], *args, warps: int = 4, **meta) -> None:
    """Launch ``kernel`` on ``grid`` (nothing for an empty grid), compiled without FMA (eager's roundings)."""
    if all(grid):
        kernel[grid](*args, num_warps=warps, enable_fp_fusion=False, **meta)


def _pass1(b: Bucket, group: Group, table: Table, scratch: Tensor, pbuf: Optional[Tensor], flag: Optional[Tensor],
           wsums: Optional[Tensor]) -> None:
    """Pass 1 of a bucket, float64: ``scratch`` (`Layout.scratch64_numel`) holds the column and item partials;
    ``pbuf`` (a relative step's), the item partials then the per-unit sums of ``p^2``; ``wsums`` (the one-process
    step), of T, gets a `Bucket.weighted`'s weighted column sums."""
    L, tab = b.layout, table.tensor
    items, mats, units = L.tables(tab.device)
    amax = b.T == torch.float64  # (fp64 squares can underflow: the activity is max |g|)
    launch(stats_tiles, (len(L.items),), tab, items, scratch, L.colp, L.colp + len(L.items),
           pbuf if pbuf is not None else tab, wsums if wsums is not None else tab, PD=TL[b.pd], T=TL[b.T],
           FACTORED=b.factored, RELATIVE=pbuf is not None, AMAX=amax, WEIGHTED=b.weighted,
           WSUMS=wsums is not None and b.weighted,
           DECAY=group.beta2_decay is not None,
           ALIGNED=table.aligned, warps=8, **b.tiles())
    launch(stats_matrices, (len(L.mats), triton.cdiv(L.max_rc, _MAT_BLOCK)), tab, mats, scratch, T=TL[b.T],
           BLK=_MAT_BLOCK, SB=8)
    sums = dict(T=tl.float64, HAS_FLAG=False, TMAX=0.0, ONLY_NAN=False, BLOCK=_SMALL_BLOCK)
    launch(unit_sums, (L.n_units,), tab, units, scratch, L.colp, flag if flag is not None else tab, DST=TAB_SUMSQ,
           FROM_MATS=b.factored, MAX=False, **{**sums, "HAS_FLAG": flag is not None,
                                                "TMAX": torch.finfo(torch.float64).max})
    if amax:
        launch(unit_sums, (L.n_units,), tab, units, scratch, L.colp + len(L.items), tab, DST=TAB_AMAX,
               FROM_MATS=False, MAX=True, **sums)
    if pbuf is not None:
        launch(unit_sums, (L.n_units,), tab, units, pbuf, 0, tab, DST=TAB_PSQ, FROM_MATS=False, MAX=False, **sums)


def _directions(b: Bucket, group: Group, table: Table, scratch: Tensor, clips: Tensor, keys: Tensor,
                skip: Optional[Tensor], *, apply: bool) -> None:
    """`direction_tiles` over the bucket's items: pass 2 (``scratch``, of T, gets the items' partial ``sum u^2``;
    a `Bucket.weighted`'s only of the units `weighted_usq` left NaN) or, ``apply``, pass 3 (with the units'
    ``clips``)."""
    L, tab = b.layout, table.tensor
    lr = group.lr
    lr_ptr = apply and isinstance(lr, Tensor) and lr.device == tab.device
    launch(direction_tiles, (len(L.items),), tab, L.tables(tab.device)[0], scratch, 0, clips, keys,
           skip if skip is not None else tab, len(b.index), PD=TL[b.pd], T=TL[b.T], MD=TL[b.md],
           FACTORED=b.factored, FLAT=L.kind == "flat", MOM=b.mom.value, EPS_ADD=group.eps_mode == "add",
           HAS_SKIP=skip is not None, DECAY=group.beta2_decay is not None, APPLY=apply, LR_PTR=lr_ptr,
           LRD=TL[lr.dtype] if lr_ptr else tl.float32, ALIGNED=table.aligned, warps=8,
           WEIGHTED=b.weighted and not apply, **b.tiles())


def _pass2(b: Bucket, group: Group, table: Table, scratch: Tensor, keys: Tensor, skip: Optional[Tensor],
           wbuf: Optional[Tensor]) -> None:
    """Pass 2 of a bucket; a `Bucket.weighted`'s weighted column sums are at ``wbuf`` (the one-process step's pass
    1 left them there) or, None, computed here from the gradient (`weighted_tiles`)."""
    L, T, tab = b.layout, TL[b.T], table.tensor
    items, mats, units = L.tables(tab.device)
    skip_arg = skip if skip is not None else tab
    nt = len(b.index)
    decay = group.beta2_decay is not None
    launch(count_steps, (nt,), tab, keys, skip_arg, nt, T=T, HAS_MOM=b.mom != MomFmt.NONE, HAS_SKIP=skip is not None,
           RELATIVE=bool(group.relative_step), DECAY=decay, UB=_SMALL_BLOCK)
    if b.factored:
        launch(factored_moments, (len(L.mats), triton.cdiv(L.max_rc, _MAT_BLOCK)), tab, mats, skip_arg, T=T,
               EPS_ADD=group.eps_mode == "add", HAS_SKIP=skip is not None, DECAY=decay, BLK=_MAT_BLOCK)
    if b.weighted:
        if wbuf is None:
            wbuf = torch.zeros(L.wcol, dtype=b.T, device=tab.device)  # (an idle or skipped unit: 0)
            tiles = b.tiles()
            launch(weighted_tiles, (len(L.items),), tab, items, wbuf, skip_arg, PD=TL[b.pd], T=T,
                   HAS_SKIP=skip is not None, ALIGNED=table.aligned, warps=8, RB=tiles["RB"], BC=tiles["BC"])
        launch(weighted_usq, (L.n_units,), tab, units, items, wbuf, T=T, EPS_ADD=group.eps_mode == "add",
               DECAY=decay, BLK=_SMALL_BLOCK)
    _directions(b, group, table, scratch, tab, keys, skip, apply=False)
    launch(unit_sums, (L.n_units,), tab, units, scratch, 0, tab, DST=TAB_USQ, T=T, FROM_MATS=False, MAX=False,
           HAS_FLAG=False, TMAX=0.0, BLOCK=_SMALL_BLOCK, ONLY_NAN=b.weighted)


def _pass3(b: Bucket, group: Group, table: Table, clips: Tensor, keys: Tensor, skip: Optional[Tensor]) -> None:
    launch(prepare_apply, (len(b.index),), table.tensor, clips, keys, T=TL[b.T], UB=_SMALL_BLOCK)
    _directions(b, group, table, table.tensor, clips, keys, skip, apply=True)


# ================================================================================================ the protocol
def _keepdim(shape: Sequence[int], bank: bool) -> tuple[int, ...]:
    """The per-unit keepdim shape: [E, 1, ...] for a bank, [1, ...] otherwise (() for a 0-d tensor)."""
    return tuple(shape[0] if (bank and d == 0) else 1 for d in range(len(shape)))


def _stat_shapes(pt: ParamTensors, factored: bool) -> list[tuple[int, ...]]:
    """Shapes of sumsq, rc, rvs, row, col (`GradStats`); p_sumsq, u_sumsq, corr and scale are the 1st, rinv and cinv
    the 4th and 5th."""
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
    the state is written. Returns one `GradStats` per parameter (views of one buffer per bucket).

    Example:
        >>> stats = grad_stats(group)  # a skewadam.kernels.types.Group of CUDA tensors
    """
    work = prepare(group, write=False)
    with on(work.device):
        return _grad_stats(work)


def _grad_stats(work: Work) -> list[GradStats]:
    group = work.group
    out: list[Optional[GradStats]] = [None] * len(work.grads)
    for b in work.buckets:
        L = b.layout
        stats = torch.zeros(L.stats64_numel, dtype=torch.float64, device=work.device)
        scratch = torch.empty(L.scratch64_numel, dtype=torch.float64, device=work.device)
        pbuf = _pbuf(work, L)
        tab = tensor_table(b, work, [_stat_addrs(stats, pbuf, L, j) for j in range(len(b.index))],
                           [[0] * 6] * len(b.index))
        _pass1(b, group, tab, scratch, pbuf, None, None)
        for j, i in enumerate(b.index):
            shapes = _stat_shapes(group.params[i], b.factored)
            v = [_view(stats, o, s) for o, s in zip(L.stats[j], shapes)]
            v += [None] * (5 - len(v))
            psq = _view(pbuf, len(L.items) + L.unit0[j], shapes[0]) if pbuf is not None else None
            amax = _view(stats, L.stats_numel + L.unit0[j], shapes[0]) if b.T == torch.float64 else None
            out[i] = GradStats(sumsq=v[0], rc_sumsq=v[1], row_var_sum=v[2], row=v[3], col=v[4], p_sumsq=psq,
                               absmax=amax)
    return out


def _pbuf(work: Work, L: Layout) -> Optional[Tensor]:
    """A relative step's float64 sums of ``p^2`` of a bucket: per item, then per unit (None without one)."""
    return torch.empty(L.psq_numel, dtype=torch.float64, device=work.device) if work.group.relative_step else None


def _stat_addrs(stats: Tensor, pbuf: Optional[Tensor], L: Layout, j: int) -> list[int]:
    """Addresses of tensor j's statistics (sumsq, rc, rvs, row, col, psq, amax) in a bucket's float64 ``stats``
    (`Layout.stats64_numel`) and ``pbuf``; 0 where absent."""
    a = addrs(stats, L.stats[j])
    psq = addrs(pbuf, [len(L.items) + L.unit0[j]])[0] if pbuf is not None else 0
    return a + [0] * (5 - len(a)) + [psq] + addrs(stats, [L.stats_numel + L.unit0[j]])


def update_moments_(group: Group, stats: Sequence[GradStats], *, skip: Optional[Tensor] = None) -> list[Moments]:
    """Pass 2: step counts, second moments and momentum in place (nothing if ``skip`` holds True); returns what the
    clip needs, one `Moments` per parameter (``corr`` a tensor shaped like ``u_sumsq``).

    Example:
        >>> moments = update_moments_(group, grad_stats(group))
    """
    work = prepare(group, write=False)
    _check_skip(skip, work.device)
    if len(stats) != len(group.params):
        raise ValueError(f"got {len(stats)} GradStats for {len(group.params)} parameters")
    with on(work.device):
        out = _update_moments(work, stats, skip)
    written(work, state=True, params=False)
    return out


def _update_moments(work: Work, stats: Sequence[GradStats], skip: Optional[Tensor]) -> list[Moments]:
    group = work.group
    out: list[Optional[Moments]] = [None] * len(work.grads)
    names = ("sumsq", "rc_sumsq", "row_var_sum", "row", "col")
    f64 = torch.float64
    for b in work.buckets:
        L = b.layout
        moments = torch.empty(L.moments_numel, dtype=b.T, device=work.device)
        active = torch.empty(L.act_numel, dtype=torch.bool, device=work.device)
        scratch = torch.empty(len(L.items), dtype=b.T, device=work.device)
        keys = torch.empty(2 * len(b.index), dtype=torch.int64, device=work.device)
        stat_addrs = []
        for j, i in enumerate(b.index):
            st = stats[i]
            fields = (st.sumsq, st.rc_sumsq, st.row_var_sum, st.row, st.col)
            shapes = _stat_shapes(group.params[i], b.factored)
            a = [_checked(n, f, s, f64, work.device, i) for n, f, s in zip(names, fields, shapes)]
            a += [0] * (5 - len(shapes))
            a.append(_checked("p_sumsq", st.p_sumsq, shapes[0], f64, work.device, i) if group.relative_step else 0)
            a.append(_checked("absmax", st.absmax, shapes[0], f64, work.device, i) if b.T == f64 else 0)
            stat_addrs.append(a)
        tab = tensor_table(b, work, stat_addrs, [_moment_addrs(moments, active, L, j) for j in range(len(b.index))])
        _pass2(b, group, tab, scratch, keys, skip, None)
        for j, i in enumerate(b.index):
            pt = group.params[i]
            shapes = _stat_shapes(pt, b.factored)
            usq, _, scale, *rc = [_view(moments, o, s) for o, s in zip(L.moments[j], [shapes[0]] * 3 + shapes[3:])]
            act = _view(active, L.act[j], shapes[0]) if pt.bank else None
            out[i] = Moments(usq, scale, rc[0] if rc else None, rc[1] if rc else None, act)  # corr: pass 3's scale
    return out


def _moment_addrs(moments: Tensor, active: Tensor, L: Layout, j: int) -> list[int]:
    """Addresses of u_sumsq, corr, scale, rinv, cinv and active of tensor j of a bucket (0 where absent)."""
    a = addrs(moments, L.moments[j])
    return a + [0] * (5 - len(a)) + [addrs(active, [L.act[j]])[0] if L.act[j] >= 0 else 0]


def apply_updates_(group: Group, moments: Sequence[Moments], *, skip: Optional[Tensor] = None) -> None:
    """Pass 3: ``p = p*(1 - lr*wd) - lr * u / max(1, rms(u))`` per unit, bf16 rounded stochastically; idle bank
    slices and a skipped step (``skip`` True) write nothing.

    Example:
        >>> apply_updates_(group, update_moments_(group, grad_stats(group)))
    """
    work = prepare(group, write=True)
    _check_skip(skip, work.device)
    if len(moments) != len(group.params):
        raise ValueError(f"got {len(moments)} Moments for {len(group.params)} parameters")
    with on(work.device):
        _apply_updates(work, moments, skip)
    written(work, state=False, params=True)


def _apply_updates(work: Work, moments: Sequence[Moments], skip: Optional[Tensor]) -> None:
    group = work.group
    for b in work.buckets:
        L = b.layout
        clips = torch.empty(L.n_units, dtype=b.T, device=work.device)
        keys = torch.empty(len(b.index), dtype=torch.int64, device=work.device)
        per_tensor = []
        for j, i in enumerate(b.index):
            mo, pt = moments[i], group.params[i]
            shapes = _stat_shapes(pt, b.factored)
            a = [_checked("u_sumsq", mo.u_sumsq, shapes[0], b.T, work.device, i), 0,
                 _checked("corr", mo.corr, shapes[0], b.T, work.device, i)]  # (pass 3 reads the scale column)
            if b.factored:
                a += [_checked("rinv", mo.rinv, shapes[3], b.T, work.device, i),
                      _checked("cinv", mo.cinv, shapes[4], b.T, work.device, i)]
            else:
                a += [0, 0]
            a.append(_checked("active", mo.active, shapes[0], torch.bool, work.device, i) if pt.bank else 0)
            per_tensor.append(a)
        tab = tensor_table(b, work, [[0] * 7] * len(b.index), per_tensor)
        _pass3(b, group, tab, clips, keys, skip)


def step_(groups: Sequence[Group], *, skip_nonfinite: bool) -> Tensor:
    """Passes 1-3 of every group, for one process (nothing to reduce between passes), with no host sync.

    Returns:
        A 0-d bool tensor on the parameters' device: True if ``skip_nonfinite`` and some gradient holds inf or NaN,
        in which case nothing was written (weights, state and step counts are as before).

    Example:
        >>> skipped = step_([group], skip_nonfinite=True)  # read it when needed: no sync here
    """
    works = [prepare(g, write=True) for g in groups if len(g.params)]
    if not works:
        return torch.zeros((), dtype=torch.bool)
    device = works[0].device
    if any(w.device != device for w in works):
        raise ValueError("step_ takes groups on one device; call it once per device")
    with on(device):
        return _step(works, device, skip_nonfinite)


def _step(works: list[Work], device: torch.device, skip_nonfinite: bool) -> Tensor:
    flag = torch.zeros(1, dtype=torch.int32, device=device) if skip_nonfinite else None
    runs = []
    for work in works:
        for b in work.buckets:
            runs.append((work, b, *_workspace(work, b)))
    for work, b, tab, ws64, ws, pbuf, active, keys in runs:
        _pass1(b, work.group, tab, ws64[b.layout.stats64_numel:], pbuf, flag, _wsums(b, ws))
    for work, b, tab, ws64, ws, pbuf, active, keys in runs:
        _pass2(b, work.group, tab, ws[b.layout.moments_numel:], keys, flag, _wsums(b, ws))
    for work, b, tab, ws64, ws, pbuf, active, keys in runs:
        _pass3(b, work.group, tab, ws[ws.numel() - b.layout.n_units:], keys, flag)
    for work in works:
        written(work, state=True, params=True)
    return flag[0] != 0 if flag is not None else torch.zeros((), dtype=torch.bool, device=device)


def _wsums(b: Bucket, ws: Tensor) -> Optional[Tensor]:
    """A weighted bucket's column sums in `step_`'s workspace of T (`workspace_numel`: after the items' sums of
    u^2); None for another bucket."""
    start = b.layout.moments_numel + len(b.layout.items)
    return ws[start: start + b.layout.wcol] if b.weighted else None


def _workspace(work: Work, b: Bucket) -> tuple[Table, Tensor, Tensor, Optional[Tensor], Tensor, Tensor]:
    """One bucket's tensor table and the scratch of `step_` it points into, kept alive by the caller until the last
    launch: the float64 workspace (statistics zeroed, then pass 1's partials), the workspace of T (moments, the
    items' sums of u^2, the weighted column sums, the clips), a relative step's sums of p^2, the bank activity, the
    keys."""
    L = b.layout
    n64, n = workspace_numel(L, b.weighted)
    ws64 = torch.empty(n64, dtype=torch.float64, device=work.device)
    ws64[: L.stats_numel].zero_()
    ws = torch.empty(n, dtype=b.T, device=work.device)
    pbuf = _pbuf(work, L)
    active = torch.empty(L.act_numel, dtype=torch.bool, device=work.device)
    keys = torch.empty(2 * len(b.index), dtype=torch.int64, device=work.device)
    stats = [_stat_addrs(ws64, pbuf, L, j) for j in range(len(b.index))]
    moments = [_moment_addrs(ws, active, L, j) for j in range(len(b.index))]
    return tensor_table(b, work, stats, moments), ws64, ws, pbuf, active, keys


def stochastic_round_bf16(x: Tensor, key: int, offset: int = 0) -> Tensor:
    """The kernels' rounding of an fp32 tensor to bf16 (`skewadam.kernels.rounding.stochastic_round_bf16`'s bits).

    Example:
        >>> stochastic_round_bf16(torch.full((4,), 1.0 + 2**-10, device="cuda"), key=1)
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes a float32 tensor, got {x.dtype}")
    check_device(x.device)
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    with on(x.device):
        launch(round_kernel, (triton.cdiv(src.numel(), 1024),), src, out, src.numel(), offset, key & _M32,
               BLOCK=1024)
    return out
