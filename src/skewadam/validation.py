"""The checks SkewAdam's param groups and parameters pass, at construction and at `SkewAdam.load_state_dict`: one
definition, so a checkpoint's hyperparameters are refused with the constructor's own messages."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from .state import MOMENTUM_DTYPES, UPDATES, check_state, state_flags
from .tiers import Tier

__all__ = ["EPS_DEFAULT", "GROUP_KEYS", "FOREIGN_KEYS", "validate_group", "validate_param", "foreign_message",
           "check_state_dict"]

EPS_DEFAULT = {"floor": 1e-8, "add": 1e-30}
GROUP_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "eps_mode", "tier", "use_momentum", "use_factored", "bank", "seed",
     "momentum_dtype", "experts", "update", "relative_step", "beta2_decay"}
)
# Keys other torch APIs put into param groups: named parameters, LR schedulers' bookkeeping.
FOREIGN_KEYS = frozenset({"param_names", "initial_lr"})


def validate_group(group: dict, idx: int) -> None:
    where = f"param group {idx}"
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = lr.item()  # its value is checked as a float's; the group keeps the tensor
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"Invalid learning rate in {where}: {group['lr']!r} (expected a finite float >= 0)")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas in {where}: {betas!r} (expected a pair (beta1, beta2))")
    for j, b in enumerate(betas):
        if isinstance(b, Tensor) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {j} in {where}: {b!r} (expected a float in [0, 1))")
    group["betas"] = (float(betas[0]), float(betas[1]))
    if group["eps_mode"] not in EPS_DEFAULT:
        raise ValueError(f"Invalid eps_mode in {where}: {group['eps_mode']!r} (expected 'floor' or 'add')")
    eps = group["eps"]
    if eps is not None and (not isinstance(eps, (int, float)) or not eps > 0 or not math.isfinite(eps)):
        raise ValueError(f"Invalid epsilon value in {where}: {eps!r} (expected a float > 0)")
    wd = group["weight_decay"]
    if not isinstance(wd, (int, float)) or not math.isfinite(wd) or wd < 0:
        raise ValueError(f"Invalid weight_decay value in {where}: {wd!r} (expected a float >= 0)")
    if group["momentum_dtype"] not in MOMENTUM_DTYPES:
        raise ValueError(
            f"Invalid momentum_dtype in {where}: {group['momentum_dtype']!r} (expected one of {MOMENTUM_DTYPES})"
        )
    for flag in ("use_momentum", "use_factored", "bank"):
        if group[flag] is not None and not isinstance(group[flag], bool):
            raise ValueError(f"Invalid {flag} in {where}: {group[flag]!r} (expected True, False or None)")
    if not isinstance(group["seed"], int) or isinstance(group["seed"], bool):
        raise ValueError(f"Invalid seed in {where}: {group['seed']!r} (expected an int)")
    try:
        Tier.parse(group["tier"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    _validate_update(group, where)
    experts = group.get("experts")
    if experts is not None:
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
            raise ValueError(f"Invalid experts in {where}: {experts!r} (expected an int >= 1: the number of experts "
                             "each tensor stacks along dim 0)")
        if Tier.parse(group["tier"]) != Tier.EXPERT:
            raise ValueError(f"{where}: experts={experts} is a key of 'expert' groups, got tier {group['tier']!r}")


def _validate_update(group: dict, where: str) -> None:
    """``update`` (`skewadam.steppers`), Adafactor's ``relative_step`` and ``beta2_decay``, and the combinations that
    mean nothing (Adafactor's options on an orthogonal group, a factored orthogonal group)."""
    if group["update"] not in UPDATES:
        raise ValueError(f"Invalid update in {where}: {group['update']!r} (expected one of {UPDATES})")
    if not isinstance(group["relative_step"], bool):
        raise ValueError(f"Invalid relative_step in {where}: {group['relative_step']!r} (expected True or False)")
    decay = group["beta2_decay"]
    if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float))
                              or not math.isfinite(decay) or decay > 0):
        raise ValueError(f"Invalid beta2_decay in {where}: {decay!r} (expected None or a float <= 0, e.g. "
                         f"Adafactor's -0.8)")
    if group["update"] != "orthogonal":
        return
    if group["relative_step"] or decay is not None:
        raise ValueError(f"{where}: relative_step and beta2_decay shape the Adam-style update; an update='orthogonal' "
                         f"group has no second moment to decay and a fixed RMS: set them in update='adam' groups only")
    if group["use_factored"]:
        raise ValueError(f"{where}: update='orthogonal' keeps no second moment: leave use_factored unset (or False), "
                         f"or use update='adam'")
    if group.get("experts") is not None:
        raise ValueError(f"{where}: update='orthogonal' takes matrices or stacked banks [E, A, B], not flattened "
                         f"banks (experts={group['experts']}): leave these tensors in an update='adam' group")


