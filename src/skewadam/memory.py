r"""Optimizer memory, measured and planned: "will my MoE fit?"

* `measure_state(optimizer)`: the bytes an optimizer's state actually holds (what `SkewAdam.state_bytes` returns),
  per tier and per state key, every tensor counted once, DTensor shards at their local size.
* `plan(model, ...)`: for AdamW, 8-bit AdamW, Adafactor, SkewAdam and its tier ablations, the parameter, gradient,
  master-weight and optimizer-state bytes of one training process, and an *estimate* of its peak memory for a given
  batch, sequence length and parameter dtype. SkewAdam's state is summed from `skewadam.state.state_spec` with the
  optimizer's bank rule and `skewadam.classify` labels: the planner and the optimizer cannot disagree.

Step counters (``step``) are reported apart from the statistics (moments), because the paper's figures count only
the latter; ``total`` includes both.

Units: GiB = 2^30 bytes, MB = 10^6 bytes (as the paper's table); exact byte counts are always printed alongside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .kernels.eager import chunk_slices
from .state import COUNTER_KEYS, StateTensor, is_bank, state_spec
from .tiers import TIER_STATE, Tier

try:  # DTensor (FSDP2): a shard's local tensor is what this process holds
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

__all__ = [
    "StateBytes", "measure_state", "OptimizerPlan", "Plan", "plan", "OPTIMIZERS", "format_bytes",
    "build_optimizer", "measure_peak", "register_cli",
]

GiB = 2**30
UNTIERED = "untiered"  # tier of a param group that names none (a plain torch optimizer)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def format_bytes(n: int) -> str:
    """GiB (2^30) from 1 GiB up, else decimal MB / kB / B: the units of the paper's table, never ambiguous."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    for unit, scale in (("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------------------------------- measured
@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of optimizer state.

    Attributes:
        statistics: moments (``exp_avg``, ``exp_avg_sq``, ``row_var``, ``col_var``, ...): what the paper counts.
        counters: step counts (`skewadam.state.COUNTER_KEYS`).
        by_tier: statistics bytes per tier (``"untiered"`` for groups without a ``tier`` key).
        by_key: all bytes per state key, counters included.
        tensors: distinct state tensors.
    """

    statistics: int
    counters: int
    by_tier: dict[str, int]
    by_key: dict[str, int]
    tensors: int

    @property
    def total(self) -> int:
        """Everything held: statistics and counters."""
        return self.statistics + self.counters

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


class _Tally:
    """Sums state bytes per tier and key. Measured tensors are counted by storage: each view charges the bytes of its
    span that no earlier tensor covered, and a storage's bytes that no view covers (a view keeps its whole storage
    alive) go to the first tensor seen in it. So shared tensors count once and the total is the memory held."""

    def __init__(self) -> None:
        self.stats = self.counters = self.tensors = 0
        self.by_tier: dict[str, int] = defaultdict(int)
        self.by_key: dict[str, int] = defaultdict(int)
        self._storages: dict[Any, tuple[int, str, str, list[tuple[int, int]]]] = {}

    def add(self, tier: str, key: str, nbytes: int) -> None:
        self.by_key[key] += nbytes
        if key in COUNTER_KEYS:
            self.counters += nbytes
        else:
            self.stats += nbytes
            self.by_tier[tier] += nbytes

    def add_tensor(self, tier: str, key: str, t: Tensor) -> None:
        itemsize = t.element_size()
        span = 0 if t.numel() == 0 else itemsize * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
        storage = t.untyped_storage()
        if storage.data_ptr() == 0:  # meta / fake / empty storage: no address to share, count the tensor itself
            self.tensors += 1
            self.add(tier, key, span)
            return
        _, _, _, spans = self._storages.setdefault((t.device, storage.data_ptr()), (storage.nbytes(), tier, key, []))
        start = t.storage_offset() * itemsize
        covered = sum(max(0, min(b, start + span) - max(a, start)) for a, b in _union(spans))
        spans.append((start, start + span))
        if span - covered > 0 or not covered:
            self.tensors += 1
            self.add(tier, key, span - covered)

    def result(self) -> StateBytes:
        for nbytes, tier, key, spans in self._storages.values():
            self.add(tier, key, nbytes - sum(b - a for a, b in _union(spans)))
        self._storages.clear()
        return StateBytes(self.stats, self.counters, dict(self.by_tier), dict(self.by_key), self.tensors)


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _plain_tensors(value: Any) -> Iterable[Tensor]:
    """The tensors holding ``value``'s memory: a DTensor's local shard, a wrapper subclass's inner tensors
    (e.g. torchao's 8-bit state: codes, scale, qmap)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if not isinstance(value, Tensor):
        return
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(value, name))
    else:
        yield value


