"""The checks SkewAdam's param groups, parameters and checkpoints pass, at construction and at
`SkewAdam.load_state_dict`: one definition each, so a checkpoint is refused with the constructor's own messages.

A group's hyperparameters follow `skewadam.kernels.types.check_group` (the rules the step applies to the kernels'
records, so a value changed after construction is refused alike); its state settings resolve through
`skewadam.state.state_flags` into its `skewadam.state.TierSpec`; a checkpoint's state is checked by
`skewadam.state.check_state` (keys, shapes, dtypes and values).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor
from torch.optim import Optimizer

from .kernels import orthogonal
from .kernels.types import NS_STEPS, Group, check_group, check_param_dtype
from .state import TierSpec, check_state, state_flags

__all__ = ["EPS_DEFAULT", "GROUP_KEYS", "ADDED_KEYS", "FOREIGN_KEYS", "resolve_group", "validate_group",
           "validate_params", "validate_param", "foreign_message", "check_state_dict"]

EPS_DEFAULT = {"floor": 1e-8, "add": 1e-30}
GROUP_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "eps_mode", "tier", "use_momentum", "use_factored", "bank", "seed",
     "momentum_dtype", "experts", "update", "relative_step", "beta2_decay", "ns_steps", "ns_dtype", "ns_interval"}
)
#: Keys added after checkpoints were saved without them, with the value those checkpoints were trained with.
ADDED_KEYS = {"ns_steps": NS_STEPS, "ns_dtype": None, "ns_interval": 1}
# Keys other APIs put into param groups: named parameters, LR schedulers' bookkeeping, DeepSpeed-MoE's expert groups.
FOREIGN_KEYS = frozenset({"param_names", "initial_lr", "moe", "name"})
# What every group SkewAdam.state_dict() saves holds (``experts`` only where the group has flattened banks).
SAVED_KEYS = GROUP_KEYS - {"experts"}
# What decides which optimizer group a saved one is: a checkpoint's must be the optimizer's.
IDENTITY_KEYS = ("tier", "experts")


def resolve_group(param_group: Mapping[str, Any], defaults: Mapping[str, Any], idx: int) -> dict[str, Any]:
    """A copy of ``param_group`` with ``defaults`` filled in, validated (`validate_group`), its tier, state flags and
    eps resolved: the constructor's path and `check_state_dict`'s."""
    unknown = set(param_group) - GROUP_KEYS - FOREIGN_KEYS
    if unknown:
        raise ValueError(f"param group {idx} has unknown key(s) {sorted(unknown)}; SkewAdam groups take "
                         f"{sorted(GROUP_KEYS)}")
    group = dict(param_group)
    for key, default in defaults.items():
        group.setdefault(key, default)
    spec = validate_group(group, idx)
    group.update(tier=spec.tier, use_momentum=spec.use_momentum, use_factored=spec.use_factored)
    if group["eps"] is None:
        group["eps"] = EPS_DEFAULT[group["eps_mode"]]
    return group


def validate_group(group: dict, idx: int) -> TierSpec:
    """Check the hyperparameters and state settings of param group ``idx`` (all keys present); ``betas`` becomes a
    tuple of floats. Returns the group's `TierSpec`."""
    where = f"param group {idx}"
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas in {where}: {betas!r} (expected a pair (beta1, beta2))")
    eps = EPS_DEFAULT.get(group["eps_mode"], 1.0) if group["eps"] is None else group["eps"]
    record = Group((), group["lr"], betas[0], betas[1], eps, group["eps_mode"], group["weight_decay"], group["seed"],
                   group["relative_step"], group["beta2_decay"], group["ns_steps"], group["ns_dtype"],
                   group["ns_interval"])
    check_group(record, where)
    orthogonal.check_options(record, where)
    lr = group["lr"]
    if isinstance(lr, Tensor) and not (math.isfinite(value := lr.item()) and value >= 0):  # read once, here
        raise ValueError(f"Invalid learning rate in {where}: {lr!r} (expected a finite float >= 0)")
    group["betas"] = (float(betas[0]), float(betas[1]))
    spec = state_flags(group, where)
    if spec.update == "orthogonal" and (group["relative_step"] or group["beta2_decay"] is not None):
        raise ValueError(f"{where}: relative_step and beta2_decay shape the Adam-style update; an update='orthogonal' "
                         f"group has no second moment to decay and a fixed RMS: set them in update='adam' groups only")
    return spec


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


def validate_params(params: Iterable[Any], group: dict, idx: int) -> None:
    """Check each parameter of (resolved) param group ``idx`` (`validate_param`; named ``(name, tensor)`` pairs
    too), and refuse flattened (FSDP1, ``deepspeed.zero.Init``) and Partial shards
    (`skewadam.distributed.check_layout`)."""
    for p in params:
        p = p[1] if isinstance(p, tuple) else p
        if isinstance(p, Tensor):  # (torch's add_param_group refuses anything else itself)
            validate_param(p, group, idx)
            if torch.distributed.is_available():
                from .distributed import check_layout

                check_layout(p, f"param group {idx} (tier {group['tier']!r})", group.get("experts"))


