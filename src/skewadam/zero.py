r"""SkewAdam's own math on ZeRO's flat partitions: the records of one rank's partition, the reducer between the passes,
and the cut blocks' exchange.

`skewadam.integrations.deepspeed.initialize` registers each flat partition DeepSpeed hands the optimizer (one per
param group under stages 1 and 2, per sub-group under stage 3) as a `Partition` of a `skewadam.pieces.Layout` in the
optimizer's `ZeroSteps`; `SkewAdam.step` then steps a group whose params are such a partition as records of the
pieces of its tensors (`Partition.records`) through `skewadam.functional.skewadam_`, with `ZeroReducer` between the
passes. One step of a partition, on every rank of its data-parallel group:

1. the cut blocks' exchange (an all-reduce, only where a run boundary cuts a block): every rank puts its elements of
   each cut block (gradient and master weight) into a buffer, so each block's owner steps it whole, in that buffer;
2. the passes: before the moments, one all-reduce of the float64 sums that two or more records share (per-unit sums,
   a factored matrix's column sums, ``sum g^2`` and ``sum row_var``); the non-finite flag (MIN, 4 bytes); after the
   moments, one all-reduce of the shared sums of ``u^2`` (the RMS clip). A partition whose tensors no two records
   share sends neither. Every rank steps an empty record besides its own (`ZeroSteps.take`), so every rank calls each
   seam even when it holds nothing of the group. A partition no other rank shares (a group of one rank) steps as one
   process does, with the fused kernel;
3. the cut blocks' new weights go back to the ranks that hold them (an all-reduce).

State lives in ``optimizer.state[flat partition]``, one dict per tensor index of the group (``{i: {"exp_avg": ...}}``)
in the tensor's layout, rows of what spans rows (`skewadam.pieces.Layout.state_shapes`). Where two records of one rank
share a matrix's ``col_var`` or a unit's step count (a cut block beside rows of its matrix, a tensor in several boxes),
the second steps a copy taken before the step: the same inputs give the same values, written once.

Stochastic rounding (bf16 momentum) draws each record's bits from its first element (`skewadam.kernels.rounding.
part_stream`), as shards do: a record starting at a tensor's element 0 draws what one process draws.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .kernels.rounding import part_stream
from .kernels.types import Group, ParamTensors
from .pieces import Box, Layout, TensorLayout
from .state import check_state, state_dtype_for, state_flags

__all__ = ["PieceRef", "Partition", "ZeroReducer", "ZeroSteps", "ZeroStep", "partition_of", "zero_layouts",
           "merge_pieces"]

class PieceRef(NamedTuple):
    """What the reducer knows of a record (a `skewadam.functional.StepGroup`'s ``params`` entry under ZeRO): its
    partition and box (None: the empty record every rank steps), and the record's ``ndim``."""

    part: Optional["Partition"]
    box: Optional[Box]
    ndim: int


class Partition:
    """One rank's flat partition of a param group, as pieces of the group's tensors.

    Args:
        flat: the partition (fp32 master weights; its ``.grad`` is set before each step).
        layout: every rank's pieces of the group (`skewadam.pieces.Layout`).
        rank: this rank's index in ``layout`` (its rank in ``group``).
        group: the data-parallel process group (None: the default group).
        first_id: the optimizer-wide index of the group's first tensor (its rounding streams).
        names: each tensor's name (the model's, as DeepSpeed names it): errors and checkpoints use it.
    """

    def __init__(self, flat: Tensor, layout: Layout, rank: int, group: Any, first_id: int, names: Sequence[str]):
        self.flat, self.layout, self.rank, self.group = flat, layout, rank, group
        self.first_id, self.names = first_id, list(names)
        self.cut, self.cut_numel = [], 0  # the cut blocks, each with its offset in the exchange's buffers
        for b in layout.cut_blocks():
            self.cut.append((b, self.cut_numel))
            self.cut_numel += b.stop - b.start
        self.units: dict[tuple[int, int], int] = {}  # shared (tensor, unit) -> its slot
        self.matrices: dict[tuple[int, int], tuple[int, int]] = {}  # shared (tensor, matrix) -> (slot, column slot)
        cols = 0
        for i, t in enumerate(layout.tensors):
            units, matrices = layout.shared(i)
            self.units.update({(i, u): len(self.units) for u in units})
            for m in matrices:
                self.matrices[(i, m)] = (len(self.matrices), cols)
                cols += t.cols
        self.cols = cols
        self.sharing = {i for i, _ in self.units}  # tensors with a shared unit (a shared matrix's unit is shared)
        self.unit_kinds = 1  # per-unit float64 sums before the moments: sum g^2 (and sum p^2 with relative_step)
        self.held: Optional[Tensor] = None  # this step's cut blocks: gradients [0] and master weights [1]
        self.counts: Any = None  # the `ZeroSteps` that counts its collectives (set by `ZeroSteps.add`)
        self.param_group: dict = {}  # the optimizer's param group it is a partition of (set by `ZeroSteps.add`)

    # ------------------------------------------------------------------------------------------------ state
    def allocate(self, state: dict, group: dict, device_steps: bool) -> None:
        """Zeros for the state of every tensor this rank owns a block of, in ``state`` (``optimizer.state[flat]``),
        unless it holds some already."""
        if state:
            return
        spec = state_flags(group)
        for i, t in enumerate(self.layout.tensors):
            full = spec.spec(t.shape, self.flat.dtype)
            for key, st in self.layout.state_shapes(self.rank, i, full).items():
                host = key == "step" and not t.bank and not device_steps  # a tensor's count on the host, as torch's
                state.setdefault(i, {})[key] = torch.zeros(st.shape, dtype=st.dtype,
                                                           device="cpu" if host else self.flat.device)

    def _views(self, box: Box, st: dict, copy_matrix: bool, copy_step: bool) -> list[Optional[Tensor]]:
        """The record's state: views of the tensor's (``st``), in `ParamTensors` order from ``step``; the first
        matrix's ``col_var`` and step (``copy_*``) copied where an earlier record of this rank steps them."""
        t = self.layout.tensors[box.tensor]
        shape = t.box_shape(box)
        (row0, _), (m0, _) = self.layout.rows(self.rank, box.tensor)
        first = box.matrix * t.rows_per_matrix + box.row - row0
        out = []
        for key in ("step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var"):
            v = st.get(key)
            if v is None:
                out.append(None)
                continue
            if key == "step":
                v = v[box.matrix - m0:box.matrix - m0 + box.matrices] if t.bank else v
                v = v.clone() if copy_step else v
            elif key == "col_var":
                v = v[box.matrix - m0:box.matrix - m0 + box.matrices]
                v = (v.clone() if copy_matrix else v).view(*shape[:-2], 1, t.cols)
            elif v.ndim == 2:  # rows [rows, last]
                v = v[first:first + box.matrices * box.rows].view(*shape[:-1], v.shape[-1])
            elif v.ndim == 1:  # a 1-D tensor's elements
                v = v[first:first + box.rows]
            out.append(v)
        return out

    # ------------------------------------------------------------------------------------------- checkpoints
    def describe(self) -> dict:
        """Where this partition's pieces lie (plain data, saved beside its state: `zero_layouts`, `merge_pieces`)."""
        lay = self.layout
        return {"rank": self.rank, "first": self.first_id, "names": self.names,
                "tensors": [tuple(t) for t in lay.tensors],
                "ranges": [[(i, *run) for i, run in spans.items()] for spans in lay.spans]}

    def check_state(self, state: dict, group: dict, where: str) -> None:
        """Raise ValueError unless ``state`` (loaded for this partition) holds, per tensor this rank owns blocks of,
        the state `allocate` gives it (shapes, dtypes, values: `skewadam.state.check_state`)."""
        spec = state_flags(group)
        owned = [i for i in range(len(self.names)) if (span := self.layout.owned(self.rank, i))[0] < span[1]]
        if sorted(state) != owned:
            raise ValueError(f"{where}: a ZeRO partition's state of tensors {sorted(state)}, this rank owns pieces of "
                             f"tensors {owned}: a checkpoint of another world size or partitioning; merge it with "
                             f"skewadam.integrations.deepspeed.consolidate and load it with load_consolidated")
        for i in owned:
            t = self.layout.tensors[i]
            want = self.layout.state_shapes(self.rank, i, spec.spec(t.shape, self.flat.dtype))
            check_state(state[i], want, f"{where}: {self.names[i]}'s piece on rank {self.rank}")

    def load_full(self, state: dict, weights: dict, whole: dict) -> None:
        """Copy this rank's pieces from one process's: ``weights`` (master weights by name), ``whole`` (state by
        name, each tensor's as one process keeps it), into the partition and ``state`` (its allocated state)."""
        lay = self.layout
        with torch.no_grad():
            for i, (a, b, off) in lay.spans[self.rank].items():
                self.flat[off:off + b - a] = weights[self.names[i]].reshape(-1)[a:b]
            for i, pieces in state.items():
                for key, v in pieces.items():
                    v.copy_(_full_part(lay, self.rank, i, key, v, whole[self.names[i]][key]))

    # ----------------------------------------------------------------------------------------------- records
    def step_records(self, opt: Any, group: dict, index: int, device_steps: bool,
                     fresh: list) -> Optional[tuple[list[PieceRef], Group]]:
        """`skewadam.SkewAdam._init_group` for this partition: its state (allocated on its first step, listed in
        ``fresh``), then its records (`records`); None while it has no gradient."""
        if self.flat.grad is None:
            return None
        if opt.in_backward:
            raise ValueError("in_backward=True under DeepSpeed ZeRO: no rank holds a whole gradient inside backward "
                             "(ZeRO reduces them into partitions after it); set optimizer.in_backward = False")
        state = opt.state[self.flat]
        if not state:
            self.allocate(state, group, device_steps)
            fresh.append(self.flat)
        opt._zero.pending(fresh).append(self)
        return self.records(state, group, index)

    def records(self, state: dict, group: dict, where: int) -> tuple[list[PieceRef], Group]:
        """This step's records of the partition (the cut blocks exchanged first: a collective), from its allocated
        ``state``; ``where``: the group's index, for names."""
        flat, grad = self.flat, self.flat.grad
        self.unit_kinds = 1 + bool(group["relative_step"]) + (flat.dtype == torch.float64)  # sum p^2, max |g|
        held = self.held = self._exchange_in(grad) if self.cut else None
        spans = self.layout.spans[self.rank]
        refs, records, last = [], [], {}
        for box in self.layout.boxes(self.rank):
            i, t = box.tensor, self.layout.tensors[box.tensor]
            shape = t.box_shape(box)
            n = math.prod(shape)
            if box.scratch:
                at = next(at for b, at in self.cut if b.tensor == i and b.start == box.first(t))
                p, g = held[1, at:at + n].view(shape), held[0, at:at + n].view(shape)
            else:
                a, _, off = spans[i]
                o = off + box.first(t) - a
                p, g = flat[o:o + n].view(shape), grad[o:o + n].view(shape)
            views = self._views(box, state[i], last.get(i) == box.matrix, i in last and not t.bank
                                or last.get(i) == box.matrix)
            last[i] = box.matrix + box.matrices - 1
            name = (f"param group {where}: {self.names[i]} {t.shape}, rank {self.rank}'s "
                    f"{'cut block' if box.scratch else 'piece'} {tuple(box)}")
            records.append(ParamTensors(p, g, *views, t.view, t.bank, part_stream(self.first_id + i, box.first(t)),
                                        name))
            refs.append(PieceRef(self, box, len(shape)))
        b1, b2 = group["betas"]
        return refs, Group(records, group["lr"], b1, b2, group["eps"], group["eps_mode"], group["weight_decay"],
                           group["seed"], group["relative_step"], group["beta2_decay"])

    def _held_parts(self):
        """``(buffer offset, flat offset, length)`` of this rank's elements of each cut block."""
        spans = self.layout.spans[self.rank]
        for b, at in self.cut:
            if b.tensor in spans:
                a, e, off = spans[b.tensor]
                x0, x1 = max(a, b.start), min(e, b.stop)
                if x0 < x1:
                    yield at + x0 - b.start, off + x0 - a, x1 - x0

    def _exchange_in(self, grad: Tensor) -> Tensor:
        buf = torch.zeros(2, self.cut_numel, dtype=self.flat.dtype, device=self.flat.device)
        for at, o, n in self._held_parts():
            buf[0, at:at + n] = grad[o:o + n]
            buf[1, at:at + n] = self.flat.detach()[o:o + n]
        _all_reduce(buf, self)
        return buf

    def finish(self) -> None:
        """Send the cut blocks' new weights from their owners to every rank holding elements of them (a collective)."""
        if self.held is None:
            return
        out = torch.zeros(self.cut_numel, dtype=self.flat.dtype, device=self.flat.device)
        for b, at in self.cut:
            if b.owner == self.rank:
                out[at:at + b.stop - b.start] = self.held[1, at:at + b.stop - b.start]
        _all_reduce(out, self)
        with torch.no_grad():
            for at, o, n in self._held_parts():
                self.flat[o:o + n] = out[at:at + n]
        self.held = None


def zero_layouts(opt: Any) -> dict:
    """What `skewadam.SkewAdam.state_dict` adds under ZeRO: ``{"zero": {saved param index: where that partition's
    pieces lie}}`` (`Partition.describe`), so that the ranks' checkpoints merge into one process's (`merge_pieces`)."""
    zero = opt.__dict__.get("_zero")
    if zero is None:
        return {}
    params = [p for g in opt.param_groups for p in g["params"]]
    out = {k: part.describe() for k, p in enumerate(params) if (part := zero.of([p])) is not None}
    return {"zero": out} if out else {}


def merge_pieces(described: Sequence[dict], states: Sequence[dict], flats: Sequence[Tensor],
                 specs: Sequence[dict]) -> tuple[dict, dict]:
    """One partition's pieces on every rank merged into one process's: ``({name: master weight}, {name: state})``,
    from each rank's `Partition.describe`, its saved state (`Partition.allocate`'s) and its master partition
    (``flats``); ``specs``: each tensor's state as one process keeps it (`skewadam.state.TierSpec.spec`)."""
    first = described[0]
    tensors = [TensorLayout(*t) for t in first["tensors"]]
    lay = Layout(tensors, first["ranges"])
    weights = {n: torch.zeros(t.shape, dtype=flats[0].dtype) for n, t in zip(first["names"], tensors)}
    whole = {n: {k: torch.zeros(st.shape, dtype=st.dtype) for k, st in spec.items()}
             for n, spec in zip(first["names"], specs)}
    for d, state, flat in zip(described, states, flats):
        rank = d["rank"]
        for i, (a, b, off) in lay.spans[rank].items():
            weights[d["names"][i]].view(-1)[a:b] = flat[off:off + b - a]
        for i, pieces in state.items():
            for key, v in pieces.items():
                _full_part(lay, rank, i, key, v, whole[d["names"][i]][key]).copy_(v)
    return weights, whole


def _full_part(lay: Layout, rank: int, i: int, key: str, piece: Tensor, full: Tensor) -> Tensor:
    """The part of one process's state tensor ``full`` (``key`` of tensor ``i``) that ``rank``'s ``piece`` of it
    holds: its matrices of ``col_var`` and of a bank's step counts, its rows of what spans rows, all of the rest; a
    view where ``full`` is contiguous (`merge_pieces` writes through it)."""
    rows, mats = lay.rows(rank, i)
    if key == "col_var" or (key == "step" and lay.tensors[i].bank):
        return full.reshape(-1, *piece.shape[1:])[mats[0]:mats[1]]
    if piece.ndim and key != "step":
        return full.reshape(-1, *piece.shape[1:])[rows[0]:rows[1]]
    return full


def _all_reduce(t: Tensor, part: Partition, op=None) -> None:
    """All-reduce ``t`` over ``part``'s group (SUM, or ``op``), counted in its `ZeroSteps` (nothing on one rank)."""
    if part.layout.world > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=part.group)
        part.counts.collectives += 1
        part.counts.bytes += t.numel() * t.element_size()


