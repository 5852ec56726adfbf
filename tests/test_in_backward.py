"""The step inside backward (``SkewAdam(..., in_backward=True)``, `skewadam.backward`): the regular step's bits on
every kernel (Triton in its interpreter), tier, bank layout, momentum storage and weight dtype; the loop, schedulers,
checkpoints, ``add_param_group``, ``deepcopy`` and hooks that go with their optimizer; and what cannot run inside
backward refused, or done per tensor, never silently wrong.

Bitwise equality with the regular step is true by construction: a hook runs the same kernel on the same record (the
parameter's own rounding stream and step count), and a kernel's fused step computes each record's sums alone. The
orthogonal tier's Newton-Schulz batches the matrices of one shape across a group in the regular step and takes one
at a time inside backward: equal to rounding there.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import re

import pytest
import torch
from torch import nn

from skewadam import SkewAdam, kernels
from skewadam.backward import BackwardSteps

BACKENDS_HERE = kernels.cpu_backends(interpreted=True)
E, N = 3, 7  # experts, tokens


class Net(nn.Module):
    """Every kind of tensor a step runs, each given its gradient by one backward: a backbone matrix and vector, an
    expert bank ``[E, R, C]`` whose expert 1 receives no token (an all-zero gradient slice), a flattened bank
    ``[E*D, F]`` (group key ``experts``), a router ``[E, D]``, and a parameter the loss never uses."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        new = lambda *shape: nn.Parameter(torch.randn(*shape, generator=g).to(dtype))  # noqa: E731
        self.w, self.b, self.bank = new(6, 5), new(5), new(E, 5, 4)
        self.flat, self.router, self.unused = new(E * 2, 5), new(E, 5), new(4)

    def forward(self, x):
        h = torch.tanh(x @ self.w + self.b)
        gate = torch.softmax(h @ self.router.T, -1) * torch.tensor([1.0, 0.0, 1.0], dtype=h.dtype)
        y = torch.einsum("nr,erc->nec", h, self.bank) * gate[..., None]
        return (y.sum(1) ** 2).mean() + torch.tanh(h @ self.flat.T).sum()

    def groups(self, momentum_dtype: str = "fp32") -> list[dict]:
        return [{"params": [self.w, self.b], "tier": "backbone", "weight_decay": 0.1, "momentum_dtype": momentum_dtype},
                {"params": [self.bank], "tier": "expert", "weight_decay": 0.1},
                {"params": [self.flat], "tier": "expert", "experts": E},
                {"params": [self.router], "tier": "router"},
                {"params": [self.unused], "tier": "backbone"}]


def _inputs(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(N, 6, generator=torch.Generator().manual_seed(100 + step)).to(dtype)


def _train(net: Net, opt: SkewAdam, steps: int, dtype: torch.dtype, scheduler=None) -> None:
    for step in range(steps):
        net(_inputs(step, dtype)).backward()
        if opt.in_backward:
            assert all(p.grad is None for p in net.parameters()), "in backward: every gradient freed"
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _build(impl, dtype, momentum_dtype="fp32", in_backward=False, **kw) -> tuple[Net, SkewAdam]:
    net = Net(dtype)
    return net, SkewAdam(net.groups(momentum_dtype), lr=1e-2, impl=impl, in_backward=in_backward, **kw)


def _snapshot(net: Net, opt: SkewAdam):
    return ({n: p.detach().clone() for n, p in net.named_parameters()},
            {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in net.named_parameters() if opt.state[p]})


def _assert_same(a, b) -> None:
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for n in a[0]:
        assert torch.equal(a[0][n], b[0][n]), n
    for n in a[1]:
        assert a[1][n].keys() == b[1][n].keys(), n
        for k in a[1][n]:
            assert a[1][n][k].dtype == b[1][n][k].dtype and torch.equal(a[1][n][k], b[1][n][k]), (n, k)


# --------------------------------------------------------------------------------------------------------- exact
CASES = [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.float32, "bf16"), (torch.bfloat16, "int8"),
         (torch.float64, "int8")]


@pytest.mark.parametrize("impl", BACKENDS_HERE)
@pytest.mark.parametrize("dtype, momentum_dtype", CASES, ids=[f"{str(d)[6:]}-{m}m" for d, m in CASES])
def test_the_step_inside_backward_is_bitwise_the_regular_step(impl, dtype, momentum_dtype):
    """Every tier, a bank with an idle expert, a flattened bank, fp32/bf16/int8 momentum, bf16 weights with
    stochastic rounding, an LR schedule (the hooks read the lr the scheduler set after the previous step): weights
    and state after 3 steps are the regular step's bits; the unused parameter is untouched and has no state."""
    runs = []
    for in_backward in (False, True):
        net, opt = _build(impl, dtype, momentum_dtype, in_backward)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        _train(net, opt, 3, dtype, schedule)
        runs.append(_snapshot(net, opt))
        assert "unused" not in runs[-1][1] and torch.equal(net.unused, Net(dtype).unused)
        assert opt.state[net.bank]["step"].tolist() == [3, 0, 3]  # the idle expert's slice untouched
    _assert_same(*runs)


