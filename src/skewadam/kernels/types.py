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
pass writes nothing and returns zeros (a kernel that can read it on the device does so without a host sync; a module
that reads it on the host says so with ``SKIP_ON_HOST = True``, and the optimizer then reads it once per step itself).

A kernel checks what it indexes with: `check` raises a ValueError naming the parameter when a gradient or a state
tensor does not fit its parameter (a compiled kernel checks the same sizes itself before touching memory).

Shape legend (here and in the kernels): ``E`` bank slices (dim 0 of a stacked expert tensor), ``...`` batch dims, ``R``
rows (dim -2), ``C`` columns (dim -1). A *unit* gets its own RMS clip and step count: a bank slice, or the whole tensor.
A unit with no elements (in the global shape) is left untouched, its step count included.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ..state import num_blocks

__all__ = ["MomFmt", "ParamTensors", "Group", "GradStats", "Moments", "ROW_MEAN_FLOOR", "RELATIVE_STEP_EPS", "unit_dims",
           "unit_numel", "stat_dims", "check", "check_lr", "all_finite"]

class MomFmt(enum.IntEnum):
    """How a parameter's first moment is stored: one numbering for every compiled kernel (the C++ kernel's
    ``MomFmt`` and the Triton kernels' ``MOM`` take these values)."""

    PLAIN = 0  # the statistics dtype
    BF16 = 1  # bf16, stochastically rounded
    INT8 = 2  # int8 codes with an fp32 scale per block (`skewadam.kernels.quant`)
    NONE = 3  # no momentum


#: The paper's guard on ``mean_i(row_var)`` in ``eps_mode="floor"``.
ROW_MEAN_FLOOR = 1e-15
#: Adafactor's eps2: the floor of the parameter RMS that scales a relative step (``Group.relative_step``).
RELATIVE_STEP_EPS = 1e-3


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
    name: str = ""  # how errors name the parameter, e.g. "param_groups[0]['params'][3] ('tok_emb.weight')"


class Group(NamedTuple):
    """One param group: its parameters and hyperparameters. ``lr`` may be a 0-d (or 1-element) tensor.

    Adafactor's options (arXiv 1804.04235, as `torch.optim.Adafactor` has them), per unit: ``relative_step`` scales
    the update term (not the weight decay) by ``max(RELATIVE_STEP_EPS, rms(p))`` of the parameter before the step;
    ``beta2_decay`` (``d <= 0``) replaces ``beta2`` by ``1 - t**d`` at the unit's new step count ``t`` and drops the
    second moment's bias correction.
    """

    params: Sequence[ParamTensors]
    lr: Union[float, Tensor]
    beta1: float
    beta2: float
    eps: float
    eps_mode: str  # "add" (eps added to g^2) or "floor" (the second moment floored at eps)
    weight_decay: float
    seed: int
    relative_step: bool = False
    beta2_decay: Optional[float] = None


class GradStats(NamedTuple):
    """Pass-1 sums of g^2. Each field pairs with the dims it sums over (`stat_dims`) for the distributed seam."""

    sumsq: Tensor  # per unit, keepdim: [E, 1, ...] or [1, ...]
    rc_sumsq: Optional[Tensor]  # factored: per batch matrix [..., 1, 1]
    row: Optional[Tensor]  # factored: sum_j g^2, [..., R, 1]
    col: Optional[Tensor]  # factored: sum_i g^2, [..., 1, C]
    row_var_sum: Optional[Tensor]  # factored: sum_i row_var before this step, [..., 1, 1]
    p_sumsq: Optional[Tensor] = None  # relative step: per unit, keepdim, sum of p^2 before this step


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


def unit_numel(shape: Sequence[int], bank: bool) -> int:
    """Elements of one unit of a parameter of (global) ``shape``: what its means divide by."""
    return math.prod(shape[1:] if bank else shape)


def stat_dims(stats: GradStats, ndim: int, bank: bool) -> list[tuple[Tensor, tuple[int, ...]]]:
    """Pair each present statistic with the parameter dims it sums over (what a shard must all-reduce)."""
    dims = [unit_dims(ndim, bank), (ndim - 2, ndim - 1), (ndim - 1,), (ndim - 2,), (ndim - 2,), unit_dims(ndim, bank)]
    return [(t, d) for t, d in zip(stats, dims) if t is not None]


