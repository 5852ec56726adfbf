r"""SkewAdam on sharded parameters (FSDP2, tensor and expert parallelism): state placements and the reducer.

A DTensor parameter's shard sees only part of each statistic the update needs. The kernels
(`skewadam.kernels.eager`) compute *partial sums* over the local shard and divide by the global sizes; between their
passes the optimizer hands every statistic, paired with the parameter dims it sums over, to a reducer. `DTensorReducer`
all-reduces (SUM) a statistic over exactly the mesh dims whose placement shards one of those dims (``Shard(d)`` or
``_StridedShard(d)``): a ``[R, C]`` weight sharded on rows (FSDP2's ``Shard(0)``) needs its column sums
``sum_i g_ij^2`` ``[1, C]`` and its per-tensor sums (``sum g^2``, ``sum_i row_var_i``, ``sum u^2`` for the RMS clip),
never its row sums; a bank ``[E, F, D]`` sharded on experts (expert parallelism) needs nothing, one sharded on ``F``
(torchtitan's ``Shard(1)``) its column and per-expert sums. Replicated mesh dims hold the same values everywhere and are
not reduced. Statistics are flattened into one buffer per process group and pass, so a step costs one all-reduce per
sharding mesh dim in each of the two seams, plus one all-reduce of a scalar so that every rank agrees on skipping a
non-finite step. No gradient and no parameter crosses ranks.

State tensors are DTensors on the parameter's mesh, so `torch.distributed.checkpoint` saves and loads them
(`state_placements`): each mesh dim keeps the parameter's placement where the state tensor spans that dim at full size
and is ``Replicate`` where the state has reduced it away (``row_var [..., R, 1]`` over columns, ``col_var [..., 1, C]``
over rows, a bank's ``step [E]`` over everything but experts). Uneven and empty shards follow the parameter's own local
shape (torchao's ``DTensor.from_local(..., shape=, stride=)``). A non-bank ``step`` is a plain host scalar, as torch's
optimizers keep it (identical on every rank, read each step).

A flattened expert bank ``[E*D, F]`` (OLMo-core, DBRX; group key ``experts``) sharded on its rows (FSDP2's
``Shard(0)``) may be cut anywhere: a rank's rows can hold part of an expert, several whole ones, or none. Its local
shard is stepped as bank *pieces* (`flat_bank_pieces`): every expert once, in expert order, with its local rows
(possibly none), each run of experts with as many local rows one ordinary bank record ``[k, rows, F]`` of global
shape ``(k, D, F)``. Its state keeps the parameter's row layout where it spans the rows (``exp_avg [E*D, F]``,
``row_var [E*D, 1]``, ``exp_avg_scale``: sharded like the parameter) and is per expert elsewhere (``col_var
[E, 1, F]`` and ``step [E]``: ``Replicate`` over the rows; every rank updates every expert's copy from the same
reduced sums, so the replicas stay bitwise equal). `skewadam.functional` hands the reducer one item per bank: each
statistic's pieces in expert order, kind after kind, so the per-expert sums (``[E, 1, F]`` column sums, ``[E, 1, 1]``
per-expert sums) line up on every rank, summed over the bank's dim 0; row sums stay local (rows are never cut).

Refused with an error: ``Partial`` placements (unreduced values), FSDP1's ``FlatParameter`` and parameters DeepSpeed
partitioned before the optimizer was built (``deepspeed.zero.Init``: ``ds_shape``/``ds_tensor``): flattening destroys
the row/column structure that factored statistics and the per-tensor clip are defined on. (DeepSpeed ZeRO stages 1-3
are stepped exactly through `skewadam.integrations.deepspeed.initialize`, `skewadam.zero`. ZeRO stage 0, DDP and
`torch.distributed.optim.ZeroRedundancyOptimizer` keep whole parameters and need no reduction. Under
``ZeroRedundancyOptimizer`` each rank steps only its own parameters, so a non-finite gradient would skip only the
partitions that hold it; ``zero.optim._reducer = DTensorReducer()`` makes all ranks skip together.)

Stochastic rounding (bf16 parameters and bf16 momentum) draws its bits per element from a key and the element's
local index; `rounding_stream` mixes the global offset of the shard's first element into the key, so shards of one
parameter draw independent bits (the same local positions would otherwise round alike on every rank) while replicas
of one shard (``Replicate`` mesh dims, HSDP) draw the same bits and stay identical.

The orthogonal tier (`skewadam.kernels.orthogonal`) needs each whole matrix: `DTensorReducer.gather` all-gathers a
sharded parameter's update over exactly the mesh dims that shard its matrix dims (the last two; a bank's expert dim
stays sharded, so a bank sharded on experts gathers nothing), every rank orthogonalises the full matrices, and
`DTensorReducer.local_part` takes back its own shard without communication, as torchtitan's DistMuon does.
``gathered_bytes`` counts what this rank received (the full matrix less its own shard, in the update's dtype).

To disable the reductions (e.g. as a negative control), set the seam yourself before the first step:
``optimizer._reducer = lambda items: None``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .kernels.rounding import part_stream
from .state import StateTensor, flat_bank_merged, spanned_dims

__all__ = ["state_placements", "new_state_dtensor", "check_layout", "check_grad", "rounding_stream", "Piece",
           "flat_bank_pieces", "DTensorReducer"]

_DEEPSPEED_ATTRS = ("ds_shape", "ds_tensor", "ds_id", "ds_numel")


def _sharded_dim(placement: Placement, ndim: int, what: str) -> Optional[int]:
    """The tensor dim a placement shards (``Shard`` and ``_StridedShard`` alike), None for ``Replicate``."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim % ndim
    if placement.is_partial():
        raise ValueError(
            f"SkewAdam cannot use a {what} with a Partial placement {placement} (its shards hold unreduced partial "
            f"values, so no statistic of it is defined); redistribute it to Shard/Replicate first, e.g. "
            f"t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])"
        )
    return None