def test_the_hooks_reach_their_optimizer_only_through_the_param_stepper_interface():
    """`BackwardSteps` (the lower layer) asks its optimizer for param groups and `ParamStepper.step_parameter` alone:
    an object with just those gets each parameter's step, with its complete gradient, as backward completes it, and
    the gradient is freed after; the skip flags it returns are what the hooks record."""
    class Stepper:
        def __init__(self, params):
            self.param_groups, self.calls = [{"params": params}], []

        def step_parameter(self, group: int, position: int) -> torch.Tensor:
            self.calls.append((group, position, self.param_groups[group]["params"][position].grad.clone()))
            return torch.tensor(position == 1)

    w, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(3))
    stepper = Stepper([w, b])
    steps = BackwardSteps(stepper)
    (w * w * 2 + b).sum().backward()
    assert sorted((g, i) for g, i, _ in stepper.calls) == [(0, 0), (0, 1)]
    grads = {i: grad for _, i, grad in stepper.calls}
    assert torch.equal(grads[0], torch.full((3,), 4.0)) and torch.equal(grads[1], torch.ones(3))
    assert w.grad is None and b.grad is None and sorted(bool(f) for f in steps.skipped) == [False, True]
    steps.remove()


@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_a_tensor_lr_and_a_step_closure_step_inside_backward_as_the_regular_step(impl):
    """A 0-d tensor lr that a schedule writes into, and ``step(closure)`` whose closure runs the backward (Lightning's
    loop): the hooks step during the closure's backward, ``step()`` does the bookkeeping."""
    runs = []
    for in_backward in (False, True):
        net = Net(torch.float32)
        opt = SkewAdam(net.groups(), lr=torch.tensor(1e-2), impl=impl, in_backward=in_backward)
        for step in range(2):
            loss = opt.step(lambda: net(_inputs(step, torch.float32)).backward() or 1.0)
            assert loss == 1.0
            opt.zero_grad()
            for g in opt.param_groups:
                g["lr"].mul_(0.5)
        runs.append(_snapshot(net, opt))
    _assert_same(*runs)


def _orthogonal_net(dtype):
    g = torch.Generator().manual_seed(3)
    a, b = (nn.Parameter(torch.randn(5, 4, generator=g).to(dtype)) for _ in range(2))
    bank = nn.Parameter(torch.randn(E, 4, 6, generator=g).to(dtype))
    return [a, b, bank], [{"params": [a, b], "update": "orthogonal", "weight_decay": 0.1},
                          {"params": [bank], "tier": "expert", "update": "orthogonal"}]


