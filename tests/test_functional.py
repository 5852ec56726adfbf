"""`skewadam.functional.skewadam_`, the one step every backend runs: atomic (a step that raises has changed nothing),
one check of what can change after construction with the same error on every kernel, the orthogonal tier inside the
same pass sequence, and messages that name the parameter as the user holds it. Every test runs on every kernel
(Triton in its interpreter on CPU: small shapes, few steps)."""

from __future__ import annotations

import re

import pytest
import torch

from skewadam import SkewAdam, kernels
from skewadam.functional import StepGroup, skewadam_

BACKENDS_HERE = kernels.cpu_backends(interpreted=True)

# Every kind of group a step runs: the orthogonal tier (matrices with momentum, a bank without), Adafactor's options
# (a relative step, a beta2 decay on a bank), an expert bank, regular backbone tensors and a router.
MIXED = [
    ({"tier": "backbone", "update": "orthogonal", "weight_decay": 0.1}, [(6, 5)]),
    ({"tier": "expert", "update": "orthogonal"}, [(3, 4, 5)]),
    ({"tier": "backbone", "relative_step": True}, [(5, 4)]),
    ({"tier": "expert", "beta2_decay": -0.8}, [(3, 4, 6)]),
    ({"tier": "expert"}, [(2, 6, 5)]),
    ({"tier": "router"}, [(3, 6)]),
    ({"tier": "backbone", "weight_decay": 0.1}, [(7,), (6, 4)]),
]


def _build(impl, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = [{"params": [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes], **kw}
              for kw, shapes in MIXED]
    return [p for g in groups for p in g["params"]], SkewAdam(groups, lr=1e-2, impl=impl)


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        if p.ndim == 3:
            p.grad[step % p.shape[0]] = 0  # an idle expert


def _snapshot(params, opt):
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _assert_same(a, b):
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    for sx, sy in zip(a[1], b[1], strict=True):
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


# ---------------------------------------------------------------------------------------------------- atomic
def _break_state(opt, p):
    """What a load that does not check, or ``p.data`` replaced, leaves: state of another shape."""
    opt.state[p]["step"] = torch.zeros(7) if opt.state[p]["step"].ndim else torch.zeros(2)


# failure -> (what breaks, the parameter it breaks or None)
FAILURES = {
    "regular_data_replaced": (lambda params, opt: setattr(params[-1], "data", torch.randn(3, 3).to(params[-1].dtype)),
                              -1),
    "bank_state_of_another_shape": (lambda params, opt: _break_state(opt, params[4]), 4),
    "orthogonal_state_of_another_shape": (lambda params, opt: _break_state(opt, params[0]), 0),
    "beta_set_to_one": (lambda params, opt: opt.param_groups[5].update(betas=(1.0, 0.999)), None),
}


@pytest.mark.parametrize("impl", BACKENDS_HERE)
@pytest.mark.parametrize("failure", list(FAILURES), ids=list(FAILURES))
def test_a_step_that_raises_leaves_every_parameter_state_and_step_count_as_it_was(impl, failure):
    """With orthogonal, relative-step, beta2-decay, bank and regular groups present, one group that cannot be
    stepped (a replaced ``p.data``, state of another shape, a beta set to 1) makes the step raise before anything is
    written; once that group is put right (as the error says), the run continues exactly as a run that never saw the
    failed step, so the other groups did not move and their rounding streams are as they were."""
    params, opt = _build(impl)
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    before = _snapshot(params, opt)
    good = params[-1].detach().clone()
    brk, broken = FAILURES[failure]
    brk(params, opt)
    with pytest.raises((ValueError, TypeError)):
        opt.step()
    after = _snapshot(params, opt)
    keep = [i for i in range(len(params)) if broken is None or i != broken % len(params)]
    _assert_same(*[([s[0][i] for i in keep], [s[1][i] for i in keep]) for s in (before, after)])
    if failure == "regular_data_replaced":
        params[-1].data = good
    elif failure == "beta_set_to_one":
        opt.param_groups[5]["betas"] = (0.9, 0.999)
    else:
        del opt.state[params[broken]]  # the error's advice: reset that parameter's state
    opt.step()
    ref_params, ref = _build(impl)
    for step in range(2):
        _grads(ref_params, step)
        ref.step()
    for i in keep if failure != "regular_data_replaced" else range(len(params)):
        p, q = params[i], ref_params[i]
        assert torch.equal(p, q), i
        assert all(torch.equal(v, ref.state[q][k]) for k, v in opt.state[p].items()), i


@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_a_failed_first_step_allocates_no_state(impl):
    p, q = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 2))
    opt = SkewAdam([{"params": [p]}, {"params": [q], "tier": "router"}], impl=impl)
    p.grad, q.grad = torch.randn(4, 3), torch.randn(5, 2)
    q.grad.data = torch.randn(3, 3)  # (.data skips autograd's own check) q's gradient does not fit it
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\]: gradient of shape \(3, 3\)"):
        opt.step()
    assert not opt.state