class ZeroReducer:
    """The reducer of `skewadam.functional.skewadam_` for ZeRO partitions: sums the statistics two or more records
    share (`skewadam.pieces.Layout.shared`) over the data-parallel group, in place, in one buffer per seam; the
    orthogonal tier's units are whole on their owners, so its seam sends nothing. What it sends is counted in
    the partitions' `ZeroSteps`.

    Its calls are those of `skewadam.functional.skewadam_` on every rank: the first Adam-style call carries the sums
    before the moments, the second the sums of u^2 (`ZeroSteps.take` makes every rank step a record, so every rank
    makes both).
    """

    def __init__(self, parts: Sequence[Partition]) -> None:
        self.parts = list(parts)
        groups = {id(p.group) for p in self.parts}
        if len(groups) > 1:
            raise ValueError("one SkewAdam step over ZeRO partitions of different process groups: step each group "
                             "by itself, as DeepSpeed's engine does")
        self.calls = 0

    def __call__(self, items: list) -> None:
        if any(ref.box is not None and ref.part.layout.tensors[ref.box.tensor].orthogonal for ref, _ in items):
            return
        self.calls += 1
        moments = self.calls == 2
        offsets, size = {}, 0
        for p in self.parts:
            offsets[id(p)] = size
            size += len(p.units) if moments else len(p.units) * p.unit_kinds + 2 * len(p.matrices) + p.cols
        if not size:
            return
        dtype = state_dtype_for(self.parts[0].flat.dtype) if moments else torch.float64
        buf = torch.zeros(size, dtype=dtype, device=self.parts[0].flat.device)
        pairs = [(slot, stat) for ref, stats in items if ref.box is not None and ref.box.tensor in ref.part.sharing
                 for slot, stat in self._slots(ref, stats, offsets[id(ref.part)], moments)]
        for slot, stat in pairs:
            buf[slot].add_(stat)
        _all_reduce(buf, self.parts[0])
        for slot, stat in pairs:
            stat.copy_(buf[slot])

    @staticmethod
    def _slots(ref: PieceRef, stats: list, base: int, moments: bool):
        """``(buffer slice, statistic view)`` of each shared sum of one record: its stats are `skewadam.kernels.
        types.stat_dims`' (factored: sum g^2, the matrices' sums, row sums, column sums, sums of row_var, then
        further per-unit sums), or after the moments its sums of u^2."""
        part, box = ref.part, ref.box
        t = part.layout.tensors[box.tensor]
        nu, nx = len(part.units), len(part.matrices)
        for j, (stat, _) in enumerate(stats):
            flat = stat.view(-1)
            if moments or not t.factored or j in (0, 5, 6):  # per unit: [k] for a bank's k experts, else [1]
                kind = 0 if moments or j == 0 else (j - 4 if t.factored else j)
                for u in t.units(box.matrix, box.matrices):
                    if (box.tensor, u) in part.units:
                        s = base + part.units[(box.tensor, u)] * (1 if moments else part.unit_kinds) + kind
                        yield slice(s, s + 1), flat[u - box.matrix if t.bank else 0:][:1]
            elif j != 2:  # per matrix: sum g^2 (j = 1), column sums (3), sum row_var (4); row sums (2) stay local
                for m in range(box.matrix, box.matrix + box.matrices):
                    if (box.tensor, m) in part.matrices:
                        x, col = part.matrices[(box.tensor, m)]
                        k = m - box.matrix
                        if j == 3:
                            s = base + nu * part.unit_kinds + 2 * nx + col
                            yield slice(s, s + t.cols), flat[k * t.cols:(k + 1) * t.cols]
                        else:
                            s = base + nu * part.unit_kinds + 2 * x + (j == 4)
                            yield slice(s, s + 1), flat[k:k + 1]

    def all_finite(self, local: Tensor) -> Tensor:
        """Whether every rank's gradients are finite (MIN of the flags), as a 0-d bool tensor."""
        flag = local.to(dtype=torch.float32).reshape(1)
        _all_reduce(flag, self.parts[0], dist.ReduceOp.MIN)
        return flag[0] > 0


