"""SkewAdam's param groups of a model, one per tier (`param_groups`), and their census (`describe`).

Labels come from `skewadam.classify`; the state a census counts is `skewadam.state`'s, resolved from the same settings
the optimizer's groups get, so the census is what `SkewAdam.state_bytes` reports after a step.

Example:
    >>> print(describe(model).table())
    >>> opt = SkewAdam(param_groups(model, weight_decay=0.1), lr=3e-4)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from torch import nn

from . import recipes
from .classify import Labels, hidden_matrices, label, split_trainable
from .state import format_bytes, spec_nbytes, state_flags
from .tiers import Tier

__all__ = ["describe", "param_groups", "split_kwargs", "orthogonal_names", "orthogonal_flops", "group_settings",
           "Census", "TierCensus", "ORTHOGONAL_MOMENTUM", "warn_untiered_experts", "describe_optimizer",
           "group_members"]

logger = logging.getLogger("skewadam")
Orthogonal = Union[bool, str, Sequence[str]]
#: What `describe` and `orthogonal_names` take as labels: `skewadam.classify.label`'s, or ``{name: tier}``.
GivenLabels = Union[Labels, Mapping[str, str]]

_TIERS = tuple(t.value for t in Tier)


# ---------------------------------------------------------------------------------------------------- census
@dataclasses.dataclass
class TierCensus:
    """One tier's share of the model and what its optimizer state costs."""

    tensors: int
    params: int
    share: float  # of all trainable parameters
    state_bytes: int  # moments (exp_avg, exp_avg_sq, row_var, col_var), as `skewadam.state.state_spec` allocates
    counter_bytes: int  # step counts


@dataclasses.dataclass
class Census:
    """Per-tier counts of a model's trainable parameters, the optimizer state they cost, and the frozen ones."""

    tiers: dict[str, TierCensus]
    frozen_tensors: int
    frozen_params: int
    frozen_names: list[str]
    model: str = ""

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tiers.values())

    @property
    def state_bytes(self) -> int:
        return sum(t.state_bytes for t in self.tiers.values())

    @property
    def counter_bytes(self) -> int:
        return sum(t.counter_bytes for t in self.tiers.values())

    def table(self) -> str:
        """The census as a fixed-width table."""
        head = f"{'tier':<9} {'tensors':>8} {'params':>16} {'share':>7} {'state':>11} {'steps':>9}"
        lines = [f"SkewAdam tiers of {self.model}" if self.model else "SkewAdam tiers", head, "-" * len(head)]
        for tier, t in self.tiers.items():
            lines.append(
                f"{tier:<9} {t.tensors:>8,} {t.params:>16,} {t.share:>7.2%} {format_bytes(t.state_bytes):>11} "
                f"{format_bytes(t.counter_bytes):>9}"
            )
        lines.append("-" * len(head))
        total_t = sum(t.tensors for t in self.tiers.values())
        lines.append(
            f"{'total':<9} {total_t:>8,} {self.params:>16,} {1 if self.params else 0:>7.2%} "
            f"{format_bytes(self.state_bytes):>11} {format_bytes(self.counter_bytes):>9}"
        )
        if self.frozen_tensors:
            lines.append(f"frozen (requires_grad=False, not optimized): {self.frozen_tensors:,} tensors, "
                         f"{self.frozen_params:,} params")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tiers": {k: dataclasses.asdict(v) for k, v in self.tiers.items()},
            "params": self.params,
            "state_bytes": self.state_bytes,
            "counter_bytes": self.counter_bytes,
            "frozen": {"tensors": self.frozen_tensors, "params": self.frozen_params, "names": self.frozen_names},
        }