def measure_state(optimizer: torch.optim.Optimizer) -> StateBytes:
    """Bytes held in ``optimizer.state``, per tier (the param group's ``tier`` key) and per state key.

    Memory is counted once per storage: a tensor shared between parameters once, views by the part of the storage
    they cover (the rest of a storage that views keep alive goes to the first one seen), DTensor state at its local
    shard's size, tensor subclasses by their inner tensors. Works for any
    ``torch.optim.Optimizer``; non-tensor state (Python numbers) holds no tensor memory and is skipped.

    Example:
        >>> opt.step(); measure_state(opt).by_tier
        {'backbone': 1365349700, 'expert': 12582912, 'router': 2097152}
    """
    tier_of = {id(p): str(g.get("tier", UNTIERED)) for g in optimizer.param_groups for p in g["params"]}
    tally = _Tally()
    for p, state in optimizer.state.items():
        tier = tier_of.get(id(p), UNTIERED)
        for key, value in state.items():
            for t in _plain_tensors(value):
                tally.add_tensor(tier, key, t)
    return tally.result()


# ----------------------------------------------------------------------------------------------- state models
# What each optimizer allocates for one trainable tensor: [(state key, StateTensor), ...] from (shape, tier, dtype),
# dtype being that of the tensor the optimizer steps (the fp32 master copy when the recipe keeps one).
TensorState = Callable[[tuple[int, ...], str, torch.dtype], list[tuple[str, StateTensor]]]

_F32 = torch.float32
_STEP = ("step", StateTensor((), _F32))  # torch optimizers' per-tensor 0-d fp32 step count


def _adamw_state(shape, tier, dtype):
    return [_STEP, ("exp_avg", StateTensor(shape, dtype)), ("exp_avg_sq", StateTensor(shape, dtype))]


def _adafactor_state(shape, tier, dtype):
    # torch.optim.Adafactor: row/col over the last two dims for >= 2-D tensors, a full variance otherwise; no momentum.
    if len(shape) >= 2:
        return [_STEP, ("row_var", StateTensor(shape[:-1] + (1,), dtype)),
                ("col_var", StateTensor(shape[:-2] + (1, shape[-1]), dtype))]
    return [_STEP, ("variance", StateTensor(shape, dtype))]


def _bnb_adamw8bit_state(shape, tier, dtype):
    # bitsandbytes AdamW8bit (block_wise=True, min_8bit_size=4096): uint8 state1/state2 with one fp32 absmax per
    # 2048-element block each; tensors under 4096 elements keep fp32 state1/state2. Its step is a Python int.
    n = math.prod(shape)
    if n < 4096:
        return [("state1", StateTensor(shape, _F32)), ("state2", StateTensor(shape, _F32))]
    blocks = (math.ceil(n / 2048),)
    return [("state1", StateTensor(shape, torch.uint8)), ("absmax1", StateTensor(blocks, _F32)),
            ("state2", StateTensor(shape, torch.uint8)), ("absmax2", StateTensor(blocks, _F32))]


