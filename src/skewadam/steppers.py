r"""Param groups that `SkewAdam` steps outside its fused kernels: the orthogonal tier, and Adafactor's options.

- ``update="orthogonal"``: Muon's orthogonalised Nesterov momentum (`skewadam.kernels.orthogonal`), for the hidden
  matrices (`skewadam.classify.hidden_matrices`) and, optionally, expert banks per expert. A sharded matrix's update
  is gathered and its shard taken back through the reducer (`skewadam.distributed.DTensorReducer.gather`).
- ``relative_step=True`` and ``beta2_decay`` (Adafactor's, arXiv 1804.04235, as `torch.optim.Adafactor` has them):
  the group's update is scaled by ``max(1e-3, rms(p))`` per unit (a tensor, or a bank slice: torch's Adafactor takes
  the whole tensor) while weight decay keeps ``lr``; the second moment decays with ``beta2_t = 1 - t^beta2_decay``
  and is not bias-corrected (the momentum still is). These are the kernels' own passes (`skewadam.kernels.eager` or
  `skewadam.kernels.cpu`) run once per unit with that unit's ``lr``/``beta2``, and the second-moment correction the
  kernel applied, ``sqrt(1 - beta2_t^t)``, divided out of its pass-2 results before pass 3 (a unit's RMS clip sees
  the corrected update). One process and DDP only: DTensor parameters are refused.

The optimizer calls `validate_group`, `check_param`, and per step `grads_finite` (over every group, so that these
groups and the kernels' groups skip a non-finite step together) and `step_`. Nothing here is a kernel: the math is in
`skewadam.kernels`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .kernels import orthogonal
from .kernels.rounding import mix32, rounding_key
from .kernels.types import unit_dims
from .state import StateTensor, UPDATES, state_flags

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

__all__ = ["GROUP_DEFAULTS", "RELATIVE_STEP_EPS", "validate_group", "check_param", "outside_kernels", "grads_finite",
           "Context", "step_"]

#: The keys this module adds to SkewAdam's param groups, with their defaults.
GROUP_DEFAULTS = {"update": "adam", "relative_step": False, "beta2_decay": None}
RELATIVE_STEP_EPS = 1e-3  # Adafactor's eps2: the floor of the parameter RMS that scales a relative step


def validate_group(group: dict, where: str) -> None:
    """Raise ValueError for an invalid ``update``, ``relative_step`` or ``beta2_decay``, or a combination that
    means nothing (Adafactor's options on an orthogonal group)."""
    if group["update"] not in UPDATES:
        raise ValueError(f"Invalid update in {where}: {group['update']!r} (expected one of {UPDATES})")
    if not isinstance(group["relative_step"], bool):
        raise ValueError(f"Invalid relative_step in {where}: {group['relative_step']!r} (expected True or False)")
    decay = group["beta2_decay"]
    if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float))
                              or not math.isfinite(decay) or decay > 0):
        raise ValueError(f"Invalid beta2_decay in {where}: {decay!r} (expected None or a float <= 0, e.g. "
                         f"Adafactor's -0.8)")
    if group["update"] == "orthogonal" and (group["relative_step"] or decay is not None):
        raise ValueError(f"{where}: relative_step and beta2_decay shape the Adam-style update; an update='orthogonal' "
                         f"group has no second moment to decay and a fixed RMS: set them in update='adam' groups only")


def check_param(p: Tensor, group: dict, where: str) -> None:
    """An orthogonal group's parameter must be a matrix, or a bank of matrices ``[E, A, B]``."""
    if group["update"] != "orthogonal":
        return
    bank = state_flags(group).is_bank(p.ndim)
    if p.ndim - bank != 2:
        raise ValueError(f"{where}: update='orthogonal' orthogonalises matrices, got a parameter of shape "
                         f"{tuple(p.shape)} (bank={bank}); give it matrices [A, B] or banks [E, A, B] (bank=True), and "
                         f"norms, biases and embeddings an update='adam' group")


def outside_kernels(group: dict) -> bool:
    """Whether ``group`` is stepped here rather than by the fused kernels."""
    return group["update"] == "orthogonal" or group["relative_step"] or group["beta2_decay"] is not None


def grads_finite(grads: Sequence[Tensor], reducer: Any) -> bool:
    """Whether every gradient is finite (on every rank, through the reducer's ``all_finite``)."""
    local = bool(torch.stack([g.isfinite().all() for g in grads]).all()) if grads else True
    agree = getattr(reducer, "all_finite", None)
    return agree(local) if agree is not None else local


class Context(NamedTuple):
    """What the optimizer lends a step: its state, how it allocates state and numbers rounding streams, the
    reducer (None on one process) and the kernel module of the fused groups."""

    state: dict
    alloc: Callable[[Tensor, str, StateTensor, bool], Tensor]  # (param, key, spec, bank) -> a zeroed state tensor
    stream: Callable[[Tensor, int, str], int]  # (param, index in the optimizer, momentum dtype) -> rounding stream
    reducer: Any
    impl: Any


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def _state(p: Tensor, group: dict, ctx: Context) -> tuple[dict, bool]:
    flags = state_flags(group)
    bank = flags.is_bank(p.ndim)
    state = ctx.state[p]
    if not state:
        for key, st in flags.spec(p.shape, p.dtype).items():
            state[key] = ctx.alloc(p, key, st, bank)
    return state, bank


