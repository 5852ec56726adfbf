"""SkewAdam in Hugging Face Transformers' `Trainer` and in Accelerate, with tiny MoE models built from configs (CPU).

The resume tests compare a run interrupted at a checkpoint with the uninterrupted run, bitwise. Mixtral and Qwen3-MoE
hold fused experts but save per-expert checkpoints (Trainer's own resume skips those tensors:
huggingface/transformers#48805); GPT-OSS saves its layout as held.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import Trainer, TrainingArguments, get_scheduler  # noqa: E402

from skewadam import SkewAdam  # noqa: E402
from skewadam.integrations.hf import (  # noqa: E402
    SkewAdamFactory, SkewAdamTrainer, create_optimizer, load_pretrained_weights)

VOCAB, SEQ = 64, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=SEQ, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=32, moe_intermediate_size=32, num_experts=4, head_dim=8)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=32, num_local_experts=4, head_dim=8)),
}


def tiny_moe(family: str = "mixtral", seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**_COMMON, **kwargs))


def dataset(n: int = 32) -> list[dict[str, torch.Tensor]]:
    """Learnable sequences: runs of consecutive token ids from random starts."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def training_args(out, **kwargs) -> TrainingArguments:
    defaults = dict(per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.8,
                    adam_beta2=0.99, lr_scheduler_type="cosine", warmup_steps=2, report_to=[], use_cpu=True, seed=0,
                    disable_tqdm=True, logging_steps=1, save_strategy="no")
    return TrainingArguments(str(out), **{**defaults, **kwargs})


def unwrap(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def expected_tier(name: str) -> str:
    """Mixtral's routed experts are the fused ``mlp.experts`` banks; its router is ``mlp.gate`` (a linear to E)."""
    if ".mlp.experts." in name:
        return "expert"
    return "router" if name.endswith(".mlp.gate.weight") else "backbone"


def test_import_skewadam_does_not_import_transformers():
    code = "import sys, skewadam; assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trainer_trains_mixtral_with_skewadam_tiers_and_args_hyperparameters(tmp_path):
    model = tiny_moe("mixtral")
    trainer = SkewAdamTrainer(model=model, args=training_args(tmp_path, max_steps=12), train_dataset=dataset())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses

    opt = unwrap(trainer.optimizer)
    assert type(opt) is SkewAdam
    names = {id(p): n for n, p in model.named_parameters()}
    tiers = {names[id(p)]: g["tier"] for g in opt.param_groups for p in g["params"]}
    assert tiers == {n: expected_tier(n) for n in names.values()}
    for g in opt.param_groups:
        assert g["initial_lr"] == 1e-2 and g["betas"] == (0.8, 0.99)
        assert g["weight_decay"] == (0.0 if g["tier"] == "router" else 0.1)
    # Trainer's own cosine schedule (warmup 2) drives the lr.
    ref = torch.optim.SGD([torch.zeros(1)], lr=1e-2)
    ref_sched = get_scheduler("cosine", ref, num_warmup_steps=2, num_training_steps=12)
    ref_lrs = []
    for _ in range(12):
        ref_lrs.append(ref.param_groups[0]["lr"])
        ref.step()
        ref_sched.step()
    assert [h["learning_rate"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(ref_lrs)


@pytest.mark.parametrize("name", ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup",
                                  "inverse_sqrt", "warmup_stable_decay", "cosine_with_min_lr"])
def test_transformers_schedulers_drive_every_tier_like_a_torch_optimizer(name):
    kwargs = {"warmup_stable_decay": {"num_decay_steps": 4}, "cosine_with_min_lr": {"min_lr_rate": 0.1}}.get(name)
    model = tiny_moe("mixtral")
    opt = SkewAdam.from_model(model, lr=1e-2, tier_options={"router": {"lr": 1e-3}})
    ref = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": g["lr"]} for g in opt.param_groups], lr=1e-2)
    scheds = [get_scheduler(name, o, num_warmup_steps=2, num_training_steps=10, scheduler_specific_kwargs=kwargs)
              for o in (opt, ref)]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for _ in range(8):
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert opt.param_groups[-1]["lr"] != opt.param_groups[0]["lr"]  # per-tier lr survives the schedule


def test_trainer_optimizers_tuple_with_create_optimizer(tmp_path):
    model = tiny_moe("qwen3_moe")
    args = training_args(tmp_path, max_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(create_optimizer(model, args), None))
    trainer.train()
    opt = unwrap(trainer.optimizer)
    assert type(opt) is SkewAdam and {g["tier"] for g in opt.param_groups} == {"backbone", "expert", "router"}
    assert all(int(s["step"].max()) == 2 for s in opt.state.values())


def _tiers(model, opt) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["tier"] for g in opt.param_groups for p in g["params"]}


def test_optimizer_cls_and_kwargs_with_the_factory_tiers_from_the_model(tmp_path):
    model = tiny_moe("mixtral")
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=4), train_dataset=dataset(),
                      optimizer_cls_and_kwargs=(SkewAdamFactory, {"lr": 1e-2, "weight_decay": 0.1}))
    trainer.train()
    opt = unwrap(trainer.optimizer)
    assert type(opt) is SkewAdam
    assert _tiers(model, opt) == {n: expected_tier(n) for n, _ in model.named_parameters()}
    assert {g["tier"]: (g["initial_lr"], g["weight_decay"]) for g in opt.param_groups} == {
        "backbone": (1e-2, 0.1), "expert": (1e-2, 0.1), "router": (1e-2, 0.0)}
    assert all(int(s["step"].max()) == 4 for s in opt.state.values())


