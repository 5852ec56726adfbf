"""Recipes: named SkewAdam configurations, each with its lr and the evidence for it (`RECIPES`).

``SkewAdam.from_model(model, recipe="quality")`` applies one (`apply`); keyword arguments given beside it override
it, a dict-valued setting (``orthogonal_options``, ``tier_options``) key by key. ``"paper"``, the paper's tiers, is
the default. The bench arms of these settings carry their names: ``skewadam`` (paper), ``skewadam-lean``,
``skewadam-quality``.

| recipe    | settings                                                     | lr   | state, paper-6.78b | Newton-Schulz |
|-----------|--------------------------------------------------------------|------|--------------------|---------------|
| `paper`   | the paper's tiers (SkewAdam's defaults)                      | 1e-3 | 1.29 GiB (0.025x)  | none          |
| `lean`    | `momentum_dtype="int8"`: the least memory                    | 1e-3 | 345 MiB (0.007x)   | none          |
| `quality` | `orthogonal="experts"`, `orthogonal_options={"use_momentum": | 3e-3 | 6.42 GiB (0.127x)  | 2.1e14 FLOPs  |
|           | True}`, `momentum_dtype="int8"`, `ns_dtype="auto"`,          |      |                    | per step      |
|           | `tier_options={"expert": {"ns_interval": 4}}`: Muon's update |      |                    |               |
|           | on the hidden matrices and each expert slice (every 4th of   |      |                    |               |
|           | its steps), from int8 Nesterov momentum                      |      |                    |               |

State: optimizer statistics in fp32 (x: AdamW's 50.55 GiB), `skewadam plan paper-6.78b --optimizer skewadam
--optimizer skewadam-lean --optimizer skewadam-quality` (the arms of these settings).
Newton-Schulz: the matmul FLOPs of its 5 steps over every matrix the recipe orthogonalises, per step on average
(`skewadam.groups.orthogonal_flops`; quality: 11 hidden matrices every step and 384 expert slices of
``[4096, 4096]`` every 4th), against the forward and backward's ~6 x 0.44B active parameters per token.
``ns_dtype="auto"`` runs it in bf16 where the device multiplies bf16 natively (a GPU; a CPU with AVX512-BF16 or
AMX), in the parameters' dtype elsewhere (`skewadam.kernels.orthogonal.ns_dtype`), so the recipe's bits, speed and
results differ between CPUs with and without bf16 matmuls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["Recipe", "RECIPES", "DEFAULT_RECIPE", "apply"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named configuration of `SkewAdam.from_model`.

    Attributes:
        name: the registry key (the bench arm of these settings carries it).
        summary: what it is, in a line.
        settings: `SkewAdam.from_model` keyword arguments (param group options and SkewAdam's own), lr aside.
        lr: its learning rate, the best the evidence found.
        state: its optimizer state on the paper's 6.78B model (`paper-6.78b`), and the command that gives it.
        compute: its extra compute per step on `paper-6.78b` (Newton-Schulz FLOPs, `skewadam.groups.orthogonal_flops`).
        evidence: why it is a recipe, in a line, with where the runs are.
    """

    name: str
    summary: str
    settings: Mapping[str, Any]
    lr: float
    state: str
    compute: str
    evidence: str

    def describe(self) -> str:
        """The recipe in a few lines: its summary, settings and lr, state, compute and evidence."""
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items()) or "SkewAdam's defaults"
        return (f"{self.name}: {self.summary}\n  settings: {settings}, lr={self.lr:g}\n  state: {self.state}\n"
                f"  compute: {self.compute}\n  evidence: {self.evidence}")


