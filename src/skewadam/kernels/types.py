"""The records every update kernel takes: one `Group` per param group, one `ParamTensors` per parameter in it.

Every kernel module (`eager`, `cpu`, `triton`) implements the same functions over these records:

- ``grad_stats(group) -> list[GradStats]``: pass 1, sums of ``g^2`` (reads state, writes nothing).
- ``update_moments_(group, stats, *, skip=None) -> list[Moments]``: pass 2, step counts, moments, per-unit ``sum u^2``.
- ``apply_updates_(group, moments, *, skip=None) -> None``: pass 3, clip, decay, write the parameters.
- ``step_(groups, *, skip_nonfinite) -> Tensor``: passes 1-3 of one process (nothing to reduce between passes), in one
  call; returns a 0-d bool tensor on the parameters' device, True if the step was skipped for a non-finite gradient.
- ``step_transient_bytes(tensors, param_dtype) -> int``: the peak bytes a step of ``[(shape, bank), ...]`` or
  ``[(shape, bank, state, group), ...]`` (`Planned`) allocates beyond parameters, gradients and state (what
  `skewadam.bench.planner` counts as step temporaries), at most; given the states, the Triton kernel's count is
  exact.

Between the passes the optimizer hands the statistics to a reducer (the distributed seam, `skewadam.distributed`), so a
kernel never calls torch.distributed. ``skip`` is an optional 0-d bool tensor on the parameters' device: when True the
pass writes nothing and returns zeros (a kernel that can read it on the device does so without a host sync; one that
reads it on the host says so in the registry, `skewadam.kernels.Backend.skip_on_host`, and `skewadam.functional` then
reads it once per step itself).

A kernel checks what it indexes with: `check` raises a ValueError naming the parameter when a gradient or a state
tensor does not fit its parameter (a compiled kernel checks the same sizes itself before touching memory).

Shape legend (here and in the kernels): ``E`` bank slices (dim 0 of a stacked expert tensor), ``...`` batch dims, ``R``
rows (dim -2), ``C`` columns (dim -1). A *unit* gets its own RMS clip and step count: a bank slice, or the whole tensor.
A unit with no elements (in the global shape) is left untouched, its step count included.

Operation order, what every kernel computes (T: the statistics dtype, fp32 for bf16 parameters; "bitwise": the same
IEEE operations, each rounded on its own, no fused multiply-add; sums are added in each kernel's own order, so what
depends on them agrees to rounding):

- Pass 1, float64: ``sq = double(g) * double(g)`` (exact for fp32 and bf16 values); ``sumsq`` per unit, ``row``/
  ``col`` per row/column of each matrix, ``rc_sumsq`` per matrix: sums of ``sq``; ``row_var_sum``: of
  ``double(row_var)``; ``p_sumsq`` (relative step): of ``double(p)^2`` per unit; ``absmax`` (fp64 parameters): max
  ``|g|`` per unit. A kernel may add a block's squares in float instead where every resulting sum lies in
  [2^-90, FLT_MAX] (no square overflowed, what underflowed is below the sum's float rounding), and in double where
  one does not (the C++ kernel does: as fast as float sums); the sums then agree to float rounding. Active units:
  `active_units`, for a bank slice; every unit with elements otherwise.
- Pass 2, per active unit with new step count t, in double: ``beta2_t = 1 - pow(t, beta2_decay)`` (libm pow: bitwise)
  or ``beta2``; ``b = beta2_t``, ``w = 1.0 - beta2_t``; ``corr = sqrt(1 - pow(beta2, t))`` (1 with beta2_decay)
  ``/ (1 - pow(beta1, t))`` (without momentum: no division); ``add``/``floor``: eps in its eps mode, else 0.

  * full second moment (bitwise): ``v = T(double(v) * b + (double(x) * double(x) + add) * w)``, x the gradient in T.
  * factored: ``row_var = T(double(row_var) * b + (row / C + add) * w)``, ``col_var`` the same with ``col / R`` (C, R:
    global sizes); ``rmean = (row_var_sum * b + (rc_sumsq / C + R * add) * w) / R`` (an idle bank slice's:
    ``row_var_sum / R``); floor mode: ``rinv = T(1 / sqrt(max(double(row_var) / max(rmean, 1e-15), eps)))``, in T
    ``cinv = 1 / sqrt(max(col_var, T(eps)))``; add mode: ``rinv = T(1 / sqrt(double(row_var) / max(rmean,
    DBL_MIN)))``, ``cinv = 1 / sqrt(col_var)``.
  * momentum, in T (bitwise): ``m = m * T(beta1) + x * T(1 - beta1)``, stored in its format (`skewadam.kernels.quant`).
  * in T: ``u = src * (rinv * T(corr)) * cinv`` or ``src * T(corr) / sqrt(max(v, T(floor)))`` (src: the stored
    momentum, else x); ``u_sumsq``: per unit, the sum of ``u * u``. ``Moments.corr = corr``, times
    ``max(RELATIVE_STEP_EPS, sqrt(p_sumsq / n))`` with a relative step, in double (a bank's rounded to T).
- Pass 3, in T: ``p = p * T(1 - lr * wd) - lr * u'``, u' as u with ``Moments.corr / max(1, sqrt(u_sumsq / n))`` for
  its scale (bf16: rounded stochastically).
"""

