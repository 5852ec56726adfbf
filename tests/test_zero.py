"""SkewAdam stepping a flat partition as pieces of its tensors (`skewadam.zero`), in one process, on every kernel: a
group's tensors flattened into one buffer (one rank holding them all, as DeepSpeed's bf16 master weights under ZeRO
stage 0) step bitwise as the tensors do; a group whose parameters were swapped behind the optimizer's back is
refused at the first step, with nothing changed. The partitions of several ranks are tested on 2 ranks
(tests/distributed/test_deepspeed_distributed.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optim_db import every_impl  # noqa: F401  (every test here runs on every kernel)
from skewadam import SkewAdam
from skewadam.pieces import Layout, TensorLayout
from skewadam.state import state_flags
from skewadam.zero import Partition, ZeroSteps

SHAPES = [(), (5,), (6, 4), (3, 4, 5), (4, 2, 3, 3)]
GROUPS = [
    {"tier": "backbone", "weight_decay": 0.1},
    {"tier": "backbone", "momentum_dtype": "int8", "relative_step": True},
    {"tier": "expert", "use_momentum": True, "momentum_dtype": "bf16", "beta2_decay": -0.8},
    {"tier": "router"},
]


def _params(seed: int, shapes=SHAPES) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _as_partition(opt: SkewAdam, params: list[nn.Parameter]) -> torch.Tensor:
    """Swap ``opt``'s one group for a flat buffer of ``params`` registered as one rank's partition holding all."""
    group = opt.param_groups[0]
    flat = torch.cat([p.detach().reshape(-1) for p in params]).requires_grad_()
    tensors = [TensorLayout.for_spec(p.shape, state_flags(group)) for p in params]
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
    layout = Layout(tensors, [[(i, 0, p.numel(), offsets[i]) for i, p in enumerate(params)]])
    zero = ZeroSteps()
    zero.add(Partition(flat, layout, 0, None, 0, [f"tensor {i}" for i in range(len(params))]), group["tier"])
    opt._zero = zero
    group["params"] = [flat]
    return flat


@pytest.mark.parametrize("settings", GROUPS, ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items()))
def test_a_flat_partition_holding_whole_tensors_steps_bitwise_as_the_tensors(settings):
    shapes = [s for s in SHAPES if not (settings["tier"] == "expert" and len(s) == 4)]  # (4-D banks: refused)
    ref_params = _params(0, shapes)
    ref = SkewAdam([{"params": ref_params, **settings}], lr=1e-2)
    opt = SkewAdam([{"params": _params(0, shapes), **settings}], lr=1e-2)
    flat = _as_partition(opt, opt.param_groups[0]["params"])
    for step in range(4):
        grads = _params(10 + step, shapes)
        for p, g in zip(ref_params, grads):
            p.grad = g.detach() * (step != 1 or p.ndim < 3)  # banks idle on step 1
        flat.grad = torch.cat([p.grad.reshape(-1) for p in ref_params])
        ref.step()
        opt.step()
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in ref_params]))
    pieces = opt.state[flat]
    for i, p in enumerate(ref_params):
        for key, value in ref.state[p].items():
            assert torch.equal(pieces[i][key].reshape(value.shape), value), (i, key)


def test_a_group_whose_parameters_were_swapped_is_refused_at_the_first_step_naming_the_deepspeed_drop_in():
    params = _params(0)
    opt = SkewAdam([{"params": params[:3]}, {"params": params[3:], "tier": "expert"}])
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    flat = torch.zeros(7, requires_grad=True)
    flat.grad = torch.ones(7)
    opt.param_groups[1]["params"] = [flat]  # what deepspeed.initialize does under ZeRO
    with pytest.raises(TypeError, match=r"skewadam\.integrations\.deepspeed\.initialize") as e:
        opt.step()
    assert "param group 1" in str(e.value) and "shape (7,)" in str(e.value)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


def test_a_copy_of_the_optimizer_steps_the_parameters_it_was_given():
    """deepcopy (and pickle) keep what the optimizer was given: the copy's own parameters are not refused."""
    params = _params(0)
    opt = copy.deepcopy(SkewAdam([{"params": params}]))
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(opt.state) == len(params)


def test_a_partition_refuses_the_state_of_another_partitioning_naming_consolidate():
    """A rank's checkpoint holds the state of the tensors it owned pieces of: loaded where the partitions lie
    otherwise (another world size), it is refused naming the converter, before anything is loaded."""
    params = _params(0, [(6, 4), (5,)])
    opt = SkewAdam([{"params": params}], lr=1e-2)
    flat = _as_partition(opt, params)
    flat.grad = torch.ones_like(flat)
    opt.step()
    saved = opt.state_dict()
    other = SkewAdam([{"params": _params(1, [(6, 4), (5,)])}], lr=1e-2)
    group = other.param_groups[0]
    tensors = [TensorLayout.for_spec(p.shape, state_flags(group)) for p in group["params"]]
    two_ranks = Layout(tensors, [[(0, 0, 14, 0)], [(0, 14, 24, 0), (1, 0, 5, 10)]])  # rank 0 owns rows 0-2 only
    zero = ZeroSteps()
    zero.add(Partition(torch.zeros(14, requires_grad=True), two_ranks, 0, None, 0, ["w", "b"]), group)
    other._zero, group["params"] = zero, [next(iter(zero.partitions.values())).flat]
    with pytest.raises(ValueError, match="another world size.*consolidate"):
        other.load_state_dict(saved)
    assert not other.state
