"""The optimizers `skewadam bench` compares, each built the way it is normally used.

Every optimizer gets the same param groups (`skewadam.classify.param_groups`: one per tier, weight decay on
backbone and experts, none on the router), the same grad clipping and the same schedule (`skewadam.harness.train`).
Default learning rates are the paper's (3e-4 for AdamW and SkewAdam), and torch's own default for Adafactor, whose
``lr`` is a relative step size (the update is scaled by the parameter's RMS).

| name                      | what                                                                          |
|---------------------------|-------------------------------------------------------------------------------|
| adamw                     | torch.optim.AdamW (fused)                                                     |
| adamw8bit-torchao         | torchao.optim.AdamW8bit (block-wise 8-bit moments; needs ``torchao``)          |
| adafactor                 | torch.optim.Adafactor (factored second moment, no momentum)                   |
| muon                      | torch.optim.Muon on the 2-D hidden matrices (attention, dense FFN), lr matched |
|                           | to AdamW's RMS; AdamW on embeddings, norms, router and the 3-D expert banks   |
| skewadam-floor            | SkewAdam, paper tiers, eps_mode="floor" (the paper's)                         |
| skewadam-add              | SkewAdam, paper tiers, eps_mode="add" (Adafactor's)                           |
| skewadam-int8             | skewadam-add, backbone momentum block-wise int8 (momentum_dtype="int8")       |
| skewadam-bf16m            | skewadam-add, backbone momentum in bf16 (momentum_dtype="bf16")               |
| skewadam-expert-momentum  | ablation: experts also keep momentum                                          |
| skewadam-factored-router  | ablation: the router's second moment factored too                             |
| skewadam-uniform          | ablation: every tier momentum + factored                                      |
The ablations and compact-momentum arms use ``eps_mode="add"``, the better of the two in the study (``docs/study``),
so that each varies one thing against ``skewadam-add``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from ..classify import param_groups
from ..optimizer import SkewAdam

__all__ = ["OptimizerSpec", "OPTIMIZERS", "DEFAULT_OPTIMIZERS", "ChainedOptimizer", "build_optimizer"]


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


Builder = Callable[[list[dict[str, Any]], float], Any]


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer: ``build(groups, lr)`` from `param_groups` output; default lr and weight decay;
    ``tier_options`` passed to `param_groups` (the SkewAdam ablations)."""

    build: Builder
    lr: float
    weight_decay: float = 0.05
    tier_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _adamw(groups, lr):
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def _adamw8bit_torchao(groups, lr):
    """torchao's AdamW8bit. It compiles its per-tensor step with ``torch.compile``; on CPU that costs minutes of
    compilation in every fresh run process (209 s measured for the first step), so parameters on CPU take the same
    step eagerly (``torch.compiler.set_stance("force_eager")``): the same math and state, not torchao's speed."""
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)  # on a CPU-only build, each of its CUDA extensions logs a failure to load
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ImportError("the adamw8bit-torchao arm needs torchao: pip install 'skewadam[bench]' (or torchao)") from e
    finally:
        log.setLevel(level)

    class EagerOnCPU(AdamW8bit):
        def step(self, closure=None):
            if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            return super().step(closure)

    return EagerOnCPU(groups, lr=lr)


def _adafactor(groups, lr):
    return torch.optim.Adafactor(groups, lr=lr)


def _is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and not name.startswith(("tok_emb.", "pos_emb.")) and ".router." not in name


def _muon(groups, lr):
    muon_groups, adamw_groups = [], []
    for g in groups:
        pairs = list(zip(g["param_names"], g["params"]))
        settings = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for target, keep in ((muon_groups, True), (adamw_groups, False)):
            members = [(n, p) for n, p in pairs if _is_hidden_matrix(n, p) == keep]
            if members:
                target.append({**settings, "params": [p for _, p in members], "param_names": [n for n, _ in members]})
    return ChainedOptimizer(
        torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(adamw_groups, lr=lr, fused=True),
    )


def _skewadam(**kwargs) -> Builder:
    def build(groups, lr):
        return SkewAdam(groups, lr=lr, **kwargs)

    return build


_skewadam_add = _skewadam(eps_mode="add")
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, lr=3e-4),
    "adamw8bit-torchao": OptimizerSpec(_adamw8bit_torchao, lr=3e-4),
    # lr is Adafactor's maximum relative step (torch's default); weight decay is multiplied by lr, so 1.5e-3 gives
    # the same decay per step as AdamW's 0.05 at 3e-4
    "adafactor": OptimizerSpec(_adafactor, lr=1e-2, weight_decay=1.5e-3),
    "muon": OptimizerSpec(_muon, lr=3e-4),
    "skewadam-floor": OptimizerSpec(_skewadam(eps_mode="floor"), lr=3e-4),
    "skewadam-add": OptimizerSpec(_skewadam_add, lr=3e-4),
    "skewadam-int8": OptimizerSpec(_skewadam(eps_mode="add", momentum_dtype="int8"), lr=3e-4),
    "skewadam-bf16m": OptimizerSpec(_skewadam(eps_mode="add", momentum_dtype="bf16"), lr=3e-4),
    "skewadam-expert-momentum": OptimizerSpec(_skewadam_add, lr=3e-4, tier_options={"expert": {"use_momentum": True}}),
    "skewadam-factored-router": OptimizerSpec(_skewadam_add, lr=3e-4, tier_options={"router": {"use_factored": True}}),
    "skewadam-uniform": OptimizerSpec(_skewadam_add, lr=3e-4, tier_options={
        "expert": {"use_momentum": True}, "router": {"use_momentum": True, "use_factored": True}}),
}
DEFAULT_OPTIMIZERS = ("adamw", "adafactor", "muon", "skewadam-floor", "skewadam-add")


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float):
    """The optimizer ``name`` of `OPTIMIZERS` over ``model``'s parameters, one param group per tier."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")
    spec = OPTIMIZERS[name]
    groups = param_groups(model, weight_decay=weight_decay, tier_options=spec.tier_options, log=False)
    return spec.build(groups, lr)