_PLAN = "skewadam plan paper-6.78b --optimizer {}"
RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("paper", "the paper's tiers: backbone fp32 momentum + factored second moment, experts factored, router "
           "exact", {}, 1e-3,
           state=f"1.29 GiB (0.025x AdamW's 50.55 GiB; {_PLAN.format('skewadam')})",
           compute="none beyond the Adam-style update",
           evidence="the paper's configuration; on the bench model it matches AdamW at 0.117x its state over 1,000 "
                    "steps (6.540 ± 0.118 against 6.624 ± 0.077, 3 seeds, docs/study/long.md), and at 20.3M "
                    "parameters, each at its best of three lrs (both 1e-3), 4.975 ± 0.008 against 4.962 ± 0.008 "
                    "over 1,000 steps (3 seeds, docs/study/scale.md)"),
    Recipe("lean", "the paper's tiers with block-wise int8 momentum: the least memory", {"momentum_dtype": "int8"},
           1e-3,
           state=f"345.23 MiB (0.007x AdamW's 50.55 GiB; {_PLAN.format('skewadam-lean')})",
           compute="none beyond the Adam-style update (and int8 (de)quantisation)",
           evidence="as good as fp32 momentum at 0.30x its state on the bench model over 200 steps (11.729 ± 0.079 "
                    "against 11.744 ± 0.083, 3 seeds, docs/study/results.md); at 20.3M parameters over 1,000 steps "
                    "4.958 against 5.016 (Shakespeare) and 4.092 against 4.183 (Python source; seed 0, "
                    "docs/study/scale.md)"),
    Recipe("quality", "Muon's update on the hidden matrices and on each expert slice (every 4th of its steps, 4 steps' "
           "update at once), from Nesterov momentum, every momentum block-wise int8, Newton-Schulz in bf16 where the "
           "device multiplies bf16 natively: the best quality measured at SkewAdam's memory",
           {"orthogonal": "experts", "orthogonal_options": {"use_momentum": True}, "momentum_dtype": "int8",
            "ns_dtype": "auto", "tier_options": {"expert": {"ns_interval": 4}}}, 3e-3,
           state=f"6.42 GiB (0.127x AdamW's 50.55 GiB; {_PLAN.format('skewadam-quality')})",
           compute="2.1e14 Newton-Schulz FLOPs per step on average (1.5e13 for the 11 hidden matrices every step, "
                   "7.9e14 for the 384 expert slices every 4th), those of ~80k tokens' forward and backward",
           evidence="on the bench model level with the recipe before it (Newton-Schulz in fp32 on every slice every "
                    "step) over 200 steps, 7.293 ± 0.096 against 7.214 ± 0.071 (lr 3e-2, 3 seeds), and over 1,000 "
                    "4.556 ± 0.053 against 4.550 ± 0.023 (lr 1e-2, 3 seeds), ahead of Muon+AdamW (8.437 ± 0.122, "
                    "4.673 ± 0.040), at an "
                    "optimizer step 0.39x the 20.3M model's forward and backward where the former took 1.47x "
                    "(docs/study/cheaper.md); at 20.3M parameters over 1,000 steps, each arm at its best of three "
                    "lrs, 4.091 ± 0.023 at 3e-3 over 3 seeds (seed 0: 4.276 at 1e-3, 4.504 at 1e-2), ahead of "
                    "Muon+AdamW (4.402 ± 0.035) and AdamW (4.962 ± 0.008; docs/study/scale.md): its lr here, "
                    "the larger model's best"),
]}
DEFAULT_RECIPE = "paper"


def apply(recipe: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`SkewAdam.from_model` keyword arguments: ``recipe``'s settings and lr, overridden by ``kwargs`` (a dict-valued
    setting key by key).

    Example:
        >>> apply("quality", {"lr": 1e-3})["lr"], apply("quality", {})["orthogonal"]
        (0.001, 'experts')
    """
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: recipe= takes one name, one of {', '.join(RECIPES)} "
                         f"(skewadam.recipes.RECIPES)")
    found = RECIPES[recipe]
    out = {"lr": found.lr, **{k: dict(v) if isinstance(v, Mapping) else v for k, v in found.settings.items()}}
    for key, value in kwargs.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out