def step_(groups: Sequence[tuple[dict, int]], ctx: Context) -> bool:
    """Step ``[(group, index of its first parameter in the optimizer), ...]`` (gradients checked finite); True."""
    for group, first_id in groups:
        if group["update"] == "orthogonal":
            _orthogonal_(group, first_id, ctx)
        else:
            _per_unit_(group, first_id, ctx)
    return True


def _orthogonal_(group: dict, first_id: int, ctx: Context) -> None:
    params, grads, moms, scales, actives, keys, banks = [], [], [], [], [], [], []
    for i, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        state, bank = _state(p, group, ctx)
        g = _local(p.grad)
        step = _local(state["step"])
        active = None
        if bank:  # an expert that received no token: its slice (and its count) stays as it is
            sumsq = g.square().sum(unit_dims(g.ndim, True), keepdim=True)
            if ctx.reducer is not None:
                ctx.reducer([(p, [(sumsq, unit_dims(g.ndim, True))])])
            active = sumsq > 0
            step.add_(active.view(-1))
        else:
            step.add_(1)
        m = _local(state.get("exp_avg"))
        rounds = p.dtype == torch.bfloat16 or (m is not None and m.dtype == torch.bfloat16)
        stream = ctx.stream(p, first_id + i, group["momentum_dtype"])
        params.append(p)
        grads.append(g)
        moms.append(m)
        scales.append(_local(state.get("exp_avg_scale")))
        actives.append(active)
        keys.append(rounding_key(group["seed"], stream, int(step.sum().item())) if rounds else 0)
        banks.append(bank)
    if not params:
        return
    reducer = ctx.reducer
    gathered = [reducer is not None and reducer.gathers(p, b) for p, b in zip(params, banks)]
    orthogonal.step_(
        [_local(p) for p in params], grads, moms, scales, actives, banks=banks, shapes=[p.shape for p in params],
        beta=group["betas"][0], lr=float(group["lr"]), weight_decay=group["weight_decay"], keys=keys,
        gather=lambda u, i: reducer.gather(u, params[i], banks[i]), gathered=gathered,
        local_part=lambda o, i: reducer.local_part(o, params[i], banks[i]))


class _Unit(NamedTuple):
    """One unit's tensors (a tensor, or a bank slice ``[e:e+1]`` kept a bank of one) as the kernel passes take them."""

    param: Tensor
    grad: Tensor
    step: Tensor
    exp_avg: Optional[Tensor]
    exp_avg_scale: Optional[Tensor]
    exp_avg_sq: Optional[Tensor]
    row_var: Optional[Tensor]
    col_var: Optional[Tensor]
    bank: bool
    stream: int


def _units(p: Tensor, state: dict, bank: bool, stream: int) -> list[_Unit]:
    keys = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var")
    if not bank:
        return [_Unit(p, p.grad, state["step"], *(state.get(k) for k in keys), False, stream)]
    return [_Unit(p[e:e + 1], p.grad[e:e + 1], state["step"][e:e + 1],
                  *(state[k][e:e + 1] if k in state else None for k in keys), True,
                  stream if e == 0 else stream ^ mix32(e))  # each slice its own rounding bits, as in one call
            for e in range(p.shape[0])]


def _per_unit_(group: dict, first_id: int, ctx: Context) -> None:
    impl, decay = ctx.impl, group["beta2_decay"]
    beta1, beta2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    for i, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        if isinstance(p, DTensor):
            raise ValueError("relative_step and beta2_decay run one unit at a time and do not support DTensor "
                             "(FSDP2) parameters yet; use them on one process or under DDP, or leave them off")
        state, bank = _state(p, group, ctx)
        for u in _units(p, state, bank, ctx.stream(p, first_id + i, group["momentum_dtype"])):
            t = float(u.step.sum()) + 1.0  # this step's count (an idle bank slice is masked out by the kernel)
            b2 = 1.0 - t ** decay if decay is not None else beta2
            scale = 1.0
            if group["relative_step"]:
                p32 = u.param.to(torch.float64)
                scale = max(RELATIVE_STEP_EPS, math.sqrt(float(p32.square().mean())))
            dtype = (u.row_var if u.row_var is not None else u.exp_avg_sq).dtype
            kw = dict(banks=[u.bank], shapes=[u.param.shape])
            stats = impl.grad_stats([u.grad], [u.row_var], banks=[u.bank], dtypes=[dtype])
            [mo] = impl.update_moments_(
                [u.grad], [u.step], [u.exp_avg], [u.exp_avg_sq], [u.row_var], [u.col_var], stats, **kw,
                beta1=beta1, beta2=b2, eps=group["eps"], eps_mode=group["eps_mode"],
                exp_avg_scales=[u.exp_avg_scale], seed=group["seed"], param_ids=[u.stream])
            if decay is not None and float(u.step.sum()) == t:  # the schedule's average is unbiased: undo the
                c2 = math.sqrt(1.0 - b2 ** t)  # kernel's sqrt(1 - b2^t) (an idle slice is left as it is anyway)
                mo = mo._replace(corr=mo.corr / c2, u_sumsq=mo.u_sumsq / (c2 * c2))
            impl.apply_updates_(
                [u.param], [u.grad], [u.step], [u.exp_avg], [u.exp_avg_sq], [mo], **kw, lr=lr * scale,
                weight_decay=wd / scale, eps=group["eps"], eps_mode=group["eps_mode"], seed=group["seed"],
                param_ids=[u.stream], exp_avg_scales=[u.exp_avg_scale])
