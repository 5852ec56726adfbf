"""The eager kernels (`skewadam.kernels.eager`, what runs on GPUs): chunked processing of large tensors is bitwise the
whole tensor and bounds a step's temporaries; a step reads no device value on the host but the documented finite check.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import skewadam.kernels.eager as eager
from skewadam import SkewAdam

# (shape, param-group overrides): an embedding-like matrix with momentum (fp32, int8, bf16 storage), a 1-D tensor, a bank
# with an idle slice each step, a 3-D tensor that is not a bank, and a router (full second moment).
CHUNKED = [
    ((600, 40), {}),
    ((600, 40), {"momentum_dtype": "int8"}),
    ((600, 40), {"momentum_dtype": "bf16"}),
    ((5000,), {}),
    ((7, 6, 300), {"tier": "expert", "use_momentum": True}),
    ((6, 20, 30), {"tier": "expert", "bank": False}),
    ((300, 50), {"tier": "router"}),
]


def _train(specs, dtype, steps=4):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s, _ in specs]
    opt = SkewAdam([{"params": [p], **o} for p, (_, o) in zip(params, specs)], lr=1e-2, weight_decay=0.1,
                   impl="eager")
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            if p.ndim == 3 and p.shape[0] == 7:
                p.grad[k % 7] = 0  # an expert that received no token
        opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_processing_is_bitwise_the_whole_tensor(monkeypatch, dtype):
    # The rule: sums are taken per block of BLOCK_NUMEL (fixed by the shape), chunks hold whole blocks, so CHUNK_NUMEL
    # (the memory knob) changes nothing. Small blocks here, so each tensor has many.
    specs = CHUNKED
    monkeypatch.setattr(eager, "BLOCK_NUMEL", 1 << 10)
    whole, opt_w = _train(specs, dtype)
    monkeypatch.setattr(eager, "CHUNK_NUMEL", 2 * 1000 + 7)  # two blocks of a matrix, a ragged last chunk
    for shape, _ in specs:
        assert len(eager._chunks(shape)) > 1, shape
    chunked, opt_c = _train(specs, dtype)
    for (shape, _), a, b in zip(specs, whole, chunked):
        assert torch.equal(a.view(-1).float(), b.view(-1).float()), shape
        for key, value in opt_w.state[a].items():
            assert torch.equal(value, opt_c.state[b][key]), (shape, key)


def _transient(opt) -> int:
    from skewadam.bench.bench_step import step_transient_bytes

    transient = step_transient_bytes(opt)
    if transient is None:
        pytest.skip("this torch's profiler does not report allocations")
    return transient


def test_eager_step_temporaries_are_bounded_by_the_chunk_not_the_tensor(monkeypatch):
    # An embedding-sized bf16 matrix with fp32 momentum (a backbone tensor): processed whole, a step allocates about
    # ten fp32 copies of it (9.5 measured); in chunks, about ten fp32 copies of a chunk plus its row/column statistics.
    shape = (2048, 512)
    fp32_copy = 4 * shape[0] * shape[1]

    def step_bytes() -> int:
        p = torch.nn.Parameter(torch.randn(shape).bfloat16())
        opt = SkewAdam([p], lr=1e-3, weight_decay=0.1, impl="eager")
        p.grad = torch.randn_like(p)
        opt.step()  # allocates the state
        p.grad = torch.randn_like(p)
        return _transient(opt)

    monkeypatch.setattr(eager, "BLOCK_NUMEL", 1 << 14)
    whole = step_bytes()
    monkeypatch.setattr(eager, "CHUNK_NUMEL", 1 << 16)  # 16 chunks of 128 rows
    chunked = step_bytes()
    chunk_copy = 4 * (1 << 16)
    assert whole > 5 * fp32_copy, whole  # the measure can fail: whole-tensor temporaries are several copies
    assert chunked <= 12 * chunk_copy + 64 * shape[0], (chunked, chunk_copy)


class _HostReads(TorchDispatchMode):
    """Counts reads of device values on the host (``.item()``, ``bool()``: aten._local_scalar_dense) of non-CPU
    tensors, answering them with 0/False, so a step on the meta device runs through and shows where it would sync."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type != "cpu":
            self.reads += 1
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


# Every path of an eager step: banks (device step counts: bias corrections and bf16 rounding keys on the device),
# factored and full second moments, bf16/int8 momentum, bf16 weights, a tensor lr on the device.
META_GROUPS = [
    {"shape": (4, 16, 8), "tier": "expert", "dtype": torch.bfloat16},
    {"shape": (4, 16, 8), "tier": "expert", "use_momentum": True, "momentum_dtype": "bf16", "dtype": torch.float32},
    {"shape": (32, 16), "tier": "backbone", "momentum_dtype": "int8", "dtype": torch.bfloat16},
    {"shape": (32, 16), "tier": "backbone", "momentum_dtype": "bf16", "dtype": torch.float32},
    {"shape": (16,), "tier": "backbone", "dtype": torch.bfloat16},
    {"shape": (4, 16), "tier": "router", "dtype": torch.float32},
]


@pytest.mark.parametrize("skip_nonfinite,reads", [(False, 0), (True, 1)])
@pytest.mark.parametrize("three_pass", [False, True], ids=["one-process", "three-pass"])
def test_an_eager_step_reads_no_device_value_but_the_finite_check(skip_nonfinite, reads, three_pass):
    params, groups = [], []
    for spec in META_GROUPS:
        spec = dict(spec)
        shape, dtype = spec.pop("shape"), spec.pop("dtype")
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        params.append(p)
        groups.append({"params": [p], **spec})
    opt = SkewAdam(groups, lr=1e-3, weight_decay=0.1, skip_nonfinite=skip_nonfinite)
    if three_pass:
        opt._reducer = lambda items: None  # the distributed seam's passes, with the optimizer's finite check
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device="meta")  # as torch.compile'd loops and schedulers keep it
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        with _HostReads() as mode:
            opt.step()
        assert mode.reads == reads
    assert opt.state[params[0]]["step"].device.type == "meta"  # a bank's step counts stay on its device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_eager_step_on_cuda_runs_under_sync_debug_mode_error():
    params = [torch.nn.Parameter(torch.randn(spec["shape"], device="cuda").to(spec["dtype"])) for spec in META_GROUPS]
    groups = [{"params": [p], **{k: v for k, v in spec.items() if k not in ("shape", "dtype")}}
              for p, spec in zip(params, META_GROUPS)]
    opt = SkewAdam(groups, lr=1e-3, skip_nonfinite=False)
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device="cuda")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state allocation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
