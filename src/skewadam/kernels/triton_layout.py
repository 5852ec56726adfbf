"""How the Triton kernels (`skewadam.kernels.triton`) cut a bucket of tensors into work, and what their step allocates
(`step_transient_bytes`): functions of shapes only, importable without triton (the planner counts Triton's step
temporaries on machines without it; the registry's ``temporaries`` names this module).

The work is cut into *items* (one program each, ~`TARGET` elements): a strip of whole rows of one matrix
(``"factored"``), a strip of rows of one unit (``"rows"``: a full second moment with int8 momentum, whose blocks lie
along rows), or a run of one unit's elements (``"flat"``). Items, matrices and units are listed in three int64 tables
that depend only on the shapes (cached); their columns are the kernels' ``ITEM_*``, ``MAT_*`` and ``UNIT_*``. A
strip holds >= `MIN_ROWS` rows, so the float64 column partials of a matrix cut into several strips are at most
numel / 1024 elements. Each strip also has C weighted column sums in the statistics dtype (``wcol``: a factored
unit without momentum takes its clip from them, `skewadam.kernels.traffic`), numel / min(R, 1024) elements a
matrix, in the workspace of a bucket without momentum (`weighted`).

Shape legend: ``E`` units (bank slices, dim 0; 1 for a single tensor), ``B`` matrices ``[R, C]`` of a factored tensor
(all dims but the last two), ``R`` rows, ``C`` columns, ``M`` rows of the ``[M, C]`` view of a tensor.

Example:
    >>> step_transient_bytes([((8, 64, 32), True), ((64,), False)], torch.bfloat16)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Hashable, Optional, Sequence

import torch
from torch import Tensor

from ..state import num_blocks, state_dtype_for
from .types import MomFmt, planned

__all__ = ["Layout", "layout", "upload", "bucket_key", "weighted", "workspace_numel", "step_transient_bytes", "TARGET",
           "MIN_ROWS", "TABLE_WIDTH"]

TARGET = 1 << 18  # elements per work item
MIN_ROWS = 1024  # rows per strip of a matrix cut into several: bounds its float64 column partials at numel / 1024
TABLE_WIDTH = 31  # int64 columns of a row of the kernels' tensor table (its header row has as many)


class Layout:
    """How one bucket's tensors are cut into work, and where their statistics sit in a workspace: a function of the
    tensors' local shapes, bank flags and kind only (cached by `layout`).

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
        self.stats: list[tuple[int, ...]] = []  # per tensor: offsets of sumsq, rc, rvs, row, col (float64 elements,
        # then every unit's max |g|: `stats64_numel`)
        self.moments: list[tuple[int, ...]] = []  # per tensor: offsets of u_sumsq, corr, scale (all tensors'
        # first), rinv, cinv
        self.act: list[int] = []  # per tensor: offset in the bank-activity buffer (-1: not a bank)
        self.n_units = self.colp = self.wcol = self.stats_numel = self.moments_numel = self.act_numel = 0
        self.max_c = self.max_rc = 1  # the longest row, the most rows or columns of a matrix
        self.aligned8 = True  # every item starts, and (rows layouts) every row holds, a multiple of 8 elements
        self._tables: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self._rc_sizes: list[tuple[int, int]] = []
        for t, (shape, bank) in enumerate(specs):
            self._add(t, shape, bank)
        start = 3 * self.n_units  # u_sumsq, corr, scale of every tensor, then rinv and cinv (`step_` keeps the first)
        for t, (rows, cols) in enumerate(self._rc_sizes):
            u, E = 3 * self.unit0[t], self.dims[t][0]
            self.moments.append((u, u + E, u + 2 * E) + ((start, start + rows) if self.kind == "factored" else ()))
            start += rows + cols
        self.moments_numel = start
        self.stats64_numel = self.stats_numel + self.n_units
        self.scratch64_numel = self.colp + 2 * len(self.items)  # column partials, per item sum g^2 and max |g|
        self.psq_numel = len(self.items) + self.n_units  # float64: per item then per unit, a relative step's sum p^2

    def _add(self, t: int, shape: tuple[int, ...], bank: bool) -> None:
        numel = math.prod(shape)
        E = shape[0] if bank else 1
        C = shape[-1] if shape else 1
        M = math.prod(shape[:-1]) if shape else 1
        factored = self.kind == "factored"
        R = shape[-2] if factored else 0
        B = math.prod(shape[:-2]) if factored else 0
        self.dims.append((E, R, C, num_blocks(C)))
        self.unit0.append(self.n_units)
        per_unit = [[len(self.items), 0] for _ in range(E)]  # first item, items

        def item(u, b, row0, nrows, e0, n, colp=-1):
            if per_unit[u][1] == 0:
                per_unit[u][0] = len(self.items)
            per_unit[u][1] += 1
            self.items.append([t, u, b, row0, nrows, e0, n, colp, self.wcol if factored else -1])
            self.wcol += C if factored else 0
            self.aligned8 = self.aligned8 and e0 % 8 == 0 and (self.kind == "flat" or C % 8 == 0)

        if factored:
            mpu = B // E if E else 0
            rows = max(1, min(R, max(MIN_ROWS, -(-TARGET // max(C, 1)))))
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
            rows = max(1, min(rpu, -(-TARGET // max(C, 1))))
            for u in range(E if C else 0):
                for r in range(0, rpu, rows):
                    nr = min(rows, rpu - r)
                    item(u, -1, u * rpu + r, nr, (u * rpu + r) * C, nr * C)
            mats = [(0, 0)] * E
        else:
            nu = numel // E if E else 0
            for u in range(E):
                for e in range(0, nu, TARGET):
                    item(u, -1, 0, 0, u * nu + e, min(TARGET, nu - e))
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
            self._tables[device] = tuple(upload(rows, device) for rows in (self.items, self.mats, self.units))
        return self._tables[device]


def _offsets(start: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in sizes:
        out.append(start)
        start += n
    return tuple(out)


@functools.lru_cache(maxsize=256)
def layout(specs: tuple[tuple[tuple[int, ...], bool], ...], kind: str) -> Layout:
    """The `Layout` of tensors ``specs`` (``((shape, bank), ...)``) of one kind, cached."""
    return Layout(specs, kind)


def upload(rows: list[list[int]], device: torch.device) -> Tensor:
    """An int64 table on ``device``; on CUDA copied from pinned memory, asynchronously (no sync)."""
    host = torch.tensor(rows or [[0]], dtype=torch.int64, pin_memory=device.type == "cuda")
    return torch.empty(host.shape, dtype=torch.int64, device=device).copy_(host, non_blocking=True)


def bucket_key(param_dtype: torch.dtype, factored: bool,
               momentum: Optional[torch.dtype]) -> tuple[str, MomFmt, torch.dtype]:
    """The kind, first-moment format and its storage dtype of a parameter in the Triton kernels' buckets (one
    bucket a group per parameter dtype and key): ``factored`` whether it keeps a factored second moment,
    ``momentum`` its first moment's dtype (None: none). The rule the step buckets by and the planner counts with."""
    T = state_dtype_for(param_dtype)
    if momentum is None:
        mom, md = MomFmt.NONE, T
    elif momentum == torch.int8:
        mom, md = MomFmt.INT8, torch.int8
    elif momentum == torch.bfloat16 and T == torch.float32:
        mom, md = MomFmt.BF16, torch.bfloat16
    else:
        mom, md = MomFmt.PLAIN, T
    return "factored" if factored else "rows" if mom == MomFmt.INT8 else "flat", mom, md


def weighted(kind: str, mom: MomFmt, T: torch.dtype) -> bool:
    """Whether a bucket's units take ``sum u^2`` from weighted column sums (`triton.weighted`), not from a pass 2
    over the gradient: factored, without momentum, fp32 statistics (fp32 and bf16 weights)."""
    return kind == "factored" and mom == MomFmt.NONE and T == torch.float32


def workspace_numel(L: Layout, wsums: bool) -> tuple[int, int]:
    """Elements one bucket's `step_` uses: float64 (the statistics, every unit's max |g|, pass 1's partials) and of
    T (u_sumsq, corr, scale, rinv and cinv, the items' partial sums of u^2, with ``wsums`` (a `weighted` bucket) the
    weighted column sums, the clips)."""
    return L.stats64_numel + L.scratch64_numel, L.moments_numel + len(L.items) + L.wcol * wsums + L.n_units


def step_transient_bytes(tensors: Sequence[Sequence[Any]], param_dtype: torch.dtype) -> int:
    """Bytes `step_` allocates for parameters ``[(shape, bank), ...]`` or ``[(shape, bank, state, group), ...]``
    (`skewadam.kernels.types.Planned`; one group where none is given): per bucket (a group's tensors of one kind and
    first-moment format) the workspaces (float64 statistics, the moments in the state dtype), the activity of bank
    slices, the rounding keys and the tensor table; the finite flag and a relative step's float64 sums of ``p^2``.
    Exact where every state is given; where not an upper bound: such a tensor is counted factored wherever its slices
    have >= 2 dims and without momentum (with weighted column sums), its group's table a header row for every bucket
    a group may have, every group as a relative step's. Not counted: contiguous copies of non-contiguous parameters,
    gradients or state, and the item, matrix and unit tables (cached across steps; 64 bytes per ~2^18 elements).

    Example:
        >>> step_transient_bytes([((8, 64, 32), True)], torch.float32)
    """
    T = state_dtype_for(param_dtype)
    itemsize = T.itemsize
    buckets: dict[tuple[Hashable, str, MomFmt], list[tuple[tuple[int, ...], bool]]] = {}
    unknown = set()  # groups with a tensor of unknown state
    for t in planned(tensors):
        kind, mom, _ = bucket_key(param_dtype, t.factored, t.momentum)
        buckets.setdefault((t.group, kind, mom), []).append((t.shape, t.bank))
        if t.state is None:
            unknown.add(t.group)
    total = 4 + 1 if tensors else 0  # the finite flag and the skipped result
    for group in unknown:  # a header row for each bucket it may have: 4 factored, 3 flat, rows
        total += (2 * len(MomFmt) - sum(key[0] == group for key in buckets)) * TABLE_WIDTH * 8
    for (_, kind, mom), specs in buckets.items():
        L = layout(tuple(specs), kind)
        ws64, ws = workspace_numel(L, weighted(kind, mom, T))
        total += (ws64 + L.psq_numel) * 8 + ws * itemsize + L.act_numel + 2 * len(specs) * 8
        total += (len(specs) + 1) * TABLE_WIDTH * 8  # a row per tensor and the bucket's header row
    return total
