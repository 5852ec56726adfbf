r"""`SkewAdam`: tiered optimizer state for Mixture-of-Experts training.

Each param group belongs to a tier (``backbone``, ``expert``, ``router``; `skewadam.tiers`) that sets which state
its parameters keep. This class holds the param groups, checks them (`skewadam.validation`, at construction and at
`SkewAdam.load_state_dict`), allocates state lazily (`skewadam.state.state_spec`) and gathers one record per group
(`skewadam.kernels.types.Group`); `skewadam.functional.skewadam_` runs the step over them, for every backend.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from . import kernels
from .backward import BackwardMode, BackwardSteps, Counter, check_trainer, stacked
from .functional import Reducer, StepGroup, skewadam_
from .groups import describe_optimizer
from .kernels.types import NS_STEPS, STATE_KEYS, Group, ParamTensors
from .state import StateBytes, flat_bank_merged, is_bank, measure_state, state_flags
from .validation import check_state_dict, resolve_group, validate_params
from .zero import partition_of, zero_layouts

try:  # DTensor (FSDP2, tensor/expert parallelism); absent on builds without torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

__all__ = ["SkewAdam"]

#: Types that are never DTensors: checked first, since ``isinstance(t, DTensor)`` costs ~0.3 us (its metaclass), a
#: few times per parameter per step.
_PLAIN = (Tensor, torch.nn.Parameter, type(None))


def _is_dtensor(t: Optional[Tensor]) -> bool:
    return type(t) not in _PLAIN and isinstance(t, DTensor)


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.to_local() if _is_dtensor(t) else t


def _rounding_stream(p: Tensor, index: int, momentum_dtype: str, row: int = 0) -> int:
    """The key index of ``p``'s stochastic rounding (from local row ``row`` on: a flattened bank's piece); a shard's
    own stream for DTensor shards that round (bf16 weights or bf16 momentum)."""
    if _is_dtensor(p) and (p.dtype == torch.bfloat16 or momentum_dtype == "bf16"):
        from .distributed import rounding_stream

        return rounding_stream(p, index, row)
    return index


class SkewAdam(BackwardMode, Optimizer):
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
    (docs/study/index.md, "200 steps, every arm", has the evidence).

    Tiers (group key ``tier``) set the state: ``backbone`` momentum + factored, ``expert`` factored only,
    ``router`` full exact second moment. ``use_momentum`` / ``use_factored`` override per group (the names of the
    paper's code). In the ``expert`` tier a tensor with >= 3 dims is a *bank* ``[E, ...]`` (group key ``bank``:
    ``None`` = that rule, ``True``/``False`` to force): every slice gets its own RMS clip and step count, and a slice
    whose gradient is all zero (an expert that received no token) is left untouched, weights and state, exactly as
    the paper's separate expert modules with ``grad=None`` are.

    Beyond the paper, ``update="orthogonal"`` (for the hidden matrices, `skewadam.classify.hidden_matrices`;
    ``param_groups(model, orthogonal=True)``): Muon's orthogonalised Nesterov momentum,
    :math:`p \leftarrow p(1-\mathrm{lr}\lambda) - \mathrm{lr}\,0.2\sqrt{\max(A,B)}\,\mathrm{NS}_5(u)`, with
    :math:`\mu` = ``betas[0]`` and no second moment (`skewadam.kernels.orthogonal`).

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
        eps_mode: ``"add"`` (Adafactor's; the default, chosen by the study in docs/study) or ``"floor"`` (the
            paper's).
        tier: default tier of groups that name none. Default ``"backbone"``.
        use_momentum: per-group override of the tier's momentum (``None`` = tier default).
        use_factored: per-group override of the tier's factored second moment (``None`` = tier default).
        bank: per-group override of the bank rule (``None`` = the rule). Group key ``experts``: E experts stacked along
            dim 0 of each tensor (flattened banks, `skewadam.classify.flattened_experts`), stepped as ``[E, D, F]``.
        momentum_dtype: storage of the first moment: ``"fp32"`` (the statistics dtype), ``"bf16"`` (stochastically
            rounded) or ``"int8"`` (block-wise, 256 per fp32 scale; tensors with < 2 dims stay fp32); see
            `skewadam.kernels.quant`, the same stored bytes on every backend.
        seed: seed of the stochastic rounding of bf16 parameters (and bf16 momentum).
        skip_nonfinite: if any gradient holds inf/NaN, skip the whole step (weights and state untouched) and count
            it in ``skipped_steps``, as AMP's GradScaler does; on the device where the backend can (no host sync).
            With ``in_backward``, that tensor's update alone (``skipped_tensors``). ``False`` (a loop that checks
            the gradients itself) also lets the C++ kernel write each fp32 expert slice right after reading its
            gradient, one read of the gradients fewer (docs/guide/kernels.md: ``whole``).
        impl: the backend, ``"auto"`` or a name of `skewadam.kernels.BACKENDS` (`skewadam.kernels.resolve_backend`:
            ``SKEWADAM_IMPL`` if set, else the preferred backend available on the parameters' device); same math.
        update: ``"adam"`` (the tiers' update) or ``"orthogonal"`` (above; matrices and banks of matrices only).
        ns_steps: the orthogonal update's Newton-Schulz iterations. Default 5.
        ns_dtype: its dtype: None (the parameter's rule), ``"fp32"``, ``"bf16"`` or ``"auto"`` (bf16 where the
            device multiplies it natively).
        ns_interval: 1 (every step) or k: each matrix orthogonalised every k of its steps, k steps' update at once.
        relative_step: Adafactor's option (off by default): the update term scaled by ``max(1e-3, rms(p))`` per unit.
        beta2_decay: Adafactor's option (off by default): ``beta2_t = 1 - t^beta2_decay`` (e.g. -0.8), uncorrected.
        in_backward: step each parameter inside backward as soon as its gradient is complete, and free it
            (`skewadam.backward`: the same update; no global grad-norm clipping, no accumulation across backwards
            but under `hold_gradients`); ``step()`` then does the bookkeeping. Settable later.

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
        eps_mode: str = "add", tier: str = "backbone",
        use_momentum: Optional[bool] = None, use_factored: Optional[bool] = None, bank: Optional[bool] = None,
        momentum_dtype: str = "fp32", seed: int = 0,
        skip_nonfinite: bool = True,
        impl: str = "auto",
        update: str = "adam",
        relative_step: bool = False, beta2_decay: Optional[float] = None,
        ns_steps: int = NS_STEPS, ns_dtype: Optional[str] = None, ns_interval: int = 1,
        in_backward: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, eps_mode=eps_mode, tier=tier,
            use_momentum=use_momentum, use_factored=use_factored, bank=bank, seed=seed, momentum_dtype=momentum_dtype,
            update=update, relative_step=relative_step, beta2_decay=beta2_decay, ns_steps=ns_steps,
            ns_dtype=ns_dtype, ns_interval=ns_interval)
        if impl not in kernels.BACKEND_CHOICES:
            raise ValueError(f"Invalid impl: {impl!r} (expected one of {kernels.BACKEND_CHOICES})")
        self._impl = impl
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_steps = 0
        self._reducer: Optional[Reducer] = None
        self._backward: Optional[BackwardSteps] = None
        super().__init__(params, defaults)
        self.in_backward = in_backward

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
        if opt_kwargs.get("in_backward"):
            check_trainer(model)  # a Lightning trainer's clipping, accumulation, fp16 or DDP would be wrong
        return cls(param_groups(model, **group_kwargs, defaults=opt_kwargs), **opt_kwargs)

    def state_bytes(self) -> StateBytes:
        """Bytes actually held in this optimizer's state, in total and per tier (`skewadam.state.StateBytes`)."""
        return measure_state(self, getattr(self.__dict__.get("_zero"), "tiers", None))

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param group must be a dict, got {type(param_group).__name__}")
        group = resolve_group(param_group, self.defaults, len(self.param_groups))
        if not isinstance(group["params"], (Tensor, set)):  # torch refuses sets itself
            group["params"] = list(group["params"])  # a generator must survive being validated
        params = [group["params"]] if isinstance(group["params"], Tensor) else group["params"]
        validate_params(params, group, len(self.param_groups))
        if "tier" not in param_group and self.defaults["tier"] == "backbone" and not getattr(self, "_hinted", 0):
            from .groups import warn_untiered_experts  # experts left in backbone by default: say so, once

            self._hinted = warn_untiered_experts(params, len(self.param_groups))
        super().add_param_group(group)
        self.__dict__.setdefault("_known", WeakIdKeyDictionary()).update(dict.fromkeys(self.param_groups[-1]["params"]))
        if getattr(self, "_backward", None) is not None:
            self._backward.add(self.param_groups[-1]["params"])

    # ------------------------------------------------------------------ state dict
    def __getstate__(self) -> dict[str, Any]:  # torch's keeps only defaults/state/param_groups (deepcopy, pickle)
        return {**super().__getstate__(), "skip_nonfinite": self.skip_nonfinite, "skipped_steps": self.skipped_steps,
                "skipped_tensors": self.skipped_tensors, "_impl": self._impl, "in_backward": self.in_backward}

    def __setstate__(self, state: dict[str, Any]) -> None:
        in_backward = state.pop("in_backward", None)  # a copy hooks its own parameters (deepcopy's, pickle's)
        super().__setstate__(state)
        for key, default in (("skip_nonfinite", True), ("skipped_steps", 0), ("skipped_tensors", 0), ("_impl", "auto"),
                             ("_reducer", None), ("_backward", None)):
            self.__dict__.setdefault(key, default)  # (a reducer is rebuilt by the first step that meets a DTensor)
        if in_backward is not None:  # (torch's load_state_dict sets state and groups alone: the hooks stay)
            self.in_backward = in_backward

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "skipped_steps": self.skipped_steps, **zero_layouts(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch, after checking everything (`skewadam.validation.check_state_dict`: each saved group with
        the constructor's own checks, each parameter's state against `skewadam.state.state_spec`); on an error
        nothing is changed. Unlike torch, each state tensor keeps its saved dtype (torch casts it to the
        parameter's: fp32 statistics of a bf16 parameter would silently become bf16), and is made contiguous."""
        groups, states = check_state_dict(state_dict, self.param_groups, self.__dict__.get("_zero"))
        super().load_state_dict({**state_dict, "param_groups": groups, "state": states})  # (torch reads these two)
        _restore_saved_dtypes(self, groups, states)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def init_state(self) -> None:
        """Allocate the state of every parameter now (zeros, step 0), as its first step would: for checkpointers that
        load into existing state (torchtitan, ``torch.distributed.checkpoint``). Unlike their zero-gradient, zero-lr
        step, this changes nothing: that step would count a step and decay ``eps`` into the second moments.

        Example:
            >>> opt.init_state(); dcp.load({"optim": opt.state_dict()}, checkpoint_id=path)
        """
        _init_state(self)

    skipped_steps = Counter("skipped_steps", "_skipped_pending", "Steps skipped for a non-finite gradient (with "
                            "``in_backward``: steps that skipped any tensor's update).")

    def _init_group(self, group: dict, index: int, first_id: int, device_steps: bool = False,
                    fresh: Optional[list] = None, only: Optional[int] = None) -> Optional[tuple[list[Tensor], Group]]:
        """Lazy state, then the parameters of group ``index`` with gradients (for the reducer) and their kernels'
        record (local shards of DTensors); None if none has a gradient. ``first_id``: the optimizer-wide index of the
        group's first parameter (its rounding stream); ``device_steps``, ``fresh``: `_state_of`'s; ``only``: the
        record of the group's parameter of that index alone (what a gradient hook steps)."""
        params, tensors = [], []
        experts, tier = group.get("experts"), group["tier"]
        key = (id(group["params"]), len(group["params"]), first_id, id(group.get("param_names")), tier, group["bank"],
               group["momentum_dtype"], experts)
        cached = self.__dict__.setdefault("_records", {}).get(index)  # what a record takes from p and its group
        if cached is None or cached[0] != key:  # new params: those add_param_group saw, or a ZeRO partition
            cached = self._records[index] = (key, [None] * len(group["params"]), partition_of(self, group, index))
        if cached[2] is not None:
            return cached[2].step_records(self, group, index, device_steps, fresh)
        states, make = self.state, ParamTensors._make  # _make: the record without NamedTuple.__new__'s Python call
        for i, p in enumerate(group["params"]) if only is None else ((only, group["params"][only]),):
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise TypeError(f"SkewAdam does not support sparse gradients (param group {index}, tier {tier!r}); "
                                "use a dense embedding (sparse=False)")
            fixed = cached[1][i]  # what the record takes from p and its group, while they hold
            if fixed is None or fixed.id != id(p) or fixed.shape != p.shape or fixed.dtype is not p.dtype:
                fixed = cached[1][i] = _fixed(p, group, index, i, first_id)
            state = (not device_steps and states.get(p)) or _state_of(states[p], p, group, device_steps, fresh)
            local = (p, grad, state["step"], *map(state.get, STATE_KEYS))
            if fixed.dtensor:  # a DTensor: the kernels step the local shards (their state is sharded as p is)
                from .distributed import check_grad

                check_grad(p)
                local = tuple(map(_local, local))
            if experts is None:
                params.append(p)
                tensors.append(make((*local, fixed.shape, fixed.bank, fixed.stream, fixed.name)))
            else:  # a flattened bank [E*D, ...]: its local rows as banks [k, rows, ...], each named by p (the reducer)
                tensors += (records := _flat_records(local, fixed))
                params += [p] * len(records)
        if not params:
            return None
        b1, b2 = group["betas"]
        return params, Group(tensors, group["lr"], b1, b2, group["eps"], group["eps_mode"], group["weight_decay"],
                             group["seed"], group["relative_step"], group["beta2_decay"], group["ns_steps"],
                             group["ns_dtype"], group["ns_interval"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step (`skewadam.functional.skewadam_`); returns the closure's loss, if a closure
        was given. A step that raises has changed nothing: no parameter, state tensor or step count, and no state
        is left allocated by it. With ``in_backward``: count what backward stepped, and step the gradients it did
        not."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        flags = self._backward.finish(self) if self._backward is not None else []
        if flags:
            Counter.add(self, "skipped_tensors", stacked(flags).sum())
        first = next((p for group in self.param_groups for p in group["params"] if p.grad is not None), None)
        if first is not None:
            flags.append(self._step(first))
        if flags:
            Counter.add(self, "skipped_steps", flags[0] if len(flags) == 1 else stacked(flags).any())
        return loss

    def step_parameter(self, group: int, position: int) -> Tensor:
        """Step parameter ``position`` of param group ``group`` alone, as `step` would (the gradient hooks' step,
        `skewadam.backward.ParamStepper`); returns its skip flag, a 0-d bool tensor on its device."""
        return self._step(self.param_groups[group]["params"][position], only=(group, position))

    def _step(self, first: Tensor, only: Optional[tuple[int, int]] = None) -> Tensor:
        """`skewadam.functional.skewadam_` over every parameter with a gradient (``first`` the first of them, whose
        device picks the backend), or (``only``: ``(group index, position)``, ``first`` that parameter) over that
        one; returns its skip flag."""
        backend = kernels.resolve_backend(self._impl, _local(first).device)
        work, fresh, first_id = [], [], 0
        try:
            for index, group in enumerate(self.param_groups):
                if only is None or only[0] == index:
                    w = self._init_group(group, index, first_id, backend.device_steps, fresh,
                                         None if only is None else only[1])
                    if w is not None:
                        work.append(StepGroup(w[1], w[0], group["update"], f"param group {index}"))
                first_id += len(group["params"])
            if (step := _zero_step(self, fresh)) is not None:  # ZeRO partitions: each rank calls each seam
                return step.run(lambda: skewadam_(work + [StepGroup(*e) for e in step.empty], backend=backend,
                                                  reducer=step.reducer, skip_nonfinite=self.skip_nonfinite))
            if self._reducer is None and any(_is_dtensor(p) for g in work for p in g.params):
                from .distributed import DTensorReducer

                self._reducer = DTensorReducer()
            return skewadam_(work, backend=backend, reducer=self._reducer, skip_nonfinite=self.skip_nonfinite)
        except BaseException:
            for p in fresh:
                del self.state[p]
            raise

    __repr__ = describe_optimizer


def _init_state(opt: "SkewAdam") -> None:
    """`SkewAdam.init_state`: every parameter's state (a ZeRO partition's: its pieces'), allocated as a first step
    allocates it."""
    for index, group in enumerate(opt.param_groups):
        if (part := partition_of(opt, group, index)) is not None:
            backend = kernels.resolve_backend(opt._impl, part.flat.device)
            part.allocate(opt.state[part.flat], group, backend.device_steps)
        for p in group["params"] if part is None else ():
            _state_of(opt.state[p], p, group)


def _zero_step(opt: "SkewAdam", fresh: list):
    """The ZeRO partitions the step of ``fresh`` (`SkewAdam._step`'s list) records, as a `skewadam.zero.ZeroStep`;
    None without any."""
    zero = opt.__dict__.get("_zero")
    return zero.take(fresh) if zero is not None else None


def _restore_saved_dtypes(opt: "SkewAdam", groups: list[dict], states: dict) -> None:
    """After torch's load: each state tensor in its saved dtype (torch casts it to the parameter's), contiguous,
    and a step count on the parameter's device for a backend that steps it there."""
    for saved_id, p in zip(chain.from_iterable(g["params"] for g in groups),
                           chain.from_iterable(g["params"] for g in opt.param_groups)):
        state = opt.state[p]
        _restore(state, states.get(saved_id, {}))
        if "step" in state and p.device.type != "cpu" and kernels.resolve_backend(opt._impl, p.device).device_steps:
            state["step"] = state["step"].to(_local(p).device)  # torch's load leaves a step count on the host


def _restore(state: dict, saved: dict) -> None:
    for key, value in saved.items():  # (a ZeRO partition's state is a dict per tensor: skewadam.zero)
        if isinstance(value, dict):
            _restore(state[key], value)
        elif state[key].dtype != value.dtype or not state[key].is_contiguous():  # contiguous, as the kernels' own
            state[key] = value.to(device=state[key].device, copy=True).contiguous()


class _Fixed(NamedTuple):
    """What the record of a parameter takes from it and its group while they hold (`_fixed`)."""

    id: int  # id(p): the cache holds while the group holds this very parameter
    shape: torch.Size  # the global shape
    dtype: torch.dtype
    dtensor: bool
    bank: bool
    stream: int  # its stochastic-rounding stream
    name: str  # how errors name it (a flattened bank by its own shape and its view's)
    pieces: Optional[tuple]  # a flattened bank's ``((piece, rounding stream), ...)`` (`_flat_records`), else None


def _fixed(p: Tensor, group: dict, index: int, i: int, first_id: int) -> _Fixed:
    """What the record of parameter ``i`` of group ``index`` takes from ``p`` and its group while they hold."""
    names, experts = group.get("param_names"), group.get("experts")
    name = f"param_groups[{index}]['params'][{i}]" + (f" ({names[i]!r})" if names else "")
    bank = experts is not None or is_bank(p.ndim, group["tier"], group["bank"])
    stream = _rounding_stream(p, first_id + i, group["momentum_dtype"])
    pieces = None
    if experts is not None:
        name += f" of shape {tuple(p.shape)}, stepped as the bank {(experts, p.shape[0] // experts, *p.shape[1:])}"
        if _is_dtensor(p):
            from .distributed import flat_bank_pieces

            found = flat_bank_pieces(p, experts, name)
        else:
            found = ((0, experts, 0, p.shape[0] // experts),)
        pieces = tuple((pc, _rounding_stream(p, first_id + i, group["momentum_dtype"], pc[2])) for pc in found)
    return _Fixed(id(p), p.shape, p.dtype, _is_dtensor(p), bank, stream, name, pieces)


def _state_of(state: dict, p: Tensor, group: dict, device_steps: bool = False, fresh: Optional[list] = None) -> dict:
    """``p``'s ``state``, allocated (zeros, step 0) by `skewadam.state.state_spec` if empty (``p`` is then listed in
    ``fresh``); with ``device_steps`` (the backend advances step counts on the device) a host count is moved to
    ``p``'s device."""
    if state and device_steps and isinstance(state.get("step"), Tensor):
        if state["step"].device != _local(p).device:
            state["step"] = state["step"].to(_local(p).device)
    if not state:
        spec = state_flags(group)
        bank = spec.is_bank(p.ndim)
        for key, st in spec.spec(p.shape, p.dtype).items():
            state[key] = _new_state(p, key, st, bank, device_steps, spec.experts is not None)
        if fresh is not None:
            fresh.append(p)
    return state


def _flat_records(local: tuple, fixed: _Fixed) -> list[ParamTensors]:
    """A flattened bank's records from its local tensors ``(param, grad, step, exp_avg, ..., col_var)``: one bank per
    piece of its local rows (`skewadam.distributed.flat_bank_pieces`; the whole bank on one process), ``[k, rows,
    ...]`` of global shape ``(k, D, ...)``: views of the parameter, gradient and the state kept in its row layout (steps
    write them), and the piece's experts of the state kept per expert (`skewadam.state.flat_bank_merged`)."""
    shape, name, pieces = fixed.shape, fixed.name, fixed.pieces
    param, grad, *state = local
    experts = sum(pc[1] for pc, _ in pieces)
    if not param.is_contiguous():
        raise ValueError(f"{name}: experts={experts} needs a contiguous parameter, got strides {param.stride()}")
    keys = ("step", *STATE_KEYS)
    rows_layout = [flat_bank_merged(key, param.ndim + 1) for key in keys]
    for key, t, rows in zip(keys, state, rows_layout):
        want = (param.ndim, param.shape[0]) if rows else (1 if key == "step" else param.ndim + 1, experts)
        if t is not None and (t.ndim, t.shape[0] if t.ndim else 0) != want:
            raise ValueError(f"{name}: state {key!r} has shape {tuple(t.shape)}, a flattened bank keeps it with "
                             f"{want[0]} dims and {want[1]} {'rows' if rows else 'experts'} in dim 0 "
                             f"(skewadam.state.TierSpec.spec): load the state saved for this model, or reset this "
                             f"parameter's state with `del optimizer.state[p]`")
    out = []
    for (first, k, row, n), stream in pieces:
        rows, span = slice(row, row + k * n), slice(first, first + k)
        g = grad[rows].reshape(k, n, *grad.shape[1:]) if grad.shape == param.shape else grad  # (the check names it)
        st = [None if t is None else t[rows].view(k, n, *t.shape[1:]) if r else t[span]
              for t, r in zip(state, rows_layout)]
        out.append(ParamTensors(param[rows].view(k, n, *param.shape[1:]), g, *st, (k, shape[0] // experts, *shape[1:]),
                                True, stream, name))
    return out


def _new_state(p: Tensor, key: str, st, bank: bool, device_steps: bool = False, flattened: bool = False) -> Tensor:
    if key == "step" and not bank:  # a tensor's count: on the host like torch's (read each step), or beside the
        # parameter for a kernel that advances it there (no host sync); a plain tensor for DTensors too
        return torch.zeros(st.shape, dtype=st.dtype, device=_local(p).device if device_steps else "cpu")
    if isinstance(p, DTensor):
        from .distributed import new_state_dtensor

        return new_state_dtensor(p, key, st, flattened)
    return torch.zeros(st.shape, dtype=st.dtype, device=p.device)  # a bank's step counts live with it