@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_the_orthogonal_tier_inside_backward_equals_the_regular_step_to_rounding(impl):
    """Two matrices of one shape share one batched Newton-Schulz in the regular step and take one each inside
    backward (a bank's slices are batched either way): equal to fp32 rounding."""
    runs = []
    for in_backward in (False, True):
        params, groups = _orthogonal_net(torch.float32)
        opt = SkewAdam(groups, lr=1e-2, impl=impl, in_backward=in_backward)
        for step in range(3):
            x = torch.randn(N, 5, generator=torch.Generator().manual_seed(step))
            h = torch.tanh(x @ params[0] + x @ params[1])
            torch.einsum("nr,erc->nec", h, params[2]).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in params] + [opt.state[p]["exp_avg"].clone() for p in params[:2]])
    for x, y in zip(*runs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------- the optimizer contract
def test_a_checkpoint_resumes_bitwise_across_the_two_modes():
    """Saved inside backward, loaded into an in-backward optimizer or a regular one (and the other way round): the
    resumed runs continue as the uninterrupted one. The hooks stay through ``load_state_dict``."""
    full_net, full = _build("auto", torch.bfloat16, in_backward=True)
    _train(full_net, full, 4, torch.bfloat16)
    for saved_in_backward in (True, False):
        for load_in_backward in (True, False):
            net, opt = _build("auto", torch.bfloat16, in_backward=saved_in_backward)
            _train(net, opt, 2, torch.bfloat16)
            buf = io.BytesIO()
            torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            net2, opt2 = _build("auto", torch.bfloat16, in_backward=load_in_backward)
            net2.load_state_dict(saved["model"])
            opt2.load_state_dict(saved["opt"])
            assert opt2.in_backward is load_in_backward
            for step in range(2, 4):
                net2(_inputs(step, torch.bfloat16)).backward()
                assert all(p.grad is None for p in net2.parameters()) is load_in_backward
                opt2.step()
                opt2.zero_grad()
            _assert_same(_snapshot(full_net, full), _snapshot(net2, opt2))


def test_add_param_group_hooks_the_new_parameters():
    net, opt = _build("auto", torch.float32, in_backward=True)
    extra = nn.Parameter(torch.randn(4, 3))
    opt.add_param_group({"params": [extra], "tier": "backbone"})
    ref_net, ref = _build("auto", torch.float32)
    ref_extra = nn.Parameter(extra.detach().clone())
    ref.add_param_group({"params": [ref_extra], "tier": "backbone"})
    for step in range(2):
        for n, o, x in ((net, opt, extra), (ref_net, ref, ref_extra)):
            (n(_inputs(step, torch.float32)) + (x ** 2).sum()).backward()
            assert (x.grad is None) is o.in_backward
            o.step()
            o.zero_grad()
    assert torch.equal(extra, ref_extra) and opt.state[extra]["step"].item() == 2
    _assert_same(_snapshot(net, opt), _snapshot(ref_net, ref))


def test_a_deepcopy_steps_its_own_parameters_inside_backward():
    """``copy.deepcopy((model, optimizer))`` gives an optimizer whose hooks step the copied model; the original
    is not touched by the copy's backward, and trains on as a copy trained alongside does."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    _train(net, opt, 1, torch.float32)
    net2, opt2 = copy.deepcopy((net, opt))
    assert opt2.in_backward and opt2.param_groups[0]["params"][0] is net2.w
    before = _snapshot(net, opt)
    net2(_inputs(1, torch.float32)).backward()
    assert all(p.grad is None for p in net2.parameters())
    _assert_same(before, _snapshot(net, opt))  # the copy's hooks stepped the copy alone
    opt2.step()
    net(_inputs(1, torch.float32)).backward()
    opt.step()
    _assert_same(_snapshot(net, opt), _snapshot(net2, opt2))


def test_a_deepcopy_sharing_the_parameters_is_refused():
    """A copy over the same parameters would step each of them twice per backward: refused, naming the fix."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    memo = {id(p): p for p in net.parameters()}
    with pytest.raises(ValueError, match="already stepped in backward by another SkewAdam .* set in_backward=False"):
        copy.deepcopy(opt, memo)
    with pytest.raises(ValueError, match="already stepped in backward by another SkewAdam"):
        SkewAdam(net.groups(), in_backward=True)
    opt.in_backward = False  # then another optimizer may take them
    assert SkewAdam(net.groups(), in_backward=True).in_backward


def _hooks(p: torch.Tensor) -> int:
    return len(getattr(p, "_post_accumulate_grad_hooks", None) or {})


def test_hooks_are_removed_when_turned_off_or_when_the_optimizer_is_collected():
    net, opt = _build("auto", torch.float32, in_backward=True)
    assert [_hooks(p) for p in net.parameters()] == [1] * 6
    opt.in_backward = False
    assert [_hooks(p) for p in net.parameters()] == [0] * 6
    net(_inputs(0, torch.float32)).backward()
    assert net.w.grad is not None  # gradients kept: the regular step
    opt.step()
    opt.in_backward = True
    opt.zero_grad()
    assert [_hooks(p) for p in net.parameters()] == [1] * 6
    del opt
    gc.collect()
    assert [_hooks(p) for p in net.parameters()] == [0] * 6
    net(_inputs(0, torch.float32)).backward()
    assert net.w.grad is not None


def test_step_hooks_run_at_step_after_the_parameters_moved():
    """``step()`` runs torch's step pre- and post-hooks as usual; inside backward the parameters have already
    moved when they run (they see the step's bookkeeping, not the update)."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o.state[net.w]["step"].item())))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o.state[net.w]["step"].item())))
    _train(net, opt, 2, torch.float32)
    assert seen == [("pre", 1), ("post", 1), ("pre", 2), ("post", 2)]


# ----------------------------------------------------------------------------------- what cannot run inside backward
def test_a_non_finite_gradient_skips_that_tensors_update_alone_and_is_counted():
    """Inside backward each tensor decides alone: the one with a NaN gradient keeps its weights and state, the
    others step as the regular step would with that tensor absent; the regular step skips the whole step."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    ref_net, ref = _build("auto", torch.float32)
    _train(net, opt, 1, torch.float32)
    _train(ref_net, ref, 1, torch.float32)
    before = _snapshot(net, opt)
    loss = net(_inputs(1, torch.float32)) + (net.router * float("nan")).sum()
    loss.backward()
    opt.step()
    after = _snapshot(net, opt)
    assert torch.equal(after[0]["router"], before[0]["router"])
    assert all(torch.equal(after[1]["router"][k], before[1]["router"][k]) for k in after[1]["router"])
    assert not torch.equal(after[0]["w"], before[0]["w"])
    assert opt.skipped_tensors == 1 and opt.skipped_steps == 1
    ref_net(_inputs(1, torch.float32)).backward()
    ref_net.router.grad = None  # the regular step of every other tensor
    ref.step()
    for name in ("w", "b", "bank", "flat"):
        assert torch.equal(after[0][name], ref_net.get_parameter(name)), name
    _train(net, opt, 1, torch.float32)
    assert opt.skipped_tensors == 1 and opt.skipped_steps == 1  # a finite step counts nothing


_RESETS = {"none": lambda net, opt: None, "optimizer.zero_grad": lambda net, opt: opt.zero_grad(),
           "model.zero_grad": lambda net, opt: net.zero_grad()}


@pytest.mark.parametrize("reset", _RESETS)
def test_a_second_backward_before_step_is_refused_at_its_first_hook_whichever_zero_grad_ran(reset):
    """Gradient accumulation, or a backward after a ``zero_grad()`` (which cannot undo the steps the first backward
    took, where the regular step would drop its gradients): refused at the second backward's first hook, nothing
    of it stepped; ``step()`` then ends the first backward's record and the next backward steps as usual."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    net(_inputs(0, torch.float32)).backward()
    after_first = _snapshot(net, opt)
    _RESETS[reset](net, opt)
    with pytest.raises(RuntimeError, match=r"param_groups\[\d\]\['params'\]\[0\] got a gradient from a second backward "
                                           r"before optimizer.step\(\).*zero_grad\(\), which cannot undo.*"
                                           r"with optimizer.hold_gradients\(\)"):
        net(_inputs(1, torch.float32)).backward()
    _assert_same(after_first, _snapshot(net, opt))
    opt.zero_grad()
    opt.step()
    _train(net, opt, 1, torch.float32)
    assert opt.state[net.w]["step"].item() == 2


def test_hooks_run_by_hand_outside_any_backward_refuse_a_second_gradient():
    """FSDP2 runs the post-accumulate-grad hooks itself; run outside any backward (no graph task to tell the
    backwards apart), a parameter stepped since ``step()`` is refused by name."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    for attempt in range(2):
        net.b.grad = torch.ones_like(net.b)
        if attempt:
            with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\] got a gradient from a second"):
                for hook in net.b._post_accumulate_grad_hooks.values():
                    hook(net.b)
        else:
            for hook in net.b._post_accumulate_grad_hooks.values():
                hook(net.b)
            assert net.b.grad is None and opt.state[net.b]["step"].item() == 1
    assert opt.state[net.b]["step"].item() == 1 and torch.equal(net.b.grad, torch.ones_like(net.b))