# ------------------------------------------------------------------------------- settings changed afterwards
def _setting(case):
    """(what changes after construction, the error every kernel raises at the next step)."""
    def half(opt, p):
        p.data = p.data.half()
        p.grad = p.grad.half()

    def fp64_state(opt, p):
        opt.state[p]["row_var"] = opt.state[p]["row_var"].double()

    def group(**kw):
        return lambda opt, p: opt.param_groups[0].update(kw)

    return {
        "fp16_parameter": (half, TypeError, "param_groups[0]['params'][0]: fp16 parameters are not supported; keep "
                                            "fp32 parameters with torch.autocast, or use bf16"),
        "fp64_state_of_an_fp32_parameter": (fp64_state, ValueError, "param_groups[0]['params'][0]: state 'row_var' "
                                            "is torch.float64, a torch.float32 parameter's needs torch.float32"),
        "eps_mode": (group(eps_mode="bogus"), ValueError, "Invalid eps_mode in param group 0: 'bogus' (expected "
                                                         "'floor' or 'add')"),
        "beta1_of_one": (group(betas=(1.0, 0.999)), ValueError, "Invalid beta parameter at index 0 in param group 0: "
                                                               "1.0 (expected a float in [0, 1))"),
        "beta2_negative": (group(betas=(0.9, -0.5)), ValueError, "Invalid beta parameter at index 1 in param group 0"),
        "string_lr": (group(lr="0.1"), ValueError, "Invalid learning rate in param group 0: '0.1' (expected a finite "
                                                   "float >= 0)"),
        "integer_tensor_lr": (group(lr=torch.tensor(1)), ValueError, "Invalid learning rate in param group 0: a "
                                                                     "tensor lr must be floating point"),
        "two_element_lr": (group(lr=torch.tensor([0.1, 0.1])), ValueError, "Tensor lr must be 1-element"),
        "negative_weight_decay": (group(weight_decay=-1.0), ValueError, "Invalid weight_decay value in param group 0"),
        "eps_of_zero": (group(eps=0.0), ValueError, "Invalid epsilon value in param group 0: 0.0"),
    }[case]


SETTINGS = ["fp16_parameter", "fp64_state_of_an_fp32_parameter", "eps_mode", "beta1_of_one", "beta2_negative",
            "string_lr", "integer_tensor_lr", "two_element_lr", "negative_weight_decay", "eps_of_zero"]


@pytest.mark.parametrize("three_pass", [False, True], ids=["one-process", "three-pass"])
@pytest.mark.parametrize("impl", BACKENDS_HERE)
@pytest.mark.parametrize("case", SETTINGS)
def test_settings_changed_after_construction_are_refused_alike_on_every_kernel(case, impl, three_pass):
    """What can change after construction (a parameter's dtype, a state tensor, a group's eps_mode, betas, lr, weight
    decay, eps) is checked at every step by one shared check: every kernel raises the same error, naming the group
    or the parameter, and writes nothing."""
    if impl == "triton" and three_pass and case not in ("fp16_parameter", "beta1_of_one"):
        pytest.skip("Triton's interpreter: the representative cases of the three-pass path")
    change, error, message = _setting(case)
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = SkewAdam([p], impl=impl)
    if three_pass:
        opt._reducer = lambda items: None
    p.grad = torch.randn_like(p)
    opt.step()
    change(opt, p)
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(error, match="^" + re.escape(message)):
        opt.step()
    assert torch.equal(p.detach(), before[0]) and all(torch.equal(v, before[1][k]) for k, v in opt.state[p].items())


# ----------------------------------------------------------------------------------------------- messages
@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_a_flattened_bank_error_names_the_parameters_own_shape(impl):
    """The kernels step a flattened bank [E*D, F] as its view [E, D, F]; an error names the parameter's own shape
    (8, 3), not only the view (2, 4, 3), and the layout its state keeps (rows [8, 1], not the view's [2, 4, 1])."""
    p = torch.nn.Parameter(torch.randn(8, 3))
    opt = SkewAdam([{"params": [p], "tier": "expert", "experts": 2}], impl=impl)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p]["row_var"] = torch.zeros(2, 4, 1)  # the view's shape, not the flattened bank's own rows
    with pytest.raises(ValueError, match=re.escape("param_groups[0]['params'][0] of shape (8, 3), stepped as the bank "
                                                   "(2, 4, 3): state 'row_var' has shape (2, 4, 1), a flattened bank "
                                                   "keeps it with 2 dims and 8 rows in dim 0")):
        opt.step()
    opt.state[p]["row_var"] = torch.zeros(8, 2)  # the rows right, a column too many: the kernels' check, on the view
    with pytest.raises(ValueError, match=re.escape("param_groups[0]['params'][0] of shape (8, 3), stepped as the bank "
                                                   "(2, 4, 3): state 'row_var' has shape (2, 4, 2), a parameter of "
                                                   "shape (2, 4, 3) needs shape (2, 4, 1)")):
        opt.step()


