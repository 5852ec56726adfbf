"""skewadam: tiered optimizer state for memory-efficient Mixture-of-Experts training.

Example:
    >>> from skewadam import SkewAdam
    >>> optimizer = SkewAdam.from_model(model, lr=3e-4, weight_decay=0.05)

Layers, lowest first. A module imports only from layers below its own (lazy imports too); a package (``kernels``,
``harness``, ``integrations``) is one unit whose modules import each other freely. ``tests/test_layout.py`` checks
every import against this list.

    1. tiers, models, data, extras  tier labels; the reference MoE and its corpora; optional dependencies (they
                                    import nothing of ours)
    2. state, structure             state_spec, state_flags, check_state, measure_state; the MoE structure of a model
    3. kernels, classify            the kernel backends and their registry; automatic tiers
    4. distributed, groups          DTensor placements and the cross-shard reducer; param groups and their census
    5. validation, functional       param group and checkpoint checks; one step over the kernels' records
    6. optimizer                    SkewAdam
    7. arms, presets                the optimizer arms (one registry); models by name
    8. planner                      plan(): memory per arm
    9. integrations, harness        Transformers, torchtitan; the benchmark (train, bench, report, measure)
   10. cli, skewadam                the command line; this package's re-exports (skewadam/__init__.py)
   11. __main__                     ``python -m skewadam``
"""

from __future__ import annotations

from .classify import classify
from .groups import describe, param_groups
from .optimizer import SkewAdam
from .state import state_spec
from .tiers import Tier

__all__ = ["SkewAdam", "Tier", "classify", "describe", "param_groups", "state_spec", "plan"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "plan":  # the planner loads on first use, so `import skewadam` stays cheap
        from .planner import plan

        return plan
    raise AttributeError(f"module 'skewadam' has no attribute {name!r}")