def check_layout(p: Tensor, where: str = "parameter", experts: Optional[int] = None) -> None:
    """Refuse parameters whose shards cannot carry SkewAdam's statistics: flattened (FSDP1, ``deepspeed.zero.Init``) or
    Partial, and flattened expert banks (``experts``) whose local rows are not one run (`flat_bank_pieces`)."""
    if getattr(p, "_is_flat_param", False):
        raise TypeError(
            f"{where}: FSDP1 FlatParameter (a flattened 1-D shard of many parameters) loses the rows and columns "
            f"SkewAdam's factored statistics and per-tensor clip need; use FSDP2 (torch.distributed.fsdp.fully_shard)"
        )
    if any(hasattr(p, a) for a in _DEEPSPEED_ATTRS):
        raise TypeError(
            f"{where}: a parameter DeepSpeed partitioned before the optimizer was built (deepspeed.zero.Init, "
            f"ds_shape={getattr(p, 'ds_shape', '?')}): SkewAdam needs the whole model's parameters to label and "
            f"size them; build the model without zero.Init and the optimizer on it, then pass both to "
            f"skewadam.integrations.deepspeed.initialize (ZeRO stage 3 partitions them there)"
        )
    if isinstance(p, DTensor):
        for pl in p.placements:
            _sharded_dim(pl, max(p.ndim, 1), where)
        if experts is not None:
            flat_bank_pieces(p, experts, where)


