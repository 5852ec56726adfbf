r"""The memory planner: "will my MoE fit?"

`plan(model, ...)`: for each optimizer arm (`skewadam.bench.arms`: AdamW, 8-bit AdamW, Adafactor, SkewAdam and its tier
ablations and compact momentum), the parameter, gradient, master-weight and optimizer-state bytes of one training
process, and an *estimate* of its peak memory for a given batch, sequence length and parameter dtype. Planning only:
nothing is allocated (meta-device models work) and nothing trains (`skewadam.bench.measure` runs real steps).

SkewAdam's state is summed from `skewadam.state.state_spec` under the flags `skewadam.state.state_flags` resolves and
`skewadam.classify` labels, so the planner and the optimizer cannot disagree; its step temporaries are those the
kernel it would run reports (``step_transient_bytes``). Step counters (``step``) are reported apart from the
statistics (moments), because the paper's figures count only the latter; ``total`` includes both.

Units: binary (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes; `skewadam.state.format_bytes`, the paper's "GB" are GiB);
exact byte counts are printed alongside.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from ..groups import orthogonal_names
from ..kernels import BACKENDS
from ..state import StateBytes, Tally, format_bytes, is_bank
from ..tiers import Tier
from . import arms

__all__ = ["OptimizerPlan", "Plan", "plan", "kernel_for", "format_bytes", "config_value", "default_seq", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _plan_state(arm: arms.Arm, tensors: Sequence[tuple[tuple[int, ...], str, bool]], dtype: torch.dtype) -> StateBytes:
    """The state ``arm`` allocates for trainable ``tensors`` ``[(shape, tier, orthogonal), ...]`` stepped in
    ``dtype``."""
    tally = Tally()
    quantized = False
    for shape, tier, orth in tensors:
        for key, st in arm.state(shape, tier, dtype, orth):
            tally.tensors += 1
            tally.add(tier, key, st.nbytes)
            quantized |= st.dtype == torch.uint8
    if quantized and tensors:  # bitsandbytes' qmaps exist once 8-bit state does; counted with the first tier
        for key, st in arm.shared:
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


def config_value(model: nn.Module, keys: Sequence[str]) -> Optional[int]:
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
    vocab = config_value(model, ("vocab_size",))
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
            k = top_k if top_k is not None else config_value(model, _TOP_K_KEYS)
            if k is None:
                raise _Unmodelled(f"{type(model).__name__}: experts per token unknown; pass top_k")
            if is_bank(p.ndim, Tier.EXPERT.value, None):
                n_tok = tokens * k * math.prod(p.shape[1:-2])  # the bank's slices share the routed tokens
            else:
                n_experts = routers.get(s) or config_value(model, _N_EXPERT_KEYS)
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
    gather_bytes: int = 0  # per rank and step under FSDP2 over `Plan.shards` ranks: the orthogonal tier's all-gathers

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
    shards: int = 1
    kernel: str = "auto"  # SkewAdam's kernel backend whose step temporaries the plan counts (`kernel_for`)

    def __getitem__(self, name: str) -> OptimizerPlan:
        return self.optimizers[arms.get(name).name]

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
            f"{self.param_dtype} parameters, batch {self.batch} x seq {self.seq}{routing}; SkewAdam's kernel: "
            f"{self.kernel}",
            "units: KiB = 2^10 bytes, MiB = 2^20 bytes, GiB = 2^30 bytes",
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
        if any(o.gather_bytes for o in self.optimizers.values()):
            lines += ["", f"bytes each rank receives per step to gather the orthogonal tier's matrices (FSDP2 over "
                          f"{self.shards} ranks, Shard(0))"]
            lines += _table(["optimizer", "gathered", "bytes"], [
                [n, format_bytes(o.gather_bytes), f"{o.gather_bytes:,}"] for n, o in self.optimizers.items()
                if o.gather_bytes])
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


def _here(device: torch.device) -> bool:
    """Whether this machine has ``device``'s type (so `skewadam.kernels.resolve` can check what runs on it)."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def kernel_for(impl: str = "auto", device: Optional[Union[str, torch.device]] = None) -> tuple[str, str]:
    """The kernel backend whose step temporaries a plan counts for SkewAdam, and why: ``(name, reason)``.

    ``impl`` a backend's name: that one (its temporaries are counted on any machine; a ``device`` it does not run on
    is refused). ``"auto"``: what SkewAdam would run on ``device`` (default CPU): `skewadam.kernels.resolve`'s choice
    where this machine has the device (it checks that the backend builds or imports, and honours ``SKEWADAM_IMPL``),
    else the backend ``SKEWADAM_IMPL`` names or ``auto`` prefers on that device type (`skewadam.kernels.Backend.auto`),
    as a machine that has it would run.

    Example:
        >>> kernel_for("auto", "cpu")[0]   # 'cpp' where the C++ kernel builds, else 'eager'
        >>> kernel_for("auto", "cuda")[0]  # 'triton'
    """
    from ..kernels import IMPLS, resolve

    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {', '.join(IMPLS)}")
    if impl != "auto":
        if device is not None and not BACKENDS[impl].runs_on(device):
            raise ValueError(f"impl={impl!r} ({BACKENDS[impl].summary}) does not run on {torch.device(device).type} "
                             f"tensors: "
                             f"use impl='auto' or another of {', '.join(IMPLS)}")
        return impl, f"impl={impl!r}"
    device = torch.device("cpu" if device is None else device)
    if _here(device):
        return resolve("auto", device).name, f"what SkewAdam runs on {device.type} here"
    env = os.environ.get("SKEWADAM_IMPL", "auto")
    if env != "auto":
        return kernel_for(env, device)[0], f"SKEWADAM_IMPL={env}"
    name = next(b.name for b in BACKENDS.values() if device.type in b.auto or b.devices is None)
    return name, f"what SkewAdam runs on {device.type} where it is installed (no {device.type} device here)"


