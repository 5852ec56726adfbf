"""The optimizer arms: each optimizer `skewadam plan`, `skewadam bench` and `skewadam bench-step` know, by one name.

An `Arm` says how to build the optimizer over a model (`Arm.build`: one param group per tier from
`skewadam.groups.param_groups`, the arm's lr and weight decay) and, for the planner, what memory it keeps: the
state of one trainable tensor, whether it keeps an fp32 master copy of 16-bit parameters, and the temporaries of its
``step()``. SkewAdam's arms take their state from `skewadam.state` under the arm's settings, and their temporaries
from the backend that runs them (`skewadam.kernels.BACKENDS`: each backend's ``step_transient_bytes``).
Builders import their optimizer when they run, so the planner reads this registry without importing SkewAdam or a
kernel.

| name                      | what                                                                              |
|---------------------------|-----------------------------------------------------------------------------------|
| adamw                     | torch.optim.AdamW (fused)                                                         |
| adamw-foreach             | torch.optim.AdamW (foreach): adamw's math, another implementation                 |
| adamw8bit-bnb             | 8-bit AdamW as bitsandbytes stores it (memory model only: not a dependency)       |
| adamw8bit-torchao         | torchao.optim.AdamW8bit (block-wise 8-bit moments; needs ``torchao``)              |
| adafactor                 | torch.optim.Adafactor (factored second moment, no momentum)                       |
| muon                      | torch.optim.Muon on the hidden matrices (`skewadam.classify.hidden_matrices`:     |
|                           | attention, dense FFN), lr matched to AdamW's RMS; AdamW (fused) on embeddings,    |
|                           | norms, router and the 3-D expert banks                                            |
| skewadam                  | the recipe "paper", SkewAdam's defaults: paper tiers, eps_mode="add"            |
| skewadam-floor            | SkewAdam, paper tiers, eps_mode="floor" (the paper's)                             |
| skewadam-lean             | the recipe "lean": skewadam, momentum block-wise int8 (momentum_dtype="int8")     |
| skewadam-bf16m            | skewadam, momentum in bf16 (momentum_dtype="bf16")                                |
| skewadam-expert-momentum  | ablation: experts also keep momentum                                              |
| skewadam-factored-router  | ablation: the router's second moment factored too                                 |
| skewadam-uniform          | ablation: every tier momentum + factored                                          |
| skewadam-orthogonal       | hidden matrices orthogonal (Muon's update, `kernels.orthogonal`), the rest paper  |
|                           | tiers: one optimizer, one state dict                                              |
| skewadam-orthogonal-experts | skewadam-orthogonal + expert banks orthogonalised per expert from the gradient  |
| skewadam-orthogonal-experts-momentum | skewadam-orthogonal-experts, expert slices with Nesterov momentum too   |
|                           | (Muon per expert; over a 0.15x budget where experts are most of the model)        |
| skewadam-quality          | the recipe "quality": that, every momentum block-wise int8, Newton-Schulz in      |
|                           | bf16 where the device multiplies bf16 natively (ns_dtype="auto"), expert slices   |
|                           | orthogonalised every 4th step (ns_interval=4); lr 3e-2, its best at the bench's   |
|                           | 200 steps (the recipe's 1e-2: 1,000)                                              |
| skewadam-quality-fp32     | the quality recipe before issue 35 (docs/study/cheaper.md): Newton-Schulz in the  |
|                           | parameters' dtype, every matrix every step                                        |
| skewadam-relative-step    | skewadam, update x max(1e-3, rms(p)) per unit (Adafactor's relative step)         |
| skewadam-in-backward      | skewadam stepped inside backward (in_backward=True): each gradient freed as soon  |
|                           | as backward completes it; skewadam's bits; trains at --grad-clip 0 (no clip)      |

SkewAdam's kernel is not an arm: every SkewAdam arm takes ``impl`` (``skewadam bench-step --impl``). The ablations and
compact-momentum arms use ``eps_mode="add"``, the better of the two in the study (``docs/study``), so that each
varies one thing against ``skewadam``. Default learning rates are each arm's best in the study on the bench's model
(``docs/study/results.md``: 3 lrs x 3 seeds, 200 steps): 1e-3 for AdamW, 8-bit AdamW and SkewAdam with
``eps_mode="add"`` (every ablation too), 1e-2 for Muon and for SkewAdam's ``eps_mode="floor"``, 1e-1 for Adafactor,
whose ``lr`` is a relative step size. (The paper trains its 6.78B model at 3e-4.)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..groups import group_settings, param_groups
from ..kernels import BACKENDS
from ..state import StateTensor, state_dtype_for, state_flags
from ..tiers import Tier
from .extras import quiet_imports

__all__ = ["Arm", "ARMS", "get", "names", "ChainedOptimizer", "PLAN_DEFAULT", "BENCH_STEP_DEFAULT"]

#: ``(param groups, lr, SkewAdam kernel impl) -> optimizer``; the impl is ignored by the others.
Builder = Callable[[list[dict[str, Any]], float, str], Any]
#: ``(shape, tier, stepped dtype, orthogonal, experts) -> [(state key, StateTensor), ...]``: the state of one
#: trainable tensor, in the dtype of the tensor the optimizer steps (the fp32 master copy when the arm keeps one);
#: ``orthogonal``: the arm's ``orthogonal`` setting selects it (`skewadam.groups.orthogonal_names`); ``experts``: a
#: flattened bank's E (`skewadam.classify.flattened_experts`), else None.
TensorState = Callable[[tuple[int, ...], str, torch.dtype, bool, Optional[int]], list[tuple[str, StateTensor]]]
#: ``([(shape, tier, orthogonal, experts), ...], stepped dtype, SkewAdam's backend by name) -> bytes``: the peak
#: temporaries of one step.
Transient = Callable[[Sequence[tuple[tuple[int, ...], str, bool, Optional[int]]], torch.dtype, str], int]

#: ``(shape, tier, stepped dtype, orthogonal, experts) -> bytes``: what one trainable tensor's statistics add to the
#: cross-rank all-reduces of a step under FSDP2 ``Shard(0)`` on several ranks (``experts``: a flattened bank's E).
Reduced = Callable[[tuple[int, ...], str, torch.dtype, bool, Optional[int]], int]

_F32 = torch.float32
_STEP = ("step", StateTensor((), _F32))  # torch optimizers' per-tensor 0-d fp32 step count


@dataclasses.dataclass(frozen=True)
class Arm:
    """One optimizer under comparison.

    Attributes:
        name, label: the registry name and a one-line description.
        make: builds it from `param_groups` output (`build` is the entry point); None for a memory model only.
        state, transient: its state per tensor and its step temporaries, for `skewadam.bench.planner.plan`; None where
            the planner has no model of it.
        reduced: the bytes its step all-reduces across ranks per tensor under FSDP2 (SkewAdam's statistics); None
            for an optimizer that reduces nothing.
        temporaries: how ``transient`` counts, in words (the plan prints it among its assumptions).
        master: keeps an fp32 master copy of 16-bit parameters (mixed precision); SkewAdam writes bf16 weights
            itself with stochastic rounding and keeps none.
        shared: state allocated once per optimizer, not per tensor (bitsandbytes' quantisation maps).
        lr, weight_decay: defaults of `skewadam bench`: the best lr of the study (``docs/study``) on its model.
        tier_options: passed to `param_groups` (SkewAdam's tier ablations).
        options: SkewAdam's keyword arguments (its constructor's: ``momentum_dtype``, the Newton-Schulz options, ...;
            empty for the others): the planner's ZeRO figures resolve each group's state from them, as SkewAdam does.
        orthogonal: passed to `param_groups`: which tensors take the orthogonal update (`orthogonal_names`).
        variant_of: another implementation of that arm's math (`bench-step` compares it; `bench --optimizers all`
            and the study leave it out).
        requires: optional packages it imports, ``{module: pip package}`` (`skewadam.bench.extras.missing` finds them).
        kernels: steps with SkewAdam's kernels (`skewadam bench` builds the C++ one before its first run).
        in_backward: steps each tensor inside backward (`skewadam.backward`): the planner counts the gradients in
            flight rather than all of them; no global gradient to clip (``--grad-clip 0``).
    """

    name: str
    label: str
    make: Optional[Builder]
    state: Optional[TensorState] = None
    transient: Optional[Transient] = None
    temporaries: str = ""
    master: bool = True
    shared: tuple[tuple[str, StateTensor], ...] = ()
    lr: float = 1e-3
    weight_decay: float = 0.05
    tier_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    orthogonal: Any = False
    variant_of: Optional[str] = None
    requires: Mapping[str, str] = dataclasses.field(default_factory=dict)
    kernels: bool = False
    in_backward: bool = False
    reduced: Optional[Reduced] = None

    def build(self, model: nn.Module, lr: Optional[float] = None, weight_decay: Optional[float] = None, *,
              impl: str = "auto"):
        """The optimizer over ``model``'s parameters, one param group per tier (``impl``: SkewAdam's kernel).

        Example:
            >>> opt = get("skewadam-lean").build(model, lr=1e-3)
        """
        if self.make is None:
            raise ValueError(f"{self.name} is a memory model only (its library is not a dependency): plan it, "
                             f"build another arm ({', '.join(names(buildable=True))})")
        wd = self.weight_decay if weight_decay is None else weight_decay
        lr = self.lr if lr is None else lr
        groups = param_groups(model, weight_decay=wd, tier_options=dict(self.tier_options), log=False,
                              orthogonal=self.orthogonal)
        return self.make(groups, lr, impl)

    def settings(self) -> dict[str, Any]:
        """What the arm builds beyond its name, lr and weight decay, as JSON: a run's log records it, so that a
        resumed bench re-runs an arm whose settings changed since (`logged_settings`)."""
        return json.loads(json.dumps({"options": self.options, "tier_options": self.tier_options,
                                      "orthogonal": self.orthogonal}, sort_keys=True,
                                     default=lambda o: dict(o) if isinstance(o, Mapping) else repr(o)))


class ChainedOptimizer:
    """Several optimizers stepped as one (Muon + AdamW); ``param_groups`` and ``state`` are the union."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


