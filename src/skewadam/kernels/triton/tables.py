"""Host side of the Triton kernels: the checks before any launch, the buckets a group is split into, and the tensor
table the kernels read addresses, sizes and hyperparameters from.

Checks, from shapes and metadata only (no device read): `types.check` on every record (the sizes every index is
computed from, their dtypes and devices, naming the parameter), `types.check_lr`, then what the tables assume beyond
(one device for the whole group, the step counts included; a non-contiguous parameter, gradient or state tensor goes
through a contiguous copy, written back where the pass writes).
A bucket holds the tensors of one group that share the compiled code: (parameter dtype, kind, first-moment format).
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import NamedTuple, Optional, Sequence

import torch
import triton.language as tl
from torch import Tensor

from .. import quant
from ...state import state_dtype_for
from ..rounding import mix32
from ..triton_layout import TABLE_WIDTH, Layout, bucket_key, layout, upload, weighted
from ..types import ROW_MEAN_FLOOR, Group, MomFmt, ParamTensors, check, check_lr
from .device import TAB_G, TAB_M, TAB_P, TAB_V, addr

TILE = 4096  # elements per tile of the item kernels
TL = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
      torch.int8: tl.int8}
_LR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # a tensor lr's, read in the kernel
_STATE = ("step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var")


class Bucket(NamedTuple):
    """Tensors of one group that share the compiled code: parameter dtype, kind, first-moment format."""

    index: list[int]  # positions in the group
    layout: Layout
    pd: torch.dtype  # parameter (and gradient) dtype
    T: torch.dtype  # math and statistics dtype
    mom: MomFmt
    md: torch.dtype  # first-moment storage dtype (T when absent)

    @property
    def factored(self) -> bool:
        return self.layout.kind == "factored"

    @property
    def weighted(self) -> bool:
        """`triton_layout.weighted`: its units take ``sum u^2`` from weighted column sums."""
        return weighted(self.layout.kind, self.mom, self.T)

    def tiles(self) -> dict[str, int]:
        """Tile shapes of the item kernels: [RB, BC] (rows layouts; BC one int8 block for int8 momentum) or [BLOCK],
        from a few sizes only (each is a compiled variant)."""
        widths = (16, 64, 256)
        bc = quant.BLOCK if self.mom == MomFmt.INT8 else next(w for w in widths if w >= min(self.layout.max_c, 256))
        return dict(RB=TILE // bc, BC=bc, BLOCK=TILE)


class Work(NamedTuple):
    """One group's call: its buckets, and the tensors the kernels read and write (contiguous)."""

    group: Group
    buckets: list[Bucket]
    params: list[Tensor]  # contiguous: the parameter itself or a copy written back by `written`
    grads: list[Tensor]
    states: list[dict[str, Optional[Tensor]]]  # per parameter, `_STATE` contiguous, as `params`
    device: torch.device


def prepare(group: Group, *, write: bool) -> Work:
    """Check every record of ``group`` (`skewadam.kernels.types.check`: the sizes the kernels index with; then the
    dtypes, devices and layouts they assume) and the lr, then bucket the tensors. Nothing is launched before."""
    if not isinstance(group, Group):
        raise TypeError(f"the Triton kernel takes a skewadam.kernels.types.Group, got {type(group).__name__}")
    if group.eps_mode not in ("add", "floor"):
        raise ValueError(f"eps_mode must be 'add' or 'floor', got {group.eps_mode!r}")
    check_lr(group.lr)
    if isinstance(group.lr, Tensor) and group.lr.dtype not in _LR_DTYPES:
        raise TypeError(f"a tensor lr must be floating point, got {group.lr.dtype}")
    params = list(group.params)
    for pt in params:
        check(pt)
    device = params[0].param.device if params else torch.device("cpu")
    if params:
        check_device(device)
    keyed: dict[tuple, list[int]] = {}
    for i, pt in enumerate(params):
        keyed.setdefault(_bucket_key(pt, i, device), []).append(i)
    buckets = []
    for (pd, T, kind, mom, md), index in keyed.items():
        specs = tuple((tuple(params[i].param.shape), bool(params[i].bank)) for i in index)
        buckets.append(Bucket(index, layout(specs, kind), pd, T, mom, md))
    reads_param = write or group.relative_step  # (pass 1 of a relative step sums p^2)
    works = [pt.param if pt.param.is_contiguous() or not reads_param else pt.param.contiguous() for pt in params]
    grads = [pt.grad.contiguous() for pt in params]
    states = [{k: _contiguous(getattr(pt, k)) for k in _STATE} for pt in params]
    return Work(group, buckets, works, grads, states, device)


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return t if t is None or t.is_contiguous() else t.contiguous()