def _torchao_adamw8bit_state(shape, tier, dtype):
    # torchao.optim.AdamW8bit (block_size=256): each moment is an OptimState8bit of uint8 codes, one fp32 scale per
    # 256 elements and its own 256-entry fp32 qmap; tensors under 4096 elements or not a multiple of 256 keep plain
    # moments in the stepped tensor's dtype.
    n = math.prod(shape)
    if n < 4096 or n % 256:
        return _adamw_state(shape, tier, dtype)
    quantized = [StateTensor(shape, torch.uint8), StateTensor((n // 256,), _F32), StateTensor((256,), _F32)]
    return [_STEP, *(("exp_avg", t) for t in quantized), *(("exp_avg_sq", t) for t in quantized)]


def _skewadam_state(shape, tier, dtype, flags):
    return list(state_spec(shape, dtype, bank=is_bank(len(shape), tier, None), **flags[tier]).items())


def _tier_flags(**overrides: dict[str, bool]) -> dict[str, dict[str, bool]]:
    return {t.value: {**TIER_STATE[t], **overrides.get(t.value, {})} for t in Tier}


class OptimizerModel(NamedTuple):
    """How one optimizer spends memory.

    ``tensor_state(shape, tier, dtype)`` lists the state of one tensor; for SkewAdam it is `state_spec` under
    ``tiers`` (the per-tier ``use_momentum``/``use_factored`` flags). ``master``: keeps an fp32 master copy of
    16-bit parameters (mixed precision); SkewAdam writes bf16 weights itself with stochastic rounding and keeps none.
    ``step_buffers``: peak temporaries of ``step()``, in fp32 copies of the largest tensor, when it steps fp32 and
    bf16 tensors (measured on a reference MoE, torch 2.13 CPU: torch's single-tensor AdamW and Adafactor, SkewAdam's
    eager kernels, which allocate per tensor and take a large expert bank a chunk of whole slices at a time; `plan`
    counts none for SkewAdam's C++ kernel, whose scratch is row/column-sized; bitsandbytes' fused kernel updates in
    place; torchao's assumed as AdamW's). ``shared``: state allocated once per optimizer, not per tensor.
    """

    label: str
    tensor_state: TensorState
    master: bool
    step_buffers: tuple[int, int]  # (fp32, bf16)
    shared: tuple[tuple[str, StateTensor], ...] = ()
    tiers: Optional[dict[str, dict[str, bool]]] = None


def _skewadam(label: str, tiers: dict[str, dict[str, bool]]) -> OptimizerModel:
    return OptimizerModel(label, lambda shape, tier, dtype: _skewadam_state(shape, tier, dtype, tiers), False, (4, 9),
                          tiers=tiers)


OPTIMIZERS: dict[str, OptimizerModel] = {
    "adamw": OptimizerModel("AdamW (fp32 m, v)", _adamw_state, True, (3, 3)),
    "adamw8bit": OptimizerModel(
        "8-bit AdamW, bitsandbytes (uint8 m, v + fp32 absmax per 2048)", _bnb_adamw8bit_state, True, (0, 0),
        shared=(("qmap1", StateTensor((256,), _F32)), ("qmap2", StateTensor((256,), _F32))),
    ),
    "adamw8bit-torchao": OptimizerModel(
        "8-bit AdamW, torchao (uint8 m, v + fp32 scale per 256)", _torchao_adamw8bit_state, True, (3, 3)),
    "adafactor": OptimizerModel("Adafactor (torch: factored v, no momentum)", _adafactor_state, True, (2, 2)),
    "skewadam": _skewadam("SkewAdam (paper tiers)", _tier_flags()),
    "skewadam+expert-momentum": _skewadam("SkewAdam, experts keep momentum",
                                          _tier_flags(expert={"use_momentum": True})),
    "skewadam+factored-router": _skewadam("SkewAdam, router factored", _tier_flags(router={"use_factored": True})),
    "skewadam-uniform": _skewadam("SkewAdam, momentum + factored everywhere",
                                  {t.value: {"use_momentum": True, "use_factored": True} for t in Tier}),
    "skewadam-bf16m": _skewadam("SkewAdam, bf16 momentum",
                                {t.value: {**TIER_STATE[t], "momentum_dtype": "bf16"} for t in Tier}),
    "skewadam-int8m": _skewadam("SkewAdam, int8 block-wise momentum",
                                {t.value: {**TIER_STATE[t], "momentum_dtype": "int8"} for t in Tier}),
}


def _plan_state(opt: OptimizerModel, tensors: Sequence[tuple[tuple[int, ...], str]], dtype: torch.dtype) -> StateBytes:
    """The state ``opt`` allocates for trainable ``tensors`` ``[(shape, tier), ...]`` stepped in ``dtype``."""
    tally = _Tally()
    quantized = False
    for shape, tier in tensors:
        for key, st in opt.tensor_state(shape, tier, dtype):
            tally.tensors += 1
            tally.add(tier, key, st.nbytes)
            quantized |= st.dtype == torch.uint8
    if quantized and tensors:  # bitsandbytes' qmaps exist once 8-bit state does; counted with the first tier
        for key, st in opt.shared:
            tally.tensors += 1
            tally.add(tensors[0][1], key, st.nbytes)
    return tally.result()


# ------------------------------------------------------------------------------------------------- activations
class _Segment(NamedTuple):
    """A stretch of the network in forward order: what its forward keeps for backward, the parameter gradients its
    backward creates, and the bytes alive only while its backward runs."""

    saved: int
    grads: int
    transient: int


def _layers(model: nn.Module) -> tuple[str, int]:
    """The repeated blocks: the ``nn.ModuleList`` holding the most parameters, as (prefix, length)."""
    best, best_n, length = "", -1, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n, length = name, n, len(m)
    return best, length


def _config_value(model: nn.Module, keys: Sequence[str]) -> Optional[int]:
    config = getattr(model, "config", None)
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


_TOP_K_KEYS = ("top_k", "num_experts_per_tok", "experts_per_token", "moe_top_k", "num_selected_experts")
_N_EXPERT_KEYS = ("n_experts", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class _Unmodelled(Exception):
    """The activation estimate does not apply to this model (the reason is the message)."""


def _activation_segments(
    model: nn.Module, labels: Mapping[str, str], *, tokens: int, itemsize: int, top_k: Optional[int]
) -> tuple[list[_Segment], int, int]:
    """``(segments, held, saved)`` of one training step of a language model over ``tokens`` tokens.

    Rules (an estimate, no tracing): every matrix multiply keeps about its input and its output for backward, so a
    weight ``[out, in]`` that sees ``n`` tokens costs ``n * (in + out)`` activations (attention scores are not
    stored: flash/SDPA attention); a routed expert sees ``tokens * top_k / n_experts`` tokens; embeddings keep their
    output; the LM head keeps its input, the logits (``held``: the caller's output keeps them through the step) and
    the fp32 log-softmax of the loss, and its backward briefly holds two fp32 gradients of the logits. A tied
    embedding's gradient is created by the head, and its lookup's backward briefly holds two of them.
    Segments: embeddings, each block of the largest ``nn.ModuleList``, then the head.
    """
    vocab = _config_value(model, ("vocab_size",))
    if vocab is None:
        raise _Unmodelled(f"{type(model).__name__} has no config.vocab_size (activations are modelled for LMs)")
    names = dict(model.named_parameters())
    embeds = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_w = getattr(head, "weight", None)
    if head_w is None:  # a head that reuses the token embedding in forward (our reference model)
        head_w = next((w for w in embeds.values() if w.shape[0] == vocab), None)
    tied = head_w is not None and id(head_w) in embeds
    d_model = head_w.shape[-1] if head_w is not None else max((w.shape[-1] for w in embeds.values()), default=0)
    prefix, n_layers = _layers(model)
    head_seg = n_layers + 1
    seg_of: dict[str, int] = {}  # 0 = embeddings, 1..n = blocks, n+1 = head (whatever follows the blocks)
    after_blocks = False
    for name in names:
        if prefix and name.startswith(prefix + "."):
            seg_of[name] = 1 + int(name[len(prefix) + 1:].split(".")[0])
            after_blocks = True
        else:
            seg_of[name] = head_seg if after_blocks else 0
    routers = {seg_of[n]: names[n].shape[0] for n, t in labels.items() if t == Tier.ROUTER.value and names[n].ndim == 2}
    saved, grads, biggest = [0] * (n_layers + 2), [0] * (n_layers + 2), [0] * (n_layers + 2)
    for name, p in names.items():
        s = seg_of[name]
        if p.requires_grad:
            grads[head_seg if p is head_w else s] += p.numel() * itemsize
        if p.ndim < 2 or id(p) in embeds or p is head_w:
            continue
        if labels.get(name) == Tier.EXPERT.value:
            k = top_k if top_k is not None else _config_value(model, _TOP_K_KEYS)
            if k is None:
                raise _Unmodelled(f"{type(model).__name__}: experts per token unknown; pass top_k")
            if is_bank(p.ndim, Tier.EXPERT.value, None):
                n_tok = tokens * k * math.prod(p.shape[1:-2])  # the bank's slices share the routed tokens
            else:
                n_experts = routers.get(s) or _config_value(model, _N_EXPERT_KEYS)
                if n_experts is None:
                    raise _Unmodelled(f"{name}: no router in its block and no config.num_experts")
                n_tok = tokens * k * math.prod(p.shape[:-2]) / n_experts
        else:
            n_tok = tokens * math.prod(p.shape[:-2])
        saved[s] += int(n_tok * (p.shape[-2] + p.shape[-1]) * itemsize)
        biggest[s] = max(biggest[s], int(n_tok * max(p.shape[-2:]) * itemsize))
    logits, fp32_logits = tokens * vocab * itemsize, tokens * vocab * 4
    saved[0] += tokens * d_model * itemsize  # the embedding output
    saved[-1] += tokens * d_model * itemsize + fp32_logits  # head input, log-softmax output
    lookup = (1 + tied) * vocab * d_model * itemsize
    head_transient = 2 * fp32_logits + (logits if itemsize != 4 else 0)  # + the cast back, for 16-bit logits
    segments = [_Segment(saved[0], grads[0], lookup)]
    segments += [_Segment(saved[i], grads[i], 2 * biggest[i]) for i in range(1, n_layers + 1)]
    segments.append(_Segment(saved[-1], grads[-1], head_transient))
    return segments, logits, sum(saved) + logits


def _backward_peak(segments: Sequence[_Segment], held: int) -> tuple[int, int]:
    """``(peak, after)``: the most bytes alive during backward, and those left after it (held + all gradients)."""
    mem = held + sum(s.saved for s in segments)
    peak = mem
    for seg in reversed(segments):
        peak = max(peak, mem + seg.transient)
        mem += seg.grads
        peak = max(peak, mem)
        mem -= seg.saved
    return peak, mem


# --------------------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """One optimizer's bytes for one training process (no sharding)."""

    name: str
    label: str
    params: int
    grads: int
    master: int
    state: StateBytes
    activations: Optional[int]  # saved for backward at the end of forward, logits included
    step_temporaries: int  # alive during step(): the optimizer implementation's scratch tensors
    peak: Optional[int]  # estimate; None without an activation estimate

    @property
    def static(self) -> int:
        """Bytes held through training: parameters, master copy, optimizer state (gradients come and go)."""
        return self.params + self.master + self.state.total

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "state": self.state.to_dict(), "static": self.static}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The memory plan of one model under each optimizer (`plan`). ``str(plan)`` is the printed table."""

    model: str
    params: int
    trainable: int
    params_by_tier: dict[str, int]
    param_dtype: str
    batch: int
    seq: int
    top_k: Optional[int]
    optimizers: dict[str, OptimizerPlan]
    assumptions: list[str]

    def __getitem__(self, name: str) -> OptimizerPlan:
        return self.optimizers[name]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["optimizers"] = {k: v.to_dict() for k, v in self.optimizers.items()}
        out["units"] = "bytes"
        return out

    def __str__(self) -> str:
        tiers = [t.value for t in Tier]
        counts = {t: self.params_by_tier.get(t, 0) for t in tiers}
        share = ", ".join(f"{t} {n:,} ({n / max(self.trainable, 1):.1%})" for t, n in counts.items())
        trainable = f" ({self.trainable:,} trainable)" if self.trainable != self.params else ""
        routing = f", top-{self.top_k} routing" if self.top_k else ""
        lines = [
            f"Memory plan for {self.model} (one process; the peak is an estimate)",
            f"parameters: {self.params:,}{trainable}: {share}",
            f"{self.param_dtype} parameters, batch {self.batch} x seq {self.seq}{routing}",
            "units: GiB = 2^30 bytes, MB = 10^6 bytes, kB = 10^3 bytes",
            "",
            "optimizer state: statistics (what the paper counts), per tier; step counters apart",
        ]
        lines += _table(["optimizer", "statistics", "bytes", *tiers, "counters"], [
            [n, format_bytes(o.state.statistics), f"{o.state.statistics:,}",
             *(format_bytes(o.state.by_tier.get(t, 0)) for t in tiers), format_bytes(o.state.counters)]
            for n, o in self.optimizers.items()])
        lines += ["", "training memory: params + grads + master + state (+ activations or step temporaries) -> peak"]
        lines += _table(["optimizer", "params", "grads", "master", "state", "activations", "step tmp", "peak"], [
            [n, *("n/a" if c is None else format_bytes(c) for c in (
                o.params, o.grads, o.master, o.state.total, o.activations, o.step_temporaries, o.peak))]
            for n, o in self.optimizers.items()])
        lines += ["", "optimizers:", *(f"  {n}: {o.label}" for n, o in self.optimizers.items())]
        lines += ["assumptions:", *(f"  - {a}" for a in self.assumptions)]
        return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Fixed-width text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return [line(header), "-" * len(line(header)), *map(line, rows)]


def _model_name(model: Any) -> str:
    return os.fspath(model) if isinstance(model, (str, os.PathLike)) else type(model).__name__


def _default_seq(model: nn.Module) -> int:
    n = _config_value(model, ("block_size", "max_position_embeddings", "n_positions", "max_seq_len"))
    return min(n, 4096) if n else 2048


def plan(
    model: Union[nn.Module, str, os.PathLike],
    *,
    batch: int = 1,
    seq: Optional[int] = None,
    param_dtype: str = "fp32",
    top_k: Optional[int] = None,
    optimizers: Optional[Sequence[str]] = None,
    labels: Optional[Mapping[str, str]] = None,
    impl: str = "eager",
) -> Plan:
    """Plan the memory of training ``model`` with each optimizer of `OPTIMIZERS` (or those named).

    Args:
        model: an ``nn.Module`` (meta-device models work), a preset name or a ``config.json`` path
            (`skewadam.presets.load_model`, built on the meta device).
        batch, seq: sequences per step and tokens per sequence, for the activation estimate (``seq`` defaults to
            the model's context length, at most 4096).
        param_dtype: ``"fp32"`` or ``"bf16"``: parameters, gradients and activations. With bf16 the baselines keep
            an fp32 master copy (mixed precision); SkewAdam keeps none (stochastic rounding).
        top_k: experts per token; default from the model's config.
        optimizers: names from `OPTIMIZERS`; default all.
        labels: ``{parameter name: tier}``; default `skewadam.classify.classify(model)`.
        impl: SkewAdam's update kernel, which sets its step temporaries: ``"eager"`` (torch ops: what runs on GPUs,
            and on CPUs without the C++ kernel) or ``"cpp"`` (`skewadam.kernels.cpu`: no tensor-sized scratch).

    Example:
        >>> print(plan("paper-6.78b"))
        >>> plan(model, batch=8, seq=1024, param_dtype="bf16")["skewadam"].peak
    """
    if isinstance(model, (str, os.PathLike)):
        from .presets import load_model

        name, model = os.fspath(model), load_model(model, device="meta")
    else:
        name = _model_name(model)
    if param_dtype not in _DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r}: use one of {sorted(_DTYPES)}")
    if impl not in ("eager", "cpp"):
        raise ValueError(f"impl={impl!r}: use 'eager' (torch ops, GPUs) or 'cpp' (the C++ CPU kernel)")
    if batch < 1 or (seq is not None and seq < 1):
        raise ValueError(f"batch={batch}, seq={seq}: both must be >= 1")
    chosen = list(OPTIMIZERS) if optimizers is None else list(optimizers)
    unknown = [o for o in chosen if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}: use names from {list(OPTIMIZERS)}")
    if labels is None:
        from .classify import classify

        labels = classify(model)
    labels = {n: Tier.parse(t).value for n, t in labels.items()}
    dtype = _DTYPES[param_dtype]
    itemsize = dtype.itemsize
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in labels]
    if missing:
        raise ValueError(f"labels miss trainable parameter(s) {missing[:5]}: label every one (skewadam.classify)")
    trainable = [(tuple(p.shape), labels[n]) for n, p in params.items() if p.requires_grad]
    n_params = sum(p.numel() for p in params.values())
    n_trainable = sum(math.prod(s) for s, _ in trainable)
    by_tier = {t.value: 0 for t in Tier}
    for shape, tier in trainable:
        by_tier[tier] += math.prod(shape)
    seq = _default_seq(model) if seq is None else seq
    k = top_k if top_k is not None else _config_value(model, _TOP_K_KEYS)
    try:
        segments, held, activations = _activation_segments(
            model, labels, tokens=batch * seq, itemsize=itemsize, top_k=k)
        bwd_peak, after_bwd = _backward_peak(segments, held)
        unmodelled = None
    except _Unmodelled as e:
        activations = bwd_peak = after_bwd = None
        unmodelled = str(e)
    largest = max((math.prod(s) for s, _ in trainable), default=0)
    # SkewAdam's eager kernels take a large expert bank a chunk of whole slices at a time
    largest_chunk = max((chunk_slices(s, is_bank(len(s), t, None)) * math.prod(s[1:]) if s else 1
                         for s, t in trainable), default=0)
    rows = {}
    for opt in chosen:
        m = OPTIMIZERS[opt]
        master = n_trainable * 4 if (m.master and itemsize < 4) else 0
        stepped = _F32 if master else dtype
        state = _plan_state(m, trainable, stepped)
        static = n_params * itemsize + master + state.total
        buffers = 0 if (m.tiers is not None and impl == "cpp") else m.step_buffers[stepped.itemsize < 4]
        temporaries = buffers * (largest_chunk if m.tiers is not None else largest) * 4
        peak = None if unmodelled else static + max(bwd_peak, after_bwd + temporaries)
        rows[opt] = OptimizerPlan(opt, m.label, n_params * itemsize, n_trainable * itemsize, master, state,
                                  activations, temporaries, peak)
    assumptions = [
        "peak = params + master + state + the larger of the backward peak and (gradients + step temporaries); "
        "gradients are freed between steps (zero_grad(set_to_none=True)) and the loop keeps the model's output "
        "(logits) until the step",
        f"activations ({param_dtype}): every matmul keeps ~ its input and output for backward (tokens x (in + out)); "
        "routed experts see tokens x top_k / n_experts each with balanced routing (CPU's padded dispatch adds the "
        "busiest expert's excess); flash/SDPA attention (no T x T scores); no activation checkpointing; "
        "fp32 log-softmax of the loss",
        "bf16: baselines keep an fp32 master copy and fp32 state (mixed precision); SkewAdam keeps fp32 state and "
        "writes bf16 weights with stochastic rounding (no master copy)",
        "8-bit AdamW as bitsandbytes (block 2048, tensors < 4096 elements in fp32) and torchao (block 256) "
        "store it; their small-tensor and shared-table rules included",
        "step temporaries: fp32 scratch copies of the largest tensor (a whole expert bank; for SkewAdam's eager "
        "kernels, the largest chunk of whole bank slices of at most 2^24 elements), as many as the "
        f"implementation allocates (measured, torch 2.13 CPU: AdamW 3, Adafactor 2, SkewAdam eager 4 (fp32) / 9 "
        f"(bf16), SkewAdam C++ 0; bitsandbytes' fused kernel 0; torchao assumed 3); SkewAdam kernel here: {impl}",
        "one process: divide parameters, gradients and state by the shard count under FSDP/ZeRO-3; tensor bytes "
        "only: allocator caches and runtime workspaces are not included (on CPU, glibc's heap kept RSS 14-45% "
        "above this on small models unless MALLOC_MMAP_THRESHOLD_ is set, and oneDNN's bf16 matmuls added ~85 MB "
        "of their own buffers on a 25M-parameter model)",
    ]
    if unmodelled:
        assumptions.insert(0, f"no activation or peak estimate: {unmodelled}")
    return Plan(name, n_params, n_trainable, by_tier, param_dtype, batch, seq, k, rows, assumptions)


# ------------------------------------------------------------------------------------------------ measured peak
def build_optimizer(name: str, model: nn.Module, labels: Mapping[str, str], lr: float = 1e-4) -> torch.optim.Optimizer:
    """The real optimizer a `plan` row describes, for ``model`` labelled by ``labels`` (tier groups carry ``tier``,
    so `measure_state` reports per tier for torch optimizers too). Of the 8-bit rows, torchao's is built (it needs
    ``torchao``); bitsandbytes' is not."""
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n, t in labels.items() if t == tier], "tier": tier}
              for tier in (t.value for t in Tier) if tier in labels.values()]
    m = OPTIMIZERS.get(name)
    if m is not None and m.tiers is not None:
        from .optimizer import SkewAdam

        return SkewAdam([{**g, **m.tiers[g["tier"]]} for g in groups], lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr)
    if name == "adamw8bit-torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=lr)
    raise ValueError(f"cannot build {name!r}: use adamw, adafactor, adamw8bit-torchao or a skewadam variant of "
                     f"{list(OPTIMIZERS)}")