# ----------------------------------------------------------------------------------------------------- builders
def _adamw8bit_torchao(groups, lr, impl):
    """torchao's AdamW8bit. It compiles its per-tensor step with ``torch.compile``; on CPU that costs minutes of
    compilation in every fresh run process (``docs/bench/design.md``), so parameters on CPU take the same step
    eagerly (``torch.compiler.set_stance("force_eager")``): the same math and state, not torchao's speed."""
    try:
        with quiet_imports():  # on a CPU-only build, each of its CUDA extensions logs a failure to load
            from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ImportError("the adamw8bit-torchao arm needs torchao: pip install 'skewadam[bench]' (or torchao)") from e

    class EagerOnCPU(AdamW8bit):
        def step(self, closure=None):
            if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            return super().step(closure)

    return EagerOnCPU(groups, lr=lr)


_SKEWADAM_ONLY = ("update", "betas", "relative_step", "beta2_decay")  # orthogonal groups' SkewAdam settings


def _muon(groups, lr, impl):
    """torch's Muon on the orthogonal groups (the hidden matrices), fused AdamW on the others; one lr."""
    muon_groups = [{k: v for k, v in g.items() if k not in _SKEWADAM_ONLY} for g in groups
                   if g.get("update") == "orthogonal"]
    adamw_groups = [g for g in groups if g.get("update") != "orthogonal"]
    return ChainedOptimizer(
        torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(adamw_groups, lr=lr, fused=True),
    )


