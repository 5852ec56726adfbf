"""The one source of truth for the optimizer state a parameter holds.

`state_spec` says which tensors (name, shape, dtype) a parameter of a given shape keeps under a param group's
flags. `SkewAdam` allocates exactly these, and the memory planner (`skewadam.memory`) sums exactly these, so the two
cannot disagree. Names follow torch: ``step``, ``exp_avg`` (first moment), ``exp_avg_sq`` (full second moment),
``row_var`` ``[..., R, 1]`` and ``col_var`` ``[..., 1, C]`` (factored second moment, over the last two dims).

``momentum_dtype`` stores ``exp_avg`` compactly: ``"fp32"`` (the statistics dtype: fp32, or fp64 for fp64
parameters), ``"bf16"``, or ``"int8"`` (block-wise, with ``exp_avg_scale`` ``[..., ceil(C / 256)]``; tensors with
< 2 dims keep the statistics dtype, see `skewadam.kernels.quant`).

A *bank* is a stacked expert tensor ``[E, ...]`` whose slices along dim 0 are treated as separate experts: its
``step`` holds one count per slice, and whether a slice is factored depends on the slice's rank, not the bank's.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .kernels.quant import num_blocks

__all__ = ["StateTensor", "state_spec", "spec_nbytes", "is_bank", "is_factored", "state_dtype_for", "COUNTER_KEYS"]

#: State entries that are bookkeeping (step counts), reported apart from the statistics themselves.
COUNTER_KEYS = frozenset({"step"})


class StateTensor(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """Statistics live in fp32 for 16-bit parameters and in the parameter's own dtype otherwise."""
    return torch.float32 if param_dtype in (torch.bfloat16, torch.float16) else param_dtype


def is_bank(ndim: int, tier: str, bank: bool | None) -> bool:
    """A tensor is a bank when its group says so, or (``bank=None``) when it is an expert tensor with >= 3 dims."""
    if bank is None:
        return tier == "expert" and ndim >= 3
    return bank


def is_factored(shape: Sequence[int], *, use_factored: bool, bank: bool) -> bool:
    """Factored iff the group asks for it and the (slice) tensor has >= 2 dims."""
    slice_rank = len(shape) - 1 if bank else len(shape)
    return use_factored and slice_rank >= 2


def state_spec(
    shape: Sequence[int],
    param_dtype: torch.dtype,
    *,
    use_momentum: bool,
    use_factored: bool,
    bank: bool,
    momentum_dtype: str = "fp32",
) -> dict[str, StateTensor]:
    """The state tensors of one parameter, in allocation order.

    Example:
        >>> spec = state_spec((8, 64, 32), torch.bfloat16, use_momentum=False, use_factored=True, bank=True)
        >>> {k: v.shape for k, v in spec.items()}
        {'step': (8,), 'row_var': (8, 64, 1), 'col_var': (8, 1, 32)}
    """
    shape = tuple(int(s) for s in shape)
    dtype = state_dtype_for(param_dtype)
    spec = {"step": StateTensor((shape[0],) if bank else (), torch.float32)}
    if use_momentum:
        if momentum_dtype == "int8" and len(shape) >= 2:
            spec["exp_avg"] = StateTensor(shape, torch.int8)
            spec["exp_avg_scale"] = StateTensor(shape[:-1] + (num_blocks(shape[-1]),), torch.float32)
        else:
            spec["exp_avg"] = StateTensor(shape, torch.bfloat16 if momentum_dtype == "bf16" else dtype)
    if is_factored(shape, use_factored=use_factored, bank=bank):
        spec["row_var"] = StateTensor(shape[:-1] + (1,), dtype)
        spec["col_var"] = StateTensor(shape[:-2] + (1, shape[-1]), dtype)
    else:
        spec["exp_avg_sq"] = StateTensor(shape, dtype)
    return spec


def spec_nbytes(spec: dict[str, StateTensor]) -> tuple[int, int]:
    """``(statistics, counters)`` bytes of a `state_spec`: moments apart from step counts (the paper counts only the former)."""
    stats = sum(st.nbytes for key, st in spec.items() if key not in COUNTER_KEYS)
    return stats, sum(st.nbytes for key, st in spec.items() if key in COUNTER_KEYS)
