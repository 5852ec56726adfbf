"""torchtitan integration: `SkewAdamOptimizers`, an ``OptimizersContainer`` that builds SkewAdam with its tiers.

torchtitan builds its optimizer from ``Trainer.Config.optimizer``, an ``OptimizersContainer.Config`` whose factory
table is fixed (Adam, AdamW, DistMuon); a container subclass is its way to bring another optimizer. Set::

    from skewadam.integrations.torchtitan import SkewAdamOptimizers
    config.optimizer = SkewAdamOptimizers.Config(lr=3e-4, weight_decay=0.1)

Per model part (pipeline stage) it builds one `SkewAdam` with one param group per tier, labelled by
`skewadam.classify` (``rules``, ``tier_options``, ``exempt_1d`` as in `skewadam.classify.param_groups`). With
torchtitan's own ``param_groups=[ParamGroupConfig(pattern, "SkewAdam", optimizer_kwargs)]`` the patterns choose the
groups instead (first match wins, as in torchtitan); a group whose kwargs name no ``tier`` is split by `classify`'s
labels, and its router part gets ``weight_decay=0`` unless the kwargs set one. Other ``optimizer_name`` s keep
torchtitan's factories.

What torchtitan expects of its optimizers, and how SkewAdam meets it:

- ``fused``/``foreach``: torchtitan puts its ``implementation`` into every group; SkewAdam has its own kernels
  (``impl`` in ``kwargs``), so they are dropped from SkewAdam's groups.
- FQN-keyed checkpoints: groups carry ``param_names`` (torchtitan's canonical FQNs), so its flat optimizer state dict
  (``state.{fqn}.{key}``, ``param_groups.{fqn}.{key}``) saves and loads SkewAdam's state; a resumed run continues
  bitwise. (``skipped_steps``, a counter of skipped non-finite steps, is not part of that state dict.)
- State before a checkpoint exists: torchtitan materialises it with a zero-gradient, zero-lr step, which would count
  a step and decay ``eps`` into SkewAdam's second moments; this container allocates it with `SkewAdam.init_state`
  instead, so saving before the first step changes nothing.
- DTensor parameters (FSDP2 ``Shard(0)``/``Shard(1)``, expert parallelism ``Shard(0)`` on the EP mesh): SkewAdam's
  own DTensor support (`skewadam.distributed`).

- Stepping inside backward (``in_backward=True``, `skewadam.backward`): each tensor is stepped as soon as backward
  completes its gradient, FSDP2 running the hooks on its sharded parameters after the reduce-scatter, and the
  gradient freed. torchtitan's trainer still calls ``clip_grad_norm_`` after backward, which then finds no gradient
  (its logged ``grad_norm`` is 0 and it clips nothing; SkewAdam RMS-clips each update unit at 1.0): the container
  warns once. Gradient accumulation and pipeline microbatches run several backwards per step, which raises at the
  second one.

torchtitan is an optional dependency (``pip install 'skewadam[torchtitan]'``); ``import skewadam`` never imports it.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("skewadam.integrations.torchtitan needs torchtitan: pip install 'skewadam[torchtitan]'") from e

from ..classify import classify, flattened_experts
from ..groups import param_groups
from ..optimizer import SkewAdam
from ..tiers import Tier

__all__ = ["SkewAdamOptimizers"]

_NAME = "SkewAdam"
_IMPL_KEYS = ("fused", "foreach")  # torchtitan's implementation switches, meaningless to SkewAdam


class SkewAdamOptimizers(OptimizersContainer):
    """torchtitan ``OptimizersContainer`` holding one `SkewAdam` per model part, with tiers from `skewadam.classify`.

    Args:
        config: `SkewAdamOptimizers.Config`.
        model_parts: the model parts torchtitan passes (one per pipeline stage held).

    Example:
        >>> optimizers = SkewAdamOptimizers.Config(lr=3e-4, weight_decay=0.1).build(model_parts=[model])
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 1e-3
        """Learning rate of every group that sets none."""
        betas: tuple[float, float] = (0.9, 0.999)
        weight_decay: float = 0.0
        """Decoupled weight decay of backbone and expert groups (router groups get none, as in the paper)."""
        rules: list[tuple[str, str]] = dataclasses.field(default_factory=list)
        """``(pattern, tier)`` overrides of the automatic labels (`skewadam.classify.classify`)."""
        tier_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
        """Per-tier group settings, e.g. ``{"router": {"lr": 1e-4}}`` (automatic groups only)."""
        exempt_1d: bool = False
        """Norms, biases and scalars in groups without weight decay (automatic groups only)."""
        kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Other `SkewAdam` arguments: ``eps``, ``eps_mode``, ``momentum_dtype``, ``seed``, ``impl``, ..."""
        in_backward: bool = False
        """Step each tensor inside backward and free its gradient (no global clipping: ``training.max_norm`` then
        clips nothing; one backward per step: no gradient accumulation or pipeline microbatches)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups and (config.tier_options or config.exempt_1d):
            raise ValueError(
                "SkewAdamOptimizers: tier_options and exempt_1d shape the automatic groups; with param_groups "
                "patterns, set each group's optimizer_kwargs instead"
            )
        impl_kwargs = self._build_impl_kwargs(config)
        self.optimizers = []
        self.model_parts = model_parts
        all_params: list[nn.Parameter] = []
        skewadam_kwargs = {"lr": config.lr, "betas": tuple(config.betas), "weight_decay": config.weight_decay,
                           "in_backward": config.in_backward, **config.kwargs,
                           **config.optimizer_factory_kwargs_by_name.get(_NAME, {})}
        if skewadam_kwargs["in_backward"]:
            warnings.warn("SkewAdamOptimizers(in_backward=True): each tensor is stepped inside backward, so the "
                          "trainer's clip_grad_norm_ (training.max_norm) finds no gradient: it logs grad_norm 0 and "
                          "clips nothing; SkewAdam RMS-clips each update unit at 1.0", stacklevel=2)
        for part_idx, model in enumerate(model_parts):
            if config.param_groups:
                by_name, patterns = self._build_param_groups(model, config.param_groups, impl_kwargs)
            else:
                by_name = {_NAME: _tier_groups(model, config)}
                patterns = {_NAME: [f"tier {g['tier']}" for g in by_name[_NAME]]}
            for name, groups in by_name.items():
                if name == _NAME:
                    if config.param_groups:
                        groups, origins = _split_by_tier(model, groups, config.rules)
                        patterns[name] = [patterns[name][i] for i in origins]
                    optimizer = SkewAdam(groups, **skewadam_kwargs)
                else:
                    optimizer = self._resolve_optimizer_factory(name)(
                        groups, **config.optimizer_factory_kwargs_by_name.get(name, {}))
                self.optimizers.append(optimizer)
                self._log_optimizer(optimizer, part_idx, patterns[name])
                all_params.extend(p for g in optimizer.param_groups for p in g["params"])
        self._validate_params(all_params)
        if config.implementation == "fused_opt_states_bf16":
            self._register_bf16_optimizer_state_hook()  # Adam/AdamW groups only, as in torchtitan
        self._post_init(all_params)

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat, FQN-keyed state dict of every optimizer; SkewAdam's state is allocated first without a
        step (`SkewAdam.init_state`), so saving before the first step changes nothing."""
        self._init_skewadam_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._init_skewadam_state()
        super().load_state_dict(state_dict)

    def _init_skewadam_state(self) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, SkewAdam):
                optimizer.init_state()


def _tier_groups(model: nn.Module, config: SkewAdamOptimizers.Config) -> list[dict[str, Any]]:
    """`skewadam.classify.param_groups` with torchtitan's canonical FQNs as ``param_names``."""
    groups = param_groups(model, weight_decay=config.weight_decay, rules=config.rules or None,
                          tier_options=config.tier_options, exempt_1d=config.exempt_1d)
    for g in groups:
        g["param_names"] = [canonical_fqn(n) for n in g["param_names"]]
    return groups