# ------------------------------------------------------------------------------------------------ memory models
def _adamw_state(shape, tier, dtype, orthogonal=False, experts=None):
    return [_STEP, ("exp_avg", StateTensor(shape, dtype)), ("exp_avg_sq", StateTensor(shape, dtype))]


def _muon_state(shape, tier, dtype, orthogonal=False, experts=None):
    # torch.optim.Muon keeps one momentum buffer (no step) per hidden matrix; fused AdamW the rest
    return [("momentum_buffer", StateTensor(shape, dtype))] if orthogonal else _adamw_state(shape, tier, dtype)


def _adafactor_state(shape, tier, dtype, orthogonal=False, experts=None):
    # torch.optim.Adafactor: row/col over the last two dims for >= 2-D tensors, a full variance otherwise; no momentum.
    if len(shape) >= 2:
        return [_STEP, ("row_var", StateTensor(shape[:-1] + (1,), dtype)),
                ("col_var", StateTensor(shape[:-2] + (1, shape[-1]), dtype))]
    return [_STEP, ("variance", StateTensor(shape, dtype))]


def _bnb_adamw8bit_state(shape, tier, dtype, orthogonal=False, experts=None):
    # bitsandbytes AdamW8bit (block_wise=True, min_8bit_size=4096): uint8 state1/state2 with one fp32 absmax per
    # 2048-element block each; tensors under 4096 elements keep fp32 state1/state2. Its step is a Python int.
    n = math.prod(shape)
    if n < 4096:
        return [("state1", StateTensor(shape, _F32)), ("state2", StateTensor(shape, _F32))]
    blocks = (math.ceil(n / 2048),)
    return [("state1", StateTensor(shape, torch.uint8)), ("absmax1", StateTensor(blocks, _F32)),
            ("state2", StateTensor(shape, torch.uint8)), ("absmax2", StateTensor(blocks, _F32))]


