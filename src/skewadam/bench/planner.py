r"""The memory planner: "will my MoE fit?"

`plan(model, ...)`: for each optimizer arm (`skewadam.bench.arms`: AdamW, 8-bit AdamW, Adafactor, SkewAdam and its tier
ablations and compact momentum), the parameter, gradient, master-weight and optimizer-state bytes of one training
process, and an *estimate* of its peak memory for a given batch, sequence length and parameter dtype. Planning only:
nothing is allocated (meta-device models work) and nothing trains (`skewadam.bench.measure` runs real steps).

SkewAdam's state is summed from `skewadam.state.state_spec` under the flags `skewadam.state.state_flags` resolves and
`skewadam.classify` labels, so the planner and the optimizer cannot disagree; its step temporaries are those the
backend it would run reports (``step_transient_bytes``). Step counters (``step``) are reported apart from the
statistics (moments), because the paper's figures count only the latter; ``total`` includes both.

Units: binary (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes; `skewadam.state.format_bytes`, the paper's "GB" are GiB);
exact byte counts are printed alongside.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..groups import orthogonal_flops, orthogonal_names
from ..kernels import BACKENDS, resolve_backend
from ..state import StateBytes, Tally, format_bytes
from ..tiers import Tier
from . import arms
from .zero_plan import ZeroPlan, zero_plan
from .activations import (TOP_K_KEYS, Segment, Unmodelled, activation_segments, backward_peak,
                          backward_peak_stepped, config_value)

__all__ = ["OptimizerPlan", "Plan", "plan", "format_bytes", "default_seq", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _plan_state(arm: arms.Arm, tensors: Sequence[tuple[tuple[int, ...], str, bool, Optional[int]]],
                dtype: torch.dtype) -> StateBytes:
    """The state ``arm`` allocates for trainable ``tensors`` ``[(shape, tier, orthogonal, experts), ...]`` stepped in
    ``dtype``."""
    tally = Tally()
    quantized = False
    for shape, tier, orth, experts in tensors:
        for key, st in arm.state(shape, tier, dtype, orth, experts):
            tally.tensors += 1
            tally.add(tier, key, st.nbytes)
            quantized |= st.dtype == torch.uint8
    if quantized and tensors:  # bitsandbytes' qmaps exist once 8-bit state does; counted with the first tier
        for key, st in arm.shared:
            tally.tensors += 1
            tally.add(tensors[0][1], key, st.nbytes)
    return tally.result()


def _in_flight(arm: arms.Arm, trainable: Sequence[tuple[str, tuple[int, ...], str]], orth: set[str],
               experts: dict[str, int], stepped: torch.dtype, backend: str, itemsize: int,
               segments: Sequence[Segment], tied: int) -> tuple[int, int, list[int]]:
    """For ``arm`` stepped inside backward: ``(most gradient bytes alive at once, largest one tensor's step
    temporaries, per segment its largest gradient with that gradient's step temporaries)``."""
    cache: dict[tuple, int] = {}
    own = {}
    for name, shape, tier in trainable:
        key = (shape, tier, name in orth, experts.get(name))
        if key not in cache:
            cache[key] = arm.transient([key], stepped, backend)
        own[name] = (math.prod(shape) * itemsize, cache[key])
    grads = max((g for g, _ in own.values()), default=0)
    for i, seg in enumerate(segments):
        between = tied if 0 < i < len(segments) - 1 else 0
        grads = max(grads, between + max((own[n][0] for n in seg.names), default=0))
    in_flight = [max((sum(own[n]) for n in seg.names), default=0) for seg in segments]
    return grads, max((t for _, t in own.values()), default=0), in_flight


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
    in_backward: bool = False  # stepped inside backward: ``grads`` is the most gradient bytes in flight, not all
    reduce_bytes: int = 0  # per rank and step under FSDP2 over `Plan.shards` ranks: its statistics' all-reduces
    newton_schulz_flops: int = 0  # per step: the orthogonal update's matmuls (`skewadam.groups.orthogonal_flops`)
    zero: Optional[ZeroPlan] = None  # per rank under DeepSpeed ZeRO (`Plan.zero`; SkewAdam's arms)

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
    backend: str = "auto"  # SkewAdam's backend, whose step temporaries the plan counts
    matmul_flops: Optional[int] = None  # the forward and backward's at batch x seq (`activation_segments`' rules)
    zero: Optional[int] = None  # a DeepSpeed ZeRO stage over `shards` ranks (`skewadam.bench.zero_plan`)

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
            f"{self.param_dtype} parameters, batch {self.batch} x seq {self.seq}{routing}; SkewAdam's backend: "
            f"{self.backend}",
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
            [n + (" (in backward)" if o.in_backward else ""), *("n/a" if c is None else format_bytes(c) for c in (
                o.params, o.grads, o.master, o.state.total, o.activations, o.step_temporaries, o.peak))]
            for n, o in self.optimizers.items()])
        for key, column, what in (
                ("reduce_bytes", "all-reduced", "all-reduces per step for the optimizer's statistics"),
                ("gather_bytes", "gathered", "receives per step to gather the orthogonal tier's matrices")):
            sent = {n: getattr(o, key) for n, o in self.optimizers.items() if getattr(o, key)}
            if sent:
                lines += ["", f"bytes each rank {what} (FSDP2 over {self.shards} ranks, Shard(0))"]
                lines += _table(["optimizer", column, "bytes"], [[n, format_bytes(b), f"{b:,}"]
                                                                  for n, b in sent.items()])
        zero = {n: o.zero for n, o in self.optimizers.items() if o.zero is not None}
        if zero:
            lines += ["", f"DeepSpeed ZeRO stage {self.zero} over {self.shards} ranks "
                          f"(skewadam.integrations.deepspeed): bytes per rank, state of the rank keeping the most"]
            lines += _table(["optimizer", "params", "master", "grads", "state", "state x ranks / one process",
                             "all-reduced per step", "all-reduces"], [
                [n, *map(format_bytes, (z.params, z.master, z.grads, z.state)),
                 f"{z.state_ranks / max(self.optimizers[n].state.total, 1):.3f}", f"{z.sent:,}", str(z.collectives)]
                for n, z in zero.items()])
        flops = {n: o.newton_schulz_flops for n, o in self.optimizers.items() if o.newton_schulz_flops}
        if flops:
            lines += ["", "compute beyond an Adam-style update: Newton-Schulz matmul FLOPs per step (each group's "
                          "iterations over every matrix it orthogonalises, on average over its interval; one process)"]
            if self.matmul_flops:
                fb = self.matmul_flops
                lines += [f"against the forward and backward's matmuls at batch {self.batch} x {self.seq}: {fb:.3g} "
                          "FLOPs (6 x the tokens each weight sees x its size, attention's T x T products left out); "
                          "share: of a training step's FLOPs, an estimate of its time at one FLOP rate for both"]
            lines += _table(["optimizer", "FLOPs", *(["x fwd+bwd", "share"] if self.matmul_flops else [])], [
                [n, f"{f:.3g}", *([f"{f / self.matmul_flops:.2f}x", f"{f / (f + self.matmul_flops):.0%}"]
                                  if self.matmul_flops else [])] for n, f in flops.items()])
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
    in_backward: bool = False,
    zero: Optional[int] = None,
) -> Plan:
    """Plan the memory of training ``model`` with each optimizer arm named (default `skewadam.bench.arms.PLAN_DEFAULT`).

    Args:
        model: an ``nn.Module`` (meta-device models work), a preset name or a ``config.json`` path
            (`skewadam.bench.presets.load_model`, built on the meta device).
        batch: sequences per step, for the activation estimate.
        seq: tokens per sequence, for the activation estimate (default: the model's context length, at most 4096).
        param_dtype: ``"fp32"`` or ``"bf16"``: parameters, gradients and activations. With bf16 the baselines keep
            an fp32 master copy (mixed precision); SkewAdam keeps none (stochastic rounding).
        top_k: experts per token; default from the model's config.
        optimizers: arm names (`skewadam.bench.arms`) with a memory model; default
            `skewadam.bench.arms.PLAN_DEFAULT`.
        labels: ``{parameter name: tier}``; default `skewadam.classify.classify(model)`.
        impl: SkewAdam's backend, which sets its step temporaries: a name of `skewadam.kernels.BACKENDS`,
            or ``"auto"``: the one SkewAdam runs on ``device`` where it is installed
            (`skewadam.kernels.resolve_backend` with ``build=False``: nothing is imported or built to plan it).
        device: where the model would train (default: ``"cpu"`` for ``impl="auto"``, else a device the backend
            runs on).
        shards: FSDP2 ranks (``Shard(0)`` on every tensor), for the bytes an orthogonal tier all-gathers per step
            (``gather_bytes``: its 2-D matrices' updates, the full matrix less the rank's shard; a bank sharded
            on its expert dim gathers nothing) and those SkewAdam's statistics add to all-reduces per step
            (``reduce_bytes``: per-tensor sums, a matrix's column sums, a flattened bank's per-expert sums, and the
            non-finite flag: one per tensor inside backward). State and memory stay those of one process.
        zero: a DeepSpeed ZeRO stage (1, 2 or 3) over ``shards`` ranks: SkewAdam's arms get per-rank figures
            (`skewadam.bench.zero_plan.ZeroPlan`: the weights, master, gradients and state a rank holds, what it
            all-reduces per step) in place of FSDP2's.
        in_backward: SkewAdam's arms step each tensor inside backward (``SkewAdam(..., in_backward=True)``, as the
            arm ``skewadam-in-backward`` always does): each gradient is freed as soon as backward completes it, so
            the peak holds the largest gradient one backward node produces at once (a tensor's, or a tied
            embedding's from the head to the lookup) with its step's temporaries, not every gradient.

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
    if device is None:  # "auto" plans for CPU; a named backend on a device it runs on
        device = (BACKENDS[impl].devices or ("cpu",))[0] if impl in BACKENDS else "cpu"
    device = torch.device(device)
    backend = resolve_backend(impl, device, build=False).name
    if batch < 1 or (seq is not None and seq < 1) or shards < 1:
        raise ValueError(f"batch={batch}, seq={seq}, shards={shards}: all must be >= 1")
    chosen = [arms.get(o) for o in (arms.PLAN_DEFAULT if optimizers is None else optimizers)]
    unmodelled_arms = [a.name for a in chosen if a.state is None]
    if unmodelled_arms:
        raise ValueError(f"no memory model of {unmodelled_arms}: plan any of {', '.join(arms.names(planned=True))}")
    from ..classify import label

    found = label(model) if labels is None else None  # labelled once: its tiers and flattened banks
    labels = {n: Tier.parse(t).value for n, t in (found.tiers if found is not None else labels).items()}
    dtype = DTYPES[param_dtype]
    itemsize = dtype.itemsize
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in labels]
    if missing:
        raise ValueError(f"labels miss trainable parameter(s) {missing[:5]}: label every one (skewadam.classify)")
    trainable = [(n, tuple(p.shape), labels[n]) for n, p in params.items() if p.requires_grad]
    if found is None:  # the flattened banks of a model labelled elsewhere: their E
        found = label(model, tiers={n: labels[n] for n, _, _ in trainable})
    experts = found.experts
    n_params = sum(p.numel() for p in params.values())
    n_trainable = sum(math.prod(s) for _, s, _ in trainable)
    by_tier = {t.value: 0 for t in Tier}
    for _, shape, tier in trainable:
        by_tier[tier] += math.prod(shape)
    seq = default_seq(model) if seq is None else seq
    k = top_k if top_k is not None else config_value(model, TOP_K_KEYS)
    try:
        segments, held, activations, tied = activation_segments(
            model, labels, tokens=batch * seq, itemsize=itemsize, top_k=k)
        bwd_peak, after_bwd = backward_peak(segments, held)
        unmodelled = None
    except Unmodelled as e:
        segments, held, tied, activations = [], 0, 0, None
        bwd_peak = after_bwd = None
        unmodelled = str(e)
    rows = {}
    for arm in chosen:
        master = n_trainable * 4 if (arm.master and itemsize < 4) else 0
        stepped = torch.float32 if master else dtype
        orth = set(orthogonal_names(model, labels, arm.orthogonal))
        tensors = [(shape, tier, n in orth, experts.get(n)) for n, shape, tier in trainable]
        state = _plan_state(arm, tensors, stepped)
        static = n_params * itemsize + master + state.total
        temporaries = arm.transient(tensors, stepped, backend)
        grads = n_trainable * itemsize
        peak = None if unmodelled else static + max(bwd_peak, after_bwd + temporaries)
        inside = arm.in_backward or (in_backward and arm.kernels)
        if inside:  # each gradient stepped and freed as backward completes it
            grads, temporaries, in_flight = _in_flight(arm, trainable, orth, experts, stepped, backend, itemsize,
                                                       segments, tied)
            peak = None if unmodelled else static + backward_peak_stepped(segments, held, in_flight, tied)
        # the update is gathered in the compute dtype (fp32 for 16-bit weights); an even share of it is the rank's own
        update_bytes = 4 if stepped.itemsize < 4 else stepped.itemsize
        gathered = sum(math.prod(s) for s, _, o, _ in tensors if o and len(s) == 2) * update_bytes * (
            shards - 1) // shards
        reduced, zero_figures = 0, None
        if zero:  # ZeRO's figures in place of FSDP2's; a step inside backward is refused under ZeRO
            gathered = 0
            if arm.kernels and not inside:
                zero_figures = zero_plan(arm, found, orth, stage=zero, ranks=shards, itemsize=itemsize)
        elif shards > 1 and arm.reduced is not None:  # and the 4-byte float32 flag that skips a non-finite step
            reduced = 4 * (len(trainable) if inside else 1) + sum(  # inside backward: a flag per tensor's step
                arm.reduced(shape, tier, stepped, n in orth, experts.get(n)) for n, shape, tier in trainable)
        flops = orthogonal_flops(model, arm.orthogonal, labels, defaults=arm.options,
                                 tier_options=dict(arm.tier_options)) if arm.orthogonal else 0
        rows[arm.name] = OptimizerPlan(arm.name, arm.label, n_params * itemsize, grads, master, state, activations,
                                       temporaries, peak, gathered, inside, reduced, flops, zero_figures)
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
        + f"; SkewAdam's backend: {backend} ({BACKENDS[backend].summary}: impl={impl!r} on {device.type})",
        "one process: divide parameters, gradients and state by the shard count under FSDP/ZeRO-3; tensor bytes "
        "only: allocator caches and runtime workspaces are not included (on CPU, glibc's heap kept RSS 14-45% "
        "above this on small models unless MALLOC_MMAP_THRESHOLD_ is set, and oneDNN's bf16 matmuls added ~81 MiB "
        "of their own buffers on a 25M-parameter model)",
    ]
    if zero:
        assumptions.append(f"ZeRO stage {zero}: DeepSpeed 0.19's partitions under its defaults (stages 1/2: each param "
                           f"group flattened in order, padded to {2 * shards} elements, cut in {shards}; stage 3: each "
                           f"tensor cut in {shards}); SkewAdam.from_model's groups, each stepped by one call; fp32 "
                           f"master weights; the orthogonal tier's cut matrices are sent whole to their owners")
    inside = [n for n, o in rows.items() if o.in_backward]
    if inside:
        assumptions.insert(1, f"in backward ({', '.join(inside)}): each gradient is stepped and freed as soon as "
                              "backward completes it; in flight: the largest gradient one backward node produces "
                              "(one tensor's: a stacked expert bank is one; a tied embedding's is held from the "
                              "head's backward to the lookup's) with its step's temporaries; 'grads' is the most "
                              "gradient bytes alive at once" + ("; the other optimizers step after backward"
                                                                 if len(inside) < len(rows) else ""))
    if unmodelled:
        assumptions.insert(0, f"no activation or peak estimate: {unmodelled}")
    return Plan(name, n_params, n_trainable, by_tier, param_dtype, batch, seq, k, rows, assumptions, shards, backend,
                sum(seg.flops for seg in segments) if segments else None, zero)