def _split_by_tier(
    model: nn.Module, groups: list[dict[str, Any]], rules: list
) -> tuple[list[dict[str, Any]], list[int]]:
    """torchtitan's pattern groups as SkewAdam groups, and the pattern index each came from: ``fused``/``foreach``
    dropped, and a group naming no ``tier`` split by `classify`'s labels (flattened banks with their ``experts``
    count), in tier order."""
    fqn = {canonical_fqn(n): n for n, _ in model.named_parameters()}
    labels = classify(model, rules or None)
    flat = flattened_experts(model, rules or None)
    out, origins = [], []
    for i, group in enumerate(groups):
        group = {k: v for k, v in group.items() if k not in _IMPL_KEYS}
        if "tier" in group:
            out.append(group)
            origins.append(i)
            continue
        parts: dict[tuple[str, Any], list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        for name, p in zip(group["param_names"], group["params"]):
            parts[(labels[fqn[name]], flat.get(fqn[name]))].append((name, p))
        tiers = [t.value for t in Tier]
        for tier, experts in sorted(parts, key=lambda key: (tiers.index(key[0]), key[1] or 0)):
            members = parts[(tier, experts)]
            sub = {**group, "params": [p for _, p in members], "param_names": [n for n, _ in members], "tier": tier}
            if experts is not None:
                sub["experts"] = experts
            if tier == Tier.ROUTER.value:
                sub.setdefault("weight_decay", 0.0)
            out.append(sub)
            origins.append(i)
    return out, origins