_STATE_FIX = ("the optimizer state does not belong to this parameter (a state dict saved for another model, or p.data "
              "replaced by a tensor of another shape): load the state saved for this model, or reset this "
              "parameter's state with `del optimizer.state[p]`")


def _shape(t) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def check(pt: ParamTensors) -> None:
    """Raise ValueError, naming the parameter, if its gradient or a state tensor does not have the shape the parameter
    needs, or a tensor is missing where its state flags need one (the sizes every kernel indexes with).

    Example:
        >>> check(ParamTensors(p, torch.zeros(3), ...))  # p of shape (8, 6): ValueError "gradient of shape (3,) ..."
    """
    name = pt.name or "parameter"
    p = tuple(pt.param.shape)
    if not isinstance(pt.grad, Tensor) or tuple(pt.grad.shape) != p:
        raise ValueError(f"{name}: gradient of shape {_shape(pt.grad)} for a parameter of shape {p}; give p.grad the "
                         f"parameter's shape (p.grad.data was replaced by a tensor of another shape?)")
    if pt.grad.dtype != pt.param.dtype:
        raise ValueError(f"{name}: gradient dtype {pt.grad.dtype} differs from the parameter's {pt.param.dtype}; "
                         f"give p.grad the parameter's dtype")
    if len(pt.shape) != len(p) or any(n > m for n, m in zip(p, pt.shape)):
        raise ValueError(f"{name}: local shape {p} does not fit the global shape {tuple(pt.shape)}")
    if pt.bank and not p:
        raise ValueError(f"{name}: a bank needs a leading expert dim, got a 0-d parameter")
    want: dict[str, Optional[tuple[int, ...]]] = {"step": p[:1] if pt.bank else None, "exp_avg": None,
                                                  "exp_avg_scale": None, "exp_avg_sq": None, "row_var": None,
                                                  "col_var": None}
    if pt.exp_avg is not None:
        want["exp_avg"] = p
        if pt.exp_avg.dtype == torch.int8:
            if not p:
                raise ValueError(f"{name}: int8 momentum of a 0-d parameter; {_STATE_FIX}")
            want["exp_avg_scale"] = p[:-1] + (num_blocks(p[-1]),)
    if pt.row_var is not None or pt.col_var is not None:
        if len(p) < 2 + pt.bank:
            raise ValueError(f"{name}: factored state for a parameter of shape {p} (bank={pt.bank}), which has no "
                             f"matrix per unit; {_STATE_FIX}")
        want["row_var"], want["col_var"] = p[:-1] + (1,), p[:-2] + (1, p[-1])
    else:
        want["exp_avg_sq"] = p
    for key, shape in want.items():
        t = getattr(pt, key)
        if key == "step":
            if not isinstance(t, Tensor) or (tuple(t.shape) != shape if shape is not None else t.numel() != 1):
                raise ValueError(f"{name}: step of shape {_shape(t)}, expected a tensor of shape "
                                 f"{shape if shape is not None else '()'}; {_STATE_FIX}")
        elif (t is None) != (shape is None) or (t is not None and tuple(t.shape) != shape):
            got = "none" if t is None else f"shape {tuple(t.shape)}"
            need = "none" if shape is None else f"shape {shape}"
            raise ValueError(f"{name}: state {key!r} has {got}, a parameter of shape {p} needs {need}; {_STATE_FIX}")


def check_lr(lr: Union[float, Tensor]) -> None:
    """A tensor lr holds one value (torch's optimizers' rule and message); reading its shape is no host sync."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")


def all_finite(sums: Sequence[Tensor]) -> Tensor:
    """Whether every sum is finite, as a 0-d bool tensor on the first one's device (no host sync)."""
    if not sums:
        return torch.ones((), dtype=torch.bool)
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in sums:
        by_device.setdefault(t.device, []).append(t.reshape(-1))
    flags = [torch.cat(ts).isfinite().all() for ts in by_device.values()]
    first = flags[0].device
    return torch.stack([f.to(first) for f in flags]).all() if len(flags) > 1 else flags[0]