def on(device: torch.device):
    """Launch on ``device``: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def written(work: Work, *, state: bool, params: bool) -> None:
    """After the launches that write them: write back the state (``state``) and the parameters (``params``) updated
    through a contiguous copy, and bump the version counters of the others, as torch's in-place ops do, so autograd
    refuses a backward through a tensor the step changed (the kernels write through raw addresses)."""
    pairs = []
    if state:
        pairs += [(getattr(pt, k), used[k]) for pt, used in zip(work.group.params, work.states) for k in _STATE]
    if params:
        pairs += list(zip((pt.param for pt in work.group.params), work.params))
    bump = []
    for t, used in pairs:
        if used is not t:
            t.copy_(used)  # (an in-place op: it bumps the version itself)
        elif t is not None:
            bump.append(t)
    if bump:
        torch.autograd.graph.increment_version(bump)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` was set before ``triton`` was first
    imported (Triton decorates its own library then) and before this package was."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(addr, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the kernels can run on tensors on ``device``: CUDA with a GPU, or CPU under the interpreter."""
    device = torch.device(device)
    if device.type == "cpu":
        return interpreted()
    return device.type == "cuda" and torch.cuda.is_available()


def check_device(device: torch.device) -> None:
    """Raise unless the kernels run on ``device``'s tensors (CUDA, or CPU under the interpreter)."""
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return
    if device.type == "cpu":
        raise ValueError("the Triton kernel runs on CUDA tensors; for CPU tensors use impl='eager' or 'cpp' (or, to "
                         "test it, set TRITON_INTERPRET=1 before triton is first imported)")
    raise ValueError(f"the Triton kernel runs on CUDA tensors, got tensors on {device}; use impl='eager'")


def _bucket_key(pt: ParamTensors, i: int, device: torch.device) -> tuple:
    """The bucket key of one parameter that `check` has accepted (sizes, dtypes, each tensor on its parameter's
    device), after checking what the tables assume beyond it: every tensor on the group's one device, the step count
    too (non-contiguous tensors go through copies)."""
    p = pt.param
    where = pt.name or f"parameter {i} of its group"
    if p.device != device:
        raise ValueError(f"{where}: the parameter is on {p.device}, other parameters of the group on {device}")
    if pt.step.device != device:
        raise ValueError(f"{where}: step is on {pt.step.device}, the parameters on {device}; the Triton kernel "
                         "advances step counts on the parameters' device, with no host sync: keep state['step'] on "
                         "the parameter's device")
    m = pt.exp_avg
    return (p.dtype, state_dtype_for(p.dtype),
            *bucket_key(p.dtype, pt.row_var is not None, None if m is None else m.dtype))


def _key_base(seed: int, stream: int) -> int:
    """``rounding_key(seed, stream, step) == mix32(base + step)``: the part that does not depend on the step."""
    return mix32(mix32(seed) ^ stream)


def addrs(base: Tensor, offsets: Sequence[int]) -> list[int]:
    """Addresses of elements ``offsets`` of ``base``."""
    p, size = base.data_ptr(), base.element_size()
    return [p + o * size for o in offsets]


def _ptr(t: Optional[Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


class Table(NamedTuple):
    tensor: Tensor  # the header row, then one row per tensor of the bucket
    aligned: bool  # parameter-sized tensors 16-byte aligned, rows and items multiples of 8 elements


def tensor_table(b: Bucket, work: Work, stats: list[list[int]], moments: list[list[int]]) -> Table:
    """The hyperparameters, then one row per tensor of the bucket: addresses (``stats``: sumsq, rc, rvs, row, col,
    psq, amax; ``moments``: u_sumsq, corr, scale, rinv, cinv, active; absent ones 0), then sizes."""
    rows = [_header(work.group, work.device)]
    L, seed = b.layout, work.group.seed
    for j, i in enumerate(b.index):
        pt, st = work.group.params[i], work.states[i]
        E, R, C, NB = L.dims[j]
        shape = pt.shape
        ng = math.prod(shape[1:] if pt.bank else shape)
        rows.append([
            work.params[i].data_ptr(), work.grads[i].data_ptr(),
            *(_ptr(st[k]) for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "row_var", "col_var", "step")),
            *stats[j], *moments[j],
            E, R, C, NB, shape[-2] if b.factored else 1, shape[-1] if shape else 1, ng, int(bool(pt.bank)),
            _key_base(seed, pt.stream), L.unit0[j],
        ])
    aligned = L.aligned8 and all(r[c] % 16 == 0 for r in rows[1:] for c in (TAB_P, TAB_G, TAB_M, TAB_V))
    return Table(upload(rows, work.device), aligned)


def _header(group: Group, device: torch.device) -> list[int]:
    """Row 0 of a tensor table: the group's hyperparameters as float64 bits (and the lr tensor's address: the
    kernel reads it on the device; a tensor elsewhere, on the host, is read here, which is no device sync)."""
    lr, lr_addr = group.lr, 0
    if isinstance(lr, Tensor):
        if lr.device == device:
            lr_addr, lr = lr.data_ptr(), 0.0
        else:
            lr = float(lr)
    add, floor = (group.eps, 0.0) if group.eps_mode == "add" else (0.0, group.eps)
    rm_floor = ROW_MEAN_FLOOR if group.eps_mode == "floor" else torch.finfo(torch.float64).tiny  # (of a float64)
    decay = group.beta2_decay if group.beta2_decay is not None else 0.0
    values = [1.0 - group.beta1, 1.0 - group.beta2, group.beta1, group.beta2, add, floor, rm_floor, float(lr),
              group.weight_decay, decay]
    bits = [struct.unpack("<q", struct.pack("<d", float(v)))[0] for v in values]
    return bits + [lr_addr] + [0] * (TABLE_WIDTH - len(bits) - 1)