def state_placements(
    placements: Sequence[Placement], ndim: int, key: str, state_ndim: int, *, flattened: bool = False
) -> tuple[Placement, ...]:
    """Placements of state ``key`` of a parameter with ``placements``: the parameter's where the state keeps the dim,
    ``Replicate`` where it does not. ``flattened``: the parameter is a flattened bank ``[E*D, ...]``, whose state
    kept per expert (``col_var [E, 1, F]``, ``step [E]``: `skewadam.state.flat_bank_merged`) is replicated over the
    rows and sharded on the view's dim ``d + 1`` where the parameter is on its dim ``d >= 1``.

    Example:
        >>> state_placements([Shard(0)], 2, "col_var", 2)  # [1, C] over a row-sharded [R, C]
        (Replicate(),)
        >>> state_placements([_StridedShard(0, split_factor=2), Shard(0)], 3, "step", 1)  # a bank's [E]
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
        >>> state_placements([Shard(0), Shard(1)], 2, "col_var", 3, flattened=True)  # [E, 1, F] of [E*D, F]
        (Replicate(), Shard(dim=2))
    """
    per_expert = flattened and not flat_bank_merged(key, ndim + 1)
    kept = spanned_dims(key, ndim + per_expert, state_ndim)
    out = []
    for pl in placements:
        d = _sharded_dim(pl, max(ndim, 1), f"parameter (state {key!r})")
        if not per_expert:
            out.append(pl if d is not None and d in kept else Replicate())
        elif d is not None and d > 0 and d + 1 in kept:
            out.append(Shard(d + 1))
        else:
            out.append(Replicate())
    return tuple(out)


def new_state_dtensor(param: DTensor, key: str, st: StateTensor, flattened: bool = False) -> Tensor:
    """Zeros for state ``key`` of a DTensor parameter (``flattened``: a flattened bank), as a DTensor placed per
    `state_placements` (a non-bank ``step`` is a plain CPU scalar, as torch keeps it). Works for uneven and empty
    local shards.
    """
    if key == "step" and not st.shape:
        return torch.zeros((), dtype=st.dtype)
    if key == "exp_avg_scale" and any(
        _sharded_dim(pl, param.ndim, "parameter") == param.ndim - 1 for pl in param.placements
    ):
        raise ValueError(
            f"int8 momentum keeps one scale per block of its parameter's last dim, which placements "
            f"{param.placements} of a {tuple(param.shape)} parameter split across ranks; shard another dim, or use "
            f"momentum_dtype='bf16' for this parameter's group"
        )
    local = param.to_local()
    placements = state_placements(param.placements, param.ndim, key, len(st.shape), flattened=flattened)
    if flattened and not flat_bank_merged(key, param.ndim + 1):  # per expert: sharded as the columns are, if at all
        local_shape = tuple(compute_local_shape_and_global_offset(torch.Size(st.shape), param.device_mesh,
                                                                  placements)[0])
    else:
        kept = spanned_dims(key, param.ndim, len(st.shape))
        local_shape = tuple(local.shape[d] if d in kept else st.shape[d] for d in range(len(st.shape)))
    zeros = torch.zeros(local_shape, dtype=st.dtype, device=local.device)
    return DTensor.from_local(
        zeros, param.device_mesh, placements, run_check=False,
        shape=torch.Size(st.shape), stride=torch.empty(st.shape, device="meta").stride(),
    )


@functools.lru_cache(maxsize=4096)
def _first_element(shape: torch.Size, mesh, placements: tuple[Placement, ...]) -> int:
    """Row-major global index of the local shard's first element."""
    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return sum(o * st for o, st in zip(offset, strides))


def rounding_stream(param: DTensor, index: int, row: int = 0) -> int:
    """The stochastic-rounding stream of ``param``'s local shard (the ``param_index`` of
    `skewadam.kernels.rounding.rounding_key`), or of its part from local row ``row`` on (a flattened bank's piece):
    ``index`` itself for the part starting at global element 0, so that one process draws what it always drew, else
    ``index`` mixed with the global index of the part's first element."""
    first = _first_element(param.shape, param.device_mesh, tuple(param.placements)) + row * math.prod(param.shape[1:])
    return part_stream(index, first)


class Piece(NamedTuple):
    """A run of a flattened bank's experts that hold the same number of this rank's rows: the kernels step it as the
    bank ``[experts, rows, ...]`` of global shape ``(experts, D, ...)`` (`flat_bank_pieces`)."""

    first: int  # its first expert
    experts: int
    row: int  # its first row in the local shard
    rows: int  # local rows of each of its experts, 0 to D