def validate_param(p: Tensor, group: dict, idx: int) -> None:
    """Check one parameter of (resolved) param group ``idx``: its dtype, and the shape its group's settings need."""
    where = f"param group {idx} (tier {group['tier']!r})"
    check_param_dtype(p.dtype, where)
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
                         f"{tuple(p.shape)} (bank={bank}); give it matrices [A, B] or banks [E, A, B], and "
                         f"norms, biases and embeddings an update='adam' group")
    experts = group.get("experts")
    if experts is not None and (p.ndim < 2 or p.shape[0] % experts):
        raise ValueError(
            f"{where}: experts={experts} needs tensors of >= 2 dims whose dim 0 stacks that many experts, got shape "
            f"{tuple(p.shape)}; put this tensor in a group without 'experts'"
        )


def check_state_dict(state_dict: Mapping[str, Any], param_groups: list[dict],
                     zero: Any = None) -> tuple[list[dict], dict]:
    """The param groups and state of ``state_dict`` (an optimizer's), checked for loading
    into an optimizer holding ``param_groups``: each saved group whole (every key SkewAdam saves, none another
    optimizer's; nothing is filled in but the `ADDED_KEYS` an older checkpoint lacks), with the constructor's checks,
    and the group it replaces (the same tier and flattened banks); each parameter's state against `skewadam.state.state_spec`, by value too (a Python-number
    ``step`` of older checkpoints and other tools becomes a tensor, a flattened bank's state in the stacked layout
    of earlier versions is reshaped to its own, `skewadam.state.TierSpec.spec`); a ZeRO partition's (registered in
    ``zero``, `skewadam.zero.ZeroSteps`) against its pieces (`skewadam.zero.Partition.check_state`);
    ``skipped_steps``, where present, a whole number >= 0. Returns ``(groups, state)`` to load; raises ValueError
    naming what does not fit, having changed nothing."""
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        raise ValueError(f"the state dict has no {' and no '.join(map(repr, missing))} (it has keys "
                         f"{sorted(state_dict)}): SkewAdam loads what SkewAdam.state_dict() saved")
    skipped = state_dict.get("skipped_steps", 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise ValueError(f"the state dict's skipped_steps is {skipped!r}, expected a whole number >= 0 (the steps "
                         f"skipped for a non-finite gradient)")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(_other_groups(saved_groups, param_groups))
    groups = []
    for idx, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if set(saved) - GROUP_KEYS - FOREIGN_KEYS:
            raise ValueError(foreign_message(saved, idx))
        saved = {**ADDED_KEYS, **saved}
        absent = sorted(SAVED_KEYS - set(saved))
        if absent:
            raise ValueError(f"param group {idx} of the state dict has no {absent}: every group SkewAdam.state_dict() "
                             f"saves holds them (nothing is filled in from the constructor's values); load an "
                             f"unedited checkpoint, or add the key(s) with the values it was trained with")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(_other_groups(saved_groups, param_groups))
        resolved = resolve_group(saved, {}, idx)
        for key in IDENTITY_KEYS:
            if resolved.get(key) != group.get(key):
                raise ValueError(f"param group {idx} of the state dict has {key}={resolved.get(key)!r}, this "
                                 f"optimizer's param group {idx} {key}={group.get(key)!r}: a checkpoint's groups are "
                                 f"the optimizer's, in order; build the optimizer as the checkpoint's was built")
        groups.append(resolved)
    states = dict(state_dict["state"])
    for idx, (saved, group) in enumerate(zip(groups, param_groups)):
        spec = state_flags(saved)
        names = group.get("param_names") or [None] * len(group["params"])
        for i, (saved_id, p, name) in enumerate(zip(saved["params"], group["params"], names)):
            state = states.get(saved_id)
            if not state:
                continue
            if zero is not None and (part := zero.of([p])) is not None:
                part.check_state(state, saved, f"param group {idx} (tier {saved['tier']!r})")
                continue
            want = spec.spec(p.shape, p.dtype)
            state = dict(state)
            if isinstance(state.get("step"), (int, float)) and want["step"].shape == ():
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            if spec.experts is not None:  # a flattened bank's state saved in the stacked layout of earlier versions
                stacked = spec.spec(p.shape, p.dtype, stacked=True)
                state.update({key: v.reshape(want[key].shape) for key, v in state.items() if key in want
                              and isinstance(v, Tensor) and tuple(v.shape) == stacked[key].shape != want[key].shape})
            check_state(state, want, f"state of parameter {i}{f' ({name})' if name else ''} of param group "
                        f"{idx} (tier {saved['tier']!r})")
            states[saved_id] = state
    return groups, states


def _other_groups(saved: list[dict], groups: list[dict]) -> str:
    """The error refusing a checkpoint whose param groups are not the optimizer's: both, each group in a few words
    (index, tier, update, size)."""
    def words(groups: list[dict]) -> str:
        out = []
        for i, g in enumerate(groups):
            n = len(g.get("params", ()))
            out.append(f"[{i}] {g.get('tier', 'no tier')}{' orthogonal' if g.get('update') == 'orthogonal' else ''} "
                       f"({n} tensor{'s' * (n != 1)})")
        return ", ".join(out)

    return (f"the state dict's param groups are not this optimizer's: saved {words(saved)}; this optimizer "
            f"{words(groups)}. It was saved by an optimizer built with other tiers or another recipe (or over "
            f"another model): build the optimizer as the checkpoint's was built")