def _torchao_adamw8bit_state(shape, tier, dtype, orthogonal=False, experts=None):
    # torchao.optim.AdamW8bit (block_size=256): each moment is an OptimState8bit of uint8 codes, one fp32 scale per
    # 256 elements and its own 256-entry fp32 qmap; tensors under 4096 elements or not a multiple of 256 keep plain
    # moments in the stepped tensor's dtype.
    n = math.prod(shape)
    if n < 4096 or n % 256:
        return _adamw_state(shape, tier, dtype)
    quantized = [StateTensor(shape, torch.uint8), StateTensor((n // 256,), _F32), StateTensor((256,), _F32)]
    return [_STEP, *(("exp_avg", t) for t in quantized), *(("exp_avg_sq", t) for t in quantized)]


def _fp32_copies_of_largest(n: int) -> Transient:
    """``n`` fp32 copies of the largest tensor: torch's per-tensor implementations allocate per tensor."""
    return lambda tensors, dtype, impl: n * max((math.prod(s) for s, *_ in tensors), default=0) * 4


def _copy_of_largest_group(tensors, dtype, impl) -> int:
    """One stepped-dtype copy of the largest param group (one group per tier): foreach ops take a group at once."""
    by_tier: dict[str, int] = defaultdict(int)
    for shape, tier, *_ in tensors:
        by_tier[tier] += math.prod(shape)
    return max(by_tier.values(), default=0) * dtype.itemsize


def _skewadam(name: str, label: str, *, options: Optional[dict[str, Any]] = None,
              tier_options: Optional[dict[str, dict[str, Any]]] = None, lr: float = 1e-3,
              orthogonal: Any = False, variant_of: Optional[str] = None) -> Arm:
    """A SkewAdam arm: ``options`` are SkewAdam keyword arguments (``in_backward`` among them), ``tier_options``
    per-tier group settings, ``orthogonal`` which tensors take the orthogonal update (their state, as
    `param_groups` sets their groups)."""
    options, tier_options = dict(options or {}), dict(tier_options or {})
    flags = {(t.value, False): state_flags(group_settings(t.value, False, options, tier_options, {})) for t in Tier}
    if orthogonal:  # what param_groups gives the tensors `orthogonal` selects (in the backbone and expert tiers)
        flags.update({(t, True): state_flags(group_settings(t, True, options, tier_options, {}))
                      for t in (Tier.BACKBONE.value, Tier.EXPERT.value)})

    def make(groups, lr, impl):
        from ..optimizer import SkewAdam

        return SkewAdam(groups, lr=lr, impl=impl, **options)

    def tier_spec(tier, orthogonal, experts):  # a flattened bank's group has its E (`param_groups`)
        spec = flags[tier, orthogonal]
        return spec if orthogonal or experts is None else spec._replace(experts=experts)

    def state(shape, tier, dtype, orthogonal=False, experts=None):
        return list(tier_spec(tier, orthogonal, experts).spec(shape, dtype).items())

    def transient(tensors, dtype, impl):
        # a group a tier, and one a flattened bank's E, as `param_groups` makes them
        fused = [(*tier_spec(tier, False, e).planned(shape, dtype), (tier, e))
                 for shape, tier, o, e in tensors if not o]
        orthogonal_shapes = [shape for shape, _, o, _ in tensors if o]
        if orthogonal_shapes:  # the Newton-Schulz step is one module for every backend
            from ..kernels import orthogonal as orthogonal_kernel

            ns = orthogonal_kernel.step_transient_bytes(orthogonal_shapes, dtype, [
                group_settings(tier, True, options, tier_options, {}).get("ns_dtype")
                for _, tier, o, _ in tensors if o])
        else:
            ns = 0
        return max(BACKENDS[impl].step_transient_bytes(fused, dtype), ns)

    relative = bool(options.get("relative_step"))

    def reduced(shape, tier, dtype, orthogonal=False, experts=None):
        """The sums a dim-0 shard cannot complete alone (`skewadam.distributed`): per unit sum g^2 and sum u^2 (and
        sum p^2 for a relative step, max |g| for float64 parameters), and a factored matrix's whole-matrix,
        row-statistic and column sums where dim 0 holds its rows: float64 (`GradStats`), sum u^2 in the state dtype.
        A stacked bank is sharded on its experts (all of its sums are per expert: none); a flattened bank [E*D, F]
        is cut in its experts' rows (every expert's sums). The orthogonal update gathers instead."""
        if orthogonal or not shape:
            return 0
        spec = tier_spec(tier, False, experts)
        view = spec.view_shape(shape)
        bank = spec.is_bank(len(view))
        if bank and experts is None:
            return 0
        units = view[0] if bank else 1
        n = units * (1 + relative + (dtype == torch.float64))
        if spec.use_factored and len(view) - bank == 2:  # a matrix per unit, its rows along dim 0
            n += units * (2 + view[-1])
        return n * 8 + units * state_dtype_for(dtype).itemsize

    return Arm(name, label, make, state, transient, master=False, tier_options=tier_options, options=options,
               kernels=True, lr=lr, orthogonal=orthogonal, variant_of=variant_of,
               in_backward=bool(options.get("in_backward")), reduced=reduced,
               temporaries="as its backend counts them (`step_transient_bytes` of skewadam.kernels.BACKENDS) "
               "and, for orthogonal groups, skewadam.kernels.orthogonal (the stacked Newton-Schulz iterates): the "
               "larger of the two")


_MEASURED = "measured, torch 2.13 CPU"
ARMS: dict[str, Arm] = {arm.name: arm for arm in [
    Arm("adamw", "AdamW, torch fused (fp32 m, v)", lambda g, lr, impl: torch.optim.AdamW(g, lr=lr, fused=True),
        _adamw_state, _fp32_copies_of_largest(0), f"none (in place; {_MEASURED})"),
    Arm("adamw-foreach", "AdamW, torch foreach (fp32 m, v)",
        lambda g, lr, impl: torch.optim.AdamW(g, lr=lr, foreach=True), _adamw_state, _copy_of_largest_group,
        f"one copy of the largest param group ({_MEASURED})", variant_of="adamw"),
    Arm("adamw8bit-bnb", "8-bit AdamW, bitsandbytes (uint8 m, v + fp32 absmax per 2048)", None,
        _bnb_adamw8bit_state, _fp32_copies_of_largest(0), "none (its fused kernel updates in place)",
        shared=(("qmap1", StateTensor((256,), _F32)), ("qmap2", StateTensor((256,), _F32)))),
    Arm("adamw8bit-torchao", "8-bit AdamW, torchao (uint8 m, v + fp32 scale per 256)", _adamw8bit_torchao,
        _torchao_adamw8bit_state, _fp32_copies_of_largest(3), "3 fp32 copies of the largest tensor (assumed)",
        requires={"torchao": "torchao"}),
    # lr is Adafactor's maximum relative step; weight decay is multiplied by lr (the study's setting: 1.5e-3 made
    # its decay per step AdamW's 0.05 at the paper's 3e-4 against Adafactor's 1e-2)
    Arm("adafactor", "Adafactor, torch (factored v, no momentum)", lambda g, lr, impl: torch.optim.Adafactor(g, lr=lr),
        _adafactor_state, _fp32_copies_of_largest(2), f"2 fp32 copies of the largest tensor ({_MEASURED})",
        lr=1e-1, weight_decay=1.5e-3),
    Arm("muon", "Muon, torch, on hidden matrices + fused AdamW on the rest", _muon, _muon_state,
        _fp32_copies_of_largest(2), "2 fp32 copies of the largest tensor (assumed)", orthogonal=True, lr=1e-2),
    _skewadam("skewadam", "SkewAdam (paper tiers, eps_mode='add')"),
    _skewadam("skewadam-floor", "SkewAdam (paper tiers, eps_mode='floor', the paper's)", options={"eps_mode": "floor"},
              lr=1e-2),
    _skewadam("skewadam-lean", "SkewAdam's lean recipe: int8 block-wise momentum", options={"momentum_dtype": "int8"}),
    _skewadam("skewadam-bf16m", "SkewAdam, bf16 momentum", options={"momentum_dtype": "bf16"}),
    _skewadam("skewadam-expert-momentum", "SkewAdam, experts keep momentum",
              tier_options={"expert": {"use_momentum": True}}),
    _skewadam("skewadam-factored-router", "SkewAdam, router factored", tier_options={"router": {"use_factored": True}}),
    _skewadam("skewadam-uniform", "SkewAdam, momentum + factored everywhere",
              tier_options={"expert": {"use_momentum": True}, "router": {"use_momentum": True, "use_factored": True}}),
    _skewadam("skewadam-orthogonal", "SkewAdam, hidden matrices orthogonal (Muon's update, fp32 momentum)",
              orthogonal=True, lr=1e-2),
    _skewadam("skewadam-orthogonal-experts", "SkewAdam, hidden matrices and expert banks (per expert) orthogonal",
              orthogonal="experts", lr=3e-2),
    _skewadam("skewadam-orthogonal-experts-momentum",
              "skewadam-orthogonal-experts, expert slices with Nesterov momentum", orthogonal="experts",
              tier_options={"expert": {"use_momentum": True}}, lr=3e-2),  # its int8 twin's best (not swept itself)
    _skewadam("skewadam-quality", "SkewAdam's quality recipe: hidden matrices and expert slices orthogonal from int8 "
              "Nesterov momentum, Newton-Schulz in bf16 where the device multiplies it natively, expert slices "
              "every 4th step", options={"momentum_dtype": "int8", "ns_dtype": "auto"}, orthogonal="experts",
              tier_options={"expert": {"use_momentum": True, "ns_interval": 4}}, lr=3e-2),
    _skewadam("skewadam-quality-fp32", "the quality recipe before issue 35: skewadam-quality with Newton-Schulz in the "
              "parameters' dtype on every matrix every step", options={"momentum_dtype": "int8"}, orthogonal="experts",
              tier_options={"expert": {"use_momentum": True}}, lr=3e-2),
    _skewadam("skewadam-relative-step", "SkewAdam, update x max(1e-3, rms(p)) (Adafactor's relative step)",
              options={"relative_step": True}),
    # skewadam's math in another place (bench --optimizers all leaves it out: it trains only at --grad-clip 0)
    _skewadam("skewadam-in-backward", "SkewAdam stepped inside backward (in_backward=True: no gradients held)",
              options={"in_backward": True}, variant_of="skewadam"),
]}

PLAN_DEFAULT = ("adamw", "adamw8bit-bnb", "adamw8bit-torchao", "adafactor", "skewadam", "skewadam-expert-momentum",
                "skewadam-factored-router", "skewadam-uniform", "skewadam-bf16m", "skewadam-lean")
BENCH_STEP_DEFAULT = ("skewadam", "adamw", "adamw-foreach", "adafactor")  # the first is the one compared with


#: Arms whose settings changed before run logs recorded them (`Arm.settings`), and the arm that builds today what
#: they built then: the quality recipe's cheaper Newton-Schulz (docs/study/cheaper.md).
BEFORE_LOGGED_SETTINGS = {"skewadam-quality": "skewadam-quality-fp32"}


def logged_settings(log: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a run's log ran its arm with: recorded, or for a log older than the record, the arm's settings
    then (today's but for the arms of `BEFORE_LOGGED_SETTINGS`)."""
    if "arm" in log:
        return log["arm"]
    name = log["config"]["optimizer"]
    return get(BEFORE_LOGGED_SETTINGS.get(name, name)).settings()


def names(*, buildable: bool = False, planned: bool = False, variants: bool = True) -> list[str]:
    """Registry names: those with a builder, with a memory model, and/or without implementation variants."""
    return [n for n, a in ARMS.items() if (a.make or not buildable) and (a.state or not planned)
            and (variants or a.variant_of is None)]


def get(name: str) -> Arm:
    """The arm called ``name``; ValueError naming the choices if there is none.

    Example:
        >>> get("skewadam-lean").label
        'SkewAdam, int8 block-wise momentum'
    """
    if name not in ARMS:
        raise ValueError(f"unknown optimizer {name!r}: use any of {', '.join(ARMS)}")
    return ARMS[name]