@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_gradients_held_across_backwards_are_stepped_as_their_sum(impl):
    """Accumulation under ``hold_gradients()``: the last backward (outside it) steps the summed gradients, bitwise
    as the regular step after accumulating the same micro-batches."""
    runs = []
    for in_backward in (False, True):
        net, opt = _build(impl, torch.float32, in_backward=in_backward)
        for step in range(2):
            with opt.hold_gradients():
                net(_inputs(2 * step, torch.float32)).backward()
            assert net.w.grad is not None
            net(_inputs(2 * step + 1, torch.float32)).backward()
            opt.step()
            opt.zero_grad()
        runs.append(_snapshot(net, opt))
    _assert_same(*runs)


def test_gradients_backward_did_not_step_are_stepped_by_step():
    """A gradient set by hand, or held to the end: ``step()`` steps it as the regular step does."""
    runs = []
    for in_backward in (False, True):
        net, opt = _build("auto", torch.float32, in_backward=in_backward)
        for step in range(2):
            for p in net.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            opt.step()
            with opt.hold_gradients():
                net(_inputs(step, torch.float32)).backward()
            opt.step()
            opt.zero_grad()
        runs.append(_snapshot(net, opt))
    _assert_same(*runs)


def test_a_gradient_written_after_its_step_in_backward_is_refused_at_step():
    """What DDP does after the hooks (its all-reduce writes ``p.grad`` again): ``step()`` names the parameter."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    net.b.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", torch.zeros_like(p)))
    net(_inputs(0, torch.float32)).backward()
    with pytest.raises(RuntimeError, match=re.escape("param_groups[0]['params'][1] has a gradient again after it was "
                                                     "stepped in backward") + ".*DistributedDataParallel"):
        opt.step()


def test_a_step_that_raises_inside_backward_leaves_its_parameter_as_it_was_with_its_gradient():
    """The hook's step is atomic, as ``step()`` is: the parameter it raised for keeps its weights, state and
    gradient (backward stops there; the tensors stepped before it in this backward keep their updates)."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    _train(net, opt, 1, torch.float32)
    opt.state[net.w]["row_var"] = torch.zeros(2, 1)  # state of another shape
    w, state = net.w.detach().clone(), {k: v.clone() for k, v in opt.state[net.w].items()}
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: state 'row_var' has shape \(2, 1\)"):
        net(_inputs(1, torch.float32)).backward()
    assert net.w.grad is not None and torch.equal(net.w, w)
    assert all(torch.equal(opt.state[net.w][k], v) for k, v in state.items())


