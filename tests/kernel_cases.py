"""The kernel tests' one fixture set (tests/test_kernels.py, tests/test_triton.py): the kernels that run here, the
parameters every kernel steps and their gradients, and records built from `state_spec` for the tests that call a
kernel's passes without the optimizer.

- `impl`: a fixture over `skewadam.kernels.cpu_backends(interpreted=True)`, every kernel usable here (without a GPU, the
  Triton kernel in Triton's interpreter: tests/conftest.py sets it); `three_pass`: one process's whole-step call, and
  the three passes of the distributed seam (`IDENTITY`: a reducer that sums nothing). Import them into a test module.
- `SPECS` ``(shape, tier, overrides)``: every rank, every tier, momentum and factoring switched both ways, banks on
  and off; its last two (`LARGE`) are units too large for one core's cache, which the C++ kernel splits across
  threads. `ZERO_SPECS`: tensors with a zero-size dim in every tier, beside `LIVE`.
- `step_grads`: per step, a seeded gradient per spec; slice 0 of every bank is idle (all zero) on odd steps.
- `ParamState` / `make_states`, `record_group`, `eager_step`: parameters with their state as a kernel's records
  (`skewadam.kernels.types`), and eager's step of such a group.
"""

from __future__ import annotations

import pytest
import torch

from skewadam import kernels
from skewadam.kernels import eager
from skewadam.kernels.types import Group, ParamTensors
from skewadam.state import is_bank, state_spec
from skewadam.tiers import TIER_STATE, Tier

__all__ = ["impl", "three_pass", "IDENTITY", "SPECS", "LARGE", "ZERO_SPECS", "LIVE", "step_grads", "ParamState",
           "make_states", "HP", "record_group", "eager_step"]


@pytest.fixture(params=kernels.cpu_backends(interpreted=True))
def impl(request) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["one-process", "three-pass"])
def three_pass(request) -> bool:
    return request.param


IDENTITY = lambda items: None  # noqa: E731 - a reducer that sums nothing: the three passes of one process

SPECS = [
    ((), "backbone", {}),
    ((7,), "backbone", {}),
    ((5, 9), "backbone", {}),
    ((2, 3, 4, 5), "backbone", {}),
    ((3, 5, 9), "expert", {}),
    ((4, 70, 130), "expert", {"use_momentum": True}),
    ((40,), "router", {}),
    ((6, 8), "router", {}),
    ((33, 17), "expert", {"use_factored": False}),
    ((3, 6, 10), "expert", {"bank": False}),
    ((2, 600, 600), "expert", {}),
    ((300, 1000), "backbone", {"use_factored": False}),
]
LARGE = SPECS[-2:]

ZERO_SPECS = [
    ((0,), "backbone", {}), ((0, 5), "backbone", {}), ((3, 0), "backbone", {}), ((0, 0), "backbone", {}),
    ((2, 0, 4), "backbone", {}), ((0, 5), "router", {}), ((3, 0), "router", {}), ((3, 0), "expert", {}),
    ((0, 5), "expert", {}), ((2, 0, 4), "expert", {}), ((0, 3, 4), "expert", {}),
    ((2, 3, 0), "expert", {"use_momentum": True}), ((0, 4), "expert", {"use_factored": False}),
    ((2, 0, 4), "expert", {"use_factored": False, "use_momentum": True}),
]
LIVE = ((5, 9), "backbone", {})


def _flags(tier: str, overrides: dict) -> dict:
    return {**TIER_STATE[Tier.parse(tier)], **overrides}


def _bank(shape, tier: str, overrides: dict) -> bool:
    return is_bank(len(shape), tier, overrides.get("bank"))


def step_grads(specs, steps: int, dtype: torch.dtype, seed: int = 0, device="cpu") -> list[list[torch.Tensor]]:
    """Per step, a gradient per spec (seeded normals); slice 0 of every bank is idle (all zero) on odd steps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        grads = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device) for shape, _, _ in specs]
        for g, spec in zip(grads, specs):
            if _bank(*spec) and k % 2 and g.shape[0]:
                g[0].zero_()
        out.append(grads)
    return out


class ParamState:
    """One parameter of spec ``(shape, tier, overrides)`` with its state (allocated from `state_spec`, step counts
    beside the parameter), as a kernel's record."""

    def __init__(self, shape, tier, overrides, dtype, momentum_dtype="fp32", seed=0, device="cpu"):
        flags = _flags(tier, overrides)
        self.momentum, self.factored = flags["use_momentum"], flags["use_factored"]
        self.bank = _bank(shape, tier, overrides)
        gen = torch.Generator().manual_seed(seed)
        self.param = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
        spec = state_spec(shape, dtype, use_momentum=self.momentum, use_factored=self.factored, bank=self.bank,
                          momentum_dtype=momentum_dtype)
        self.state = {k: torch.zeros(v.shape, dtype=v.dtype, device=device) for k, v in spec.items()}

    def record(self, grad, stream) -> ParamTensors:
        s = self.state
        return ParamTensors(self.param, grad, s["step"], s.get("exp_avg"), s.get("exp_avg_scale"),
                            s.get("exp_avg_sq"), s.get("row_var"), s.get("col_var"), tuple(self.param.shape),
                            self.bank, stream)

    def clone(self) -> "ParamState":
        other = object.__new__(ParamState)
        other.__dict__.update(self.__dict__)
        other.param = self.param.clone()
        other.state = {k: v.clone() for k, v in self.state.items()}
        return other


def make_states(specs, dtype, momentum_dtype="fp32", device="cpu") -> list[ParamState]:
    """A `ParamState` per spec, parameter ``i`` seeded with ``i``."""
    return [ParamState(s, t, o, dtype, momentum_dtype, seed=i, device=device) for i, (s, t, o) in enumerate(specs)]


HP = dict(lr=0.02, beta1=0.9, beta2=0.99, weight_decay=0.1, seed=3)


def record_group(states, grads, *, eps_mode="add", first=0, relative_step=False, beta2_decay=None, **hp) -> Group:
    """The `Group` record of ``states`` with ``grads`` (`HP` unless given; eps 1e-30 in "add" mode, 1e-8 in
    "floor"); parameter ``i`` draws rounding stream ``first + i``."""
    hp = {**HP, **hp}
    eps = hp.pop("eps", 1e-30 if eps_mode == "add" else 1e-8)
    return Group([p.record(g, first + i) for i, (p, g) in enumerate(zip(states, grads))], hp["lr"], hp["beta1"],
                 hp["beta2"], eps, eps_mode, hp["weight_decay"], hp["seed"], relative_step, beta2_decay)


def eager_step(g: Group) -> bool:
    """One step of `skewadam.kernels.eager` on a Group, skipped when a gradient is not finite, as the optimizer does.
    Returns whether it was skipped."""
    stats = eager.grad_stats(g)
    if not all(bool(s.sumsq.isfinite().all()) for s in stats):
        return True
    eager.apply_updates_(g, eager.update_moments_(g, stats))
    return False
