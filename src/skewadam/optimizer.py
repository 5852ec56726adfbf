r"""`SkewAdam`: tiered optimizer state for Mixture-of-Experts training.

Each param group belongs to a tier (``backbone``, ``expert``, ``router``; `skewadam.tiers`) that sets which state
its parameters keep. The update math lives in `skewadam.kernels` as pure functions over tensor lists; this wrapper
validates groups, allocates state lazily (`skewadam.state.state_spec`), and runs the three kernel passes with the
cross-shard reduction seam between them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import kernels, steppers
from .state import (MOMENTUM_DTYPES, StateBytes, check_state, foreign_group_message, is_bank, measure_state,
                    state_flags, state_spec)
from .tiers import Tier

try:  # DTensor (FSDP2, tensor/expert parallelism); absent on builds without torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

__all__ = ["SkewAdam"]

_EPS_DEFAULT = {"floor": 1e-8, "add": 1e-30}
_GROUP_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "eps_mode", "tier", "use_momentum", "use_factored", "bank", "seed",
     "momentum_dtype", *steppers.GROUP_DEFAULTS}
)
# Keys other torch APIs put into param groups: named parameters, LR schedulers' bookkeeping.
_FOREIGN_KEYS = frozenset({"param_names", "initial_lr"})

#: Reducer signature: ``reduce(items)`` sums each statistic in place across the shards of its parameter, where
#: ``items`` is a list of ``(param, [(statistic, dims_it_sums_over), ...])``. `skewadam.distributed` provides one.
Reducer = Callable[[list[tuple[Tensor, list[tuple[Tensor, tuple[int, ...]]]]]], None]


class _Work(NamedTuple):
    """One group's flat tensor lists for the kernels (local shards for DTensor parameters)."""

    group: dict
    params: list[Tensor]  # as the user holds them (DTensor or plain): for the reducer
    local_params: list[Tensor]
    grads: list[Tensor]
    steps: list[Tensor]
    exp_avgs: list[Optional[Tensor]]
    exp_avg_sqs: list[Optional[Tensor]]
    exp_avg_scales: list[Optional[Tensor]]
    row_vars: list[Optional[Tensor]]
    col_vars: list[Optional[Tensor]]
    banks: list[bool]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    param_ids: list[int]


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def _rounding_stream(p: Tensor, index: int, momentum_dtype: str) -> int:
    """The key index of ``p``'s stochastic rounding; a shard's own stream for DTensor shards that round (bf16
    weights or bf16 momentum)."""
    if isinstance(p, DTensor) and (p.dtype == torch.bfloat16 or momentum_dtype == "bf16"):
        from .distributed import rounding_stream

        return rounding_stream(p, index)
    return index


