"""`skewadam_`: one SkewAdam step over the kernels' records, for any backend (torch's ``adam()`` plays this part).

`skewadam.SkewAdam.step` gathers one record per param group (`skewadam.kernels.types.Group`: the local tensors and
the hyperparameters) and calls `skewadam_`; so can anything that holds records of its own, e.g. a gradient hook
stepping one parameter as soon as its gradient is complete (one `StepGroup` per call, each call with its own skip
decision). A step is, for every backend of `skewadam.kernels.BACKENDS`:

1. every check of every group: the hyperparameters (`skewadam.kernels.types.check_group`; an orthogonal group's
   Newton-Schulz settings, `skewadam.kernels.orthogonal.check_options`), then each backend's pass 1
   (`grad_stats`, which checks every record it reads and writes nothing; the orthogonal update's is
   `skewadam.kernels.orthogonal.grad_stats`). A step that raises has written nothing: the error is the one shared
   check's (`skewadam.kernels.types.check`) whatever the backend's own message;
2. the reducer (the cross-shard seam, `skewadam.distributed.DTensorReducer`: it sums each statistic over the shards
   of its parameter) and the non-finite decision: all ranks skip together, on the host for a backend that reads the
   flag there (eager, C++: a step found non-finite returns before anything is written), else on the device with no
   host sync (Triton: every later pass reads the flag and writes nothing when it is set);
3. pass 2 (`update_moments_`: step counts, moments, the per-unit sums for the clip), the reducer again, and pass 3
   (`apply_updates_`: clip, decay, write); the orthogonal groups' momentum, Newton-Schulz and write
   (`skewadam.kernels.orthogonal.step_`).

On one process (no reducer) a backend's fused ``step_`` runs the adam-style groups in one call (the C++ kernel's
speed depends on it); with orthogonal groups present it is composed with their passes when the skip is decided on
the host, and the three passes run otherwise (Triton: no host sync). The results are the same bits either way.

Example:
    >>> skipped = skewadam_([StepGroup(record, params)], backend=kernels.resolve_backend("auto", device))
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .kernels import Backend, orthogonal, resolve_backend
from .kernels.types import Group, all_finite, check, check_group, stat_dims, unit_dims

__all__ = ["Reducer", "StepGroup", "skewadam_"]

#: ``reduce(items)`` sums each statistic in place across the shards of its parameter, where ``items`` is a list of
#: ``(param, [(statistic, dims_it_sums_over), ...])`` (the dims of ``param``, also for a flattened bank's pieces);
#: `skewadam.distributed.DTensorReducer` is one. Optionally
#: ``reduce.all_finite(flag)`` (all ranks agree on a 0-d bool flag) and ``gathers``/``gather``/``local_part`` (the
#: full matrices of a sharded parameter, for the orthogonal update).
Reducer = Callable[[list[tuple[Tensor, list[tuple[Tensor, tuple[int, ...]]]]]], None]


class StepGroup(NamedTuple):
    """One param group's part of a step."""

    record: Group  # the kernels' record: local tensors (shards of DTensors), state, hyperparameters
    params: Sequence[Tensor]  # the parameters as the user holds them, one per record entry: a reducer reads placements
    # (a flattened bank [E*D, ...] stepped as pieces, records of its view [k, D, ...], is named once per piece)
    update: str = "adam"  # "orthogonal": `skewadam.kernels.orthogonal`; else the tiers' Adam-style update
    where: str = "the param group"  # how errors about the group's hyperparameters name it


def skewadam_(groups: Sequence[StepGroup], *, backend: Union[Backend, str] = "auto", reducer: Optional[Reducer] = None,
              skip_nonfinite: bool = True) -> Tensor:
    """One step of ``groups``, in place: parameters, state and step counts. Call it under ``torch.no_grad()`` (as
    `skewadam.SkewAdam.step` and gradient hooks run), like torch's functional optimizers.

    Args:
        groups: the param groups' records (`StepGroup`); groups without parameters are ignored.
        backend: a backend of `skewadam.kernels.BACKENDS`, or a choice for `skewadam.kernels.resolve_backend`
            (``"auto"`` or a backend's name) on the first parameter's device.
        reducer: the cross-shard seam (`Reducer`); None on one process.
        skip_nonfinite: skip the whole step, writing nothing, if a gradient holds inf or NaN.

    Returns:
        A 0-d bool tensor, True if the step was skipped for a non-finite gradient: on the parameters' device, and
        never read on the host by a backend that skips on the device.

    Example:
        >>> skipped = skewadam_([StepGroup(record, params)], backend="auto", skip_nonfinite=True)
    """
    groups = [g for g in groups if len(g.record.params)]
    if not groups:
        return torch.zeros((), dtype=torch.bool)
    device = groups[0].record.params[0].param.device
    if isinstance(backend, str):
        backend = resolve_backend(backend, device)
    kernel = backend.load()
    for g in groups:
        check_group(g.record, g.where)
        if g.update == "orthogonal":
            orthogonal.check_options(g.record, g.where)
    adam = [g for g in groups if g.update != "orthogonal"]
    orth = [g for g in groups if g.update == "orthogonal"]
    try:
        if reducer is None and not orth:
            return kernel.step_([g.record for g in adam], skip_nonfinite=skip_nonfinite)
        none = torch.zeros((), dtype=torch.bool, device=device)
        if reducer is None and backend.skip_on_host:
            return _composed(kernel, adam, orth, skip_nonfinite, none)
        stats = [kernel.grad_stats(g.record) for g in adam]
        maxima = [orthogonal.grad_stats(g.record) for g in orth]
    except (TypeError, ValueError, RuntimeError):
        _explain(groups)
        raise
    if skip_nonfinite:  # (before the seam: a sum of shards' maxima could overflow where none of them does)
        finite = all_finite([s.sumsq for st in stats for s in st] + [m for ms in maxima for m in ms])
    _reduce(reducer, adam, stats, lambda pt, st: stat_dims(st, pt.grad.ndim, pt.bank))
    _reduce(reducer, orth, maxima, lambda pt, m: [(m, unit_dims(pt.grad.ndim, True))] if pt.bank else [])
    skip, skipped = None, none
    if skip_nonfinite:
        agree = getattr(reducer, "all_finite", None)
        skipped = (agree(finite) if agree is not None else finite).logical_not()
        if backend.skip_on_host:  # (the backend would read it on the host: read it once, here)
            if bool(skipped):
                return skipped
        else:
            skip = skipped
    moments = [kernel.update_moments_(g.record, st, skip=skip) for g, st in zip(adam, stats)]
    _reduce(reducer, adam, moments, lambda pt, mo: [(mo.u_sumsq, unit_dims(pt.grad.ndim, pt.bank))])
    for g, mo in zip(adam, moments):
        kernel.apply_updates_(g.record, mo, skip=skip)
    for g, ms in zip(orth, maxima):
        _orthogonal_(g, ms, reducer, skip)
    return skipped