from __future__ import annotations

import enum
import math
from typing import Any, Hashable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ..state import num_blocks, state_dtype_for

__all__ = ["MomFmt", "ParamTensors", "Group", "GradStats", "Moments", "NS_STEPS", "ROW_MEAN_FLOOR", "RELATIVE_STEP_EPS",
           "EPS_MODES", "PARAM_DTYPES", "unit_dims", "active_units", "unit_numel", "stat_dims", "check_param_dtype",
           "check", "check_lr", "check_group", "all_finite", "Planned", "planned"]


class MomFmt(enum.IntEnum):
    """How a parameter's first moment is stored: one numbering for every compiled kernel (the C++ kernel's
    ``MomFmt`` is built from these, as ``-D`` flags; the Triton kernels' ``MOM`` takes these values)."""

    PLAIN = 0  # the statistics dtype
    BF16 = 1  # bf16, stochastically rounded
    INT8 = 2  # int8 codes with an fp32 scale per block (`skewadam.kernels.quant`)
    NONE = 3  # no momentum


class Planned(NamedTuple):
    """One parameter a step is planned for (`step_transient_bytes`): its shape as the kernels see it (a flattened
    bank stacked), whether it is a bank, its `skewadam.state.state_spec` (names to `StateTensor`) where known (a
    backend counts an unknown state as the one that allocates the most), and a key of its param group (a kernel may
    allocate per group; parameters of one key step in one group)."""

    shape: tuple[int, ...]
    bank: bool
    state: Optional[Mapping[str, Any]] = None
    group: Hashable = None

    @property
    def factored(self) -> bool:
        """Whether it keeps a factored second moment (unknown state: wherever its units are matrices)."""
        return len(self.shape) - self.bank >= 2 and (self.state is None or "row_var" in self.state)

    @property
    def momentum(self) -> Optional[torch.dtype]:
        """Its first moment's storage dtype, None without one (unknown state: None, the most a backend allocates
        for, its clip's weighted column sums)."""
        m = self.state.get("exp_avg") if self.state is not None else None
        return None if m is None else m.dtype


def planned(tensors: Sequence[Sequence[Any]]) -> list[Planned]:
    """``[(shape, bank), ...]``, ``[(shape, bank, state), ...]`` or ``[(shape, bank, state, group), ...]`` as
    `Planned` records."""
    return [Planned(tuple(int(s) for s in t[0]), bool(t[1]), *t[2:]) for t in tensors]


#: Newton-Schulz iterations of the orthogonal update unless a group sets ``ns_steps`` (Muon's 5).
NS_STEPS = 5
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


#: The optional state of a record, in `ParamTensors`' order after ``step``: the state dict keys beside ``step``.
STATE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var")


