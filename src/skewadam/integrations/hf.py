"""Hugging Face Transformers integration: SkewAdam in `Trainer`, and MoE checkpoints that resume exactly.

Three ways in, from the least to the most that works:

- ``Trainer(optimizer_cls_and_kwargs=(SkewAdam, {...}))`` trains, but without tiers: Trainer hands an optimizer class
  two param groups of bare tensors (decay / no decay), with no names and no model, so everything is ``backbone``.
- ``Trainer(optimizer_cls_and_kwargs=(SkewAdamFactory, {"lr": ..., ...}))`` tiers automatically: Trainer (5.x) treats
  a class that is not an optimizer as a factory and calls it with the model, so this is `SkewAdam.from_model`. The
  hyperparameters are the kwargs (Trainer passes no `TrainingArguments` to a factory; its LR schedule still applies).
  Resuming is exact for models saved as held (GPT-OSS, non-MoE), not for the fused-expert families below.
- `SkewAdamTrainer` builds `SkewAdam.from_model` from its `TrainingArguments` (the LR schedule stays Transformers' own:
  ``lr_scheduler_type``, ``warmup_steps``, ...) and resumes MoE checkpoints exactly.

Why resuming needs care (transformers 5.x; huggingface/transformers#48805): most MoE families (Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V2/V3, ...) hold their routed experts fused, ``mlp.experts.gate_up_proj [E, 2I, H]``, but
``save_pretrained`` writes the Hub's legacy per-expert layout (``experts.{e}.w1.weight``; Mixtral also renames
``mlp.`` to ``block_sparse_moe.``). ``Trainer`` resumes (and loads the best model at the end) with a plain, non-strict
``model.load_state_dict`` that applies no conversion: every expert tensor (and Mixtral's router) is skipped with only a
logged warning, and training continues from the freshly initialised experts, with the trained optimizer state.
`SkewAdamTrainer` loads such checkpoints through Transformers' own conversion (`load_pretrained_weights`) and refuses
any key left unloaded. Families saved as held (GPT-OSS) and non-MoE models take Trainer's usual path.

Stepping inside backward (``optimizer_kwargs={"in_backward": True}``, `skewadam.backward`): each tensor is stepped as
soon as backward completes its gradient, and the gradient freed. What Trainer would do after backward is handled
before training: its global clipping (``max_grad_norm``, on by default at 1.0) would see no gradient, so it is turned
off with a warning (SkewAdam RMS-clips each update unit at 1.0 anyway); ``gradient_accumulation_steps > 1``, fp16
loss scaling (``fp16=True``: under its GradScaler every gradient is held to the step, nothing saved) and DDP (``world_size > 1`` without FSDP: it
all-reduces after the hooks) are refused naming the fix. `SkewAdamFactory`, which sees no `TrainingArguments`, refuses
``in_backward``.

Transformers is an optional dependency (``pip install 'skewadam[hf]'``): ``import skewadam`` never imports it; this
module does.

Example:
    >>> from skewadam.integrations.hf import SkewAdamTrainer
    >>> trainer = SkewAdamTrainer(model=model, args=args, train_dataset=ds, optimizer_kwargs={"tier_options": ...})
    >>> trainer.train()                              # later: trainer.train(resume_from_checkpoint=True)
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

import torch

try:
    from transformers import PreTrainedModel, Trainer
    from transformers.trainer import is_sagemaker_mp_enabled
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("skewadam.integrations.hf needs Hugging Face Transformers: pip install 'skewadam[hf]'") from e

from ..optimizer import SkewAdam

__all__ = ["SkewAdamFactory", "SkewAdamTrainer", "check_in_backward", "create_optimizer", "load_pretrained_weights"]


class SkewAdamFactory:
    """``optimizer_cls`` for ``Trainer(optimizer_cls_and_kwargs=(SkewAdamFactory, kwargs))``: SkewAdam with its tiers.

    Transformers instantiates an ``optimizer_cls`` that is not a `torch.optim.Optimizer` and calls the instance with
    the model and ``kwargs`` (``Trainer.create_optimizer``, ``is_optimizer_factory``); this returns
    ``SkewAdam.from_model(model, **kwargs)``. ``kwargs`` are `SkewAdam.from_model`'s (``lr``, ``weight_decay``,
    ``tier_options``, ...): `TrainingArguments` does not reach a factory, so give ``lr`` here (Trainer's LR schedule
    then scales it).

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
        ...                   optimizer_cls_and_kwargs=(SkewAdamFactory, {"lr": 3e-4, "weight_decay": 0.1}))
    """

    def __call__(self, model: torch.nn.Module, **kwargs: Any) -> SkewAdam:
        if kwargs.get("in_backward"):
            raise ValueError("SkewAdamFactory: in_backward=True needs Trainer's settings checked (max_grad_norm, "
                             "gradient accumulation, fp16, DDP), which Trainer does not hand a factory; use "
                             "SkewAdamTrainer(..., optimizer_kwargs={'in_backward': True}), or "
                             "Trainer(optimizers=(create_optimizer(model, args, in_backward=True), None))")
        return SkewAdam.from_model(model, **kwargs)


def create_optimizer(model: torch.nn.Module, args: Any = None, **kwargs: Any) -> SkewAdam:
    """`SkewAdam.from_model` with ``lr``, ``betas`` and ``weight_decay`` taken from Transformers' `TrainingArguments`.

    ``args.learning_rate``, ``(args.adam_beta1, args.adam_beta2)`` and ``args.weight_decay`` become defaults that
    ``kwargs`` override. ``args.adam_epsilon`` is not used: SkewAdam's ``eps`` floors the second moment (or is added to
    it, ``eps_mode="add"``) rather than being added to its square root, so set it in ``kwargs`` if you need to.

    A plain `Trainer` trains with it, but resuming a checkpoint of the MoE families named in the module docstring
    leaves their experts at their initial values; `SkewAdamTrainer` resumes them exactly. With ``in_backward=True``,
    ``args`` is checked (`check_in_backward`) and its ``max_grad_norm`` turned off.

    Example:
        >>> trainer = Trainer(model=model, args=args, optimizers=(create_optimizer(model, args), None))
    """
    defaults: dict[str, Any] = {}
    if args is not None:
        defaults = {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "weight_decay": args.weight_decay,
        }
        if kwargs.get("in_backward"):
            check_in_backward(args)
    return SkewAdam.from_model(model, **{**defaults, **kwargs})


def check_in_backward(args: Any) -> None:
    """Make Trainer's ``args`` fit a SkewAdam stepping inside backward: ``max_grad_norm`` turned off with a warning
    (global clipping would see no gradient; SkewAdam RMS-clips each update unit at 1.0); ValueError for gradient
    accumulation, fp16 loss scaling and DDP, naming the fix.

    Example:
        >>> check_in_backward(args); trainer = Trainer(..., optimizers=(SkewAdam.from_model(m, in_backward=True), None))
    """
    fixes = []
    if args.gradient_accumulation_steps > 1:
        fixes.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps}: each backward's gradients are "
                     f"stepped at once, so micro-batches cannot be summed first; use gradient_accumulation_steps=1 "
                     f"with a larger per_device_train_batch_size")
    if args.fp16:
        fixes.append("fp16=True scales the loss: under a GradScaler SkewAdam holds every gradient to the step (nothing "
                     "saved); use bf16=True")
    if args.world_size > 1 and not args.fsdp:
        fixes.append(f"world_size={args.world_size} without FSDP is DDP, which all-reduces gradients after the hooks "
                     f"have stepped them; shard with FSDP2 (fsdp_version 2), whose hooks run after the reduce-scatter")
    if fixes:
        raise ValueError("SkewAdam in_backward=True cannot train with these TrainingArguments: " + "; ".join(fixes)
                         + "; or use in_backward=False")
    if args.max_grad_norm:
        warnings.warn(f"SkewAdam in_backward=True: TrainingArguments.max_grad_norm={args.max_grad_norm:g} turned off "
                      f"(0): each tensor is stepped inside backward, so no gradient is left to clip globally; "
                      f"SkewAdam RMS-clips each update unit at 1.0", stacklevel=2)
        args.max_grad_norm = 0.0


def load_pretrained_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Copy the weights of a ``save_pretrained`` directory into ``model``, in place and exactly.

    The checkpoint goes through Transformers' own loader (``from_pretrained``), so its layout conversions (per-expert
    tensors stacked into fused banks, renamed modules) are undone as they are for a Hub model; the values are then
    copied into the existing parameters, which an optimizer may already hold. A parameter the checkpoint lacks, or of
    the wrong shape, is an error rather than a silently re-initialised tensor. Costs a second copy of the weights on
    the CPU while it runs.

    Example:
        >>> load_pretrained_weights(model, "out/checkpoint-500")
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"load_pretrained_weights needs a transformers PreTrainedModel, got {type(model).__name__}; "
            "load a plain torch state dict with model.load_state_dict instead"
        )
    loaded, info = type(model).from_pretrained(checkpoint_dir, config=model.config, output_loading_info=True)
    problems = {key: sorted(map(str, info.get(key, ()))) for key in ("missing_keys", "mismatched_keys", "error_msgs")}
    problems = {key: names for key, names in problems.items() if names}
    if problems:
        raise RuntimeError(
            f"checkpoint {os.fspath(checkpoint_dir)!r} does not hold every weight of {type(model).__name__} "
            f"({problems}); refusing to continue with re-initialised tensors. Was it saved from the same model class "
            "and config?"
        )
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict(), strict=True)


def _checkpoint_keys(checkpoint_dir: str) -> Optional[set[str]]:
    """Tensor names stored in a ``save_pretrained`` directory (safetensors, single or sharded); None if neither."""
    index = os.path.join(checkpoint_dir, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(checkpoint_dir, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def _needs_conversion(model: torch.nn.Module, checkpoint_dir: Optional[str]) -> bool:
    """True if ``checkpoint_dir`` stores tensors under names ``model`` does not have: a converted layout, which a
    plain ``load_state_dict`` would skip. (Names only missing from the checkpoint are tied weights: Trainer handles
    those.)"""
    if checkpoint_dir is None or not isinstance(model, PreTrainedModel):
        return False
    keys = _checkpoint_keys(checkpoint_dir)
    return keys is not None and bool(keys - set(model.state_dict()))


class SkewAdamTrainer(Trainer):
    """`transformers.Trainer` with SkewAdam and exact resume of MoE checkpoints.

    The optimizer is `create_optimizer(model, args, **optimizer_kwargs)`: one param group per tier, labelled by
    `skewadam.classify`, with ``lr``/``betas``/``weight_decay`` from ``args`` unless ``optimizer_kwargs`` sets
    them (and any `SkewAdam.from_model` option: ``tier_options``, ``rules``, ``eps_mode``, ...). The scheduler
    is Trainer's (``args.lr_scheduler_type``). A SkewAdam passed through ``optimizers=(opt, sched)`` is used as
    is. Checkpoints saved in a converted layout (fused MoE experts; see `skewadam.integrations.hf`) are loaded through
    `load_pretrained_weights` when resuming and for ``load_best_model_at_end``. With DeepSpeed
    (``TrainingArguments(deepspeed=config)``, or Accelerate's DeepSpeed plugin), ZeRO's partitions are stepped as
    pieces of SkewAdam's tensors (`skewadam.integrations.deepspeed.prepare_with`).

    Args:
        *args: those of `transformers.Trainer`.
        **kwargs: those of `transformers.Trainer`.
        optimizer_kwargs: keyword arguments of `SkewAdam.from_model`, overriding those taken from ``args``.
    """

    def __init__(self, *args: Any, optimizer_kwargs: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(
                "SkewAdamTrainer builds SkewAdam itself: pass its options as optimizer_kwargs={...}, "
                "not optimizer_cls_and_kwargs (or use transformers.Trainer for another optimizer)"
            )
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:  # ZeRO hands SkewAdam flat partitions: step them as pieces of its tensors
            from .deepspeed import prepare_with

            prepare_with(self.accelerator)

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            self.optimizer = create_optimizer(model, self.args, **self.optimizer_kwargs)
        elif getattr(self.optimizer, "in_backward", False):  # passed in through optimizers=(opt, sched)
            check_in_backward(self.args)
        return self.optimizer

    def _plain_loading(self) -> bool:
        # DeepSpeed, FSDP and SageMaker load checkpoints their own way; PEFT models are not PreTrainedModels.
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled or is_sagemaker_mp_enabled())

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        target = self.model if model is None else model
        if self._plain_loading() and _needs_conversion(target, resume_from_checkpoint):
            load_pretrained_weights(target, resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self._plain_loading() and _needs_conversion(self.model, self.state.best_model_checkpoint):
            load_pretrained_weights(self.model, self.state.best_model_checkpoint)
        else:
            super()._load_best_model()