def test_the_backward_steps_need_no_optimizer_reference():
    """The hooks hold the optimizer weakly: a collected optimizer's hooks are gone (`BackwardSteps` is its own)."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    steps = opt._backward
    assert isinstance(steps, BackwardSteps) and steps._optimizer() is opt
    del opt
    gc.collect()
    assert steps._optimizer() is None and not steps._handles


@pytest.mark.skipif("triton" not in BACKENDS_HERE, reason="needs triton (its interpreter on CPU)")
def test_triton_steps_inside_backward_with_no_host_read(monkeypatch):
    """A faked CUDA device (Triton through the registry, as on a GPU): during backward nothing in skewadam reads a
    tensor on the host (``bool``, ``item``, ``int``, ``float``, ``tolist``: each a host sync on a GPU), a NaN gradient
    included; the skips are counted on the device and read only when asked."""
    import skewadam

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    resolve = kernels.resolve_backend
    monkeypatch.setattr(kernels, "resolve_backend", lambda impl, device: resolve(impl, "cuda"))
    monkeypatch.delenv("SKEWADAM_IMPL", raising=False)
    net = Net(torch.float32)
    opt = SkewAdam(net.groups("int8"), lr=1e-2, in_backward=True)
    reads, package = [], skewadam.__file__.rpartition("/")[0]

    def watch(name):
        method = getattr(torch.Tensor, name)

        def read(self, *args):
            caller = __import__("sys")._getframe(1).f_code.co_filename
            if caller.startswith(package):
                reads.append((name, caller))
            return method(self, *args)
        return read

    for step in range(2):
        loss = net(_inputs(step, torch.float32)) + (net.router * (float("nan") if step else 1.0)).sum()
        with monkeypatch.context() as m:
            for name in ("__bool__", "item", "__int__", "__float__", "tolist"):
                m.setattr(torch.Tensor, name, watch(name))
            loss.backward()
        assert not reads, reads
        opt.step()
    assert "_skipped_pending" in opt.__dict__ and opt.skipped_tensors == 1 and opt.skipped_steps == 1
    assert opt.state[net.bank]["step"].tolist() == [2, 0, 2] and opt.state[net.router]["step"].item() == 1


# ------------------------------------------------------------------------- traps: each exact, or refused up front
class Segmented(nn.Module):
    """Reentrant checkpointing (``use_reentrant=True``: a nested backward per segment) over weights used every way:
    ``emb`` before the segments and as the tied head after them, ``w`` in both segments and after them, ``u``
    inside one segment only, ``v`` outside only."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        new = lambda *shape: nn.Parameter((torch.randn(*shape, generator=g) * 0.5).to(dtype))  # noqa: E731
        self.emb, self.w, self.u, self.v = new(5, 6), new(6, 6), new(6, 6), new(6, 6)

    def forward(self, x, segments: int = 2, fail: bool = False):
        from torch.utils.checkpoint import checkpoint

        h = x @ self.emb
        h = checkpoint(lambda h: torch.tanh(h @ self.w) @ self.u, h, use_reentrant=True)
        if segments == 2:
            h = checkpoint(lambda h: torch.tanh(h @ self.w), h, use_reentrant=True)
        if fail:  # the backward raises after the weights used after the segments got their gradients
            h = _Raises.apply(h)
        h = torch.tanh(h @ self.v) @ self.w
        return (h @ self.emb.T).pow(2).mean()