def _composed(kernel, adam: list[StepGroup], orth: list[StepGroup], skip_nonfinite: bool, none: Tensor) -> Tensor:
    """One process, the skip read on the host: the orthogonal groups' pass 1, the fused ``step_`` of the others, then
    the orthogonal groups' update unless either found a non-finite gradient."""
    maxima = [orthogonal.grad_stats(g.record) for g in orth]
    if skip_nonfinite and not bool(all_finite([m for ms in maxima for m in ms])):
        return none.logical_not()
    skipped = kernel.step_([g.record for g in adam], skip_nonfinite=skip_nonfinite) if adam else none
    if not bool(skipped):
        for g, ms in zip(orth, maxima):
            _orthogonal_(g, ms, None, None)
    return skipped


def _orthogonal_(g: StepGroup, maxima: list[Tensor], reducer: Optional[Reducer], skip: Optional[Tensor]) -> None:
    """`skewadam.kernels.orthogonal.step_` with a sharded matrix's update gathered through the reducer."""
    params, records = g.params, g.record.params
    gathered = [reducer is not None and hasattr(reducer, "gathers") and reducer.gathers(p, pt.bank)
                for p, pt in zip(params, records)]
    orthogonal.step_(g.record, maxima, skip=skip, gathered=gathered,
                     gather=lambda u, i: reducer.gather(u, params[i], records[i].bank),  # type: ignore[union-attr]
                     local_part=lambda o, i: reducer.local_part(o, params[i], records[i].bank))  # type: ignore


def _reduce(reducer: Optional[Reducer], groups: list[StepGroup], results: list[list], items: Callable) -> None:
    """Hand the reducer ``(param, items(record, result))`` for every parameter that has statistics to sum; a
    flattened bank's pieces (records of one more dim than the bank, next to each other) as one item of the bank:
    each statistic's pieces in expert order, kind after kind, with the view's dims 0 and 1 mapped to the bank's
    dim 0, so the per-expert sums line up on every rank however its rows are cut."""
    if reducer is None:
        return
    work: list[tuple[Tensor, list]] = []
    pieces: set[int] = set()  # indices in ``work`` of flattened banks: a list of their pieces' items
    for g, rs in zip(groups, results):
        for p, pt, r in zip(g.params, g.record.params, rs):
            if not (its := items(pt, r)):
                continue
            if len(pt.shape) == p.ndim:
                work.append((p, its))
                continue
            its = [(s, tuple(max(d - 1, 0) for d in dims)) for s, dims in its]
            if work and work[-1][0] is p and len(work) - 1 in pieces:
                work[-1][1].append(its)
            else:
                pieces.add(len(work))
                work.append((p, [its]))
    if work:
        reducer([(p, [s for kind in zip(*its) for s in kind]) if i in pieces else (p, its)
                 for i, (p, its) in enumerate(work)])


def _explain(groups: list[StepGroup]) -> None:
    """Raise the shared check's error for a record a backend refused (in its own words: a compiled kernel's message),
    so the error is the same on every backend; return if the shared check accepts every record."""
    try:
        for g in groups:
            for pt in g.record.params:
                orthogonal.check(pt) if g.update == "orthogonal" else check(pt)
                if pt.param.is_meta:
                    raise ValueError(f"{pt.name or 'parameter'}: a parameter on the meta device holds no values to "
                                     f"step; materialise the model first (model.to_empty(device=...), then "
                                     f"initialise it)")
    except (TypeError, ValueError) as shared:
        raise shared from None