def describe(
    model: nn.Module,
    rules: Optional[Sequence[tuple[str, str]]] = None,
    tier_options: Optional[dict[str, dict[str, Any]]] = None,
    *,
    labels: Optional[GivenLabels] = None,
    defaults: Optional[Mapping[str, Any]] = None,
    orthogonal: Orthogonal = False,
    orthogonal_options: Optional[dict[str, Any]] = None,
) -> Census:
    """Census of ``model`` under SkewAdam: per tier the tensors, parameters, share and optimizer-state bytes.

    Labels are ``labels`` (`skewadam.classify.label`'s, or ``{name: tier}``) or else the automatic ones under
    ``rules``; not both. State bytes are those `skewadam.state.state_spec` allocates for each parameter under its
    tier's flags as `skewadam.state.state_flags` resolves them from ``defaults`` (SkewAdam's constructor settings:
    ``momentum_dtype``, ``use_momentum``, ...) overridden by ``tier_options[tier]`` (and, for the tensors
    ``orthogonal`` selects, the orthogonal groups' settings), exactly as the optimizer resolves its groups. Warns
    when a tier is empty.

    Example:
        >>> print(describe(model, defaults={"momentum_dtype": "int8"}).table())
    """
    options = _check_tier_options(tier_options)
    found = _labels(model, rules, labels)
    orth = set(orthogonal_names(model, found, orthogonal))
    flags: dict[tuple[str, bool], Any] = {}
    rows = {t: [0, 0, 0, 0] for t in _TIERS}
    for name, p in found.trainable.items():
        tier = found.tiers[name]
        key = (tier, name in orth)
        if key not in flags:
            flags[key] = state_flags(group_settings(tier, key[1], defaults, options, orthogonal_options))
        # flattened banks are sized as the stacked banks they flatten, as the optimizer steps them
        experts = found.experts.get(name) if tier == Tier.EXPERT.value else None
        tier_flags = flags[key] if experts is None else flags[key]._replace(experts=experts)
        stats, counters = spec_nbytes(tier_flags.spec(p.shape, p.dtype))
        row = rows[tier]
        row[0] += 1
        row[1] += p.numel()
        row[2] += stats
        row[3] += counters
    total = sum(r[1] for r in rows.values())
    census = Census(
        tiers={t: TierCensus(r[0], r[1], r[1] / total if total else 0.0, r[2], r[3]) for t, r in rows.items()},
        frozen_tensors=len(found.frozen),
        frozen_params=sum(p.numel() for p in found.frozen.values()),
        frozen_names=list(found.frozen),
        model=type(model).__name__,
    )
    _warn_empty(census)
    return census


def _labels(model: nn.Module, rules: Optional[Sequence[tuple[str, str]]], labels: Optional[GivenLabels]) -> Labels:
    """The `Labels` of one call: those given, or `label`'s under ``rules`` (or from given ``{name: tier}``)."""
    if not isinstance(labels, Labels):
        return label(model, rules, tiers=labels)
    if rules:
        raise ValueError("rules and labels given: labels already apply their rules; pass rules to "
                         "skewadam.classify.label(model, rules) or here, not both")
    return labels


def _warn_empty(census: Census) -> None:
    empty = [t for t, c in census.tiers.items() if c.tensors == 0]
    if not empty or census.params == 0:
        return
    if Tier.EXPERT.value in empty and Tier.ROUTER.value in empty:
        msg = (
            f"{census.model}: no expert and no router parameters found (a dense model?); SkewAdam then behaves like "
            "factored Adam with momentum on everything. If this is an MoE model, label its tensors with "
            "rules=[(pattern, tier), ...]"
        )
    else:
        msg = (
            f"{census.model}: tier(s) {empty} are empty; if the model has routed experts and a router, check "
            "skewadam.classify(model) and add rules=[(pattern, tier), ...] for what it missed"
        )
    warnings.warn(msg, stacklevel=3)


# ------------------------------------------------------------------------------------------------ param groups
_GROUP_OPTIONS = ("rules", "tier_options", "exempt_1d", "log", "verbose", "weight_decay", "orthogonal",
                  "orthogonal_options")
#: Muon's momentum (torch.optim.Muon's default), the orthogonal groups' ``betas[0]`` unless set otherwise.
ORTHOGONAL_MOMENTUM = 0.95