def _rss() -> int:
    """Resident set size of this process now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process's own address space, in bytes (``VmHWM``; Linux).

    Not ``getrusage(...).ru_maxrss``: Linux carries that across ``fork``/``exec``, so a process started by a large
    parent (a long pytest session, say) reports the parent's size as its own peak.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS is only measured on Linux")


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, batch: int, seq: int, steps: int) -> None:
    from .models import MoETransformer

    vocab = _config_value(model, ("vocab_size",))
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        tgt = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        out = model(idx, tgt) if isinstance(model, MoETransformer) else model(input_ids=idx, labels=tgt)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out


def _measure_here(spec: str, overrides: dict, optimizer: str, batch: int, seq: int, param_dtype: str,
                  device: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps in this process and return the measured peak growth (see `measure_peak`)."""
    import gc

    from .classify import classify
    from .presets import load_model

    dtype = _DTYPES[param_dtype]
    torch.manual_seed(0)
    # Warm up the same code paths on the tiny reference model, so that lazily loaded kernels and thread pools are
    # part of the baseline, not of the measurement.
    warm = load_model("tiny", device=device, dtype=dtype)
    _train_steps(warm, build_optimizer(optimizer, warm, classify(warm)), 2, 16, 2)
    del warm
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss()
    model = load_model(spec, device=device, dtype=dtype, overrides=overrides)
    _train_steps(model, build_optimizer(optimizer, model, classify(model)), batch, seq, steps)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss() - base
    return {"measured": peak, "method": "cuda max_memory_allocated" if device == "cuda" else "peak RSS growth"}


