r"""Where ZeRO's flat partitions cut SkewAdam's tensors, and what each rank steps, keeps and sends: layout arithmetic
only (no process group, no kernel), shared by the ZeRO runtime (`skewadam.zero`) and the planner.

DeepSpeed ZeRO hands each rank one flat 1-D partition per param group (per parameter under stage 3): a run of
elements that may start and end anywhere in a tensor (mid-row, mid-expert, mid-bank). `Layout` maps every rank's run
back to pieces of the tensors, in three rules:

- **Blocks are owned whole.** A tensor is cut into blocks: rows (its last dim, ``C`` elements) for the Adam-style
  tiers, so a row's sum, its ``row_var`` and its int8 scale blocks never span ranks; units (a matrix, a bank's expert)
  for the orthogonal tier, which orthogonalises whole matrices; elements for 0-d and 1-D tensors. A block belongs to
  the rank whose run holds its first element. A block that a run boundary cuts (a *cut block*: at most one per
  boundary) is stepped whole by its owner, which receives the other ranks' elements of it (gradients and master
  weights) before the step and returns their new values after it (`Layout.cut_blocks`).
- **Records are boxes.** A rank steps its owned blocks as at most three boxes per tensor (whole rows of a partial
  first matrix, whole matrices, whole rows of a partial last matrix) plus a scratch box for the cut block it owns
  (`Layout.boxes`). Each box is an ordinary record to the kernels, with the tensor's global shape (`TensorLayout.view`).
- **Shared statistics are summed.** A unit (a bank's expert, else the whole tensor) or a factored matrix that two or
  more boxes cover, on one rank or several, gets its partial sums added over the data-parallel group (`Layout.shared`):
  the per-unit sums (``sum g^2``, the clip's ``sum u^2``), and a matrix's column sums, ``sum g^2`` and ``sum row_var``.
  Row sums never cross ranks (rows are whole), nor does anything of a tensor one box holds.

A rank keeps the state of its owned blocks in the tensor's layout (`Layout.state_shapes`): what spans rows (momentum, a
full second moment, ``row_var``, int8 scales) as rows ``[rows, ...]`` of the tensor viewed ``[M*R, C]``; ``col_var``
per matrix and a bank's ``step`` per expert it holds rows of; a tensor's ``step`` count. The ranks' states of one tensor
concatenate by rows into one process's (a matrix whose rows two ranks hold keeps a ``col_var`` on each), which is what
makes checkpoints move across world sizes.

Shape legend: ``M`` matrices (a bank's experts, a tensor's leading dims), ``R`` rows per matrix, ``C`` columns.

Example:
    >>> lay = Layout([TensorLayout.of((4, 6), bank=False, factored=True, orthogonal=False)],
    ...              [[(0, 0, 15, 0)], [(0, 15, 24, 0)]])  # rank 0 holds elements 0-14, rank 1 15-23
    >>> lay.boxes(0)  # rows 0-1 in place, row 2 (elements 12-17) whole in scratch
    [Box(tensor=0, matrix=0, matrices=1, row=0, rows=2, scratch=False), Box(..., row=2, rows=1, scratch=True)]
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Mapping, NamedTuple, Sequence

from .state import StateTensor, TierSpec

__all__ = ["TensorLayout", "Box", "CutBlock", "Layout", "Traffic", "zero_ranges", "partition_numel"]


class TensorLayout(NamedTuple):
    """One tensor of a partitioned param group, as its records see it."""

    shape: tuple[int, ...]  # the parameter's own shape
    view: tuple[int, ...]  # the records' global shape: (), (N,), (R, C), (M, R, C), a bank's (E, C) or (E, R, C)
    bank: bool
    factored: bool
    orthogonal: bool

    @classmethod
    def of(cls, shape: Sequence[int], *, bank: bool, factored: bool, orthogonal: bool,
           experts: int | None = None) -> "TensorLayout":
        """The layout of a parameter of ``shape`` (``experts``: a flattened bank ``[E*D, ...]``, viewed ``[E, D,
        ...]``); raises ValueError for a bank that is not 2-D or 3-D (its experts would not be rows of matrices)."""
        shape = tuple(int(s) for s in shape)
        view = (experts, shape[0] // experts, *shape[1:]) if experts is not None else shape
        if bank and len(view) not in (2, 3):
            raise ValueError(f"a bank of shape {shape} under ZeRO: SkewAdam steps ZeRO partitions of banks [E, C] and "
                             f"[E, R, C]; put this tensor in a group with bank=False, or reshape it")
        if not bank and len(view) > 3:
            view = (math.prod(view[:-2]), *view[-2:])
        return cls(shape, view, bank, factored and len(view) - bank >= 2, orthogonal)

    @classmethod
    def for_spec(cls, shape: Sequence[int], spec: TierSpec) -> "TensorLayout":
        """The layout of a parameter of ``shape`` in a param group of `skewadam.state.TierSpec` ``spec``."""
        return cls.of(shape, bank=spec.is_bank(len(shape)), factored=spec.use_factored,
                      orthogonal=spec.update == "orthogonal", experts=spec.experts)

    @property
    def numel(self) -> int:
        return math.prod(self.view)

    @property
    def cols(self) -> int:
        """``C``: elements per row (1 for 0-d and 1-D tensors, whose rows are their elements)."""
        return self.view[-1] if len(self.view) >= 2 else 1

    @property
    def rows_per_matrix(self) -> int:
        """``R``: rows of one matrix (a 2-D bank's expert is one row; a 1-D tensor is one matrix of N rows)."""
        if len(self.view) == 3 or (len(self.view) == 2 and not self.bank):
            return self.view[-2]
        return self.view[0] if len(self.view) == 1 else 1

    @property
    def block(self) -> int:
        """Elements per block owned whole: a unit (orthogonal tier), a row (other tensors of >= 2 dims), else 1."""
        if self.orthogonal:
            return self.rows_per_matrix * self.cols
        return self.cols if len(self.view) >= 2 else 1

    def box_shape(self, box: "Box") -> tuple[int, ...]:
        """A record's local shape (its global shape is `view`)."""
        if len(self.view) == 3:
            return (box.matrices, box.rows, self.cols)
        if len(self.view) == 2:
            return (box.matrices, self.cols) if self.bank else (box.rows, self.cols)
        return (box.rows,) if self.view else ()

    def units(self, matrix: int, matrices: int) -> range:
        """The units (clip, step count) of matrices ``[matrix, matrix + matrices)``: those matrices for a bank, the
        tensor (unit 0) otherwise."""
        return range(matrix, matrix + matrices) if self.bank else range(1)


class Box(NamedTuple):
    """One record of a rank: ``rows`` rows from row ``row`` of each of ``matrices`` matrices from ``matrix`` (a 1-D
    tensor: ``rows`` elements from element ``row``); ``scratch``: a cut block, stepped in a buffer of its own."""

    tensor: int
    matrix: int
    matrices: int
    row: int
    rows: int
    scratch: bool = False

    def first(self, t: TensorLayout) -> int:
        """Its first element in the tensor (row-major)."""
        return (self.matrix * t.rows_per_matrix + self.row) * t.cols


class CutBlock(NamedTuple):
    """A block that a run boundary cuts: elements ``[start, stop)`` of tensor ``tensor``, stepped by rank ``owner``."""

    tensor: int
    start: int
    stop: int
    owner: int


class Traffic(NamedTuple):
    """What one step of a partitioned group sends, per rank (each an all-reduce over the data-parallel group)."""

    exchange: int  # bytes of the cut blocks' gradients and master weights in, their new weights out (two collectives)
    reduced: int  # bytes of the shared statistics: float64 sums before the moments, sums of u^2 after them
    flag: int  # the 4-byte flag that skips a non-finite step on every rank together
    collectives: int

    @property
    def total(self) -> int:
        return self.exchange + self.reduced + self.flag


def _boxes(tensor: int, start: int, stop: int, r: int) -> list[Box]:
    """Rows ``[start, stop)`` (of the tensor's ``[M*R, C]`` rows, ``r`` per matrix) as boxes: a partial first
    matrix, whole matrices, a partial last matrix."""
    out, t = [], start
    while t < stop:
        m, row = divmod(t, r)
        if row == 0 and stop - t >= r:
            k = (stop - t) // r
            out.append(Box(tensor, m, k, 0, r))
            t += k * r
        else:
            n = min(r - row, stop - t)
            out.append(Box(tensor, m, 1, row, n))
            t += n
    return out


class Layout:
    """Every rank's pieces of one partitioned param group.

    Args:
        tensors: the group's tensors, in its order (`TensorLayout`).
        ranges: per rank, its runs ``(tensor, start, stop, offset)``: elements ``[start, stop)`` of tensor ``tensor``
            at ``offset`` of that rank's flat partition (what `zero_ranges` computes for DeepSpeed's partitioning).
    """

    def __init__(self, tensors: Sequence[TensorLayout], ranges: Sequence[Sequence[tuple[int, int, int, int]]]):
        self.tensors = list(tensors)
        self.world = len(ranges)
        self.spans: list[dict[int, tuple[int, int, int]]] = []  # per rank: tensor -> (start, stop, offset)
        for runs in ranges:
            spans = {}
            for i, a, b, off in runs:
                if i in spans or not 0 <= a < b <= self.tensors[i].numel:
                    raise ValueError(f"rank {len(self.spans)}: run {(i, a, b, off)} is not one run within tensor {i} "
                                     f"of {self.tensors[i].numel} elements")
                spans[i] = (a, b, off)
            self.spans.append(spans)
        for i, t in enumerate(self.tensors):
            held = sorted((s[i][0], s[i][1]) for s in self.spans if i in s)
            if t.numel and (not held or held[0][0] != 0 or held[-1][1] != t.numel
                            or any(x[1] != y[0] for x, y in zip(held, held[1:]))):
                raise ValueError(f"tensor {i} {t.shape}: the ranks' runs {held} do not cover it exactly once")
        self._boxes = [self._rank_boxes(r) for r in range(self.world)]
        counts: Counter = Counter()
        for boxes in self._boxes:
            for b in boxes:
                t = self.tensors[b.tensor]
                counts.update(("unit", b.tensor, u) for u in t.units(b.matrix, b.matrices))
                if t.factored:
                    counts.update(("matrix", b.tensor, m) for m in range(b.matrix, b.matrix + b.matrices))
        self._shared = {key for key, n in counts.items() if n > 1}

    def owned(self, rank: int, tensor: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the blocks ``rank`` owns of ``tensor`` (empty: ``lo >= hi``)."""
        if tensor not in self.spans[rank]:
            return 0, 0
        a, b, _ = self.spans[rank][tensor]
        g = self.tensors[tensor].block
        return -(-a // g) * g, -(-b // g) * g

    def rows(self, rank: int, tensor: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The rows ``[r0, r1)`` (elements, of a 1-D tensor) and matrices ``[m0, m1)`` of ``tensor`` that ``rank``
        keeps state of: those of the blocks it owns."""
        lo, hi = self.owned(rank, tensor)
        t = self.tensors[tensor]
        rows = (lo // t.cols, hi // t.cols)
        return rows, (rows[0] // t.rows_per_matrix, -(-rows[1] // t.rows_per_matrix))

    def _rank_boxes(self, rank: int) -> list[Box]:
        out = []
        for i in sorted(self.spans[rank]):
            t, (lo, hi), (_, b, _) = self.tensors[i], self.owned(rank, i), self.spans[rank][i]
            if lo >= hi:
                continue
            c, r = t.cols, t.rows_per_matrix
            whole = max(lo, b // t.block * t.block)  # the end of the owned blocks this rank holds whole
            out += _boxes(i, lo // c, whole // c, r)
            if whole < hi:  # the last owned block runs past this rank's run: a cut block, in scratch
                row = whole // c
                out.append(Box(i, row // r, 1, row % r, t.block // c, scratch=True))
        return out

    def boxes(self, rank: int) -> list[Box]:
        """The records ``rank`` steps, in tensor order (a cut block's scratch box after the tensor's others)."""
        return self._boxes[rank]

    def shared(self, tensor: int) -> tuple[list[int], list[int]]:
        """``(units, matrices)`` of ``tensor`` whose statistics two or more boxes (on any ranks) hold partial sums of;
        matrices only for a factored tensor."""
        units = sorted(u for kind, i, u in self._shared if kind == "unit" and i == tensor)
        return units, sorted(m for kind, i, m in self._shared if kind == "matrix" and i == tensor)

    def cut_blocks(self) -> list[CutBlock]:
        """Every block a run boundary cuts, in tensor order, with its owner."""
        out = []
        for i, t in enumerate(self.tensors):
            g = t.block
            for rank, spans in enumerate(self.spans):
                if i in spans and spans[i][0] % g:  # a run starting inside a block: the block is cut
                    start = spans[i][0] // g * g
                    owner = next(r for r, s in enumerate(self.spans) if i in s and s[i][0] <= start < s[i][1])
                    if not out or out[-1][:2] != (i, start):
                        out.append(CutBlock(i, start, start + g, owner))
        return out

    def state_shapes(self, rank: int, tensor: int, spec: Mapping[str, StateTensor]) -> dict[str, StateTensor]:
        """The state ``rank`` keeps of ``tensor`` (none if it owns no block), from the whole tensor's ``spec``
        (`skewadam.state.TierSpec.spec`): rows of the row-spanning state, ``col_var`` per matrix and a bank's
        ``step`` per expert it holds rows of, a tensor's ``step``."""
        lo, hi = self.owned(rank, tensor)
        if lo >= hi:
            return {}
        t = self.tensors[tensor]
        rows, mats = self.rows(rank, tensor)
        out = {}
        for key, st in spec.items():
            if key == "step":
                shape = (mats[1] - mats[0],) if t.bank else ()
            elif len(t.view) < 2:
                shape = (hi - lo,) if t.view else ()
            elif key == "col_var":
                shape = (mats[1] - mats[0], 1, t.cols)
            else:  # spans the rows: momentum, full second moment, row_var, int8 scales
                shape = (rows[1] - rows[0], st.shape[-1])
            out[key] = StateTensor(shape, st.dtype)
        return out

    def traffic(self, *, relative_step: bool = False, stats_bytes: int = 4) -> Traffic:
        """Bytes one step sends per rank (`Traffic`): the cut blocks (4-byte master weights and gradients), the shared
        float64 sums (one per shared unit, ``2 + C`` per shared matrix; ``relative_step`` adds the sum of p^2 per
        unit) and sums of u^2 in the state dtype (``stats_bytes``), the skip flag."""
        cut = sum(b.stop - b.start for b in self.cut_blocks())
        units = matrices = 0
        for i, t in enumerate(self.tensors):
            u, m = self.shared(i)
            units += len(u)
            matrices += len(m) * (2 + t.cols)
        reduced = 8 * (units * (1 + relative_step) + matrices) + stats_bytes * units
        collectives = 1 + 2 * bool(cut) + 2 * bool(units)  # (a shared matrix's unit is shared too)
        return Traffic(3 * 4 * cut, reduced, 4, collectives)


def zero_ranges(sizes: Sequence[int], world: int, *, stage: int, alignment: int = 2) -> list[list[tuple]]:
    """Every rank's runs ``(tensor, start, stop, offset)`` of tensors of ``sizes`` elements as DeepSpeed 0.19 cuts
    them: stages 1 and 2 flatten the group in order, padded to a multiple of ``alignment * world`` elements, into
    ``world`` equal partitions; stage 3 cuts each tensor into ``world`` parts of ``ceil(numel / world)`` elements
    (the last padded), a rank's parts next to each other in its partition."""
    out: list[list[tuple]] = [[] for _ in range(world)]
    if stage == 3:
        offsets = [0] * world
        for i, n in enumerate(sizes):
            part = partition_numel([n], world, stage=3)
            for r in range(world):
                a, b = min(n, r * part), min(n, (r + 1) * part)
                if a < b:
                    out[r].append((i, a, b, offsets[r]))
                offsets[r] += part
        return out
    part = partition_numel(sizes, world, stage=stage, alignment=alignment)
    start = 0
    for i, n in enumerate(sizes):
        for r in range(world):
            a, b = max(start, r * part), min(start + n, (r + 1) * part)
            if a < b:
                out[r].append((i, a - start, b - start, a - r * part))
        start += n
    return out


def partition_numel(sizes: Sequence[int], world: int, *, stage: int, alignment: int = 2) -> int:
    """Elements of each rank's partition of tensors of ``sizes`` as DeepSpeed 0.19 cuts them (`zero_ranges`),
    padding included."""
    if stage == 3:
        return sum(-(-n // world) for n in sizes)
    return -(-sum(sizes) // (alignment * world)) * alignment
