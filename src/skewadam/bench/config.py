"""Run configurations of the benchmark, as dataclasses, and the named presets ``skewadam bench --preset`` takes.

A `RunConfig` is one training run, everything that decides its result; a `BenchConfig` is the set of runs
`skewadam bench` compares: the shared `RunConfig` fields (``base``), optimizers, learning rates per optimizer, seeds.
Presets are functions returning a `BenchConfig`; command-line flags override their fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Callable, Optional

from . import arms
from .data import check_data_path
from .presets import known, preset_names

__all__ = ["RunConfig", "BenchConfig", "PRESETS", "ALL", "DEFAULT_OPTIMIZERS", "DEFAULT_STEPS", "DEFAULT_EVAL_INTERVAL",
           "DEFAULT_LRS", "get_preset", "run_name", "run_name_of", "run_identity",
           "config_hash", "with_defaults", "default_jobs"]


#: The default bench (`default`: ``skewadam bench`` with no arguments), set here in one place: which arms, how many
#: steps, an evaluation every how many, and lrs other than each arm's registry lr (``{arm: (lr, ...)}``).
DEFAULT_OPTIMIZERS: tuple[str, ...] = ("adamw", "adafactor", "muon", "skewadam",
                                       "skewadam-quality")
DEFAULT_STEPS = 200  # the study's horizon: its ranking and its lrs (docs/study/rerun.md); 60 steps rank otherwise
DEFAULT_EVAL_INTERVAL = 25
DEFAULT_LRS: dict[str, tuple[float, ...]] = {}


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """One training run. ``optimizer`` is an arm of `skewadam.bench.arms`; ``lr`` and
    ``weight_decay`` ``None`` mean the arm's defaults."""

    optimizer: str = "adamw"
    lr: Optional[float] = None
    weight_decay: Optional[float] = None
    seed: int = 0  # initial weights, batch order and router noise
    model: str = "cpu"  # what `skewadam plan` takes: a preset (`skewadam.bench.presets`) or a config.json path
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # --set: the model config's own keys
    data: Optional[str] = None  # text file or folder; None = the embedded Shakespeare
    steps: int = 200
    batch_size: int = 16
    block_size: Optional[int] = None  # None = the model preset's
    eval_interval: int = 25
    eval_batches: int = 8  # fixed validation batches of batch_size x block_size tokens
    warmup_frac: float = 0.03  # linear warm-up over this fraction of steps, then cosine to 0
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    device: str = "cpu"  # "cuda": bf16 weights (SkewAdam rounds them stochastically)
    threads: Optional[int] = None  # torch CPU threads; None = torch's default

    def __post_init__(self) -> None:
        """Every field checked before anything runs: a wrong value names the field, the flag and what it takes."""
        self.optimizer = _trainable(self.optimizer)
        for name in ("steps", "batch_size", "eval_interval", "eval_batches"):
            _check_int(name, getattr(self, name), 1)
        _check_int("seed", self.seed, 0)
        for name in ("block_size", "threads"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.lr is not None:
            _check_float("lr", self.lr, "> 0", lambda v: v > 0)
        if self.weight_decay is not None:
            _check_float("weight_decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        _check_float("warmup_frac", self.warmup_frac, "in [0, 1)", lambda v: 0.0 <= v < 1.0)
        _check_float("grad_clip", self.grad_clip, ">= 0 (0 = off)", lambda v: v >= 0)
        if self.grad_clip and arms.ARMS[self.optimizer].in_backward:
            raise ValueError(f"{self.optimizer} steps each tensor inside backward: no gradient is left to clip "
                             f"globally (--grad-clip {self.grad_clip:g}); run it with --grad-clip 0 (SkewAdam "
                             f"RMS-clips each update unit at 1.0 anyway)")
        if not isinstance(self.model, str) or not known(self.model):
            raise ValueError(f"unknown model {self.model!r} (--model): use a preset ({', '.join(preset_names())}) "
                             f"or a Hugging Face config.json path")
        if not isinstance(self.overrides, dict) or not all(isinstance(k, str) for k in self.overrides):
            raise ValueError(f"overrides (--set) must map config keys to values, got {self.overrides!r}")
        if self.data is not None:
            if not isinstance(self.data, (str, os.PathLike)):
                raise ValueError(f"data (--data) must be a path, got {self.data!r}")
            check_data_path(self.data)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def param_dtype(self) -> Any:
        """The runs' weight dtype (a ``torch.dtype``): bf16 on CUDA (SkewAdam rounds it stochastically), else fp32."""
        import torch

        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def resolved_lr(self) -> float:
        return arms.ARMS[self.optimizer].lr if self.lr is None else self.lr

    @property
    def resolved_weight_decay(self) -> float:
        return arms.ARMS[self.optimizer].weight_decay if self.weight_decay is None else self.weight_decay


def run_identity(cfg: RunConfig) -> dict[str, Any]:
    """Every setting of a run, its lr and weight decay resolved: what its log's ``config`` records."""
    return dataclasses.asdict(cfg) | {"lr": cfg.resolved_lr, "weight_decay": cfg.resolved_weight_decay}


def run_name_of(identity: dict[str, Any]) -> str:
    """File stem of a run's log, from its `run_identity`: ``{optimizer}_lr{lr}_seed{seed}``."""
    return f"{identity['optimizer']}_lr{identity['lr']:g}_seed{identity['seed']}"


def run_name(cfg: RunConfig) -> str:
    """File stem of a run's log: ``{optimizer}_lr{lr}_seed{seed}``."""
    return run_name_of(run_identity(cfg))


#: Settings a run's config hash leaves out: they change its timings, not what it computes.
IGNORED_BY_HASH = ("threads",)


def with_defaults(identity: dict[str, Any]) -> dict[str, Any]:
    """A logged `run_identity` with the settings it predates at their defaults."""
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(RunConfig)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    return {**defaults, **identity}


def config_hash(identity: dict[str, Any]) -> str:
    """A short hash of a run's settings (`run_identity`, settings it predates at their defaults), all but
    `IGNORED_BY_HASH`: two logs with the same hash ran the same thing."""
    kept = {k: v for k, v in with_defaults(identity).items() if k not in IGNORED_BY_HASH}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: RunConfig fields that differ between the runs of one bench; all others must match to resume a run directory.
PER_RUN_FIELDS = ("optimizer", "lr", "weight_decay", "seed", "threads")


@dataclasses.dataclass(kw_only=True)
class BenchConfig:
    """A comparison: every optimizer x its learning rates x seeds ``0..seeds-1``, sharing ``base``.

    ``lrs`` maps an optimizer to its learning rates; a missing optimizer uses its default lr. ``jobs`` runs at a
    time; None = `default_jobs`.
    """

    base: RunConfig = dataclasses.field(default_factory=RunConfig)
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    lrs: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    seeds: int = 1
    jobs: Optional[int] = None

    def __post_init__(self) -> None:
        self.optimizers = tuple(dict.fromkeys(_trainable(o) for o in self.optimizers))
        self.lrs = {_trainable(o): lrs for o, lrs in self.lrs.items()}
        for opt, lrs in self.lrs.items():
            if not lrs:
                raise ValueError(f"no learning rate given for {opt}")
            for lr in lrs:
                _check_float("lr", lr, "> 0", lambda v: v > 0)
        _check_int("seeds", self.seeds, 1)
        if self.jobs is not None:
            _check_int("jobs", self.jobs, 1)

    @property
    def resolved_jobs(self) -> int:
        return default_jobs(self.base) if self.jobs is None else self.jobs

    def runs(self) -> list[RunConfig]:
        """All runs, seed-major (an interrupted study has every optimizer at the first seeds)."""
        return [
            dataclasses.replace(self.base, optimizer=opt, lr=lr, seed=seed)
            for seed in range(self.seeds)
            for opt in self.optimizers
            for lr in self.lrs.get(opt, (arms.ARMS[opt].lr,))
        ]


def _flag(name: str) -> str:
    """A field and the flag that sets it: ``grad_clip (--grad-clip)``."""
    flag = {"lr": "--lrs", "seed": None, "weight_decay": None, "overrides": "--set"}.get(
        name, f"--{name.replace('_', '-')}")
    return f"{name} ({flag})" if flag else name


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_flag(name)} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, what: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{_flag(name)} must be a finite number {what}, got {value!r}")


def _trainable(name: str) -> str:
    """The arm name of ``name``, if the bench can train it."""
    arm = arms.get(name)
    if arm.make is None:
        raise ValueError(f"{arm.name} is a memory model only: train any of {', '.join(arms.names(buildable=True))}")
    return arm.name


#: What ``--optimizers all`` trains: every arm that builds, one implementation of each.
ALL = tuple(arms.names(buildable=True, variants=False))
#: The arms of the study in docs/study/results.md, fixed so that the preset reproduces it as new arms come.
STUDY_ARMS = ("skewadam-floor", "skewadam", "adamw", "skewadam-lean", "adafactor", "muon", "skewadam-expert-momentum",
              "skewadam-factored-router", "skewadam-uniform", "skewadam-bf16m", "adamw8bit-torchao")


def default_jobs(base: RunConfig) -> int:
    """Runs at a time when not chosen: one per ``threads`` cores of this process's CPUs on CPU (1 when ``threads`` is
    torch's default, which takes them all); 1 on CUDA."""
    if base.device != "cpu" or base.threads is None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // base.threads)


def default() -> BenchConfig:
    """`skewadam bench` with no arguments: a few optimizers at their best lrs, short enough for a first look.

    Its optimizers, steps, evaluation interval and lrs are the four constants above (`DEFAULT_OPTIMIZERS`, ...), on
    the study's data, model, batch and schedule, one single-threaded run per core, budgeted to finish within
    8 minutes on 2 CPU cores (the measured wall time is in README's bench section). Longer runs, more seeds and the
    ablations: ``--steps``, ``--seeds``, ``--optimizers all``, ``--preset study``."""
    return BenchConfig(base=RunConfig(steps=DEFAULT_STEPS, eval_interval=DEFAULT_EVAL_INTERVAL, threads=1),
                       optimizers=DEFAULT_OPTIMIZERS, lrs=dict(DEFAULT_LRS))


def smoke() -> BenchConfig:
    """The tiny model for 2 steps: seconds, a check that everything runs (tests)."""
    return BenchConfig(base=RunConfig(model="tiny", steps=2, batch_size=2, eval_interval=1, eval_batches=1))


#: the study's learning-rate grid per optimizer: 3 half-decade lrs around each one's best at 200 steps, found by
#: seed-0 sweeps from (3e-4, 1e-3, 3e-3) extended while the best sat at an edge (the report flags a best at an edge)
STUDY_LRS: dict[str, tuple[float, ...]] = {"skewadam-floor": (3e-3, 1e-2, 3e-2), "adafactor": (3e-2, 1e-1, 3e-1),
                                           "muon": (3e-3, 1e-2, 3e-2)}
STUDY_LR_DEFAULT = (3e-4, 1e-3, 3e-3)


def study() -> BenchConfig:
    """Every optimizer and ablation x 3 learning rates x 3 seeds, 200 steps (its wall time is in docs/study).

    Seed-major, so an interrupted study has every arm at its first seeds; resumable. Its settings are the default
    bench's (`RunConfig`'s defaults)."""
    return BenchConfig(
        base=RunConfig(steps=200, eval_interval=25),
        optimizers=STUDY_ARMS,
        lrs={name: STUDY_LRS.get(name, STUDY_LR_DEFAULT) for name in STUDY_ARMS},
        seeds=3,
    )


#: the orthogonal tier's grid: 3 half-decade lrs around each new arm's best at 200 steps (seed-0 sweeps first,
#: extended while the best sat at an edge, as for `STUDY_LRS`)
STUDY_ORTH_LRS: dict[str, tuple[float, ...]] = {
    "skewadam-orthogonal": (3e-3, 1e-2, 3e-2),
    "skewadam-orthogonal-experts": (1e-2, 3e-2, 1e-1),
    "skewadam-quality": (1e-2, 3e-2, 1e-1),
    "skewadam-relative-step": (3e-2, 1e-1, 3e-1),
}


def study_orth() -> BenchConfig:
    """The orthogonal tier's and Adafactor's relative step's study: 3 lrs x 3 seeds, 200 steps, with the base
    settings of `study` (so ``--out`` may be that study's directory, whose runs it leaves as they are). The options
    it found no better (a separate orthogonal lr, Adafactor's beta2 decay) are not arms; their rows are in
    ``docs/study/orthogonal.md``."""
    return BenchConfig(base=study().base, optimizers=tuple(STUDY_ORTH_LRS), lrs=dict(STUDY_ORTH_LRS), seeds=3)


#: the 10x study's grid (docs/study/scale.md): 3 half-decade lrs per arm around its best at 1,000 steps on the `cpu`
#: model (docs/study/long.md)
STUDY_20M_LRS: dict[str, tuple[float, ...]] = {
    "adamw": (3e-4, 1e-3, 3e-3),
    "muon": (1e-3, 3e-3, 1e-2),
    "skewadam": (3e-4, 1e-3, 3e-3),
    "skewadam-lean": (3e-4, 1e-3, 3e-3),
    "skewadam-quality": (3e-3, 1e-2, 3e-2),
}


def study_20m() -> BenchConfig:
    """The 10x study: model ``cpu-20m`` (20.3M parameters), 1,000 steps of 16 x 128 tokens, 8 validation batches
    every 50, 1 thread a run, 3 lrs x 3 seeds per arm; 20-150 minutes a run on a shared 2-core CPU, so the study ran
    a chosen subset of it (docs/study/scale.md says which)."""
    return BenchConfig(base=RunConfig(model="cpu-20m", steps=1000, eval_interval=50, threads=1),
                       optimizers=tuple(STUDY_20M_LRS), lrs=dict(STUDY_20M_LRS), seeds=3)


PRESETS: dict[str, Callable[[], BenchConfig]] = {"default": default, "smoke": smoke, "study": study,
                                                 "study-orth": study_orth, "study-20m": study_20m}


def get_preset(name: str) -> BenchConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]()