def test_trainer_steps_inside_backward_as_the_regular_step_without_global_clipping(tmp_path):
    """``optimizer_kwargs={"in_backward": True}``: Trainer's ``max_grad_norm`` (1.0 by default) is turned off with a
    warning naming the per-unit clip, and training is bitwise a regular SkewAdamTrainer run at ``max_grad_norm=0``."""
    runs = []
    for in_backward in (False, True):
        model = tiny_moe("mixtral")
        args = training_args(tmp_path / str(in_backward), max_steps=4, **({} if in_backward else {"max_grad_norm": 0}))
        trainer = SkewAdamTrainer(model=model, args=args, train_dataset=dataset(),
                                  optimizer_kwargs={"in_backward": in_backward})
        if in_backward:
            with pytest.warns(UserWarning, match=r"max_grad_norm=1 turned off \(0\).*RMS-clips each update unit"):
                trainer.train()
            assert trainer.args.max_grad_norm == 0 and unwrap(trainer.optimizer).in_backward
        else:
            trainer.train()
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_trainer_with_reentrant_gradient_checkpointing_steps_inside_backward_as_the_regular_step(tmp_path):
    """``gradient_checkpointing_kwargs={"use_reentrant": True}``: each decoder layer's backward is a nested one, whose
    gradients are left for ``step()`` to step (the embeddings, head and final norm are stepped inside backward from
    the second step on); training is bitwise a regular run."""
    runs = []
    for in_backward in (False, True):
        model = tiny_moe("mixtral")
        args = training_args(tmp_path / str(in_backward), max_steps=3, max_grad_norm=0, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": True})
        trainer = SkewAdamTrainer(model=model, args=args, train_dataset=dataset(),
                                  optimizer_kwargs={"in_backward": in_backward})
        trainer.train()
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if in_backward:
            assert unwrap(trainer.optimizer)._backward.segmented  # the layers' weights came inside nested backwards
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_trainer_settings_that_cannot_run_inside_backward_are_refused(tmp_path):
    trainer = SkewAdamTrainer(model=tiny_moe("mixtral"), train_dataset=dataset(),
                              args=training_args(tmp_path, max_steps=2, gradient_accumulation_steps=2),
                              optimizer_kwargs={"in_backward": True})
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2: each backward's gradients are stepped at "
                                         "once.*or use in_backward=False"):
        trainer.train()
    with pytest.raises(ValueError, match="SkewAdamFactory: in_backward=True needs Trainer's settings checked"):
        SkewAdamFactory()(tiny_moe("mixtral"), lr=1e-2, in_backward=True)


def test_optimizer_cls_and_kwargs_with_skewadam_itself_trains_untiered(tmp_path):
    # Trainer hands an optimizer class bare tensors in decay / no-decay groups: no names, no model, no tiers
    model = tiny_moe("mixtral")
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=2), train_dataset=dataset(),
                      optimizer_cls_and_kwargs=(SkewAdam, {"lr": 1e-2}))
    trainer.train()
    assert set(_tiers(model, unwrap(trainer.optimizer)).values()) == {"backbone"}


def test_factory_resume_is_bitwise_for_a_model_saved_as_held(tmp_path):
    # GPT-OSS saves its fused experts as held, so plain Trainer's resume restores every weight
    def run(out, resume=None):
        model = tiny_moe("gpt_oss")
        args = training_args(out, max_steps=6, save_strategy="steps", save_steps=3)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                          optimizer_cls_and_kwargs=(SkewAdamFactory, {"lr": 1e-2, "weight_decay": 0.1}))
        trainer.train(resume_from_checkpoint=resume)
        return model, unwrap(trainer.optimizer)

    full, full_opt = run(tmp_path / "full")
    resumed, resumed_opt = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    a, b = full_opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_skewadam_trainer_refuses_optimizer_cls_and_kwargs(tmp_path):
    with pytest.raises(ValueError, match="optimizer_kwargs"):
        SkewAdamTrainer(model=tiny_moe(), args=training_args(tmp_path), optimizer_cls_and_kwargs=(SkewAdam, {}))