def flat_bank_pieces(param: Tensor, experts: int, where: str = "parameter") -> tuple[Piece, ...]:
    """The local shard of a flattened bank ``[E*D, ...]`` as bank pieces: every expert once, in expert order, with
    the rows of it this rank holds (a shard may cut an expert, hold several whole ones, or none: an expert with no
    local row is a piece of zero rows, which still steps its replicated per-expert state from the reduced sums).
    Experts next to each other with as many local rows form one piece. One piece for a tensor that is not a DTensor.

    Example:
        >>> flat_bank_pieces(w, 3)  # w [3*4, F] Shard(0) on 2 ranks, rank 1 (global rows 6 to 11)
        (Piece(first=0, experts=1, row=0, rows=0), Piece(first=1, experts=1, row=0, rows=2), Piece(first=2, ...
    """
    per = param.shape[0] // experts
    if not isinstance(param, DTensor):
        return (Piece(0, experts, 0, per),)
    lo, hi = _local_rows(param.shape[0], param.device_mesh, tuple(param.placements), where)
    pieces: list[Piece] = []
    row = 0
    for e in range(experts):
        n = max(0, min(hi, (e + 1) * per) - max(lo, e * per))
        if pieces and pieces[-1].rows == n:
            pieces[-1] = pieces[-1]._replace(experts=pieces[-1].experts + 1)
        else:
            pieces.append(Piece(e, 1, row, n))
        row += n
    return tuple(pieces)


@functools.lru_cache(maxsize=4096)
def _local_rows(n: int, mesh, placements: tuple[Placement, ...], where: str) -> tuple[int, int]:
    """The global rows ``[lo, hi)`` of dim 0 (of ``n``) that the local shard of a flattened bank holds, as DTensor
    splits them (no communication); refused where they are not contiguous or another dim is strided."""
    for pl in placements:
        if isinstance(pl, _StridedShard) and pl.dim != 0:
            raise ValueError(f"{where}: a flattened expert bank with a strided placement {pl} of a dim other than 0 "
                             f"is not supported; shard it with Shard placements, or stack its experts [E, D, F]")
    dim0 = [pl if _sharded_dim(pl, 2, where) == 0 else Replicate() for pl in placements]
    if all(isinstance(pl, Replicate) for pl in dim0):
        return 0, n
    rows = distribute_tensor(torch.arange(n, device=mesh.device_type), mesh, dim0, src_data_rank=None)
    local = rows.to_local().tolist()
    lo = local[0] if local else 0
    if local != list(range(lo, lo + len(local))):
        raise ValueError(f"{where}: placements {list(placements)} give this rank rows {local[:4]}... of a flattened "
                         f"expert bank, not one contiguous run; shard its dim 0 with Shard(0), or stack its experts "
                         f"[E, D, F] for expert parallelism")
    return lo, lo + len(local)


