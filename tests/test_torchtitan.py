"""`skewadam.integrations.torchtitan.SkewAdamOptimizers` on one process: a tiny torchtitan Qwen3 MoE
(`torchtitan_cases`) trains, checkpoints through torchtitan's CheckpointManager and resumes bitwise. Two ranks:
tests/distributed/test_torchtitan_distributed.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.components.optimizer.utils import init_optim_state  # noqa: E402
from torchtitan_cases import batches, loss_fn, tiny_qwen3_moe  # noqa: E402

from skewadam import SkewAdam  # noqa: E402
from skewadam.integrations.torchtitan import SkewAdamOptimizers  # noqa: E402

ROUTER = r"\.router\.gate\."


def build(seed: int = 0, **config):
    model = tiny_qwen3_moe(seed=seed)
    optimizers = SkewAdamOptimizers.Config(**{"lr": 1e-2, "weight_decay": 0.1, **config}).build(model_parts=[model])
    return model, optimizers


def train(model, optimizers, data, schedule=None):
    for tokens, labels in data:
        loss_fn(model, tokens, labels).backward()
        optimizers.step()
        optimizers.zero_grad()
        if schedule is not None:
            schedule.step()


def snapshot(model, optimizers):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = optimizers.optimizers[0].state_dict()["state"]
    return params, {(i, k): t.clone() for i, s in state.items() for k, t in s.items()}


def assert_equal(a, b):
    for x, y in zip(a, b):  # parameters, then state
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def test_import_skewadam_does_not_import_torchtitan():
    code = "import sys, skewadam; assert 'torchtitan' not in sys.modules, 'torchtitan imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_container_builds_one_skewadam_with_tier_groups_and_canonical_names():
    model, optimizers = build()
    (opt,) = optimizers.optimizers
    assert type(opt) is SkewAdam
    assert [g["tier"] for g in opt.param_groups] == ["backbone", "expert", "router"]
    expert, router = opt.param_groups[1], opt.param_groups[2]
    assert all(".moe.routed_experts.inner_experts.w" in n for n in expert["param_names"])
    assert router["param_names"] == ["layers.0.moe.router.gate.weight", "layers.1.moe.router.gate.weight"]
    assert router["weight_decay"] == 0.0 and expert["weight_decay"] == 0.1
    assert not any(k in g for g in opt.param_groups for k in ("fused", "foreach"))  # torchtitan's, dropped
    names = dict(model.named_parameters())
    assert all(p is names[n] for g in opt.param_groups for n, p in zip(g["param_names"], g["params"]))


def test_param_group_patterns_choose_groups_and_classify_splits_them_by_tier():
    groups = [ParamGroupConfig(pattern=r"(tok_embeddings|lm_head)\.", optimizer_name="AdamW",
                               optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0}),
              ParamGroupConfig(pattern=ROUTER, optimizer_name="SkewAdam",
                               optimizer_kwargs={"lr": 1e-4, "tier": "router"}),
              ParamGroupConfig(pattern=r".*", optimizer_name="SkewAdam", optimizer_kwargs={"weight_decay": 0.1})]
    model, optimizers = build(param_groups=groups, implementation="for-loop")
    adamw, skewadam = optimizers.optimizers
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["foreach"] is False  # torchtitan's own
    assert [(g["tier"], g["lr"]) for g in skewadam.param_groups] == [
        ("router", 1e-4), ("backbone", 1e-2), ("expert", 1e-2)]  # the catch-all has no router left
    assert {g["tier"]: g["weight_decay"] for g in skewadam.param_groups[1:]} == {"backbone": 0.1, "expert": 0.1}
    train(model, optimizers, batches(1))


def test_patterns_exclude_tier_options():
    with pytest.raises(ValueError, match="tier_options and exempt_1d"):
        build(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="SkewAdam")], exempt_1d=True)


def test_state_dict_before_the_first_step_changes_nothing():
    # torchtitan materialises missing state with a zero-gradient, zero-lr step; the container allocates it instead
    data = batches(3)
    model, optimizers = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = optimizers.state_dict()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    steps = [v for k, v in flat.items() if k.startswith("state.") and k.endswith(".step")]
    assert steps and all(int(t.max()) == 0 for t in steps)
    assert all(int(t.count_nonzero()) == 0 for k, t in flat.items() if k.startswith("state."))
    init_optim_state(optimizers.optimizers[0])  # torchtitan's own init is then a no-op
    train(model, optimizers, data)
    untouched, fresh = build()
    train(untouched, fresh, data)
    assert_equal(snapshot(model, optimizers), snapshot(untouched, fresh))


def test_torchtitan_checkpoint_resume_is_bitwise(tmp_path):
    data = batches(6)

    def run(seed):
        model, optimizers = build(seed)
        schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=8)
        manager = CheckpointManager(
            CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0), dataloader=None,
            model_parts=[model], optimizers=optimizers, lr_schedulers=schedule, states={}, sd_adapter=None,
            base_folder=str(tmp_path))
        return model, optimizers, schedule, manager

    model, optimizers, schedule, manager = run(0)
    train(model, optimizers, data[:3], schedule)
    manager.save(3)
    train(model, optimizers, data[3:], schedule)

    resumed, resumed_opt, resumed_schedule, resumed_manager = run(1)
    assert resumed_manager.load(3)
    train(resumed, resumed_opt, data[3:], resumed_schedule)
    assert_equal(snapshot(model, optimizers), snapshot(resumed, resumed_opt))
    keys = resumed_opt.state_dict()
    assert "state.layers.0.moe.routed_experts.inner_experts.w1_EFD.row_var" in keys  # SkewAdam's state, FQN-keyed
    assert keys["param_groups.layers.0.moe.router.gate.weight.tier"] == "router"


def test_the_container_steps_inside_backward_as_the_regular_step_and_warns_about_max_norm():
    """``in_backward=True``: torchtitan's loop (backward, clip_grad_norm_, step) gives the regular step's bits; the
    container says that torchtitan's clip finds no gradient."""
    data = batches(3)
    model, optimizers = build()
    train(model, optimizers, data)
    with pytest.warns(UserWarning, match=r"clip_grad_norm_ \(training.max_norm\) finds no gradient"):
        inside, inside_opt = build(in_backward=True)
    assert inside_opt.optimizers[0].in_backward
    for tokens, labels in data:
        loss_fn(inside, tokens, labels).backward()
        assert torch.nn.utils.clip_grad_norm_(inside.parameters(), 1.0) == 0  # nothing left to clip
        inside_opt.step()
        inside_opt.zero_grad()
    assert_equal(snapshot(model, optimizers), snapshot(inside, inside_opt))
