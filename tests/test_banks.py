"""Expert banks ``[E, ...]`` behave exactly like E separate expert parameters (the paper's ModuleList of experts).

Per slice: its own RMS clip, its own step count (bias correction), and an all-zero gradient slice (an expert that
received no token) leaves the slice's weights, statistics and step count untouched, weight decay included, just as a
separate expert with ``grad=None`` is skipped. Shape legend: E experts, R rows, C columns, D model dim, F hidden dim,
N tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_db import every_impl  # noqa: F401 (autouse fixture: every test on every kernel)
from skewadam import SkewAdam

E, R, C = 4, 6, 5
#: Experts that receive no token at each step (3 never does); expert 1 gets a 100x gradient (its clip binds).
IDLE = [{3}, {0, 3}, {3}, {1, 2, 3}, {3}, {2, 3}, {0, 3}, {3}, {0, 3}, {3}]
SCALE_E = torch.tensor([1.0, 100.0, 0.01, 1.0]).view(E, 1, 1)


def _train_bank_and_separate(flags: dict, *, bank_flag=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    w0_ERC = torch.randn(E, R, C, generator=gen, dtype=torch.float64).to(dtype)
    bank = nn.Parameter(w0_ERC.clone())
    experts = [nn.Parameter(w0_ERC[e].clone()) for e in range(E)]
    kwargs = dict(lr=1e-2, weight_decay=0.1, **flags)
    opt_bank = SkewAdam([{"params": [bank], "tier": "expert", "bank": bank_flag}], **kwargs)
    opt_sep = SkewAdam([{"params": experts, "tier": "expert"}], **kwargs)
    for t, idle in enumerate(IDLE):
        grad_ERC = (torch.randn(E, R, C, generator=gen, dtype=torch.float64) * SCALE_E * (30.0 if t == 5 else 1.0))
        grad_ERC = grad_ERC.to(dtype)
        for e in idle:
            grad_ERC[e] = 0.0
        bank.grad = grad_ERC
        for e, p in enumerate(experts):
            p.grad = None if e in idle else grad_ERC[e].clone()
        opt_bank.step()
        opt_sep.step()
    return w0_ERC, bank, opt_bank, experts, opt_sep


@pytest.mark.parametrize("eps_mode", ["floor", "add"])
@pytest.mark.parametrize("flags", [{}, {"use_momentum": True}, {"use_factored": False}], ids=["factored", "momentum",
                                                                                              "full"])
def test_bank_equals_separate_experts_bitwise(flags, eps_mode):
    w0_ERC, bank, opt_bank, experts, opt_sep = _train_bank_and_separate({**flags, "eps_mode": eps_mode})
    state = opt_bank.state[bank]
    expected_steps = [sum(e not in idle for idle in IDLE) for e in range(E)]
    assert state["step"].tolist() == expected_steps  # per-slice step counts: [7, 9, 8, 0]
    for e, p in enumerate(experts):
        assert torch.equal(bank.detach()[e], p.detach()), e
        sep_state = opt_sep.state[p] if p in opt_sep.state else None
        if expected_steps[e] == 0:
            assert sep_state is None
            assert torch.equal(bank.detach()[e], w0_ERC[e])  # never routed: not even decayed
            assert all(not v[e].any() for v in state.values())
            continue
        assert sep_state.keys() == state.keys()
        for key, value in sep_state.items():
            assert torch.equal(state[key][e], value), (e, key)


def test_idle_slice_keeps_its_weights_and_state_through_a_step():
    gen = torch.Generator().manual_seed(1)
    bank = nn.Parameter(torch.randn(E, R, C, generator=gen))
    opt = SkewAdam([{"params": [bank], "tier": "expert"}], lr=1e-2, weight_decay=0.5, use_momentum=True)
    bank.grad = torch.randn(E, R, C, generator=gen)
    opt.step()
    before = bank.detach().clone(), {k: v.clone() for k, v in opt.state[bank].items()}
    bank.grad = torch.randn(E, R, C, generator=gen)
    bank.grad[2] = 0.0
    opt.step()
    assert torch.equal(bank.detach()[2], before[0][2])
    for key, value in opt.state[bank].items():
        assert torch.equal(value[2], before[1][key][2]), key
        assert not torch.equal(value[0], before[1][key][0]), key  # active slices did move
    assert opt.state[bank]["step"].tolist() == [2, 2, 1, 2]


def test_bank_off_clips_the_tensor_as_one_unit_and_differs_from_separate_experts():
    """Sensitivity check of the equivalence above: without the bank rule the same tensor does not match."""
    _, bank, opt_bank, experts, _ = _train_bank_and_separate({}, bank_flag=False)
    assert opt_bank.state[bank]["step"].shape == ()
    assert not torch.equal(bank.detach()[0], experts[0].detach())
    assert not torch.equal(bank.detach()[3], experts[3].detach())  # the idle expert was decayed and updated


@pytest.mark.parametrize(
    "tier,shape,bank,step_shape",
    [
        ("expert", (E, R, C), None, (E,)),
        ("expert", (2, E, R, C), None, (2,)),
        ("expert", (R, C), None, ()),
        ("backbone", (E, R, C), None, ()),
        ("router", (E, R, C), None, ()),
        ("expert", (E, R, C), False, ()),
        ("backbone", (E, C), True, (E,)),
    ],
)
def test_bank_rule_expert_tensors_with_3_or_more_dims_unless_overridden(tier, shape, bank, step_shape):
    p = nn.Parameter(torch.zeros(shape))
    opt = SkewAdam([{"params": [p], "tier": tier, "bank": bank}])
    p.grad = torch.ones(shape)
    opt.step()
    assert opt.state[p]["step"].shape == step_shape


# ------------------------------------------------------------------------------- a real MoE layer through backward
def _expert_ffn(x_ND, w1_FD, w2_DF):
    return F.silu(x_ND @ w1_FD.T) @ w2_DF.T


class _Expert(nn.Module):
    def __init__(self, w1_FD, w2_DF):
        super().__init__()
        self.w1 = nn.Parameter(w1_FD.clone())
        self.w2 = nn.Parameter(w2_DF.clone())

    def forward(self, x_ND):
        return _expert_ffn(x_ND, self.w1, self.w2)


class _MoE(nn.Module):
    """Top-1 MoE FFN; experts stacked as banks ``w1 [E, F, D]``, ``w2 [E, D, F]``, or kept as a ModuleList."""

    def __init__(self, router_ED, w1_EFD, w2_EDF, *, stacked: bool):
        super().__init__()
        self.router = nn.Linear(router_ED.shape[1], router_ED.shape[0], bias=False)
        self.router.weight.data.copy_(router_ED)
        self.stacked = stacked
        if stacked:
            self.w1 = nn.Parameter(w1_EFD.clone())
            self.w2 = nn.Parameter(w2_EDF.clone())
        else:
            self.experts = nn.ModuleList(_Expert(a, b) for a, b in zip(w1_EFD, w2_EDF))

    def forward(self, x_ND):
        probs_NE = self.router(x_ND).softmax(-1)
        top_N = probs_NE.argmax(-1)
        out_ND = torch.zeros_like(x_ND)
        for e in range(probs_NE.shape[1]):
            idx = (top_N == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue  # no token: a ModuleList expert gets grad=None, a bank slice a zero gradient
            y = _expert_ffn(x_ND[idx], self.w1[e], self.w2[e]) if self.stacked else self.experts[e](x_ND[idx])
            out_ND = out_ND.index_add(0, idx, y * probs_NE[idx, e : e + 1])
        return out_ND

    def groups(self):
        experts = [self.w1, self.w2] if self.stacked else list(self.experts.parameters())
        return [{"params": experts, "tier": "expert"}, {"params": [self.router.weight], "tier": "router"}]


def test_bank_moe_trains_like_modulelist_moe():
    D, Fh, N = 8, 12, 5
    gen = torch.Generator().manual_seed(0)
    router_ED = torch.randn(E, D, generator=gen)
    w1_EFD, w2_EDF = torch.randn(E, Fh, D, generator=gen) * 0.3, torch.randn(E, D, Fh, generator=gen) * 0.3
    stacked = _MoE(router_ED, w1_EFD, w2_EDF, stacked=True)
    listed = _MoE(router_ED, w1_EFD, w2_EDF, stacked=False)
    opts = [SkewAdam(m.groups(), lr=1e-2, weight_decay=0.1) for m in (stacked, listed)]
    idle_events = 0
    for _ in range(8):
        x_ND, target_ND = torch.randn(N, D, generator=gen), torch.randn(N, D, generator=gen)
        for model, opt in zip((stacked, listed), opts):
            opt.zero_grad()
            F.mse_loss(model(x_ND), target_ND).backward()
            opt.step()
        idle_events += sum(ex.w1.grad is None for ex in listed.experts)
        for e, ex in enumerate(listed.experts):
            assert (ex.w1.grad is None) == (not stacked.w1.grad[e].any())
    assert idle_events > 0  # some expert did sit out, so the skip path was exercised
    assert torch.equal(stacked.router.weight, listed.router.weight)
    for e, ex in enumerate(listed.experts):
        assert torch.equal(stacked.w1.detach()[e], ex.w1.detach()), e
        assert torch.equal(stacked.w2.detach()[e], ex.w2.detach()), e
        steps = opts[1].state[ex.w1]["step"].item() if ex.w1 in opts[1].state else 0
        assert opts[0].state[stacked.w1]["step"][e].item() == steps