class ZeroStep(NamedTuple):
    """What `ZeroSteps.take` gives one step: the empty record every rank steps (``(record, params)`` of a
    `skewadam.functional.StepGroup`; none where no other rank takes part), the reducer (None then), the partitions."""

    empty: list[tuple[Group, list[PieceRef]]]
    reducer: Optional[ZeroReducer]
    parts: list[Partition]

    def run(self, step: Callable[[], Tensor]) -> Tensor:
        """``step()`` (`skewadam.functional.skewadam_` over the records and ``empty``), then the cut blocks' new
        weights back to the ranks that hold them (`Partition.finish`); returns the skip flag."""
        skipped = step()
        for p in self.parts:
            p.finish()
        return skipped


class ZeroSteps:
    """The ZeRO partitions of one optimizer (``optimizer._zero``, set by `skewadam.integrations.deepspeed`), the
    ones the step in progress records (`pending`), and what their collectives sent: ``collectives`` and ``bytes``
    (per-rank payload, every all-reduce: the cut blocks' exchange, the shared sums, the skip flag)."""

    def __init__(self) -> None:
        self.partitions: dict[int, Partition] = {}
        self._pending: tuple[Optional[list], list[Partition]] = (None, [])
        self.collectives = self.bytes = 0

    def pending(self, step: list) -> list[Partition]:
        """The partitions recorded by the step whose ``fresh`` list (`skewadam.SkewAdam._step`'s) is ``step``: a step
        that raised leaves none behind."""
        if self._pending[0] is not step:
            self._pending = (step, [])
        return self._pending[1]

    def add(self, part: Partition, group: dict) -> None:
        """Register ``part``, a partition of param group ``group``."""
        part.counts, part.param_group = self, group
        self.partitions[id(part.flat)] = part

    @property
    def tiers(self) -> dict[int, str]:
        """``id(flat partition)`` -> its group's tier (`skewadam.state.measure_state`)."""
        return {i: p.param_group["tier"] for i, p in self.partitions.items()}

    def of(self, params: Sequence[Tensor]) -> Optional[Partition]:
        """The partition of a group whose params are ``params`` (DeepSpeed's ``[flat partition]``), else None."""
        part = self.partitions.get(id(params[0])) if len(params) == 1 else None
        return part if part is not None and part.flat is params[0] else None

    def take(self, step: list) -> Optional[ZeroStep]:
        """The partitions the step of ``step`` (its ``fresh`` list) recorded, an empty record for every rank to
        step, their reducer; None if it recorded none. Partitions no other rank shares (one rank's whole groups:
        ZeRO-Offload on one process, experts no other rank holds) step as one process does: no reducer, the fused
        kernel."""
        parts = self.pending(step)
        self._pending = (None, [])
        if not parts:
            return None
        if all(p.layout.world == 1 for p in parts):
            return ZeroStep([], None, parts)
        flat = parts[0].flat
        dtype = state_dtype_for(flat.dtype)
        empty = torch.zeros(0, dtype=flat.dtype, device=flat.device)
        record = ParamTensors(empty, empty, torch.zeros((), dtype=torch.float32), None, None,
                              torch.zeros(0, dtype=dtype, device=flat.device), None, None, (0,), False, 0)
        return ZeroStep([(Group([record], 0.0, 0.9, 0.999, 1e-30, "add", 0.0, 0), [PieceRef(None, None, 1)])],
                        ZeroReducer(parts), parts)