def orthogonal_names(model: nn.Module, labels: GivenLabels, orthogonal: Orthogonal) -> list[str]:
    """The tensors ``orthogonal`` puts into update="orthogonal" groups: none (False), the hidden matrices (True or
    ``"hidden"``: `skewadam.classify.hidden_matrices`), those and every expert tensor made of matrices
    (``"experts"``: banks ``[E, A, B]``, per-expert ``[A, B]``), or the names given (a list). ``labels`` are
    `skewadam.classify.label`'s, or ``{name: tier}``."""
    if orthogonal is False or orthogonal is None:
        return []
    if isinstance(labels, Labels):
        trainable, tiers, hidden = labels.trainable, labels.tiers, list(labels.hidden)
    else:
        trainable, tiers, hidden = split_trainable(model)[0], labels, None
    if orthogonal is True or orthogonal in ("hidden", "experts"):
        names = hidden if hidden is not None else hidden_matrices(model, tiers)
        if orthogonal == "experts":  # banks of matrices, and the weights of per-expert Linear modules (not the
            linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}  # [E, F] bias banks)
            names += [n for n, p in trainable.items()
                      if tiers[n] == Tier.EXPERT.value and (p.ndim == 3 or (p.ndim == 2 and id(p) in linear))]
        return names
    if isinstance(orthogonal, str) or not all(isinstance(n, str) for n in orthogonal):
        raise ValueError(f"orthogonal={orthogonal!r}: use True (the hidden matrices), 'experts' (and the expert "
                         f"matrices), or a list of parameter names")
    names = list(orthogonal)
    unknown = [n for n in names if n not in trainable]
    if unknown:
        raise ValueError(f"orthogonal names {unknown[:3]} are not trainable parameters of {type(model).__name__} "
                         f"(names such as {next(iter(trainable), '<none>')!r})")
    return names