class SkewAdam(Optimizer):
    r"""Adam with state allocated by tier: factored second moments, momentum only where it pays.

    Per parameter (per bank slice, for stacked experts) with gradient :math:`g`, step :math:`t`:

    .. math::
        \begin{aligned}
        &\textbf{factored } (\ge 2 \text{ dims}, \text{ over the last two; leading dims are batch dims}):\\
        &\quad r \leftarrow \beta_2 r + (1-\beta_2)\,\mathrm{mean}_j(g^2), \quad
              c \leftarrow \beta_2 c + (1-\beta_2)\,\mathrm{mean}_i(g^2)\\
        &\quad d = \sqrt{\max(r/\max(\mathrm{mean}_i r, 10^{-15}), \epsilon)}\;\sqrt{\max(c, \epsilon)}\\
        &\textbf{full}: \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2, \quad d = \sqrt{\max(v, \epsilon)}\\
        &\textbf{momentum}: \quad m \leftarrow \beta_1 m + (1-\beta_1) g, \quad
              u = m\,\sqrt{1-\beta_2^t}\,/\,(1-\beta_1^t)\,/\,d \qquad
              \textbf{else}\quad u = g\,\sqrt{1-\beta_2^t}\,/\,d\\
        &u \leftarrow u / \max(1, \mathrm{rms}(u)), \qquad
              p \leftarrow p\,(1 - \mathrm{lr}\cdot\lambda) - \mathrm{lr}\cdot u
        \end{aligned}

    That is the paper's ``eps_mode="floor"``. The default, ``eps_mode="add"`` (Adafactor's convention), accumulates
    :math:`g^2 + \epsilon` instead and applies no floor (:math:`d = \sqrt{r/\mathrm{mean}_i r}\sqrt{c}` or
    :math:`\sqrt{v}`), with ``eps`` 1e-30: with the paper's 1e-8 floor most second-moment entries sit on the floor
    and SkewAdam trained worst of all optimizers in our study (README, "Which settings train best").

    Tiers (group key ``tier``) set the state: ``backbone`` momentum + factored, ``expert`` factored only,
    ``router`` full exact second moment. ``use_momentum`` / ``use_factored`` override per group (the names of the
    paper's code). In the ``expert`` tier a tensor with >= 3 dims is a *bank* ``[E, ...]`` (group key ``bank``:
    ``None`` = that rule, ``True``/``False`` to force): every slice gets its own RMS clip and step count, and a slice
    whose gradient is all zero (an expert that received no token) is left untouched, weights and state, exactly as
    the paper's separate expert modules with ``grad=None`` are.

    Beyond the paper, ``update="orthogonal"``: Muon's :math:`p \leftarrow p(1-\mathrm{lr}\lambda) - \mathrm{lr}\,
    0.2\sqrt{\max(A,B)}\,\mathrm{NS}_5(u)`, no second moment (`skewadam.kernels.orthogonal`, `skewadam.steppers`).

    .. Note:: Deviations from the paper's code.
        bf16 parameters are written with exact, unbiased stochastic rounding (a counter-based hash of ``seed``, the
        parameter and its step; no generator state to save) instead of dithering, and weight decay is fused into the
        fp32 update before rounding (the paper's decays the bf16 weight, where ``lr*wd`` is below one ULP and does
        nothing). Math is fp32 for bf16 parameters and in the parameter's dtype for fp32/fp64 ones. fp16
        parameters are refused (keep fp32 master weights with AMP instead).

    Args:
        params: parameters or param groups (dicts with ``params`` and any of the keys below).
        lr: learning rate: a float, or a 0-d (or 1-element) tensor that schedulers write into. Default 1e-3.
        betas: ``(beta1, beta2)``. Default (0.9, 0.999).
        eps: second-moment addend (``add``) or floor (``floor``). Default 1e-30 with ``eps_mode="add"``, 1e-8 with
            ``"floor"``.
        weight_decay: decoupled weight decay :math:`\lambda`. Default 0.
        eps_mode: ``"add"`` (Adafactor's; the default, chosen by the study in the README: 11.74 +- 0.08 vs
            17.85 +- 0.33 validation perplexity for ``"floor"`` over 3 seeds at each mode's best lr) or ``"floor"``
            (the paper's).
        tier: default tier of groups that name none. Default ``"backbone"``.
        use_momentum, use_factored, bank: per-group overrides of the tier's state (``None`` = tier default).
        momentum_dtype: storage of the first moment: ``"fp32"`` (the statistics dtype), ``"bf16"`` (stochastically
            rounded) or ``"int8"`` (block-wise, 256 per fp32 scale; tensors with < 2 dims stay fp32); see
            `skewadam.kernels.quant`. Every kernel (eager and C++) handles it, with the same stored bytes.
        seed: seed of the stochastic rounding of bf16 parameters (and bf16 momentum).
        skip_nonfinite: if any gradient holds inf/NaN, skip the whole step (weights and state untouched) and count
            it in ``skipped_steps``, as AMP's GradScaler does. On by default: costs one host sync per step on GPU.
        impl: update kernel (`skewadam.kernels.select`): ``"auto"`` (the ``SKEWADAM_IMPL`` environment variable if
            set, else the C++ kernel for CPU tensors when it builds, eager torch ops otherwise), ``"eager"`` or
            ``"cpp"``. All give the same math; the C++ kernel is several times faster on CPU.
        update, relative_step, beta2_decay: ``"adam"`` or ``"orthogonal"``; Adafactor's relative step (update x
            ``max(1e-3, rms(p))``) and ``beta2_t = 1 - t^beta2_decay`` (`skewadam.steppers`). Off by default.

    Example:
        >>> opt = SkewAdam([
        ...     {"params": backbone_params, "tier": "backbone", "weight_decay": 0.05},
        ...     {"params": expert_params, "tier": "expert", "weight_decay": 0.05},
        ...     {"params": router_params, "tier": "router"},
        ... ], lr=3e-4)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: Optional[float] = None,
        weight_decay: float = 0.0,
        *,
        eps_mode: str = "add",
        tier: str = "backbone",
        use_momentum: Optional[bool] = None,
        use_factored: Optional[bool] = None,
        bank: Optional[bool] = None,
        momentum_dtype: str = "fp32",
        seed: int = 0,
        skip_nonfinite: bool = True,
        impl: str = "auto",
        update: str = "adam", relative_step: bool = False, beta2_decay: Optional[float] = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, eps_mode=eps_mode, tier=tier,
            use_momentum=use_momentum, use_factored=use_factored, bank=bank, seed=seed,
            momentum_dtype=momentum_dtype, update=update, relative_step=relative_step, beta2_decay=beta2_decay,
        )
        if impl not in kernels.IMPLS:
            raise ValueError(f"Invalid impl: {impl!r} (expected one of {kernels.IMPLS})")
        self._impl = impl
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_steps = 0
        self._reducer: Optional[Reducer] = None
        super().__init__(params, defaults)

    @classmethod
    def from_model(cls, model: torch.nn.Module, **kwargs: Any) -> "SkewAdam":
        """Build SkewAdam with one param group per tier, labelled automatically (`skewadam.classify`).

        Keyword arguments are those of `skewadam.groups.param_groups` plus SkewAdam's own; the logged census counts
        the state under SkewAdam's own (``momentum_dtype``, ...).

        Example:
            >>> optimizer = SkewAdam.from_model(model, lr=3e-4, weight_decay=0.05)
        """
        from .groups import param_groups, split_kwargs

        group_kwargs, opt_kwargs = split_kwargs(kwargs)
        return cls(param_groups(model, **group_kwargs, defaults=opt_kwargs), **opt_kwargs)

    def state_bytes(self) -> StateBytes:
        """Bytes actually held in this optimizer's state, in total and per tier (`skewadam.state.StateBytes`)."""
        return measure_state(self)

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param group must be a dict, got {type(param_group).__name__}")
        group = self._resolve_group(param_group, len(self.param_groups))
        if not isinstance(group["params"], (Tensor, set)):  # torch refuses sets itself
            group["params"] = list(group["params"])  # a generator must survive being validated
        params = [group["params"]] if isinstance(group["params"], Tensor) else group["params"]
        for p in params:
            p = p[1] if isinstance(p, tuple) else p  # named parameters: (name, tensor)
            if isinstance(p, Tensor):
                _validate_param(p, group, len(self.param_groups))
        super().add_param_group(group)

    def _resolve_group(self, param_group: dict[str, Any], idx: int) -> dict[str, Any]:
        """A copy of ``param_group`` with this optimizer's defaults filled in, validated, and its state flags, tier
        and eps resolved (the constructor's path and `load_state_dict`'s)."""
        unknown = set(param_group) - _GROUP_KEYS - _FOREIGN_KEYS
        if unknown:
            raise ValueError(
                f"param group {idx} has unknown key(s) {sorted(unknown)}; SkewAdam groups take {sorted(_GROUP_KEYS)}"
            )
        group = dict(param_group)
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        _validate_group(group, idx)
        flags = state_flags(group)
        group.update(tier=flags.tier, use_momentum=flags.use_momentum, use_factored=flags.use_factored)
        if group["eps"] is None:
            group["eps"] = _EPS_DEFAULT[group["eps_mode"]]
        return group

    # ------------------------------------------------------------------ state dict
    def __getstate__(self) -> dict[str, Any]:  # torch's keeps only defaults/state/param_groups (deepcopy, pickle)
        return {**super().__getstate__(), "skip_nonfinite": self.skip_nonfinite, "skipped_steps": self.skipped_steps,
                "_impl": self._impl}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("skip_nonfinite", True)
        self.__dict__.setdefault("skipped_steps", 0)
        self.__dict__.setdefault("_impl", "auto")
        self.__dict__.setdefault("_reducer", None)  # rebuilt by the first step that meets a DTensor

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch, after validating everything: each saved group with the constructor's own checks, each
        parameter's state against `skewadam.state.state_spec` (keys, shapes, dtypes); on an error nothing is changed.
        A Python-number ``step`` (older checkpoints, other tools) becomes a tensor. Unlike torch, each state tensor
        keeps its saved dtype (torch casts it to the parameter's: fp32 statistics of a bf16 parameter would
        silently become bf16)."""
        state_dict = dict(state_dict)
        skipped = state_dict.pop("skipped_steps", 0)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        groups = []
        for idx, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 "optimizer's group")
            if set(saved) - _GROUP_KEYS - _FOREIGN_KEYS:
                raise ValueError(foreign_group_message(saved, idx, _GROUP_KEYS, _FOREIGN_KEYS))
            groups.append(self._resolve_group(saved, idx))
        states = dict(state_dict["state"])
        for idx, (saved, group) in enumerate(zip(groups, self.param_groups)):
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
        state_dict.update(param_groups=groups, state=states)
        super().load_state_dict(state_dict)
        for saved_id, p in zip(chain.from_iterable(g["params"] for g in groups),
                               chain.from_iterable(g["params"] for g in self.param_groups)):
            state = self.state[p]
            for key, value in states.get(saved_id, {}).items():
                if state[key].dtype != value.dtype:
                    state[key] = value.to(device=state[key].device, copy=True)
        self.skipped_steps = int(skipped)

    # ------------------------------------------------------------------ step
    def _init_group(self, group: dict, first_id: int) -> Optional[_Work]:
        w = _Work(group, *([] for _ in range(13)))
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                idx = next(i for i, g in enumerate(self.param_groups) if g is group)  # by identity: == compares tensors
                raise TypeError(
                    f"SkewAdam does not support sparse gradients (param group {idx}, "
                    f"tier {group['tier']!r}); use a dense embedding (sparse=False)"
                )
            bank = is_bank(p.ndim, group["tier"], group["bank"])
            state = self.state[p]
            if not state:
                spec = state_spec(
                    p.shape, p.dtype, use_momentum=group["use_momentum"], use_factored=group["use_factored"],
                    bank=bank, momentum_dtype=group["momentum_dtype"],
                )
                for key, st in spec.items():
                    state[key] = _new_state(p, key, st, bank)
            w.params.append(p)
            w.local_params.append(_local(p))
            w.grads.append(_local(p.grad))
            w.steps.append(_local(state["step"]))
            for lst, key in ((w.exp_avgs, "exp_avg"), (w.exp_avg_sqs, "exp_avg_sq"), (w.exp_avg_scales, "exp_avg_scale"),
                             (w.row_vars, "row_var"), (w.col_vars, "col_var")):
                lst.append(_local(state.get(key)))
            w.banks.append(bank)
            w.shapes.append(p.shape)
            w.dtypes.append((w.row_vars[-1] if w.row_vars[-1] is not None else w.exp_avg_sqs[-1]).dtype)
            w.param_ids.append(_rounding_stream(p, first_id + i, group["momentum_dtype"]))
        return w if w.params else None

    def _step_outside(self, outside: list[tuple[dict, int]], work: list[_Work]) -> bool:
        """Step `skewadam.steppers`' groups once every gradient (theirs, the kernels') is finite; False: skipped."""
        params = [p for g, _ in outside for p in g["params"] if p.grad is not None]
        grads = [_local(p.grad) for p in params] + [g for w in work for g in w.grads]
        if self.skip_nonfinite and not steppers.grads_finite(grads, self._reducer):
            self.skipped_steps += 1
            return False
        impl = kernels.select(self._impl, _local(params[0]).device) if params else None
        return steppers.step_(outside, steppers.Context(self.state, _new_state, _rounding_stream, self._reducer, impl))

    def _reduce(self, work: list[_Work], per_group: list[list[list[tuple[Tensor, tuple[int, ...]]]]]) -> None:
        if self._reducer is None:
            return
        self._reducer([(p, items) for w, group_items in zip(work, per_group) for p, items in zip(w.params, group_items)])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; returns the closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, first_id, outside = [], 0, []
        for group in self.param_groups:
            if steppers.outside_kernels(group):  # orthogonal / Adafactor-option groups: `skewadam.steppers`
                outside.append((group, first_id))
            elif (w := self._init_group(group, first_id)) is not None:
                work.append(w)
            first_id += len(group["params"])
        if self._reducer is None and any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            from .distributed import DTensorReducer

            self._reducer = DTensorReducer()
        if outside and not self._step_outside(outside, work):
            return loss
        if not work:
            return loss
        impl = kernels.select(self._impl, work[0].local_params[0].device)
        if self._reducer is None and hasattr(impl, "step_"):  # one process: the kernel runs the whole step at once
            if not impl.step_(
                [w.local_params for w in work], [w.grads for w in work], [w.steps for w in work],
                [w.exp_avgs for w in work], [w.exp_avg_sqs for w in work], [w.row_vars for w in work],
                [w.col_vars for w in work], banks=[w.banks for w in work], shapes=[w.shapes for w in work],
                param_ids=[w.param_ids for w in work], betas=[w.group["betas"] for w in work],
                eps=[w.group["eps"] for w in work], eps_mode=[w.group["eps_mode"] for w in work],
                lr=[float(w.group["lr"]) for w in work], weight_decay=[w.group["weight_decay"] for w in work],
                seed=[w.group["seed"] for w in work], skip_nonfinite=self.skip_nonfinite,
                exp_avg_scales=[w.exp_avg_scales for w in work],
            ):
                self.skipped_steps += 1
            return loss
        stats = [impl.grad_stats(w.grads, w.row_vars, banks=w.banks, dtypes=w.dtypes) for w in work]
        self._reduce(work, [[impl.stat_dims(s, g.ndim, b) for s, g, b in zip(st, w.grads, w.banks)]
                            for w, st in zip(work, stats)])
        if self.skip_nonfinite and not _all_finite([s.sumsq for st in stats for s in st], self._reducer):
            self.skipped_steps += 1
            return loss
        moments = []
        for w, st in zip(work, stats):
            g = w.group
            moments.append(impl.update_moments_(
                w.grads, w.steps, w.exp_avgs, w.exp_avg_sqs, w.row_vars, w.col_vars, st,
                banks=w.banks, shapes=w.shapes, beta1=g["betas"][0], beta2=g["betas"][1],
                eps=g["eps"], eps_mode=g["eps_mode"], exp_avg_scales=w.exp_avg_scales, seed=g["seed"],
                param_ids=w.param_ids,
            ))
        self._reduce(work, [[[(m.u_sumsq, impl.unit_dims(gr.ndim, b))] for m, gr, b in zip(mo, w.grads, w.banks)]
                            for w, mo in zip(work, moments)])
        for w, mo in zip(work, moments):
            g = w.group
            impl.apply_updates_(
                w.local_params, w.grads, w.steps, w.exp_avgs, w.exp_avg_sqs, mo,
                banks=w.banks, shapes=w.shapes, lr=float(g["lr"]), weight_decay=g["weight_decay"],
                eps=g["eps"], eps_mode=g["eps_mode"], seed=g["seed"], param_ids=w.param_ids,
                exp_avg_scales=w.exp_avg_scales,
            )
        return loss

    def __repr__(self) -> str:
        lines = [self.__class__.__name__ + " ("]
        for i, group in enumerate(self.param_groups):
            n = sum(p.numel() for p in group["params"])
            lines.append(f"Parameter Group {i} [{group['tier']}: {len(group['params'])} tensors, {n:,} parameters]")
            for key in sorted(k for k in group if k not in ("params", "param_names")):
                lines.append(f"    {key}: {group[key]}")
        lines.append(f"skip_nonfinite: {self.skip_nonfinite} (skipped_steps: {self.skipped_steps})")
        lines.append(")")
        return "\n".join(lines)


def _validate_group(group: dict, idx: int) -> None:
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
    if group["eps_mode"] not in _EPS_DEFAULT:
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
    steppers.validate_group(group, where)
    try:
        Tier.parse(group["tier"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _validate_param(p: Tensor, group: dict, idx: int) -> None:
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
    steppers.check_param(p, group, where)
    if torch.distributed.is_available():  # flattened (FSDP1, DeepSpeed ZeRO-3) or Partial shards are refused
        from .distributed import check_layout

        check_layout(p, where)


def _new_state(p: Tensor, key: str, st, bank: bool) -> Tensor:
    if isinstance(p, DTensor):
        from .distributed import new_state_dtensor

        return new_state_dtensor(p, key, st)
    # Per-tensor step counts stay on the host like torch's (read each step); a bank's live with its parameter.
    device = p.device if (key != "step" or bank) else torch.device("cpu")
    return torch.zeros(st.shape, dtype=st.dtype, device=device)


def _all_finite(tensors: list[Tensor], reducer: Optional[Reducer] = None) -> bool:
    """Whether all sums are finite; with a reducer that can tell, on every rank (so all ranks skip together)."""
    by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_device[t.device].append(t.sum())
    finite = all(bool(torch.stack(ts).sum().isfinite()) for ts in by_device.values())
    agree = getattr(reducer, "all_finite", None)
    return agree(finite) if agree is not None else finite