def test_a_meta_parameter_is_refused_naming_the_fix():
    """Parameters on the meta device hold no values: the step says so, and how to materialise them."""
    p = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    opt = SkewAdam([p])
    p.grad = torch.empty_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: a parameter on the meta device holds no "
                                         r"values to step; materialise the model first \(model.to_empty"):
        opt.step()


# ------------------------------------------------------------------------------------------- the functional
@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_the_functional_steps_one_parameter_at_a_time_like_the_optimizer(impl):
    """What a gradient hook does: one record per call, each call with its own skip decision. A call whose gradient
    is non-finite is skipped (and says so); the others step exactly as one optimizer step of all of them."""
    params, opt = _build(impl, dtype=torch.float32)
    ref_params, ref = _build(impl, dtype=torch.float32)
    backend = kernels.resolve_backend(impl, "cpu")
    for step in range(2):
        _grads(params, step)
        _grads(ref_params, step)
        ref.step()
        skipped = []
        first_id = 0
        for index, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                if step == 1 and index == 6 and j == 1:
                    p.grad[0, 0] = float("nan")
                params_, record = opt._init_group(group, index, first_id, only=j)  # that parameter alone
                with torch.no_grad():  # (as a gradient hook runs)
                    skipped.append(bool(skewadam_([StepGroup(record, params_, group["update"])], backend=backend)))
            first_id += len(group["params"])
        assert skipped == [False] * (len(params) - 1) + [step == 1]
    for i, (p, q) in enumerate(zip(params[:-1], ref_params[:-1])):
        assert torch.equal(p, q), i
    assert torch.equal(params[-1], ref_params[-1]) is False and opt.state[params[-1]]["step"].item() == 1


def test_the_functional_resolves_a_backend_by_name_and_ignores_groups_without_parameters():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = SkewAdam([p], impl="eager")
    p.grad = torch.randn_like(p)
    params, record = opt._init_group(opt.param_groups[0], 0, 0)
    empty = StepGroup(record._replace(params=[]), [])
    with torch.no_grad():
        assert not bool(skewadam_([empty], backend="eager")) and not opt.state[p]["step"].item()
        assert not bool(skewadam_([empty, StepGroup(record, params)], backend="eager"))
    assert opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("impl", BACKENDS_HERE)
def test_a_checkpoint_with_non_contiguous_state_steps_as_its_contiguous_copy_on_every_kernel(impl):
    """Loaded state is made contiguous, so every kernel steps a checkpoint with non-contiguous state, bitwise as the
    contiguous one."""
    runs = []
    for transposed in (False, True):
        params, opt = _build(impl, dtype=torch.float32)
        _grads(params, 0)
        opt.step()
        sd = opt.state_dict()
        if transposed:
            for state in sd["state"].values():
                for key, value in state.items():
                    if value.ndim == 2 and value.shape[0] > 1 and value.shape[1] > 1:
                        state[key] = value.t().contiguous().t()  # the same values, column-major
            assert any(not v.is_contiguous() for st in sd["state"].values() for v in st.values())
        fresh_params, fresh = _build(impl, dtype=torch.float32)
        with torch.no_grad():
            for p, q in zip(fresh_params, params):
                p.copy_(q)
        fresh.load_state_dict(sd)
        assert all(v.is_contiguous() for p in fresh_params for v in fresh.state[p].values())
        _grads(fresh_params, 1)
        fresh.step()
        runs.append(_snapshot(fresh_params, fresh))
    _assert_same(*runs)


@pytest.mark.skipif("triton" not in BACKENDS_HERE, reason="needs triton (its interpreter on CPU)")
def test_on_a_cuda_device_the_optimizer_picks_triton_and_skips_on_the_device(monkeypatch):
    """A faked CUDA device: ``impl="auto"`` resolves to Triton through the registry (no kernel name in the
    optimizer), whose facts the step follows: step counts beside the parameters, the skip decided on the device (the
    skip count is not read until asked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton = kernels.resolve_backend("auto", "cuda")
    assert triton.name == "triton" and triton.device_steps and not triton.skip_on_host
    asked, resolve = [], kernels.resolve_backend

    def as_if_on_cuda(impl, device):  # these CPU tensors stand for a GPU's (Triton's interpreter runs them)
        asked.append(impl)
        return resolve(impl, "cuda")

    monkeypatch.setattr(kernels, "resolve_backend", as_if_on_cuda)
    monkeypatch.delenv("SKEWADAM_IMPL", raising=False)
    p, bank = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(2, 4, 3))
    opt = SkewAdam([{"params": [p]}, {"params": [bank], "tier": "expert"}])
    for bad in (False, True):
        p.grad, bank.grad = torch.randn_like(p), torch.randn_like(bank)
        bank.grad[0, 0, 0] = float("nan") if bad else 0.0
        opt.step()
    assert asked == ["auto", "auto"] and "_skipped_pending" in opt.__dict__  # counted on the device
    assert opt.skipped_steps == 1 and opt.state[p]["step"].item() == 1 and opt.state[bank]["step"].tolist() == [1, 1]