def orthogonal_flops(model: nn.Module, orthogonal: Orthogonal, labels: Optional[GivenLabels] = None, *,
                     defaults: Optional[Mapping[str, Any]] = None,
                     tier_options: Optional[dict[str, dict[str, Any]]] = None,
                     orthogonal_options: Optional[dict[str, Any]] = None) -> int:
    """Matmul FLOPs of Newton-Schulz per step, on average, over the tensors ``orthogonal`` selects
    (`orthogonal_names`): per matrix ``[A, B]`` (each slice of a bank ``[E, A, B]``), with ``m, n = min(A, B),
    max(A, B)``, ``ns_steps`` x ``(4 m^2 n + 2 m^3)`` (the Gram matrix, its square, the product with the iterate),
    divided by ``ns_interval``, as its group sets them (`param_groups`' settings from SkewAdam's ``defaults``,
    ``tier_options`` and ``orthogonal_options``; Muon's 5 steps every step unless they say otherwise).

    Example:
        >>> orthogonal_flops(model, "experts")  # paper-6.78b: 8.07e14
    """
    from .kernels.types import NS_STEPS  # here: the planner counts FLOPs without loading a kernel module

    found = _labels(model, None, labels)
    options = _check_tier_options(tier_options)
    settings: dict[str, dict[str, Any]] = {}
    by_interval: dict[int, int] = {}
    for name in orthogonal_names(model, found, orthogonal):
        tier = found.tiers[name]
        group = settings.setdefault(tier, group_settings(tier, True, defaults, options, orthogonal_options))
        *batch, a, b = found.trainable[name].shape
        m, n = min(a, b), max(a, b)
        every = group.get("ns_interval", 1)
        by_interval[every] = by_interval.get(every, 0) + math.prod(batch) * group.get("ns_steps", NS_STEPS) * (
            4 * m * m * n + 2 * m ** 3)
    return sum(flops // every for every, flops in by_interval.items())


def group_settings(tier: str, orthogonal: bool, defaults: Optional[Mapping[str, Any]], options: dict,
              orthogonal_options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A group's settings: SkewAdam's ``defaults``, then for orthogonal groups Muon's momentum, then
    ``tier_options[tier]``, then ``orthogonal_options``."""
    out = dict(defaults or {})
    if orthogonal:
        out.update(update="orthogonal", betas=(ORTHOGONAL_MOMENTUM, out.get("betas", (0.9, 0.999))[1]),
                   relative_step=False, beta2_decay=None)
    out.update(options.get(tier, {}))
    if orthogonal:
        out.update(orthogonal_options or {})
    return {**out, "tier": tier}


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`SkewAdam.from_model` keyword arguments as ``(param_groups kwargs, SkewAdam kwargs)``, after applying their
    ``recipe`` (default ``"paper"``; `skewadam.recipes.apply`: explicit arguments override it)."""
    kwargs = dict(kwargs)
    kwargs = recipes.apply(kwargs.pop("recipe", recipes.DEFAULT_RECIPE), kwargs)
    group = {k: v for k, v in kwargs.items() if k in _GROUP_OPTIONS}
    return group, {k: v for k, v in kwargs.items() if k not in _GROUP_OPTIONS}


def _check_tier_options(tier_options: Optional[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for tier, opts in (tier_options or {}).items():
        try:
            key = Tier.parse(tier).value
        except ValueError as e:
            raise ValueError(f"tier_options: {e}") from None
        if not isinstance(opts, dict):
            raise ValueError(f"tier_options[{tier!r}] must be a dict of param group settings, e.g. {{'lr': 1e-4}}")
        if "params" in opts or "tier" in opts:
            raise ValueError(f"tier_options[{tier!r}] may not set 'params' or 'tier'; use rules=[...] to move tensors")
        if "experts" in opts:
            raise ValueError(f"tier_options[{tier!r}] may not set 'experts': param_groups sets it per flattened bank "
                             "from the model's structure (skewadam.classify.flattened_experts)")
        out[key] = dict(opts)
    return out


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float = 0.0,
    rules: Optional[Sequence[tuple[str, str]]] = None,
    tier_options: Optional[dict[str, dict[str, Any]]] = None,
    exempt_1d: bool = False,
    log: bool = True,
    verbose: bool = False,
    defaults: Optional[Mapping[str, Any]] = None,
    orthogonal: Orthogonal = False,
    orthogonal_options: Optional[dict[str, Any]] = None,
) -> list[dict[str, Any]]:
    """SkewAdam param groups for ``model``: one per non-empty tier (two with ``exempt_1d``), labelled by `classify`.

    The paper's defaults: ``weight_decay`` on backbone and expert tensors, none on the router. ``exempt_1d`` moves
    tensors with < 2 dims (norms, biases, scalars) of each tier into a group without weight decay, as common practice
    does. ``tier_options={"router": {"lr": 1e-4}}`` overrides any group setting per tier (applied last; an exempted
    group keeps ``weight_decay=0``). Groups carry ``param_names``. Flattened expert banks (`flattened_experts`) go
    to an expert group of their own per count E with the key ``experts=E``: each tensor stacks E experts along dim 0.
    The census (`describe`) counts the state under ``defaults``, the SkewAdam settings the groups will inherit
    (`SkewAdam.from_model` passes its own); ``verbose`` prints it, ``log`` sends it to the ``skewadam`` logger (INFO).

    ``orthogonal`` (beyond the paper; `orthogonal_names`): True puts the hidden matrices into a backbone group with
    ``update="orthogonal"`` (Muon's update, momentum ``ORTHOGONAL_MOMENTUM``), ``"experts"`` also the expert
    matrices (an expert group with ``update="orthogonal"``, no momentum: per expert, from the gradient);
    ``orthogonal_options`` overrides those groups' settings (applied after ``tier_options``):
    ``{"use_momentum": True}`` with ``"experts"`` gives the expert slices Nesterov momentum too (with
    ``momentum_dtype="int8"`` the basis of the ``quality`` recipe, `skewadam.recipes`).

    Example:
        >>> opt = SkewAdam(param_groups(model, weight_decay=0.1, exempt_1d=True), lr=3e-4)
    """
    options = _check_tier_options(tier_options)
    found = label(model, rules)
    census = describe(model, tier_options=tier_options, labels=found, defaults=defaults, orthogonal=orthogonal,
                      orthogonal_options=orthogonal_options)
    orth = set(orthogonal_names(model, found, orthogonal))
    report = [census.table()]
    if census.frozen_names:
        report.append(f"frozen parameters left out of the optimizer: {census.frozen_names}")
    if verbose:
        print("\n".join(report))
    if log:
        logger.info("%s", "\n".join(report))
    groups = []
    for tier, members, exempt, experts, orthogonal_group in group_members(found, orth, exempt_1d):
        group = {"params": [found.trainable[n] for n in members], "param_names": members, "tier": tier,
                 "weight_decay": 0.0 if tier == Tier.ROUTER.value or exempt else weight_decay}
        if experts is not None:
            group["experts"] = experts
        if orthogonal_group:
            settings = group_settings(tier, True, defaults, options, orthogonal_options)
            group.update({k: settings[k] for k in ("update", "betas", "relative_step", "beta2_decay",
                                                   *options.get(tier, {}), *(orthogonal_options or {}))})
        else:
            group.update(options.get(tier, {}))
            if exempt:
                group["weight_decay"] = 0.0
        groups.append(group)
    return groups


def group_members(found: Labels, orth: set[str], exempt_1d: bool = False) -> list[tuple[str, list[str], bool,
                                                                                          Optional[int], bool]]:
    """The tensors of each param group `param_groups` makes, in its order: ``(tier, names, exempt (< 2 dims, no
    weight decay), experts (a flattened bank's E) or None, orthogonal)``; per tier, its tensors (split by
    ``exempt_1d`` and by flattened banks' E), then its orthogonal ones (``orth``). ZeRO partitions each group on
    its own, in this order (`skewadam.bench.planner`'s ZeRO figures)."""
    trainable, labels, flat = found.trainable, found.tiers, found.experts
    out = []
    for tier in _TIERS:
        names = [n for n, t in labels.items() if t == tier and n not in orth]
        split = [(names, False)]
        if exempt_1d:
            split = [([n for n in names if trainable[n].ndim >= 2], False),
                     ([n for n in names if trainable[n].ndim < 2], True)]
        out += [(tier, members, exempt, k, False) for m, exempt in split
                for k in [None, *sorted({flat[n] for n in m if n in flat})]
                if (members := [n for n in m if flat.get(n) == k])]
        members = [n for n, t in labels.items() if t == tier and n in orth]
        if members:
            out.append((tier, members, False, None, True))
    return out


# ----------------------------------------------------------------------------------------------- untiered groups
def warn_untiered_experts(params: Sequence[Any], idx: int) -> bool:
    """Warn (once; True if it did) when a param group that names no tier holds tensors that look like experts: a
    bank ``[E, A, B]`` with matrix-sized A and B (not a conv kernel), or any >= 3-D tensor ``[E, ...]`` beside an
    ``[E, D]``-shaped gate. Without a tier they would all keep backbone state (momentum + factored), ~4x what the
    paper's tiers keep for experts."""
    shapes = [tuple(p[1].shape if isinstance(p, tuple) else p.shape) for p in params]  # (name, tensor) pairs too
    gates = {s for s in shapes if len(s) == 2}
    banks = [s for s in shapes if len(s) >= 3 and (min(s[-2:]) > 8 or any((s[0], d) in gates for d in s[1:]))]
    if not banks:
        return False
    gate = next(((b[0], d) for b in banks for d in b[1:] if (b[0], d) in gates), None)
    frame, level = sys._getframe(1), 2  # point at the caller's line, past skewadam and torch.optim
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("skewadam.", "torch.optim")):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"SkewAdam: param group {idx} names no tier, so all its tensors keep backbone state (momentum + factored), "
        f"but {len(banks)} look like expert banks ({', '.join(map(str, banks[:3]))}{', ...' if len(banks) > 3 else ''}"
        f"{f', beside a gate {list(gate)}' if gate else ''}). Label them: SkewAdam.from_model(model, ...), or give "
        f"each group a tier ('expert' for banks, 'router' for the gate, 'backbone' for the rest)",
        UserWarning, stacklevel=level)
    return True


def describe_optimizer(self: Any) -> str:
    """``repr(optimizer)`` of `skewadam.SkewAdam`: each group's tier, size and settings, and the skip counts."""
    lines = [self.__class__.__name__ + " ("]
    for i, group in enumerate(self.param_groups):
        n = sum(p.numel() for p in group["params"])
        lines.append(f"Parameter Group {i} [{group['tier']}: {len(group['params'])} tensors, {n:,} parameters]")
        for key in sorted(k for k in group if k not in ("params", "param_names")):
            lines.append(f"    {key}: {group[key]}")
    lines.append(f"skip_nonfinite: {self.skip_nonfinite} (skipped_steps: {self.skipped_steps})")
    if self.in_backward:
        lines.append(f"in_backward: True (skipped_tensors: {self.skipped_tensors})")
    lines.append(")")
    return "\n".join(lines)
