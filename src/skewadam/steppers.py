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

The optimizer checks these groups' keys (`skewadam.validation`), checks every gradient is finite (these groups and the
kernels' skip a non-finite step together) and calls `step_`. Nothing here is a kernel: the math is in
`skewadam.kernels`; this module builds their records (`skewadam.kernels.types.Group`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from .kernels import orthogonal
from .kernels.rounding import mix32
from .kernels.types import Group, ParamTensors, unit_dims

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

__all__ = ["RELATIVE_STEP_EPS", "outside_kernels", "grads_finite", "step_"]

RELATIVE_STEP_EPS = 1e-3  # Adafactor's eps2: the floor of the parameter RMS that scales a relative step


def outside_kernels(group: dict) -> bool:
    """Whether ``group`` is stepped here rather than by the fused kernels."""
    return group["update"] == "orthogonal" or group["relative_step"] or group["beta2_decay"] is not None


def grads_finite(grads: Sequence[Tensor], reducer: Any = None) -> Tensor:
    """Whether every gradient is finite, as a 0-d bool tensor (no host sync); on every rank when ``reducer`` can
    tell (`skewadam.distributed.DTensorReducer.all_finite`), so all ranks skip a step together."""
    finite = torch.stack([g.isfinite().all() for g in grads]).all() if grads else torch.ones((), dtype=torch.bool)
    agree = getattr(reducer, "all_finite", None)
    return agree(finite) if agree is not None else finite


def step_(work: Sequence[tuple[dict, list[Tensor], Group]], reducer: Any, impl: Any) -> None:
    """Step ``[(param group, its parameters with gradients, their kernel record), ...]`` (the optimizer's records:
    state allocated, gradients checked finite). ``reducer``: the optimizer's (None on one process); ``impl``: the
    fused groups' kernel module (Adafactor's options run its passes)."""
    for group, params, record in work:
        if group["update"] == "orthogonal":
            _orthogonal_(record, params, reducer)
            continue
        if any(isinstance(p, DTensor) for p in params):
            raise ValueError("relative_step and beta2_decay run one unit at a time and do not support DTensor (FSDP2) "
                             "parameters yet; use them on one process or under DDP, or leave them off")
        for pt in record.params:
            _per_unit_(group, record, pt, impl)


def _orthogonal_(record: Group, params: list[Tensor], reducer: Any) -> None:
    """A bank's active slices (its gradient's sums over each slice, reduced across shards), then
    `skewadam.kernels.orthogonal.step_` with a sharded matrix's update gathered through the reducer."""
    records, actives = record.params, []
    for p, pt in zip(params, records):
        orthogonal.check(pt)  # before the sums index the gradient
        if not pt.bank:
            actives.append(None)
            continue
        dims = unit_dims(pt.grad.ndim, True)
        sumsq = pt.grad.square().sum(dims, keepdim=True)
        if reducer is not None:
            reducer([(p, [(sumsq, dims)])])
        actives.append(sumsq > 0)  # an expert that received no token: its slice (and its count) stays as it is
    gathered = [reducer is not None and hasattr(reducer, "gathers") and reducer.gathers(p, pt.bank)
                for p, pt in zip(params, records)]
    orthogonal.step_(record, actives, gathered=gathered,
                     gather=lambda u, i: reducer.gather(u, params[i], records[i].bank),
                     local_part=lambda o, i: reducer.local_part(o, params[i], records[i].bank))


def _per_unit_(group: dict, record: Group, pt: ParamTensors, impl: Any) -> None:
    """Adafactor's options on one parameter: the kernel's passes per unit (a tensor, or a bank slice kept a bank of
    one with its own rounding bits), each unit with its ``lr`` scaled by its RMS and its ``beta2_t``."""
    decay = group["beta2_decay"]
    units = [pt] if not pt.bank else [pt._replace(
        param=pt.param[e:e + 1], grad=pt.grad[e:e + 1], step=pt.step[e:e + 1],
        **{k: getattr(pt, k)[e:e + 1] for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var")
           if getattr(pt, k) is not None},
        shape=(1, *pt.shape[1:]), stream=pt.stream if e == 0 else pt.stream ^ mix32(e)) for e in range(pt.shape[0])]
    lr, wd = float(record.lr), record.weight_decay
    for u in units:
        t = float(u.step.sum()) + 1.0  # this step's count (an idle bank slice is masked out by the kernel)
        b2 = 1.0 - t ** decay if decay is not None else record.beta2
        scale = 1.0
        if group["relative_step"]:
            scale = max(RELATIVE_STEP_EPS, math.sqrt(float(u.param.to(torch.float64).square().mean())))
        unit = record._replace(params=[u], beta2=b2, lr=lr * scale, weight_decay=wd / scale)
        stats = impl.grad_stats(unit)
        [mo] = impl.update_moments_(unit, stats)
        if decay is not None and float(u.step.sum()) == t:  # the schedule's average is unbiased: undo the kernel's
            c2 = math.sqrt(1.0 - b2 ** t)  # sqrt(1 - b2^t) (an idle slice is left as it is anyway)
            mo = mo._replace(corr=mo.corr / c2, u_sumsq=mo.u_sumsq / (c2 * c2))
        impl.apply_updates_(unit, [mo])
