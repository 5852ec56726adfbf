"""The records every update kernel takes: one `Group` per param group, one `ParamTensors` per parameter in it.

Every kernel module (`eager`, `cpu`, `triton`) implements the same functions over these records:

- ``grad_stats(group) -> list[GradStats]``: pass 1, sums of ``g^2`` (reads state, writes nothing).
- ``update_moments_(group, stats, *, skip=None) -> list[Moments]``: pass 2, step counts, moments, per-unit ``sum u^2``.
- ``apply_updates_(group, moments, *, skip=None) -> None``: pass 3, clip, decay, write the parameters.
- ``step_(groups, *, skip_nonfinite) -> Tensor``: passes 1-3 of one process (nothing to reduce between passes), in one
  call; returns a 0-d bool tensor on the parameters' device, True if the step was skipped for a non-finite gradient.
- ``step_transient_bytes(tensors, param_dtype) -> int``: the peak bytes a step of ``[(shape, bank), ...]`` allocates
  beyond parameters, gradients and state (what `skewadam.planner` counts as step temporaries).

Between the passes the optimizer hands the statistics to a reducer (the distributed seam, `skewadam.distributed`), so a
kernel never calls torch.distributed. ``skip`` is an optional 0-d bool tensor on the parameters' device: when True the
pass writes nothing (a kernel that can read it on the device does so without a host sync).

Shape legend (here and in the kernels): ``E`` bank slices (dim 0 of a stacked expert tensor), ``...`` batch dims, ``R``
rows (dim -2), ``C`` columns (dim -1). A *unit* gets its own RMS clip and step count: a bank slice, or the whole tensor.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["ParamTensors", "Group", "GradStats", "Moments", "unit_dims", "stat_dims"]


class ParamTensors(NamedTuple):
    """One parameter's tensors, as the kernel updates them in place (local shards for DTensor parameters).

    Absent state is None: ``exp_avg`` without momentum, ``exp_avg_scale`` unless ``exp_avg`` is int8, ``exp_avg_sq``
    for factored tensors, ``row_var``/``col_var`` for unfactored ones (`skewadam.state.state_spec` decides).
    """

    param: Tensor
    grad: Tensor
    step: Tensor  # () on the host, or [E] beside the parameter for a bank
    exp_avg: Optional[Tensor]  # first moment: the statistics dtype, bf16, or int8 codes
    exp_avg_scale: Optional[Tensor]  # int8 first moment: one fp32 scale per block of the last dim
    exp_avg_sq: Optional[Tensor]  # full second moment
    row_var: Optional[Tensor]  # factored second moment [..., R, 1]
    col_var: Optional[Tensor]  # factored second moment [..., 1, C]
    shape: tuple[int, ...]  # the global shape (means divide partial sums of a shard by global sizes)
    bank: bool  # dim 0 holds separate experts (units)
    stream: int  # index of the stochastic-rounding stream (`skewadam.kernels.rounding.rounding_key`)


class Group(NamedTuple):
    """One param group: its parameters and hyperparameters. ``lr`` may be a 0-d (or 1-element) tensor."""

    params: Sequence[ParamTensors]
    lr: Union[float, Tensor]
    beta1: float
    beta2: float
    eps: float
    eps_mode: str  # "add" (eps added to g^2) or "floor" (the second moment floored at eps)
    weight_decay: float
    seed: int


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
    corr: Union[Tensor, float]  # bias correction per unit
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