def _train(family, out, resume=None):
    model = tiny_moe(family)
    args = training_args(out, max_steps=6, save_strategy="steps", save_steps=3)
    trainer = SkewAdamTrainer(model=model, args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    return model, unwrap(trainer.optimizer), [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_trainer_resume_is_bitwise_identical_to_uninterrupted_run(tmp_path, family):
    full, full_opt, full_losses = _train(family, tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoint-3"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert any(".experts.0." in k for k in saved) == (family != "gpt_oss")  # legacy per-expert layout on disk

    sd = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert [g["tier"] for g in sd["param_groups"]] == ["backbone", "expert", "router"]
    assert sorted({k for s in sd["state"].values() for k in s}) == [
        "col_var", "exp_avg", "exp_avg_sq", "row_var", "step"]

    resumed, resumed_opt, resumed_losses = _train(family, tmp_path / "resumed", resume=str(ckpt))
    assert len(resumed_losses) == 6 and resumed_losses[3:] == full_losses[3:]  # log history: 3 restored, 3 new
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    a, b = full_opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for key in a[i]:
            assert torch.equal(a[i][key], b[i][key]), (i, key)


def test_load_best_model_at_end_restores_every_weight_of_the_best_checkpoint(tmp_path):
    # greater_is_better=True on the loss picks the worse, earlier checkpoint, so the best is not the final weights.
    args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps",
                         eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    model = tiny_moe("mixtral")
    trainer = SkewAdamTrainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(8))
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = tiny_moe("mixtral", seed=1)
    load_pretrained_weights(best, trainer.state.best_model_checkpoint)
    for (name, p), q in zip(model.named_parameters(), best.parameters()):
        assert torch.equal(p, q), name


def test_load_pretrained_weights_undoes_the_per_expert_layout_in_place(tmp_path):
    trained = tiny_moe("mixtral", seed=1)
    trained.save_pretrained(tmp_path)
    model = tiny_moe("mixtral", seed=0)
    before = {n: p for n, p in model.named_parameters()}
    load_pretrained_weights(model, tmp_path)
    for (name, p), q in zip(model.named_parameters(), trained.parameters()):
        assert p is before[name] and torch.equal(p, q), name


def test_load_pretrained_weights_refuses_a_checkpoint_missing_experts(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_moe("mixtral").save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if "layers.1.block_sparse_moe.experts." not in k}
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="does not hold every weight"):
        load_pretrained_weights(tiny_moe("mixtral"), tmp_path)


# --------------------------------------------------------------------------------------------------- Accelerate
@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons (mixed precision, accumulation); each test starts from scratch."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _batches(n):
    data = dataset(4 * n)
    return [torch.stack([d["input_ids"] for d in data[4 * i:4 * i + 4]]) for i in range(n)]


def test_accelerate_gradient_accumulation_matches_manual_accumulation(fresh_accelerate_state):
    batches = _batches(6)
    manual = tiny_moe("qwen3_moe")
    opt = SkewAdam.from_model(manual, lr=1e-2, weight_decay=0.1)
    for i, x in enumerate(batches):
        (manual(input_ids=x, labels=x).loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_moe("qwen3_moe")
    model, wrapped = accelerator.prepare(model, SkewAdam.from_model(model, lr=1e-2, weight_decay=0.1))
    assert type(wrapped).__name__ == "AcceleratedOptimizer" and type(wrapped.optimizer) is SkewAdam
    for x in batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=x, labels=x).loss)
            wrapped.step()
            wrapped.zero_grad()
    steps = {int(s["step"].max()) for s in wrapped.state_dict()["state"].values()}
    assert steps == {3}  # 6 micro-batches, 3 optimizer steps
    for (name, p), q in zip(manual.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_accelerate_bf16_autocast_trains_with_fp32_params_and_state(fresh_accelerate_state):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_moe("mixtral")
    model, opt = accelerator.prepare(model, SkewAdam.from_model(model, lr=1e-2))
    x = _batches(1)[0]
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = []
    for _ in range(8):
        out = model(input_ids=x, labels=x)
        assert seen.pop() == torch.bfloat16  # matmuls run under bf16 autocast
        accelerator.backward(out.loss)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for s in opt.state.values() for k, t in s.items() if k != "step")


def _accelerate_run(steps, batches, save_to=None, load_from=None):
    accelerator = Accelerator(cpu=True)
    model = tiny_moe("mixtral")
    model, opt = accelerator.prepare(model, SkewAdam.from_model(model, lr=1e-2, weight_decay=0.1))
    if load_from is not None:
        accelerator.load_state(load_from)
    for x in batches[:steps]:
        accelerator.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    if save_to is not None:
        accelerator.save_state(save_to)
    return model, opt


def test_accelerate_save_state_load_state_resumes_bitwise(tmp_path, fresh_accelerate_state):
    batches = _batches(6)
    full, _ = _accelerate_run(6, batches)
    _accelerate_run(3, batches, save_to=tmp_path)
    resumed, opt = _accelerate_run(3, batches[3:], load_from=tmp_path)
    assert {int(s["step"].max()) for s in opt.state_dict()["state"].values()} == {6}
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