class Group(NamedTuple):
    """One param group: its parameters and hyperparameters. ``lr`` may be a 0-d (or 1-element) tensor.

    Adafactor's options (arXiv 1804.04235, as `torch.optim.Adafactor` has them), per unit: ``relative_step`` scales
    the update term (not the weight decay) by ``max(RELATIVE_STEP_EPS, rms(p))`` of the parameter before the step;
    ``beta2_decay`` (``d <= 0``) replaces ``beta2`` by ``1 - t**d`` at the unit's new step count ``t`` and drops the
    second moment's bias correction. The ``ns_*`` fields shape the orthogonal update's Newton-Schulz
    (`skewadam.kernels.orthogonal`; the Adam-style kernels ignore them): its iterations, dtype and interval (every how many of a matrix's steps it is orthogonalised).
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
    ns_steps: int = NS_STEPS
    ns_dtype: Optional[str] = None
    ns_interval: int = 1


class GradStats(NamedTuple):
    """Pass-1 sums of g^2, float64 tensors whatever the parameter's dtype (the square of an fp32 or bf16 value is
    exact there, and no sum of finite ones overflows). Each field pairs with the dims it sums over (`stat_dims`) for
    the distributed seam: a shard's partial sums add up to the tensor's."""

    sumsq: Tensor  # per unit, keepdim: [E, 1, ...] or [1, ...]
    rc_sumsq: Optional[Tensor]  # factored: per batch matrix [..., 1, 1]
    row: Optional[Tensor]  # factored: sum_j g^2, [..., R, 1]
    col: Optional[Tensor]  # factored: sum_i g^2, [..., 1, C]
    row_var_sum: Optional[Tensor]  # factored: sum_i row_var before this step, [..., 1, 1]
    p_sumsq: Optional[Tensor] = None  # relative step: per unit, keepdim, sum of p^2 before this step
    absmax: Optional[Tensor] = None  # fp64 parameters: per unit, keepdim, max |g| (their squares can underflow)


class Moments(NamedTuple):
    """Pass-2 results that pass 3 needs (all small: no parameter-sized tensor)."""

    u_sumsq: Tensor  # per unit, keepdim
    corr: Union[Tensor, float]  # per unit, pass 3's scale of u: the bias correction (relative step: times rms(p))
    rinv: Optional[Tensor]  # factored: [..., R, 1]
    cinv: Optional[Tensor]  # factored: [..., 1, C]
    active: Optional[Tensor]  # bank: which slices had a non-zero gradient, [E, 1, ...]


def unit_dims(ndim: int, bank: bool) -> tuple[int, ...]:
    """The dims one unit (clip, step count) spans: all of them, or all but the bank dim."""
    return tuple(range(1 if bank else 0, ndim))


def active_units(stats: GradStats) -> Tensor:
    """Per unit, whether its gradient has a nonzero element and no NaN (a bank slice without one is an expert that
    received no token: idle, left untouched; one with a NaN, stepped without the non-finite check, is left untouched
    too): ``sumsq > 0``, or for fp64 parameters, whose squares can underflow, ``absmax > 0`` and ``sumsq`` not NaN
    (whether a max takes a NaN differs between kernels; a sum always does). All stay decidable after the reducer sums
    them across shards (a sum of per-shard maxima is > 0 iff one is)."""
    if stats.absmax is None:
        return stats.sumsq > 0
    return (stats.absmax > 0) & ~stats.sumsq.isnan()


def unit_numel(shape: Sequence[int], bank: bool) -> int:
    """Elements of one unit of a parameter of (global) ``shape``: what its means divide by."""
    return math.prod(shape[1:] if bank else shape)


def stat_dims(stats: GradStats, ndim: int, bank: bool) -> list[tuple[Tensor, tuple[int, ...]]]:
    """Pair each present statistic with the parameter dims it sums over (what a shard must all-reduce)."""
    unit = unit_dims(ndim, bank)
    dims = [unit, (ndim - 2, ndim - 1), (ndim - 1,), (ndim - 2,), (ndim - 2,), unit, unit]
    return [(t, d) for t, d in zip(stats, dims) if t is not None]


_STATE_FIX = ("the optimizer state does not belong to this parameter (a state dict saved for another model, or p.data "
              "replaced by a tensor of another shape or dtype): load the state saved for this model, or reset this "
              "parameter's state with `del optimizer.state[p]`")

#: ``eps_mode`` values: eps added to ``g^2`` (Adafactor's), or the second moment floored at eps (the paper's).
EPS_MODES = ("add", "floor")
#: Parameter dtypes the kernels step (fp16 is refused: keep fp32 parameters under autocast, or use bf16).
PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _shape(t) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def check_param_dtype(dtype: torch.dtype, where: str) -> None:
    """Raise TypeError naming ``where`` unless ``dtype`` is one the kernels step (`PARAM_DTYPES`), with the fix."""
    if dtype in PARAM_DTYPES:
        return
    if dtype.is_complex:
        raise TypeError(f"{where}: complex parameters are not supported; optimize torch.view_as_real(p) instead")
    if dtype == torch.float16:
        raise TypeError(f"{where}: fp16 parameters are not supported; keep fp32 parameters with torch.autocast, or use "
                        f"bf16")
    raise TypeError(f"{where}: parameters must be floating point, got {dtype}")


def check(pt: ParamTensors, *, second_moment: bool = True) -> None:
    """Raise, naming the parameter, if it is not one the kernels step or its gradient or a state tensor does not fit
    it: a ValueError for a size (every kernel indexes with these), a dtype or a device, a TypeError for a parameter
    dtype no kernel takes. Every backend applies these rules; a compiled kernel checks the same sizes itself.
    ``second_moment=False``: the record keeps none (the orthogonal update's).

    Example:
        >>> check(ParamTensors(p, torch.zeros(3), ...))  # p of shape (8, 6): ValueError "gradient of shape (3,) ..."
    """
    name = pt.name or "parameter"
    param = pt.param
    check_param_dtype(param.dtype, name)
    p = tuple(param.shape)
    if not isinstance(pt.grad, Tensor) or tuple(pt.grad.shape) != p:
        raise ValueError(f"{name}: gradient of shape {_shape(pt.grad)} for a parameter of shape {p}; give p.grad the "
                         f"parameter's shape (p.grad.data was replaced by a tensor of another shape?)")
    if pt.grad.dtype != param.dtype:
        raise ValueError(f"{name}: gradient dtype {pt.grad.dtype} differs from the parameter's {param.dtype}; "
                         f"give p.grad the parameter's dtype")
    if pt.grad.device != param.device:
        raise ValueError(f"{name}: gradient on {pt.grad.device}, the parameter on {param.device}; give p.grad the "
                         f"parameter's device")
    if len(pt.shape) != len(p) or any(n > m for n, m in zip(p, pt.shape)):
        raise ValueError(f"{name}: local shape {p} does not fit the global shape {tuple(pt.shape)}")
    if pt.bank and not p:
        raise ValueError(f"{name}: a bank needs a leading expert dim, got a 0-d parameter")
    stats = state_dtype_for(param.dtype)
    want: dict[str, tuple[Optional[tuple[int, ...]], tuple[torch.dtype, ...]]] = {
        "step": (p[:1] if pt.bank else None, (torch.float32,)), "exp_avg": (None, ()), "exp_avg_scale": (None, ()),
        "exp_avg_sq": (None, ()), "row_var": (None, ()), "col_var": (None, ())}
    if pt.exp_avg is not None:
        want["exp_avg"] = (p, (stats, torch.int8) + ((torch.bfloat16,) if stats == torch.float32 else ()))
        if pt.exp_avg.dtype == torch.int8:
            if not p:
                raise ValueError(f"{name}: int8 momentum of a 0-d parameter; {_STATE_FIX}")
            want["exp_avg_scale"] = (p[:-1] + (num_blocks(p[-1]),), (torch.float32,))
    if second_moment and (pt.row_var is not None or pt.col_var is not None):
        if len(p) < 2 + pt.bank:
            raise ValueError(f"{name}: factored state for a parameter of shape {p} (bank={pt.bank}), which has no "
                             f"matrix per unit; {_STATE_FIX}")
        want["row_var"], want["col_var"] = (p[:-1] + (1,), (stats,)), (p[:-2] + (1, p[-1]), (stats,))
    elif second_moment:
        want["exp_avg_sq"] = (p, (stats,))
    for key, (shape, dtypes) in want.items():
        t = getattr(pt, key)
        if key == "step":
            if not isinstance(t, Tensor) or (tuple(t.shape) != shape if shape is not None else t.numel() != 1):
                raise ValueError(f"{name}: step of shape {_shape(t)}, expected a tensor of shape "
                                 f"{shape if shape is not None else '()'}; {_STATE_FIX}")
        elif (t is None) != (shape is None) or (t is not None and tuple(t.shape) != shape):
            got = "none" if t is None else f"shape {tuple(t.shape)}"
            need = "none" if shape is None else f"shape {shape}"
            raise ValueError(f"{name}: state {key!r} has {got}, a parameter of shape {p} needs {need}; {_STATE_FIX}")
        if t is None:
            continue
        if t.dtype not in dtypes:
            raise ValueError(f"{name}: state {key!r} is {t.dtype}, a {param.dtype} parameter's needs "
                             f"{' or '.join(map(str, dtypes))}; {_STATE_FIX}")
        if t.device != param.device and not (key == "step" and shape is None and t.device.type == "cpu"):
            raise ValueError(f"{name}: state {key!r} is on {t.device}, the parameter on {param.device}; move the "
                             f"optimizer state with the parameter (load the state dict after moving the model)")


def check_lr(lr: Union[float, Tensor]) -> None:
    """A tensor lr holds one value (torch's optimizers' rule and message); reading its shape is no host sync."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_group(group: Group, where: str = "the param group") -> None:
    """Raise ValueError naming ``where`` if a hyperparameter of ``group`` is not one the passes take: the rules (and
    messages) of the optimizer's constructor, applied to the record at every step (a value may have been changed
    since). A tensor lr's value is not read here (that would be a host sync); its size and dtype are checked.

    Example:
        >>> check_group(group._replace(beta1=1.0), "param group 0")  # ValueError: Invalid beta parameter at index 0 ...
    """
    lr, b1, b2, eps, wd, decay = group.lr, group.beta1, group.beta2, group.eps, group.weight_decay, group.beta2_decay
    if (type(lr) is float and 0.0 <= lr < math.inf and type(b1) is float and 0.0 <= b1 < 1.0 and type(b2) is float
            and 0.0 <= b2 < 1.0 and type(eps) is float and 0.0 < eps < math.inf and type(wd) is float
            and 0.0 <= wd < math.inf and group.eps_mode in EPS_MODES and type(group.seed) is int
            and type(group.relative_step) is bool and (decay is None or (type(decay) is float and decay <= 0.0))):
        return  # (the common case in one expression: this runs for every group at every step)
    if isinstance(lr, Tensor):
        check_lr(lr)
        if not lr.is_floating_point():
            raise ValueError(f"Invalid learning rate in {where}: a tensor lr must be floating point, got {lr.dtype}")
    elif not _real(lr) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"Invalid learning rate in {where}: {lr!r} (expected a finite float >= 0)")
    for j, b in enumerate((group.beta1, group.beta2)):
        if not _real(b) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {j} in {where}: {b!r} (expected a float in [0, 1))")
    if group.eps_mode not in EPS_MODES:
        raise ValueError(f"Invalid eps_mode in {where}: {group.eps_mode!r} (expected 'floor' or 'add')")
    if not _real(group.eps) or not group.eps > 0 or not math.isfinite(group.eps):
        raise ValueError(f"Invalid epsilon value in {where}: {group.eps!r} (expected a float > 0)")
    wd = group.weight_decay
    if not _real(wd) or not math.isfinite(wd) or wd < 0:
        raise ValueError(f"Invalid weight_decay value in {where}: {wd!r} (expected a float >= 0)")
    if not isinstance(group.seed, int) or isinstance(group.seed, bool):
        raise ValueError(f"Invalid seed in {where}: {group.seed!r} (expected an int)")
    if not isinstance(group.relative_step, bool):
        raise ValueError(f"Invalid relative_step in {where}: {group.relative_step!r} (expected True or False)")
    decay = group.beta2_decay
    if decay is not None and (not _real(decay) or not math.isfinite(decay) or decay > 0):
        raise ValueError(f"Invalid beta2_decay in {where}: {decay!r} (expected None or a float <= 0, e.g. "
                         f"Adafactor's -0.8)")


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