def default_seq(model: nn.Module) -> int:
    n = config_value(model, ("block_size", "max_position_embeddings", "n_positions", "max_seq_len"))
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
    impl: str = "auto",
    device: Optional[Union[str, torch.device]] = None,
    shards: int = 1,
) -> Plan:
    """Plan the memory of training ``model`` with each optimizer arm named (default `skewadam.bench.arms.PLAN_DEFAULT`).

    Args:
        model: an ``nn.Module`` (meta-device models work), a preset name or a ``config.json`` path
            (`skewadam.bench.presets.load_model`, built on the meta device).
        batch, seq: sequences per step and tokens per sequence, for the activation estimate (``seq`` defaults to
            the model's context length, at most 4096).
        param_dtype: ``"fp32"`` or ``"bf16"``: parameters, gradients and activations. With bf16 the baselines keep
            an fp32 master copy (mixed precision); SkewAdam keeps none (stochastic rounding).
        top_k: experts per token; default from the model's config.
        optimizers: arm names (`skewadam.bench.arms`) with a memory model; default
            `skewadam.bench.arms.PLAN_DEFAULT`.
        labels: ``{parameter name: tier}``; default `skewadam.classify.classify(model)`.
        impl: SkewAdam's kernel backend, which sets its step temporaries: a name of `skewadam.kernels.BACKENDS`,
            or ``"auto"``: the one SkewAdam would run on ``device`` (`kernel_for`).
        device: where the model would train, for ``impl="auto"`` (default ``"cpu"``).
        shards: FSDP2 ranks (``Shard(0)`` on every tensor), for the bytes an orthogonal tier all-gathers per step
            (``gather_bytes``: its 2-D matrices' updates, the full matrix less the rank's shard; a bank sharded
            on its expert dim gathers nothing). State and memory stay those of one process.

    Example:
        >>> print(plan("paper-6.78b"))
        >>> plan(model, batch=8, seq=1024, param_dtype="bf16")["skewadam"].peak
    """
    if isinstance(model, (str, os.PathLike)):
        from .presets import load_model

        name, model = os.fspath(model), load_model(model, device="meta")
    else:
        name = _model_name(model)
    if param_dtype not in DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r}: use one of {sorted(DTYPES)}")
    kernel, why = kernel_for(impl, device)
    if batch < 1 or (seq is not None and seq < 1) or shards < 1:
        raise ValueError(f"batch={batch}, seq={seq}, shards={shards}: all must be >= 1")
    chosen = [arms.get(o) for o in (arms.PLAN_DEFAULT if optimizers is None else optimizers)]
    unmodelled_arms = [a.name for a in chosen if a.state is None]
    if unmodelled_arms:
        raise ValueError(f"no memory model of {unmodelled_arms}: plan any of {', '.join(arms.names(planned=True))}")
    if labels is None:
        from ..classify import classify

        labels = classify(model)
    labels = {n: Tier.parse(t).value for n, t in labels.items()}
    dtype = DTYPES[param_dtype]
    itemsize = dtype.itemsize
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in labels]
    if missing:
        raise ValueError(f"labels miss trainable parameter(s) {missing[:5]}: label every one (skewadam.classify)")
    trainable = [(n, tuple(p.shape), labels[n]) for n, p in params.items() if p.requires_grad]
    n_params = sum(p.numel() for p in params.values())
    n_trainable = sum(math.prod(s) for _, s, _ in trainable)
    by_tier = {t.value: 0 for t in Tier}
    for _, shape, tier in trainable:
        by_tier[tier] += math.prod(shape)
    seq = default_seq(model) if seq is None else seq
    k = top_k if top_k is not None else config_value(model, _TOP_K_KEYS)
    try:
        segments, held, activations = _activation_segments(
            model, labels, tokens=batch * seq, itemsize=itemsize, top_k=k)
        bwd_peak, after_bwd = _backward_peak(segments, held)
        unmodelled = None
    except _Unmodelled as e:
        activations = bwd_peak = after_bwd = None
        unmodelled = str(e)
    rows = {}
    for arm in chosen:
        master = n_trainable * 4 if (arm.master and itemsize < 4) else 0
        stepped = torch.float32 if master else dtype
        orth = set(orthogonal_names(model, labels, arm.orthogonal))
        tensors = [(shape, tier, n in orth) for n, shape, tier in trainable]
        state = _plan_state(arm, tensors, stepped)
        static = n_params * itemsize + master + state.total
        temporaries = arm.transient(tensors, stepped, kernel)
        peak = None if unmodelled else static + max(bwd_peak, after_bwd + temporaries)
        # the update is gathered in the compute dtype (fp32 for 16-bit weights); an even share of it is the rank's own
        update_bytes = 4 if stepped.itemsize < 4 else stepped.itemsize
        gathered = sum(math.prod(s) for s, _, o in tensors if o and len(s) == 2) * update_bytes * (shards - 1) // shards
        rows[arm.name] = OptimizerPlan(arm.name, arm.label, n_params * itemsize, n_trainable * itemsize, master, state,
                                       activations, temporaries, peak, gathered)
    counted: dict[str, list[str]] = {}
    for arm in chosen:
        counted.setdefault(arm.temporaries, []).append(arm.name)
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
        "step temporaries: " + "; ".join(f"{', '.join(ns)}: {how}" for how, ns in counted.items())
        + f"; SkewAdam's kernel: {kernel} ({BACKENDS[kernel].summary}: {why})",
        "one process: divide parameters, gradients and state by the shard count under FSDP/ZeRO-3; tensor bytes "
        "only: allocator caches and runtime workspaces are not included (on CPU, glibc's heap kept RSS 14-45% "
        "above this on small models unless MALLOC_MMAP_THRESHOLD_ is set, and oneDNN's bf16 matmuls added ~81 MiB "
        "of their own buffers on a 25M-parameter model)",
    ]
    if unmodelled:
        assumptions.insert(0, f"no activation or peak estimate: {unmodelled}")
    return Plan(name, n_params, n_trainable, by_tier, param_dtype, batch, seq, k, rows, assumptions, shards, kernel)