def partition_of(opt: Any, group: dict, index: int) -> Optional[Partition]:
    """The ZeRO partition a param group's params are (DeepSpeed's ``[flat partition]``, registered in
    ``opt._zero``), or None for parameters ``opt.add_param_group`` saw; raises naming the fix for any other tensor: a
    wrapper swapped the group's parameters behind the optimizer's back (`skewadam.SkewAdam` keeps what it was given
    in ``_known``)."""
    zero = opt.__dict__.get("_zero")
    if zero is not None and (part := zero.of(group["params"])) is not None:
        return part
    known = opt.__dict__.get("_known")
    if known is None:  # a copy (deepcopy, pickle): its groups hold what the original was given
        known = opt._known = WeakIdKeyDictionary(dict.fromkeys(p for g in opt.param_groups for p in g["params"]))
    for i, p in enumerate(group["params"]):
        if p not in known:
            raise TypeError(
                f"param group {index} holds a tensor of shape {tuple(p.shape)} that SkewAdam was never given "
                f"(params[{i}]): its parameters were replaced behind its back, as deepspeed.initialize does under ZeRO "
                f"(flat 1-D partitions of many tensors, which lose the rows, columns and experts SkewAdam's statistics "
                f"need). Build the engine with skewadam.integrations.deepspeed.initialize(...), which takes "
                f"deepspeed.initialize's arguments; add other parameters with optimizer.add_param_group")
    return None
