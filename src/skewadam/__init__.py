"""skewadam: tiered optimizer state for memory-efficient Mixture-of-Experts training.

Example:
    >>> from skewadam import SkewAdam
    >>> optimizer = SkewAdam.from_model(model, lr=3e-4, weight_decay=0.05)
"""

from __future__ import annotations

import importlib

from .classify import classify, describe, param_groups
from .optimizer import SkewAdam
from .state import state_spec
from .tiers import Tier

# Heavier parts load on first use, so `import skewadam` stays cheap and needs nothing beyond torch.
_LAZY = {
    "plan": "skewadam.memory",
}

__all__ = ["SkewAdam", "Tier", "classify", "describe", "param_groups", "state_spec", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'skewadam' has no attribute {name!r}")
