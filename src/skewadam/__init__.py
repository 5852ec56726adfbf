"""skewadam: tiered optimizer state for memory-efficient Mixture-of-Experts training.

Example:
    >>> from skewadam import SkewAdam
    >>> optimizer = SkewAdam.from_model(model, lr=3e-4, weight_decay=0.05)

Layers, lowest first. A module imports only from layers below its own (lazy imports too); a package (``kernels``,
``bench``, ``integrations``) is one unit whose modules import each other freely. ``tests/test_layout.py`` checks
every import against this list.

    1. tiers                        tier labels (they import nothing of ours)
    2. state, structure             state_spec, state_flags, check_state, measure_state; the MoE structure of a model
    3. kernels, classify, recipes, pieces  the backends and their registry; automatic tiers; named
                                    configurations of from_model; where ZeRO's flat partitions cut the tensors
    4. distributed, groups, zero    DTensor placements and the cross-shard reducer; param groups and their census;
                                    the records and reducer of ZeRO's flat partitions
    5. validation, functional, backward  param group and checkpoint checks; one step over the kernels' records;
                                    the step inside backward (a gradient hook per parameter: it steps the
                                    parameter through its optimizer as soon as its gradient is complete)
    6. optimizer                    SkewAdam
    7. integrations                 Transformers, torchtitan, DeepSpeed
    8. bench                        the benchmark application beside the library: the arms (one registry), the
                                    planner, models, data, the harness (train, bench, report, measure); nothing
                                    below imports it, and its planner imports no optimizer and no kernel module
    9. cli, skewadam                the command line; this package's re-exports (skewadam/__init__.py)
   10. __main__                     ``python -m skewadam``
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
        from .bench.planner import plan

        return plan
    raise AttributeError(f"module 'skewadam' has no attribute {name!r}")