def _segmented_run(impl, dtype, in_backward: bool, steps: int = 3):
    net = Segmented(dtype)
    opt = SkewAdam([{"params": [net.emb, net.v], "weight_decay": 0.1, "momentum_dtype": "int8"},
                    {"params": [net.w, net.u], "tier": "router"}], lr=1e-2, impl=impl, in_backward=in_backward)
    freed = []
    for step in range(steps):
        net(torch.randn(4, 5, generator=torch.Generator().manual_seed(step)).to(dtype)).backward()
        freed.append(sorted(n for n, p in net.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
    return net, opt, freed


@pytest.mark.parametrize("impl", BACKENDS_HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reentrant_checkpointing_steps_a_weight_used_in_several_segments_once_with_its_summed_gradient(impl, dtype):
    """A gradient that arrives inside a nested backward is left to accumulate, and step() steps the sum: weights and
    state are the regular step's bits. The first backward holds every gradient (which weights the segments use is
    learnt there); from the second on, the weights used only outside the segments are stepped and freed inside
    backward."""
    ref, ref_opt, _ = _segmented_run(impl, dtype, False)
    net, opt, freed = _segmented_run(impl, dtype, True)
    for (name, a), b in zip(ref.named_parameters(), net.parameters()):
        assert torch.equal(a, b), name
        assert all(torch.equal(x, y) for x, y in zip(ref_opt.state[a].values(), opt.state[b].values())), name
    assert freed == [[], ["emb", "v"], ["emb", "v"]]
    assert opt._backward.segmented == {id(net.w), id(net.u)}


def test_a_weight_a_reentrant_segment_starts_using_after_the_first_backward_is_refused_naming_use_reentrant():
    """The weights the segments use are learnt in the first backward that has segments; a segment that starts
    using a weight already stepped in this backward (the model changed) raises, naming the fix."""
    net = Segmented(torch.float32)
    opt = SkewAdam(net.parameters(), lr=1e-2, in_backward=True)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    h = torch.tanh(x @ net.emb @ net.w)
    (h @ net.emb.T).pow(2).mean().backward()  # no segment: everything stepped inside backward
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\] got a gradient inside a reentrant "
                                           r"activation checkpoint .* Use use_reentrant=False"):
        net(x, segments=1).backward()


def test_a_first_backward_with_reentrant_segments_that_raised_leaves_the_next_one_to_learn_them():
    """The first backward with segments holds every gradient while it learns which weights the segments use; one
    that raised before its segments ran learnt nothing, so the next backward holds and learns again (rather than
    stepping a weight inside backward whose segment's gradient comes after): bitwise the regular run."""
    runs = []
    for in_backward in (False, True):
        net = Segmented(torch.float32)
        opt = SkewAdam(net.parameters(), lr=1e-2, in_backward=in_backward)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
        with pytest.raises(RuntimeError, match="the backward failed here"):
            net(x, fail=True).backward()
        opt.zero_grad()
        for step in range(2):
            net(x + step).backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _partly_reached(net: Net, step: int, dtype) -> torch.Tensor:
    """Every third step reaches every tensor; the others leave the router, the bank and the flattened bank out."""
    x = _inputs(step, dtype)
    return net(x) if step % 3 == 0 else torch.tanh(x @ net.w + net.b).pow(2).mean()


@pytest.mark.parametrize("impl", BACKENDS_HERE)
@pytest.mark.parametrize("dtype, momentum_dtype", CASES[:4], ids=[f"{str(d)[6:]}-{m}m" for d, m in CASES[:4]])
def test_a_kept_zero_gradient_is_stepped_as_the_regular_step_steps_it(impl, dtype, momentum_dtype):
    """``zero_grad(set_to_none=False)`` keeps a zero gradient for each tensor the hooks freed; a backward that does
    not reach it leaves it zero, and ``step()`` steps it (momentum decays, weight decay applies; a bank's all-zero
    slices stay untouched), bitwise as the regular step does, across tiers, banks and momentum formats."""
    runs = []
    for in_backward in (False, True):
        net, opt = _build(impl, dtype, momentum_dtype, in_backward)
        for step in range(4):
            _partly_reached(net, step, dtype).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs.append(_snapshot(net, opt))
        assert opt.state[net.router]["step"].item() == 4  # stepped with a zero gradient at steps 1 and 2
    _assert_same(*runs)


class _Raises(torch.autograd.Function):
    """The identity whose backward raises (what an out-of-memory error or a bad batch does midway through)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the backward failed here")


@pytest.mark.parametrize("impl", BACKENDS_HERE)
@pytest.mark.parametrize("reset", _RESETS)
def test_after_a_backward_that_raised_the_next_backward_steps_every_parameter_once_whichever_zero_grad_ran(impl,
                                                                                                          reset):
    """The hooks that ran before the error stepped their parameters (the bias and the flattened bank, whose
    gradients come before the failure point) and freed their gradients; the failed backward never completed (its
    final callback never ran), so the next backward starts a new record, after ``optimizer.zero_grad()``,
    ``model.zero_grad()`` (the HF Trainer's) or none: the run equals a regular one whose failed batch stepped those
    two tensors alone."""
    runs = []
    for in_backward in (False, True):
        net, opt = _build(impl, torch.float32, in_backward=in_backward)
        _train(net, opt, 1, torch.float32)
        x = _inputs(1, torch.float32)
        h = torch.tanh(_Raises.apply(x @ net.w) + net.b)
        loss = h.sum() + torch.tanh(h.detach() @ net.flat.T).sum()
        with pytest.raises(RuntimeError, match="the backward failed here"):
            loss.backward()
        if not in_backward:  # the regular twin steps what the hooks stepped before the error
            opt.step()
            opt.zero_grad()
        else:
            assert all(p.grad is None for p in net.parameters())
            _RESETS[reset](net, opt)
        _train(net, opt, 1, torch.float32)
        runs.append(_snapshot(net, opt))
        assert opt.state[net.b]["step"].item() == 3 and opt.state[net.w]["step"].item() == 2
    _assert_same(*runs)


@pytest.mark.parametrize("keep", [dict(retain_graph=True), dict(create_graph=True)], ids=["retain", "create"])
def test_a_backward_that_keeps_its_graph_is_refused_before_anything_moves_naming_hold_gradients(keep):
    """Stepping in place would change weights the kept graph saved (a second backward through it would fail with
    torch's in-place error): refused at the first hook, nothing stepped. Under ``hold_gradients()`` the backwards
    through one graph accumulate, and the last one steps their sum, as the regular step does."""
    net, opt = _build("auto", torch.float32, in_backward=True)
    _train(net, opt, 1, torch.float32)
    before = _snapshot(net, opt)
    loss = net(_inputs(1, torch.float32))
    with pytest.raises(RuntimeError, match=r"retain_graph=True or create_graph=True\) cannot step inside backward.*"
                                           r"with optimizer.hold_gradients\(\)"):
        loss.backward(**keep)
    _assert_same(before, _snapshot(net, opt))
    opt.zero_grad()
    runs = []
    for in_backward in (False, True):
        net, opt = _build("auto", torch.float32, in_backward=in_backward)
        loss = net(_inputs(0, torch.float32))
        with opt.hold_gradients():
            loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        runs.append(_snapshot(net, opt))
    _assert_same(*runs)


def _scaled_run(impl, in_backward: bool):
    """4 steps with a GradScaler (fp32 weights, scale 2**16): the third's gradients overflow (the step is skipped and
    the scale halved), the fourth accumulates two scaled micro-batches, unscales and clips them before
    ``scaler.step`` (torch's recipe)."""
    net, opt = _build(impl, torch.float32, in_backward=in_backward)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    scales, held = [], []
    for step in range(4):
        for micro in range(1 + (step == 3)):
            loss = net(_inputs(2 * step + micro, torch.float32))
            if step == 2:
                loss = loss + 1e35 * net.w.sum()  # finite, but its gradient times the scale overflows
            scaler.scale(loss).backward()
            held.append(all(p.grad is not None for n, p in net.named_parameters() if n != "unused"))
        if step == 3:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return _snapshot(net, opt), scales, held


@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_a_grad_scaler_backward_holds_its_gradients_and_scaler_step_is_bitwise_the_regular_step(impl):
    """``scaler.scale(loss).backward()``: a loss scaled by a live GradScaler holds the backward's gradients, so
    ``scaler.step(optimizer)`` runs torch's own path (unscale, inf check, ``step()`` of the held gradients, a skipped
    step on overflow) and ``scaler.update()`` moves the scale: weights, state and scales are the regular step's bits,
    a global clip after ``unscale_`` included."""
    regular, in_backward = _scaled_run(impl, False), _scaled_run(impl, True)
    _assert_same(regular[0], in_backward[0])
    assert regular[1] == in_backward[1] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    assert all(in_backward[2])  # held: the memory the mode does not save under GradScaler


def test_a_product_loss_without_a_grad_scaler_is_stepped_inside_backward():
    """``loss * torch.tensor(2.0)`` has a scaled loss's graph; without a live GradScaler that has scaled a loss
    (one that never scaled anything, or a disabled one, is no scaler) its gradients are stepped inside backward."""
    gc.collect()
    idle, disabled = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu", enabled=False)
    disabled.scale(torch.ones(()))
    runs = []
    for in_backward in (False, True):
        net, opt = _build("auto", torch.float32, in_backward=in_backward)
        for step in range(2):
            (net(_inputs(step, torch.float32)) * torch.tensor(2.0)).backward()
            assert all(p.grad is None for p in net.parameters()) is in_backward
            opt.step()
            opt.zero_grad()
        runs.append(_snapshot(net, opt))
    _assert_same(*runs)
    assert idle._scale is None


def test_a_scaled_loss_changed_after_scaling_is_refused_at_scaler_step_naming_the_fix():
    """``scaler.scale(loss) / 2`` is not recognised as scaled (its root is a division): the hooks step scaled
    gradients, and ``scaler.step(optimizer)`` raises, naming ``scaler.scale(loss).backward()`` on the final loss and
    ``hold_gradients()``, instead of torch's "No inf checks were recorded"; GradScaler's attributes are removed.
    Under ``hold_gradients()`` the same loop is the regular step's."""
    runs = []
    for in_backward, hold in ((False, False), (True, True), (True, False)):
        net, opt = _build("auto", torch.float32, in_backward=in_backward)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        with opt.hold_gradients() if hold else contextlib.nullcontext():
            (scaler.scale(net(_inputs(0, torch.float32))) / 2).backward()
        if in_backward and not hold:
            with pytest.raises(RuntimeError, match=r"its loss was not recognised as scaled.*Call "
                                                   r"scaler.scale\(loss\).backward\(\) on the final loss.*"
                                                   r"optimizer.hold_gradients\(\)"):
                scaler.step(opt)
            assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
        else:
            scaler.step(opt)
            scaler.update()
            runs.append(_snapshot(net, opt))
    _assert_same(*runs)


def test_turning_in_backward_off_between_backward_and_step_keeps_the_skip_counts():
    net, opt = _build("auto", torch.float32, in_backward=True)
    (net(_inputs(0, torch.float32)) + (net.router * float("nan")).sum()).backward()
    opt.in_backward = False
    opt.step()
    assert opt.skipped_tensors == 1 and opt.skipped_steps == 1


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_deepcopy_has_every_public_attribute_of_the_original(in_backward):
    """PyTorch's optimizer contract: every public attribute (``dir``) of the original exists on the copy, with an
    equal value for every plain one (numbers, strings, flags); param groups and state are copies of the same
    shape."""
    net, opt = _build("auto", torch.float32, in_backward=in_backward)
    _train(net, opt, 1, torch.float32)
    (net(_inputs(1, torch.float32)) + (net.router * float("nan")).sum()).backward()
    opt.step()
    copied = copy.deepcopy(opt) if not in_backward else copy.deepcopy((net, opt))[1]
    public = [a for a in dir(opt) if not a.startswith("_")]
    assert public == [a for a in dir(copied) if not a.startswith("_")]
    plain = [a for a in public if isinstance(getattr(opt, a), (bool, int, float, str))]
    assert {"skipped_steps", "skipped_tensors", "skip_nonfinite", "in_backward"} <= set(plain)
    assert {a: getattr(copied, a) for a in plain} == {a: getattr(opt, a) for a in plain}
    assert opt.skipped_tensors == in_backward and opt.skipped_steps == 1
    assert [len(g["params"]) for g in copied.param_groups] == [len(g["params"]) for g in opt.param_groups]
    assert len(copied.state) == len(opt.state)


# ---------------------------------------------------------------------------------------------- bench and planner
def test_the_bench_arm_trains_the_curve_of_skewadam_at_grad_clip_0_and_refuses_a_global_clip():
    from skewadam.bench.config import RunConfig
    from skewadam.bench.train import train

    tiny = dict(model="tiny", steps=4, batch_size=2, eval_interval=2, eval_batches=1, grad_clip=0.0)
    logs = [train(RunConfig(optimizer=o, **tiny), progress=False) for o in ("skewadam", "skewadam-in-backward")]
    assert [s["loss"] for s in logs[0]["steps"]] == [s["loss"] for s in logs[1]["steps"]]
    assert [e["val_loss"] for e in logs[0]["evals"]] == [e["val_loss"] for e in logs[1]["evals"]]
    assert all(s["grad_norm"] != s["grad_norm"] for s in logs[1]["steps"])  # NaN: no gradient left to measure
    assert "in_backward: True" in logs[1]["optimizer_repr"]
    with pytest.raises(ValueError, match=r"skewadam-in-backward steps each tensor inside backward: no gradient is "
                                         r"left to clip globally \(--grad-clip 1\); run it with --grad-clip 0"):
        RunConfig(optimizer="skewadam-in-backward", model="tiny")


def test_plan_in_backward_on_the_command_line(capsys):
    from skewadam.cli import main

    assert main(["plan", "tiny", "--in-backward", "--optimizer", "skewadam", "--optimizer", "adamw", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizers"]["skewadam"]["in_backward"] and not out["optimizers"]["adamw"]["in_backward"]
    assert out["optimizers"]["skewadam"]["grads"] < out["optimizers"]["adamw"]["grads"]
