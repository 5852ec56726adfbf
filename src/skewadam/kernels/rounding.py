"""Unbiased stochastic rounding of fp32 to bf16, from a counter-based hash.

A bf16 number is the top 16 bits of an fp32 one. Adding a uniform integer ``r`` in ``[0, 2^16)`` to the fp32 bit
pattern and truncating the low 16 bits rounds the magnitude up with probability ``low16 / 2^16``, which makes the
rounding exactly unbiased: ``E[round(x)] = x`` (carries into the exponent are handled by the integer add). A NaN
becomes 0x7FC0 whatever its sign and payload (the add alone could carry a NaN into inf, or past the sign bit to zero).

The random bits are a pure function of ``(key, element index)``: one 32-bit hash of ``(key, index // 2)`` serves two
neighbouring elements (low half for even, high half for odd indices). ``key`` mixes the seed, the parameter's index
in the optimizer and its step count, so a resumed run draws the same bits as an uninterrupted one, with no generator
state to save, and every implementation (torch ops here, the C++ kernel) produces identical bits. A key may be a
Python int or a 0-d int64 tensor (computed on the device from a bank's step counts: no host sync).
Arithmetic is modulo 2^32 on int64 tensors with multipliers below 2^31, so no product overflows.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

__all__ = ["mix32", "rounding_key", "part_stream", "stochastic_round_bf16"]

_M32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D  # multipliers of the "lowbias32" family, both < 2^31
_MUL2 = 0x2C1B3C6D
_GOLDEN = 0x61C88647  # 2^32 - floor(2^32 / phi)
_NAN_BF16 = 0x7FC0  # every NaN, as c10::BFloat16 writes it

Key = Union[int, Tensor]


def mix32(x: Key) -> Key:
    """A 32-bit integer finaliser of a Python int, or of an int64 tensor (a new tensor; `_mix32_` works in place)."""
    if isinstance(x, Tensor):
        return _mix32_(x.to(torch.int64).bitwise_and(_M32))
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    x ^= x >> 16
    return x


def rounding_key(seed: int, param_index: int, step: Key) -> Key:
    """The per-(parameter, step) key; ``step`` is the parameter's step count after this update (summed over a bank's
    slices), a Python int or an integer tensor (then the key is a 0-d int64 tensor on its device)."""
    return mix32(mix32(mix32(seed) ^ param_index) + step)


def part_stream(index: int, first: int) -> int:
    """The stream (``param_index`` of `rounding_key`) of the part of parameter ``index`` that starts at its element
    ``first`` (row-major), when a tensor is stepped in parts (shards, partitions): ``index`` itself for the part
    starting at element 0, so that one process draws what it always drew, else ``index`` mixed with ``first``, so
    that parts draw independent bits (the same local positions would otherwise round alike)."""
    return index if first == 0 else index ^ mix32(mix32(first) ^ (first >> 32))


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` on an int64 tensor holding values in [0, 2^32), in place."""
    x.bitwise_xor_(x >> 16).mul_(_MUL1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(_MUL2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def stochastic_round_bf16(x: torch.Tensor, key: Key, offset: int = 0) -> torch.Tensor:
    """Round the fp32 tensor ``x`` to bf16, unbiased; element ``i`` (row-major) draws the bits of index
    ``offset + i``, so a tensor rounded in pieces draws exactly the bits it would draw whole.

    Example:
        >>> x = torch.full((100_000,), 1.0 + 2**-10)
        >>> stochastic_round_bf16(x, key=1).float().mean()  # ~ 1.0009766, though every output is 1.0 or 1.0078125
    """
    n, shape = x.numel(), x.shape
    first, skip = offset >> 1, offset & 1
    pair = torch.arange(first, (offset + n + 1) >> 1, device=x.device, dtype=torch.int64)
    h = _mix32_(pair.mul_(_GOLDEN).add_(key).bitwise_and_(_M32))
    r = torch.stack((h & 0xFFFF, h >> 16), dim=-1).view(-1)[skip : skip + n].to(torch.int32)
    x = x.contiguous().view(-1)
    hi = (x.view(torch.int32) + r).bitwise_right_shift_(16).to(torch.int16)  # the high half: the bf16 bits
    return torch.where(x.isnan(), _NAN_BF16, hi).view(torch.bfloat16).view(shape)
