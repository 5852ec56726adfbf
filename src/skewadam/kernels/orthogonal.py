r"""The orthogonal tier's update as pure functions over tensor lists: Muon's orthogonalised Nesterov momentum.

Per parameter ``[A, B]`` (per slice of a bank ``[E, A, B]``), with gradient :math:`g` and momentum coefficient
:math:`\mu` (the group's ``betas[0]``):

.. math::
    m \leftarrow \mu m + (1-\mu) g, \qquad u = (1-\mu) g + \mu m \;\text{(Nesterov)}, \qquad
    O = \mathrm{NS}_5(u), \qquad p \leftarrow p\,(1 - \mathrm{lr}\,\lambda) - \mathrm{lr}\cdot 0.2\sqrt{\max(A, B)}\; O

Without momentum (expert banks orthogonalised per expert from the gradient) :math:`u = g`. :math:`\mathrm{NS}_5` is
five Newton-Schulz steps with Muon's coefficients after scaling :math:`u` to unit Frobenius norm,
:math:`X \leftarrow aX + (bXX^\top + c(XX^\top)^2)X` on the wide orientation, as `torch.optim.Muon` and
KellerJordan/Muon do. :math:`0.2\sqrt{\max(A,B)}` is torch's ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's): the
update's RMS is then about 0.2, an AdamW update's, so ``lr`` and ``weight_decay`` mean what they mean in the other
tiers. A bank slice whose gradient is all zero (an expert that received no token) is left untouched.

It runs over one group's record (`skewadam.kernels.types.Group`; ``beta1`` is :math:`\mu`, ``beta2``, ``eps`` and
``eps_mode`` are unused) in the passes of the other kernels, so `skewadam.functional` steps it in the same sequence:
`grad_stats` (pass 1: each unit's largest ``|g|``, for the idle slices and the non-finite check; nothing written),
then, after the seam and the skip decision, `step_` (the momentum, Newton-Schulz and the write), batching the
matrices of one shape into one Newton-Schulz per chunk. The distributed seam is injected (``gather`` a sharded
matrix's ``u``, ``local_part`` of ``O``; the identity on one device), so nothing here calls torch.distributed.

Deviations from `torch.optim.Muon`: Newton-Schulz runs in `ns_dtype` of the parameter (bf16 for bf16 parameters, as
torch always does; fp32 for fp32 and fp64 for fp64 parameters, where torch casts to bf16: fp32 matmuls are faster
than bf16 ones on CPUs without bf16 units, and an fp64 path can be tested against an fp64 reference); bf16 weights
and bf16 momentum are written with SkewAdam's unbiased stochastic rounding; momentum may be stored compactly
(``momentum_dtype``, `skewadam.kernels.quant`); an all-zero bank slice is skipped. No RMS clip: the scaled update's
RMS is about 0.2, far below SkewAdam's clip at 1.

Shape legend: ``N`` matrices stacked for one batched Newton-Schulz, ``E`` bank slices, ``A`` rows, ``B`` columns.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..state import state_dtype_for
from . import types
from .eager import step_key
from .quant import load_momentum, store_momentum_
from .rounding import stochastic_round_bf16
from .types import NS_STEPS, Group, ParamTensors, unit_dims

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_DTYPES", "CHUNK_NUMEL", "BLOCK_NUMEL", "bf16_matmuls",
           "ns_dtype", "check_options", "newton_schulz", "newton_schulz_", "rms_scale", "check", "grad_stats", "step_",
           "nesterov_", "apply_", "step_transient_bytes"]

#: Muon's quintic Newton-Schulz coefficients (KellerJordan/Muon; torch.optim.Muon's defaults) and eps; its 5 steps
#: are `skewadam.kernels.types.NS_STEPS`.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
CHUNK_NUMEL = 1 << 24  # elements of whole matrices orthogonalised at a time (64 MiB of fp32)
BLOCK_NUMEL = 1 << 17  # elements per block of the momentum and weight passes (512 KiB of fp32: in cache)

#: A group's ``ns_dtype``: the parameter's rule (None), that dtype whatever the parameter's, or ``"auto"``: bf16 where
#: the device multiplies bf16 natively (`bf16_matmuls`), else the parameter's rule.
NS_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}


@functools.lru_cache(maxsize=None)
def bf16_matmuls(device_type: str) -> bool:
    """Whether ``device_type`` multiplies bf16 matrices natively: CUDA (torch's Muon's choice there), a CPU with
    AVX512-BF16 or AMX (on others bf16 matmuls are emulated and slower than fp32)."""
    if device_type == "cuda":
        return True
    return device_type == "cpu" and any(getattr(torch.cpu, name, lambda: False)() for name in (
        "_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def ns_dtype(param_dtype: torch.dtype, choice: Optional[str] = None, device: Optional[torch.device] = None
             ) -> torch.dtype:
    """The dtype Newton-Schulz runs in: ``choice`` (a group's ``ns_dtype``: `NS_DTYPES`) if it names one (``"auto"``
    on ``device``: bf16 where `bf16_matmuls`), else bf16 for 16-bit parameters (torch's choice) and the parameter's
    own otherwise."""
    if choice == "auto" and device is not None and bf16_matmuls(torch.device(device).type):
        return torch.bfloat16
    if NS_DTYPES.get(choice) is not None:
        return NS_DTYPES[choice]
    return torch.bfloat16 if param_dtype in (torch.bfloat16, torch.float16) else param_dtype


def check_options(group: Group, where: str = "the param group") -> None:
    """Raise ValueError naming ``where`` unless ``group``'s Newton-Schulz settings are ones `step_` takes: ``ns_steps``
    an int >= 1, ``ns_dtype`` a key of `NS_DTYPES`, ``ns_interval`` an int >= 1."""
    steps, dtype = group.ns_steps, group.ns_dtype
    if type(steps) is not int or steps < 1:
        raise ValueError(f"Invalid ns_steps in {where}: {steps!r} (expected an int >= 1: Newton-Schulz iterations)")
    if dtype is not None and (not isinstance(dtype, str) or dtype not in NS_DTYPES):
        raise ValueError(f"Invalid ns_dtype in {where}: {dtype!r} (expected None, the parameter's rule, or one of "
                         f"{', '.join(repr(k) for k in NS_DTYPES if k)})")
    if type(group.ns_interval) is not int or group.ns_interval < 1:
        raise ValueError(f"Invalid ns_interval in {where}: {group.ns_interval!r} (expected an int >= 1: every how many "
                         f"of its steps a matrix is orthogonalised)")


def newton_schulz(x_NAB: Tensor, steps: int = NS_STEPS) -> Tensor:
    """``NS_steps(x)`` of each matrix of ``x_NAB`` (leading dims are batch dims), in ``x``'s dtype.

    Example:
        >>> o = newton_schulz(torch.randn(4, 64, 32))  # singular values of each o[i] in about [0.7, 1.2]
    """
    return newton_schulz_(x_NAB.clone(), steps)


def newton_schulz_(x_NAB: Tensor, steps: int = NS_STEPS) -> Tensor:
    """`newton_schulz`, using ``x_NAB`` (contiguous) as the first iterate: its values are lost."""
    a, b, c = NS_COEFFICIENTS
    wide = x_NAB.shape[-2] <= x_NAB.shape[-1]
    x = x_NAB if wide else x_NAB.mT
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp_(min=NS_EPS))
    shape = x.shape
    flat = x.reshape(-1, *shape[-2:])
    del x, x_NAB  # (the caller's reference keeps the input alive: 3 stacks and a Gram polynomial at most)
    for _ in range(steps):
        gram = torch.bmm(flat, flat.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G^2
        del gram
        flat = torch.baddbmm(flat, poly, flat, beta=a)  # a*X + poly @ X
        del poly
    flat = flat.reshape(shape)
    return flat if wide else flat.mT


def rms_scale(shape: Sequence[int]) -> float:
    """``0.2 * sqrt(max(A, B))`` of a matrix (or bank slice) ``[..., A, B]``: torch's ``match_rms_adamw``."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class _Piece(NamedTuple):
    """Part of one tensor that one batched Newton-Schulz takes: slices ``rows`` of dim 0 (a bank's experts; all of
    a matrix), or the whole tensor where its matrices are gathered across shards."""

    index: int
    rows: slice


def _pieces(shapes: Sequence[Sequence[int]], banks: Sequence[bool], whole: Sequence[bool], idx: Sequence[int]
            ) -> list[list[_Piece]]:
    """The tensors ``idx`` (local ``shapes``, one matrix shape) cut into chunks of at most `CHUNK_NUMEL` elements of
    whole matrices (a bigger piece alone), in order; a bank is cut between its slices unless ``whole[i]``."""
    chunks, chunk, room = [], [], CHUNK_NUMEL
    for i in idx:
        shape = shapes[i]
        n = shape[0] if banks[i] and not whole[i] else 1
        per = max(1, math.prod(shape) // max(n, 1))  # elements per slice (per tensor when n == 1)
        start = 0
        while start < n:
            if chunk and room < per:
                chunks.append(chunk)
                chunk, room = [], CHUNK_NUMEL
            take = min(n - start, max(1, room // per))
            chunk.append(_Piece(i, slice(start, start + take) if banks[i] and not whole[i] else slice(None)))
            room -= take * per
            start += take
    return chunks + [chunk] if chunk else chunks


def check(pt: ParamTensors) -> None:
    """Raise, naming the parameter, if it is not a matrix (a bank of matrices) as this update needs, or if its
    gradient or a state tensor does not fit it (`skewadam.kernels.types.check`'s rules, without a second moment):
    the sizes `grad_stats` and `step_` index with."""
    if len(pt.param.shape) - pt.bank != 2:
        raise ValueError(f"{pt.name or 'parameter'}: the orthogonal update takes matrices [A, B] or banks [E, A, B], "
                         f"got shape {tuple(pt.param.shape)} (bank={pt.bank})")
    types.check(pt, second_moment=False)


def _unit_shape(pt: ParamTensors) -> tuple[int, ...]:
    """The keepdim shape of a per-unit statistic: ``[E, 1, 1]`` for a bank, ``[1, 1]`` for a matrix."""
    shape = tuple(pt.param.shape)
    return (shape[0], 1, 1) if pt.bank else (1, 1)


def grad_stats(group: Group) -> list[Tensor]:
    """Pass 1: per unit (a matrix, a bank slice), the largest ``|g|`` in the compute dtype, keepdim (`_unit_shape`),
    after checking every record; nothing is written. Summed across the shards of a unit it is still 0 exactly when
    the unit's gradient has no nonzero element (an expert that received no token: idle), and it is inf or NaN
    exactly when an element is (the non-finite check); no square that could underflow or overflow."""
    for pt in group.params:
        check(pt)
    out = []
    for pt in group.params:
        g = pt.grad
        dtype = state_dtype_for(g.dtype)
        if g.numel() == 0:  # an empty local shard (amax has no identity)
            out.append(torch.zeros(_unit_shape(pt), dtype=dtype, device=g.device))
        else:
            out.append(g.abs().amax(unit_dims(g.ndim, pt.bank), keepdim=True).to(dtype))
    return out


def step_(
    group: Group,
    stats: Sequence[Tensor],
    *,
    skip: Optional[Tensor] = None,
    gather: Optional[Callable[[Tensor, int], Tensor]] = None,
    local_part: Optional[Callable[[Tensor, int], Tensor]] = None,
    gathered: Optional[Sequence[bool]] = None,
) -> None:
    """Passes 2 and 3 of the orthogonal update of ``group``'s tensors (local shards of DTensor parameters), in
    place, step counts included, from `grad_stats`' ``stats`` (summed across shards): a bank slice whose statistic
    is 0 is idle (weights, momentum and step count kept). ``skip``, a 0-d bool tensor read on the device (no host
    sync): when True nothing changes.

    The matrices of one shape are orthogonalised together, in chunks of at most `CHUNK_NUMEL` elements of whole
    matrices, so the step's temporaries stay a few chunks whatever the number of experts. Per piece: the momentum
    (`nesterov_`), ``gather(u, i)`` (tensors with ``gathered[i]``: the full matrices of a shard, whole tensors at a
    time), `newton_schulz` in `ns_dtype`, ``local_part(o, i)`` (the shard back), then `apply_`. The momentum
    coefficient is ``group.beta1``; bf16 weights and momentum round with `skewadam.kernels.rounding.rounding_key`
    of the group's seed, the parameter's stream and its step count. With ``group.ns_interval`` k > 1 a unit (matrix,
    bank slice) is orthogonalised and its weights stepped only when its new step count is a multiple of k, by k
    steps' update at once (``p (1 - k lr wd) - k lr 0.2 sqrt(max(A, B)) NS(u)``); in between its momentum alone
    moves. Which units are due is read on the host, once per step.
    """
    pts = group.params
    if len(stats) != len(pts):
        raise ValueError(f"{len(stats)} statistics for {len(pts)} parameters: give grad_stats' result")
    for pt, st in zip(pts, stats):
        check(pt)
        if not isinstance(st, Tensor) or tuple(st.shape) != _unit_shape(pt):
            raise ValueError(f"{pt.name or 'parameter'}: its pass-1 statistic has shape {types._shape(st)}, "
                             f"expected {_unit_shape(pt)} (grad_stats' result)")
    actives: list[Optional[Tensor]] = [st > 0 if pt.bank else None for pt, st in zip(pts, stats)]
    if skip is not None:
        go = skip.logical_not()
        actives = [go if a is None else a & go for a in actives]
    for pt, active in zip(pts, actives):
        pt.step.add_(1 if active is None else active.view(-1) if pt.bank else active)
    every = group.ns_interval
    dues = actives if every == 1 else [_due(pt, active, every) for pt, active in zip(pts, actives)]
    if every > 1:  # which units are due, on the host: one read per step (a device sync, where there is one)
        flat = torch.cat([d.reshape(-1).to(dues[0].device) for d in dues]).tolist()
        cuts = [0, *itertools.accumulate(d.numel() for d in dues)]
        due_host = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
    gathered = gathered or [False] * len(pts)
    lr = group.lr if isinstance(group.lr, Tensor) and group.lr.device.type != "cpu" else float(group.lr)
    lr = lr * every  # (an interval's steps at once)
    keys = [step_key(group.seed, pt) if torch.bfloat16 in (pt.param.dtype, getattr(pt.exp_avg, "dtype", None)) else 0
            for pt in pts]
    kinds: dict[tuple, list[int]] = defaultdict(list)
    for i, pt in enumerate(pts):
        kinds[(tuple(pt.shape[-2:]), ns_dtype(pt.param.dtype, group.ns_dtype, pt.param.device))].append(i)
    for (_, dtype), idx in kinds.items():
        for chunk in _pieces([pt.param.shape for pt in pts], [pt.bank for pt in pts], gathered, idx):
            # each piece's matrices as Newton-Schulz takes them: local ones, or a sharded tensor's gathered whole
            cut = [tuple(pts[i].shape) if gathered[i] else tuple(pts[i].param[rows].shape) for i, rows in chunk]
            counts = [math.prod(shape[:-2]) for shape in cut]
            due = [True] * sum(counts) if every == 1 else [  # the matrices orthogonalised: all, but in an interval
                d for (i, rows), n in zip(chunk, counts)
                for d in (due_host[i][rows] if pts[i].bank else due_host[i] * n)]
            ends = list(itertools.accumulate(counts))
            wanted = [any(due[end - n:end]) for n, end in zip(counts, ends)]  # pieces whose update is needed
            x_NAB = torch.empty(sum(counts), *cut[0][-2:], dtype=dtype, device=pts[chunk[0].index].param.device
                                ) if any(wanted) else None
            for j, ((i, rows), shape) in enumerate(zip(chunk, cut)):
                pt = pts[i]
                offset = (rows.start or 0) * math.prod(pt.param.shape[1:])
                args = (pt.grad[rows], _at(pt.exp_avg, rows), _at(pt.exp_avg_scale, rows), _at(actives[i], rows))
                if not wanted[j]:  # (the momentum alone; a gathered tensor's pieces agree on every rank)
                    nesterov_(*args, beta=group.beta1, key=keys[i], offset=offset, update=False)
                elif gathered[i]:  # the momentum of the local shard, then the full matrices
                    x_NAB[ends[j] - counts[j]:ends[j]].copy_(gather(  # type: ignore
                        nesterov_(*args, beta=group.beta1, key=keys[i], offset=offset), i).reshape(-1, *shape[-2:]))
                else:
                    nesterov_(*args, beta=group.beta1, key=keys[i], offset=offset,
                              out=x_NAB[ends[j] - counts[j]:ends[j]].view(shape))  # type: ignore[index]
            if x_NAB is None:
                continue
            if all(due):
                o_NAB = newton_schulz_(x_NAB, group.ns_steps)  # (consumes the fresh buffer)
            else:  # the due matrices alone: the others' rows are left as they are, and not applied
                sel = torch.tensor([j for j, d in enumerate(due) if d], device=x_NAB.device)
                o_NAB = x_NAB.index_copy_(0, sel, newton_schulz_(x_NAB.index_select(0, sel), group.ns_steps))
            del x_NAB
            for (i, rows), o, shape, want in zip(chunk, o_NAB.split(counts), cut, wanted):
                if not want:
                    continue
                pt = pts[i]
                o = o.reshape(shape)
                if gathered[i]:
                    o = local_part(o, i)  # type: ignore[misc]
                offset = (rows.start or 0) * math.prod(pt.param.shape[1:])
                apply_(pt.param[rows], o, _at(dues[i], rows), shape=pt.shape, lr=lr,
                       weight_decay=group.weight_decay, key=keys[i], offset=offset)


def _due(pt: ParamTensors, active: Optional[Tensor], every: int) -> Tensor:
    """Which units step their weights this step under ``ns_interval=every``: those whose new step count is a multiple
    of it (and are ``active``), as ``active``'s mask (``[E, 1, 1]`` for a bank, 0-d otherwise) on the parameter's
    device."""
    step = pt.step.to(pt.param.device)
    due = step.view(-1, 1, 1) % every == 0 if pt.bank else step.reshape(()) % every == 0
    return due if active is None else due & active


def _at(t: Optional[Tensor], rows: slice) -> Optional[Tensor]:
    """Rows ``rows`` of a tensor along the parameter's dim 0; a 0-d mask (a matrix's skip) applies to every row."""
    return t[rows] if t is not None and t.ndim else t


def _blocks(t: Tensor) -> Iterator[tuple[tuple, int]]:
    """``(index, start)`` per block of a matrix ``[A, B]`` or a bank ``[E, A, B]`` for the momentum and weight passes:
    on a CPU whole matrices of a bank together up to `BLOCK_NUMEL` elements, else whole rows of one matrix (a cache's
    worth: memory-bound passes); elsewhere the whole tensor (a GPU's launches would multiply). ``start`` is the
    block's first element's row-major position (the int8 momentum's blocks lie along rows)."""
    if t.device.type != "cpu":
        yield (), 0
        return
    *lead, rows, cols = t.shape
    per = rows * cols
    if lead and 0 < per <= BLOCK_NUMEL:
        n = BLOCK_NUMEL // per
        for e in range(0, lead[0], n):
            yield (slice(e, e + n),), e * per
        return
    step = max(1, BLOCK_NUMEL // max(cols, 1))
    for e in range(lead[0] if lead else 1):
        for r in range(0, rows, step):
            yield (*([e] if lead else []), slice(r, r + step)), (e * rows + r) * cols


def _mask(active: Optional[Tensor], index: tuple) -> Optional[Tensor]:
    """A bank's ``active`` ``[E, 1, 1]`` at a block's slices; a 0-d mask (a matrix's skip) as it is; None where there
    is none, or where a CPU mask is all True (read there: no device sync), which changes nothing."""
    mask = active[index[0]] if active is not None and active.ndim and index else active
    return None if mask is None or (mask.device.type == "cpu" and bool(mask.all())) else mask


def nesterov_(g: Tensor, m: Optional[Tensor], scale: Optional[Tensor], active: Optional[Tensor], *, beta: float,
              key: int, offset: int = 0, out: Optional[Tensor] = None, update: bool = True) -> Optional[Tensor]:
    """Update the momentum in place (``m = lerp(m, g, 1 - beta)``, stored per its dtype, `skewadam.kernels.quant`;
    a bank's slices where ``active`` is False keep theirs) and return the Nesterov update ``u = lerp(g, m, beta)``,
    computed in the compute dtype from the stored momentum; ``u = g`` without momentum. ``key`` and ``offset`` (of
    ``g``'s first element in its tensor) seed a bf16 momentum's stochastic rounding. ``u`` is written into ``out``
    (``g``'s shape, any float dtype: rounded to it) if given, else into a new tensor of the compute dtype; with
    ``update=False`` only the momentum moves (None is returned). Block by block (`_blocks`): the same values as whole
    tensors, with temporaries that stay in cache."""
    dtype = state_dtype_for(g.dtype)
    u = None if not update else torch.empty(g.shape, dtype=dtype, device=g.device) if out is None else out
    if m is None and u is None:
        return None
    for index, start in _blocks(g):
        gb = g[index].to(dtype)
        if m is None:
            if u is not None:
                u[index] = gb
            continue
        mb, sb = m[index], None if scale is None else scale[index]
        m32 = load_momentum(mb, sb, dtype)
        new = m32.lerp(gb, 1.0 - beta)
        if (mask := _mask(active, index)) is not None:
            new = torch.where(mask, new, m32)
        store_momentum_(mb, sb, new, key, offset + start)
        if u is not None:
            u[index] = gb.lerp(load_momentum(mb, sb, dtype), beta)
    return u


def apply_(p: Tensor, o: Tensor, active: Optional[Tensor], *, shape: Sequence[int], lr: float | Tensor,
           weight_decay: float, key: int, offset: int = 0) -> None:
    """``p = p*(1 - lr*wd) - lr * rms_scale(shape) * o`` in the compute dtype (``shape``: the global shape), bf16
    weights rounded stochastically (``key``, ``offset``); where ``active`` is False (an idle bank slice, a skipped
    step) ``p`` is kept. ``lr`` may be a one-element tensor on ``p``'s device (read there: no host sync). Block by
    block (`_blocks`), as `nesterov_`."""
    dtype = state_dtype_for(p.dtype)
    if isinstance(lr, Tensor):
        lr = lr.detach().reshape(()).to(torch.float64)
        decay, alpha = (1.0 - lr * weight_decay).to(dtype), (-lr * rms_scale(shape)).to(dtype)
    else:
        decay, alpha = 1.0 - lr * weight_decay, -lr * rms_scale(shape)
    for index, start in _blocks(p):
        pb = p[index]
        p32, ob = pb.to(dtype), o[index].to(dtype)
        if isinstance(alpha, Tensor):
            new = torch.add(p32 * decay, ob * alpha)
        else:
            new = torch.add(p32 * decay if decay != 1.0 else p32, ob, alpha=alpha)
        if (mask := _mask(active, index)) is not None:
            new = torch.where(mask, new, p32)
        if p.dtype == torch.bfloat16:
            new = stochastic_round_bf16(new, key, offset + start)
        pb.copy_(new)


def step_transient_bytes(shapes: Sequence[Sequence[int]], param_dtype: torch.dtype,
                         choices: Optional[Sequence[Optional[str]]] = None) -> int:
    """Peak bytes a step of the orthogonal tensors ``shapes`` allocates beyond parameters, gradients and state, for
    the largest chunk of one matrix shape (`CHUNK_NUMEL` elements of whole matrices; a bigger matrix alone): during
    Newton-Schulz 3 of its stacks (the input, the old and the new iterate) and a Gram polynomial (``min(A, B)^2``
    per matrix) in the Newton-Schulz dtype (`ns_dtype` of ``param_dtype`` and each tensor's group's ``ns_dtype``,
    ``choices``; ``"auto"`` as the parameter's rule: the larger, where the device is not known); then its result
    and 4 blocks (`BLOCK_NUMEL`) in the compute dtype (the result's block, decay, update, mask).
    Measured on torch 2.13 CPU (tests/test_planner.py, tracked tensor bytes)."""
    compute = state_dtype_for(param_dtype).itemsize
    stacks: dict[tuple, int] = defaultdict(int)
    for s, choice in zip(shapes, choices or [None] * len(shapes)):
        stacks[(*s[-2:], ns_dtype(param_dtype, choice).itemsize)] += math.prod(s[:-2])
    worst = 0
    for (a, b, ns), count in stacks.items():
        n = max(1, min(count, CHUNK_NUMEL // (a * b)))
        block = min(a * b * n, max(BLOCK_NUMEL, b))
        worst = max(worst, n * (3 * a * b + min(a, b) ** 2) * ns, n * a * b * ns + 4 * block * compute)
    return worst