def measure_peak(
    spec: str,
    *,
    optimizer: str = "skewadam",
    batch: int = 1,
    seq: Optional[int] = None,
    param_dtype: str = "fp32",
    device: str = "cpu",
    steps: int = 2,
    overrides: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Measure the peak memory of real training steps and set it beside `plan`'s estimate.

    The model (``spec``: preset or ``config.json``, with config ``overrides``) is built on ``device`` and trained
    ``steps`` steps on random tokens. CPU: the growth of the peak resident set size (``VmHWM``) over the
    resident size after a warm-up, in a fresh Python process (the peak RSS of this one is not resettable). CUDA:
    ``torch.cuda.max_memory_allocated`` growth, in this process.

    The estimate assumes the SkewAdam kernel that ``impl="auto"`` selects on ``device`` (``impl`` in the result).

    Returns:
        ``{"measured", "estimate", "ratio" (measured / estimate), "method", "impl", ...}``, bytes.

    Example:
        >>> measure_peak("cpu", optimizer="adamw", batch=16, seq=128)["ratio"]
    """
    from .presets import load_model

    from . import kernels

    overrides = dict(overrides or {})
    meta = load_model(spec, device="meta", overrides=overrides)
    seq = _default_seq(meta) if seq is None else seq
    impl = "eager" if kernels.select("auto", torch.device(device)) is kernels.eager else "cpp"
    estimate = plan(meta, batch=batch, seq=seq, param_dtype=param_dtype, optimizers=[optimizer],
                    impl=impl)[optimizer].peak
    args = dict(spec=os.fspath(spec), overrides=overrides, optimizer=optimizer, batch=batch, seq=seq,
                param_dtype=param_dtype, device=device, steps=steps)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch.cuda.is_available() is False")
        result = _measure_here(**args)
    elif device == "cpu":
        # the child steps with the kernel the estimate assumes (not whatever "auto" finds there)
        proc = subprocess.run([sys.executable, "-m", "skewadam.memory", json.dumps(args)],
                              capture_output=True, text=True, check=False, env={**os.environ, "SKEWADAM_IMPL": impl})
        if proc.returncode:
            raise RuntimeError(f"measuring in a fresh process failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    return {**args, **result, "impl": impl, "estimate": estimate, "ratio": result["measured"] / estimate}


# ----------------------------------------------------------------------------------------------------------- CLI
def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="bytes of parameters, gradients, master weights and optimizer state, and an estimated peak, per optimizer",
        description="Plan the memory of training MODEL with AdamW, 8-bit AdamW, Adafactor, SkewAdam and its tier "
        "ablations. MODEL is a preset or a Hugging Face config.json (built on the meta device). The peak is an "
        "estimate; its assumptions are printed.",
    )
    p.add_argument("model", metavar="MODEL", help="a preset (e.g. paper-6.78b, mixtral-8x7b) or a config.json path")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: context length, <= 4096)")
    p.add_argument("--param-dtype", choices=sorted(_DTYPES), default="fp32", help="parameter/activation dtype")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: from the config)")
    p.add_argument("--impl", choices=["eager", "cpp"], default="eager",
                   help="SkewAdam kernel for its step temporaries: eager (GPUs; default) or cpp (the C++ CPU kernel)")
    p.add_argument("--optimizer", action="append", choices=list(OPTIMIZERS), default=None,
                   help="plan only these (repeatable; default all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (VALUE parsed as JSON), e.g. --set num_hidden_layers=4; repeatable")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    p.add_argument("--measure", metavar="OPTIMIZER", default=None,
                   help="also train real steps with OPTIMIZER (adamw, adafactor, skewadam...) and print the measured "
                   "peak beside the estimate (allocates the model!)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device for --measure")
    p.set_defaults(func=_cli_plan)


def _parse_sets(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. --set n_experts=64")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _cli_plan(args: argparse.Namespace) -> int:
    from .presets import load_model

    overrides = _parse_sets(args.set)
    try:
        model = load_model(args.model, device="meta", overrides=overrides)
        result = plan(model, batch=args.batch, seq=args.seq, param_dtype=args.param_dtype, top_k=args.top_k,
                      optimizers=args.optimizer, impl=args.impl)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"skewadam plan: {e}") from None
    result = dataclasses.replace(result, model=args.model)
    measured = None
    if args.measure:
        measured = measure_peak(args.model, optimizer=args.measure, batch=args.batch, seq=result.seq,
                                param_dtype=args.param_dtype, device=args.device, overrides=overrides)
    if args.json:
        out = result.to_dict()
        if measured:
            out["measured"] = measured
        print(json.dumps(out, indent=2))
    else:
        print(result)
        if measured:
            print(f"\nmeasured ({measured['method']}, {args.measure}, {args.device}): "
                  f"{format_bytes(measured['measured'])} ({measured['measured']:,} B) vs estimate "
                  f"{format_bytes(measured['estimate'])}: ratio {measured['ratio']:.3f}")
    return 0


if __name__ == "__main__":  # the fresh process of `measure_peak` on CPU
    print(json.dumps(_measure_here(**json.loads(sys.argv[1]))))
