"""The SkewAdam configurations the generic optimizer-contract tests run over, in the manner of torch's ``optim_db``.

`CASES` is a table of `Case(kwargs, desc)`: constructor keyword arguments that change the code path (tier, explicit
state flags, bank handling, eps mode, weight decay). `DTYPES` lists the parameter dtypes each case runs in, and the
autouse fixture `every_impl` (import it into a test module) runs each test of the module on every kernel available
here (`skewadam.kernels.cpu_backends()`), as ``impl="auto"`` selects it.
`make_params` builds one parameter of every rank the optimizer must handle (0-d to a 4-D conv weight), optionally
non-contiguous, and `make_grads` fills their gradients from a seeded generator.

(torch's own ``torch.testing._internal.common_optimizers`` imports ``common_utils``, which needs the ``expecttest``
package that the torch wheel does not install; this table keeps the same shape without that dependency.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from skewadam import kernels

__all__ = ["Case", "CASES", "DTYPES", "SHAPES", "make_params", "make_grads", "case_id", "every_impl"]


class Case(NamedTuple):
    kwargs: dict[str, Any]
    desc: str


CASES: list[Case] = [
    Case({}, "default: backbone tier, momentum + factored, eps add (Adafactor's: accumulate g^2 + eps, no floor)"),
    Case({"tier": "expert"}, "expert tier: no momentum, factored; 3-d and 4-d tensors are banks"),
    Case({"tier": "router"}, "router tier: full exact second moment"),
    Case({"weight_decay": 0.1, "lr": 1e-2}, "decoupled weight decay"),
    Case({"eps_mode": "floor"}, "the paper's eps: the second moment floored at eps"),
    Case({"tier": "expert", "eps_mode": "add", "weight_decay": 0.05}, "expert banks with eps add and decay"),
    Case({"tier": "backbone", "use_momentum": False, "use_factored": False}, "explicit flags: plain RMSProp-like"),
    Case({"tier": "router", "use_momentum": True, "use_factored": True}, "explicit flags override the router tier"),
    Case({"tier": "expert", "bank": False}, "expert tier with banks off: each tensor is one unit"),
    Case({"betas": (0.5, 0.9), "lr": 3e-2}, "non-default betas and lr"),
    Case({"skip_nonfinite": False}, "non-finite check off"),
    Case({"relative_step": True, "weight_decay": 0.1}, "Adafactor's relative step: the passes one unit at a time"),
    Case({"tier": "expert", "beta2_decay": -0.8}, "Adafactor's second-moment decay, expert banks unit by unit"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.fixture(autouse=True, params=kernels.cpu_backends())
def every_impl(request, monkeypatch) -> str:
    """The kernel this run of the test uses: ``SKEWADAM_IMPL``, which ``impl="auto"`` (the default) follows."""
    monkeypatch.setenv("SKEWADAM_IMPL", request.param)
    return request.param

#: One tensor of each rank: 0-d, 1-d, 2-d, a 3-d stacked-expert tensor and a 4-D conv-like weight.
SHAPES: list[tuple[int, ...]] = [(), (5,), (6, 4), (3, 4, 5), (4, 2, 3, 3)]


def case_id(case: Case) -> str:
    return ",".join(f"{k}={v}" for k, v in case.kwargs.items()) or "default"


def make_params(dtype: torch.dtype, *, noncontiguous: bool = False, seed: int = 0) -> list[torch.nn.Parameter]:
    """Seeded parameters of every shape in `SHAPES`; with ``noncontiguous`` every tensor of >= 2 dims is a
    transposed (non-contiguous) leaf."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        if noncontiguous and len(shape) >= 2:
            t = torch.randn(shape[::-1], generator=gen, dtype=torch.float64).permute(*reversed(range(len(shape))))
            assert not t.is_contiguous() and t.shape == shape
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
        params.append(torch.nn.Parameter(t.to(dtype)))
    return params


def make_grads(params: list[torch.Tensor], gen: torch.Generator, scale: float = 1.0) -> None:
    """Set every parameter's ``.grad`` to seeded Gaussian noise of the given scale (in the parameter's dtype)."""
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.dtype)