class DTensorReducer:
    """Sum SkewAdam's partial statistics of DTensor parameters across their shards, in place, batched.

    ``reducer(items)``, with ``items`` a list of ``(param, [(statistic, dims_it_sums_over), ...])`` (the optimizer's
    reduce seam), all-reduces each statistic over the mesh dims sharding any of its dims: one flat buffer and one
    collective per (process group, dtype), in order, so a statistic sharded over two mesh dims is summed over both.
    Non-DTensor parameters pass through. ``collectives`` and ``bytes`` count what it sent (per-rank payload).

    Example:
        >>> opt = SkewAdam(fsdp_model.parameters())   # installs a DTensorReducer on the first step
        >>> opt.step(); opt._reducer.collectives, opt._reducer.bytes
    """

    def __init__(self) -> None:
        self.collectives = 0
        self.bytes = 0
        self.gathered_bytes = 0
        self._device: Optional[torch.device] = None

    def __call__(self, items: list[tuple[Tensor, list[tuple[Tensor, tuple[int, ...]]]]]) -> None:
        buckets: dict[tuple, list[Tensor]] = {}
        for param, stats in items:
            self._device = stats[0][0].device  # where `all_finite`'s flag lives (NCCL needs it on the GPU)
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            sharding = [
                (i, d) for i, pl in enumerate(param.placements)
                if (d := _sharded_dim(pl, max(param.ndim, 1), "parameter")) is not None and mesh.size(i) > 1
            ]
            for stat, dims in stats:
                for i, d in sharding:
                    if d in dims:
                        buckets.setdefault((mesh.get_group(i), stat.dtype, stat.device), []).append(stat)
        for (group, _, _), stats in buckets.items():  # the same order on every rank: all step the same params
            flat = torch.cat([s.reshape(-1) for s in stats])
            dist.all_reduce(flat, group=group)
            self.collectives += 1
            self.bytes += flat.numel() * flat.element_size()
            for s, chunk in zip(stats, flat.split([s.numel() for s in stats])):
                s.copy_(chunk.view_as(s))

    def all_finite(self, local: Tensor) -> Tensor:
        """Whether the gradients are finite on every rank (so all ranks skip a step together or none does), from this
        rank's 0-d bool ``local``; a 0-d bool tensor (no host sync)."""
        flag = local.to(device=self._device or local.device, dtype=torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        self.collectives += 1
        self.bytes += flag.element_size()
        return flag[0] > 0

    def gathers(self, param: Tensor, bank: bool) -> bool:
        """Whether `gather` communicates for ``param``: a mesh dim of size > 1 shards one of its matrix dims."""
        return _matrix_gathered(param, bank) is not None

    def gather(self, local: Tensor, param: Tensor, bank: bool) -> Tensor:
        """The full matrices of ``local`` (this rank's part of a tensor placed like ``param``): all-gathered over the
        mesh dims that shard a matrix dim; a bank's expert dim stays as it is. ``local`` itself where none does."""
        placements = _matrix_gathered(param, bank)
        if placements is None:
            return local
        dt = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                stride=param.stride())
        full = dt.redistribute(param.device_mesh, placements).to_local()
        self.collectives += 1
        self.gathered_bytes += (full.numel() - local.numel()) * full.element_size()
        return full

    def local_part(self, full: Tensor, param: Tensor, bank: bool) -> Tensor:
        """This rank's shard of ``full`` (what `gather` returned, transformed), as ``param`` is placed: a local
        slice, no communication."""
        placements = _matrix_gathered(param, bank)
        if placements is None:
            return full
        dt = DTensor.from_local(full, param.device_mesh, placements, run_check=False, shape=param.shape,
                                stride=param.stride())
        return dt.redistribute(param.device_mesh, param.placements).to_local()


def _matrix_gathered(param: Tensor, bank: bool) -> Optional[tuple[Placement, ...]]:
    """``param``'s placements with every mesh dim that shards one of its matrix dims (the last two) replicated;
    None when no mesh dim of size > 1 does (nothing to gather)."""
    if not isinstance(param, DTensor):
        return None
    matrix = {param.ndim - 2, param.ndim - 1} if bank else set(range(param.ndim))
    out, gathered = [], False
    for i, pl in enumerate(param.placements):
        d = _sharded_dim(pl, max(param.ndim, 1), "parameter")
        if d is not None and d in matrix and param.device_mesh.size(i) > 1:
            out.append(Replicate())
            gathered = True
        else:
            out.append(pl)
    return tuple(out) if gathered else None


def check_grad(param: DTensor) -> None:
    """Refuse a gradient not placed like its DTensor parameter (Partial, a plain tensor): its local shape and values
    are not the shard's."""
    grad = param.grad
    if grad is None or (isinstance(grad, DTensor) and tuple(grad.placements) == tuple(param.placements)):
        return
    got = grad.placements if isinstance(grad, DTensor) else "a plain tensor"
    raise ValueError(
        f"SkewAdam: the gradient of a DTensor parameter {tuple(param.shape)} with placements {param.placements} is "
        f"{got}; SkewAdam needs gradients placed like their parameters (reduced, not Partial): redistribute the "
        f"gradient with grad.redistribute(placements=param.placements)"
    )
