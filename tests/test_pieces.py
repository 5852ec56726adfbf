"""ZeRO's flat partitions as pieces of SkewAdam's tensors (`skewadam.pieces`): every element is stepped by exactly one
rank, in whole blocks; a rank keeps the state of what it steps, in the tensor's layout; only what two records hold
is shared; DeepSpeed's partitioning is reproduced (the planner's ZeRO figures rest on it)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from skewadam.pieces import Box, Layout, TensorLayout, zero_ranges
from skewadam.state import state_flags

SHAPES = [((7, 5), False, True, False), ((13,), False, False, False), ((), False, False, False),
          ((3, 7, 5), True, True, False), ((4, 6), True, False, False), ((2, 3, 4, 5), False, True, False),
          ((3, 6, 4), True, False, True), ((5, 9), False, False, True), ((1, 7), False, True, False),
          ((1,), False, False, False)]


def _layouts(seed: int):
    """Random groups of the shapes above under every stage and 1-5 ranks."""
    rng = random.Random(seed)
    tensors = [TensorLayout.of(s, bank=b, factored=f, orthogonal=o) for s, b, f, o in rng.sample(SHAPES, 5)]
    for stage, world in itertools.product((1, 2, 3), (1, 2, 3, 5)):
        yield tensors, Layout(tensors, zero_ranges([t.numel for t in tensors], world, stage=stage))


def _elements(t: TensorLayout, box: Box) -> range:
    return range(box.first(t), box.first(t) + math.prod(t.box_shape(box)))


@pytest.mark.parametrize("seed", range(6))
def test_every_element_is_stepped_by_one_rank_in_boxes_of_whole_blocks(seed):
    for tensors, lay in _layouts(seed):
        stepped = {i: [] for i in range(len(tensors))}
        for rank in range(lay.world):
            for box in lay.boxes(rank):
                t = tensors[box.tensor]
                elements = _elements(t, box)
                assert elements.start % t.block == 0 and len(elements) % t.block == 0, (t, box)
                lo, hi = lay.owned(rank, box.tensor)
                assert lo <= elements.start and elements.stop <= hi, (box, lo, hi)
                a, b, _ = lay.spans[rank][box.tensor]
                held = a <= elements.start and elements.stop <= b
                assert held != box.scratch, (box, a, b)  # scratch exactly where the rank does not hold it all
                stepped[box.tensor] += elements
        assert all(sorted(v) == list(range(tensors[i].numel)) for i, v in stepped.items())


@pytest.mark.parametrize("seed", range(6))
def test_a_cut_block_is_stepped_in_scratch_by_the_rank_holding_its_first_element(seed):
    for tensors, lay in _layouts(seed):
        scratch = [(r, b.tensor, b.first(tensors[b.tensor])) for r in range(lay.world)
                   for b in lay.boxes(r) if b.scratch]
        assert sorted(scratch) == sorted((c.owner, c.tensor, c.start) for c in lay.cut_blocks())
        for c in lay.cut_blocks():
            a, b, _ = lay.spans[c.owner][c.tensor]
            assert a <= c.start < b < c.stop, c


@pytest.mark.parametrize("seed", range(6))
def test_the_ranks_state_concatenates_into_one_process_s_and_shares_only_cut_matrices(seed):
    """Row-spanning state: the ranks' rows add up to the tensor's; per-matrix and per-expert state: a copy on each
    rank holding rows of the matrix, so extra copies exist only for matrices the ranks split."""
    flags = state_flags({"tier": "backbone", "momentum_dtype": "int8"})
    for tensors, lay in _layouts(seed):
        for i, t in enumerate(tensors):
            spec = flags._replace(tier="expert" if t.bank else "backbone", bank=t.bank).spec(t.shape, torch.float32)
            shapes = [lay.state_shapes(r, i, spec) for r in range(lay.world)]
            rows = sum(s["exp_avg"].shape[0] if s["exp_avg"].shape else 1 for s in shapes if s)
            assert rows == t.numel // t.cols, (t, shapes)
            if "col_var" in spec:  # a copy per rank holding rows of the matrix: one extra per boundary at most
                copies = sum(s["col_var"].shape[0] for s in shapes if s)
                holders = {(r, m) for r in range(lay.world) for b in lay.boxes(r) if b.tensor == i
                           for m in range(b.matrix, b.matrix + b.matrices)}
                matrices = t.numel // (t.cols * t.rows_per_matrix)
                assert copies == len(holders) <= matrices + lay.world - 1, (t, shapes)


def test_only_entities_two_records_hold_are_shared():
    t = TensorLayout.of((3, 7, 5), bank=True, factored=True, orthogonal=False)
    lay = Layout([t], [[(0, 0, 54, 0)], [(0, 54, 105, 0)]])  # the boundary in expert 1, row 3
    assert lay.shared(0) == ([1], [1])
    assert lay.boxes(0) == [Box(0, 0, 1, 0, 7), Box(0, 1, 1, 0, 3), Box(0, 1, 1, 3, 1, scratch=True)]
    assert lay.boxes(1) == [Box(0, 1, 1, 4, 3), Box(0, 2, 1, 0, 7)]
    whole = Layout([t], [[(0, 0, 105, 0)]])
    assert whole.shared(0) == ([], []) and whole.boxes(0) == [Box(0, 0, 3, 0, 7)] and not whole.cut_blocks()


def test_the_orthogonal_tier_owns_whole_matrices_and_shares_nothing():
    t = TensorLayout.of((3, 6, 4), bank=True, factored=False, orthogonal=True)
    lay = Layout([t], [[(0, 0, 30, 0)], [(0, 30, 72, 0)]])  # the boundary in expert 1
    assert lay.boxes(0) == [Box(0, 0, 1, 0, 6), Box(0, 1, 1, 0, 6, scratch=True)]
    assert lay.boxes(1) == [Box(0, 2, 1, 0, 6)] and lay.shared(0) == ([], [])


def test_what_a_step_sends_is_the_cut_blocks_and_the_shared_sums():
    """A [7, 5] matrix cut in row 4: the row's 5 gradients and weights in, 5 weights out (4 bytes each); the shared
    unit's sum of g^2 and the matrix's two sums and 5 column sums (8 bytes each), the unit's sum of u^2 (4), the
    skip flag (4); five all-reduces."""
    t = TensorLayout.of((7, 5), bank=False, factored=True, orthogonal=False)
    lay = Layout([t], zero_ranges([35], 2, stage=1))
    assert lay.traffic() == (12 * 5, 8 * (1 + 2 + 5) + 4, 4, 5)
    assert lay.traffic(relative_step=True).reduced == 8 * (2 + 2 + 5) + 4


def test_zero_ranges_cut_as_deepspeed_does():
    """Stages 1/2: the group padded to a multiple of 2 * world elements, equal partitions; stage 3: each tensor in
    parts of ceil(numel / world), the last rank's part padded."""
    assert zero_ranges([35, 7], 2, stage=2) == [[(0, 0, 22, 0)], [(0, 22, 35, 0), (1, 0, 7, 13)]]
    assert zero_ranges([35, 7, 1], 2, stage=3) == [[(0, 0, 18, 0), (1, 0, 4, 18), (2, 0, 1, 22)],
                                                   [(0, 18, 35, 0), (1, 4, 7, 18)]]


def test_runs_that_do_not_cover_a_tensor_exactly_once_are_refused():
    t = TensorLayout.of((4, 6), bank=False, factored=True, orthogonal=False)
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        Layout([t], [[(0, 0, 12, 0)], [(0, 13, 24, 0)]])
    with pytest.raises(ValueError, match="ZeRO partitions of banks"):
        TensorLayout.of((2, 3, 4, 5), bank=True, factored=True, orthogonal=False)