def foreign_message(saved: dict, idx: int) -> str:
    """What a state dict whose param group ``idx`` has keys SkewAdam does not take is, for the error refusing it."""
    keys = set(saved) - {"params", "tier"} - FOREIGN_KEYS
    if "decoupled_weight_decay" in keys:  # torch's Adam and AdamW share one group layout
        what = "torch.optim.AdamW" if saved["decoupled_weight_decay"] else "torch.optim.Adam"
    else:
        what = next((f"torch.optim.{name}" for name in torch.optim.__all__
                     if isinstance(cls := getattr(torch.optim, name), type) and issubclass(cls, Optimizer)
                     and keys <= set(inspect.signature(cls).parameters)), "another optimizer")
    return (f"param group {idx} of the state dict is not SkewAdam's: it has key(s) {sorted(keys - GROUP_KEYS)} "
            f"SkewAdam does not take{'' if 'tier' in saved else ' and no tier'}; it looks like the state dict of "
            f"{what}. SkewAdam loads what SkewAdam.state_dict() saved: to switch optimizers, load the model weights "
            f"and start the optimizer fresh")


def validate_param(p: Tensor, group: dict, idx: int) -> None:
    where = f"param group {idx} (tier {group['tier']!r})"
    if p.is_complex():
        raise TypeError(f"{where}: complex parameters are not supported; optimize torch.view_as_real(p) instead")
    if p.dtype == torch.float16:
        raise TypeError(
            f"{where}: fp16 parameters are not supported; keep fp32 parameters with torch.autocast, or use bf16"
        )
    if not p.is_floating_point():
        raise TypeError(f"{where}: parameters must be floating point, got {p.dtype}")
    if group["momentum_dtype"] == "bf16" and p.dtype == torch.float64:
        raise TypeError(
            f"{where}: momentum_dtype='bf16' rounds fp32 momentum to bf16; fp64 parameters keep their momentum in "
            f"fp64 (momentum_dtype='fp32', the statistics dtype) or int8 (momentum_dtype='int8')"
        )
    if group["bank"] and p.ndim < 1:
        raise ValueError(f"{where}: bank=True needs parameters with a leading expert dim, got a 0-d tensor")
    bank = state_flags(group).is_bank(p.ndim)
    if group["update"] == "orthogonal" and p.ndim - bank != 2:
        raise ValueError(f"{where}: update='orthogonal' orthogonalises matrices, got a parameter of shape "
                         f"{tuple(p.shape)} (bank={bank}); give it matrices [A, B] or banks [E, A, B] (bank=True), and "
                         f"norms, biases and embeddings an update='adam' group")
    experts = group.get("experts")
    if experts is not None and (p.ndim < 2 or p.shape[0] % experts):
        raise ValueError(
            f"{where}: experts={experts} needs tensors of >= 2 dims whose dim 0 stacks that many experts, got shape "
            f"{tuple(p.shape)}; put this tensor in a group without 'experts'"
        )


def check_state_dict(state_dict: dict, param_groups: list[dict], resolve: Callable[[dict, int], dict]
                     ) -> tuple[list[dict], dict]:
    """The param groups and state of ``state_dict`` (an optimizer's, without ``skipped_steps``), checked for loading
    into an optimizer holding ``param_groups``: each saved group resolved by ``resolve(saved, idx)`` (the
    constructor's checks and defaults), each parameter's state against `skewadam.state.state_spec` (a Python-number
    ``step`` of older checkpoints and other tools becomes a tensor). Returns ``(groups, state)`` to load; raises
    ValueError naming what does not fit, having changed nothing."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    groups = []
    for idx, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        if set(saved) - GROUP_KEYS - FOREIGN_KEYS:
            raise ValueError(foreign_message(saved, idx))
        groups.append(resolve(saved, idx))
    states = dict(state_dict["state"])
    for idx, (saved, group) in enumerate(zip(groups, param_groups)):
        flags = state_flags(saved)
        names = group.get("param_names") or [None] * len(group["params"])
        for i, (saved_id, p, name) in enumerate(zip(saved["params"], group["params"], names)):
            state = states.get(saved_id)
            if not state:
                continue
            spec = flags.spec(p.shape, p.dtype)
            state = dict(state)
            if isinstance(state.get("step"), (int, float)) and spec["step"].shape == ():
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            check_state(state, spec, f"state of parameter {i}{f' ({name})' if name else ''} of param group "
                        f"{idx} (tier {saved['tier']!r})")
            states[saved_id] = state
    return groups, states
