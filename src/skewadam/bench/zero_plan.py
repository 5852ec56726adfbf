"""The planner's DeepSpeed ZeRO figures for SkewAdam (`skewadam plan MODEL --zero {1,2,3} --shards N`): what each rank
holds and sends when `skewadam.integrations.deepspeed` steps ZeRO's partitions as pieces of the tensors.

The groups are `skewadam.SkewAdam.from_model`'s (`skewadam.groups.group_members`), each partitioned as DeepSpeed 0.19
partitions it (`skewadam.pieces.zero_ranges`); each rank's state is what `skewadam.pieces.Layout.state_shapes` gives it
(the optimizer allocates exactly that) and its traffic what `skewadam.pieces.Layout.traffic` counts (the optimizer's
collectives send exactly that). DeepSpeed's own buffers are modelled as its ZeRO paper states them: every rank holds
the 16- or 32-bit weights whole under stages 1 and 2 and its partition under stage 3, an fp32 master partition, and
its gradients whole under stage 1, a partition under stages 2 and 3.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..classify import Labels
from ..groups import group_members, group_settings
from ..pieces import Layout, TensorLayout, partition_numel, zero_ranges
from ..state import state_flags
from . import arms

__all__ = ["ZeroPlan", "zero_plan"]


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Bytes per rank of one SkewAdam arm under DeepSpeed ZeRO ``stage`` over ``ranks`` ranks."""

    stage: int
    ranks: int
    params: int  # the model's weights a rank holds (whole under stages 1/2, its partition under 3)
    master: int  # its fp32 master partition
    grads: int  # the gradients it holds after backward (whole under stage 1, its partition under 2/3)
    state: int  # SkewAdam's state of the rank that keeps the most
    state_ranks: int  # SkewAdam's state over all the ranks (one process keeps `skewadam.state.StateBytes.total`)
    sent: int  # what a rank all-reduces per step: cut blocks, shared sums, skip flags (`skewadam.pieces.Traffic`)
    collectives: int  # all-reduces per step (DeepSpeed steps one param group at a time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def zero_plan(arm: arms.Arm, found: Labels, orth: set[str], *, stage: int, ranks: int, itemsize: int) -> ZeroPlan:
    """`ZeroPlan` of SkewAdam ``arm`` (``arm.options``, ``arm.tier_options``) on the labelled model ``found``, with
    the tensors ``orth`` in orthogonal groups, weights of ``itemsize`` bytes.

    Example:
        >>> zero_plan(arms.get("skewadam"), label(model), set(), stage=2, ranks=8, itemsize=2).state
    """
    if stage not in (1, 2, 3) or ranks < 1:
        raise ValueError(f"zero={stage}, shards={ranks}: ZeRO stages are 1, 2 and 3, over at least 1 rank")
    state, part, sent, collectives = [0] * ranks, 0, 0, 0
    relative = bool(arm.options.get("relative_step"))
    for tier, names, _, experts, orthogonal in group_members(found, orth):
        spec = state_flags(group_settings(tier, orthogonal, arm.options, dict(arm.tier_options), {}))
        spec = spec._replace(experts=experts)
        shapes = [tuple(found.trainable[n].shape) for n in names]
        tensors = [TensorLayout.for_spec(s, spec) for s in shapes]
        sizes = [math.prod(s) for s in shapes]
        layout = Layout(tensors, zero_ranges(sizes, ranks, stage=stage))
        for r in range(ranks):
            state[r] += sum(st.nbytes for i, s in enumerate(shapes)
                            for st in layout.state_shapes(r, i, spec.spec(s, torch.float32)).values())
        part += partition_numel(sizes, ranks, stage=stage)
        traffic = layout.traffic(relative_step=relative)
        sent, collectives = sent + traffic.total, collectives + traffic.collectives
    whole = sum(found.trainable[n].numel() for n in found.tiers) * itemsize
    return ZeroPlan(stage, ranks, whole if stage < 3 else part * itemsize, part * 4,
                    whole if stage == 1 else part * itemsize, max(state), sum(state), sent, collectives)
