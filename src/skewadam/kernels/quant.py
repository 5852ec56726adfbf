"""Compact storage of the first moment: block-wise int8 with a per-block scale, or bf16.

int8 layout: blocks of ``BLOCK`` consecutive elements along the LAST dim (a row of ``C`` elements holds
``ceil(C / BLOCK)`` blocks, at least one), so blocks never straddle the leading dims that FSDP/expert parallelism
shard, and a bank slice never shares a block with its neighbour. Shapes: ``q [..., C]`` int8, ``scale [..., NB]`` fp32.

Values are companded with a signed square root before the linear int8 grid, which spends the 8 bits where momentum
mostly lives (small magnitudes): ``q = round(QMAX * sign(x) * sqrt(|x| / absmax))`` and
``x = sign(q) * (q / QMAX)^2 * absmax``, with ``absmax`` the block's largest magnitude (so the block's extreme is exact).

Every operation is one IEEE-rounded float operation, so the C++ kernel stores the same bytes: the code is chosen in fp32
(``|x| / absmax`` rounded to fp32) with a correctly rounded fp32 square root, taken as the fp64 root rounded to fp32
(torch's CPU ``sqrt`` goes through MKL's vector math, which is not correctly rounded: here ~20% of fp32 roots are one
ULP off, and which ones depends on the CPU; a faithful fp64 root rounded to fp32 is the correctly rounded fp32 root).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..state import BLOCK, num_blocks
from .rounding import Key, mix32, stochastic_round_bf16

__all__ = ["BLOCK", "QMAX", "MOMENTUM_STREAM", "num_blocks", "quantize_", "dequantize", "load_momentum",
           "store_momentum_"]

QMAX = 127.0  # the int8 grid's largest code
MOMENTUM_STREAM = 0x5BD1E995  # separates the momentum's rounding bits from the weight's (same param and step)


def _blocked(x: Tensor) -> list[tuple[Tensor, slice]]:
    """Views of ``[..., C]`` as blocks: ``([..., n, BLOCK], blocks)`` for the full ones and ``([..., 1, r], block)``
    for a partial last one (no copy, no padding: as a zero-padded block it has the same largest magnitude), each with
    its blocks' indices; C = 0 is one empty block, a zero-padded copy."""
    c = x.shape[-1]
    if c == 0:
        return [(F.pad(x, (0, BLOCK)).unsqueeze(-2), slice(0, 1))]
    full = c // BLOCK
    parts = [(x[..., : full * BLOCK].unflatten(-1, (full, BLOCK)), slice(0, full))] if full else []
    if c > full * BLOCK:
        parts.append((x[..., full * BLOCK:].unsqueeze(-2), slice(full, full + 1)))
    return parts


def quantize_(q: Tensor, scale: Tensor, x: Tensor) -> None:
    """Store ``x`` (the statistics dtype) into ``q`` (int8, same shape) and ``scale`` (``[..., NB]``), in place."""
    for (xb, blocks), (qb, _) in zip(_blocked(x), _blocked(q)):
        magnitude = xb.abs()
        absmax = magnitude.amax(dim=-1, keepdim=True)
        scale[..., blocks].copy_(absmax.squeeze(-1))
        ratio = magnitude.div_(absmax.clamp(min=torch.finfo(x.dtype).tiny)).to(torch.float32)
        qb.copy_(ratio.double().sqrt_().float().mul_(QMAX).round_().copysign_(xb))


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The fp32 (or ``dtype``) values that ``q`` and ``scale`` encode."""
    parts = []
    for qb, blocks in _blocked(q):
        code = qb.to(dtype).div_(QMAX)
        parts.append(code.abs().mul_(code).mul_(scale[..., blocks].unsqueeze(-1).to(dtype)).flatten(-2))
    return parts[0][..., : q.shape[-1]] if len(parts) == 1 else torch.cat(parts, -1)


def load_momentum(m: Tensor, scale: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """The first moment in the compute dtype, whatever its storage (a view when it is stored in that dtype)."""
    if m.dtype == torch.int8:
        return dequantize(m, scale, dtype)
    return m if m.dtype == dtype else m.to(dtype)


def store_momentum_(m: Tensor, scale: Optional[Tensor], x: Tensor, key: Key, offset: int = 0) -> None:
    """Write ``x`` into the first moment's storage: int8 block-wise, or bf16 with unbiased stochastic rounding
    (round-to-nearest would stall the EMA: ``(1 - beta1) * (g - m)`` is often below half a bf16 ULP of ``m``)."""
    if m.dtype == torch.int8:
        quantize_(m, scale, x)
    elif m.dtype == torch.bfloat16 and x.dtype != torch.bfloat16:
        m.copy_(stochastic_round_bf16(x, mix32(key + MOMENTUM_STREAM), offset))
    else:
        m.copy_(x)
