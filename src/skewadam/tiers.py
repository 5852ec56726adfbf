"""The three parameter populations of an MoE and the optimizer state each one gets.

| tier       | momentum | second moment        | who                                              |
|------------|----------|----------------------|--------------------------------------------------|
| `backbone` | yes      | factored (>= 2 dims) | embeddings, attention, norms, dense/shared FFNs  |
| `expert`   | no       | factored (>= 2 dims) | routed experts (stacked banks or separate)       |
| `router`   | no       | full, exact          | the gate that scores experts                     |

Tiers are plain labels (`str` values); a param group chooses one with its ``tier`` key.
"""

from __future__ import annotations

import enum

__all__ = ["Tier", "TIER_STATE"]


class Tier(str, enum.Enum):
    """A tier label: ``backbone``, ``expert`` or ``router``; a `str`, so ``"expert"`` works wherever a Tier does."""

    BACKBONE = "backbone"
    EXPERT = "expert"
    ROUTER = "router"

    def __str__(self) -> str:  # prints as the label users write in configs
        return self.value

    @classmethod
    def parse(cls, value: str | "Tier") -> "Tier":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown tier {value!r}: use one of {[t.value for t in cls]}"
            ) from None


#: The state each tier keeps by default: the paper's Table 1. A param group may override either flag.
TIER_STATE: dict[Tier, dict[str, bool]] = {
    Tier.BACKBONE: {"use_momentum": True, "use_factored": True},
    Tier.EXPERT: {"use_momentum": False, "use_factored": True},
    Tier.ROUTER: {"use_momentum": False, "use_factored": False},
}
