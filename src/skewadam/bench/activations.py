"""The planner's activation model: what one training step of a language model keeps for backward, segment by
segment in forward order (`activation_segments`), and the most bytes alive during its backward, with every gradient
held (`backward_peak`) or each stepped and freed as it completes (`backward_peak_stepped`). An estimate from the
parameters' shapes, no tracing; its rules are `activation_segments`'s."""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional, Sequence

from torch import nn

from ..state import is_bank
from ..tiers import Tier

__all__ = ["Segment", "Unmodelled", "activation_segments", "backward_peak", "backward_peak_stepped", "config_value",
           "TOP_K_KEYS"]


class Segment(NamedTuple):
    """A stretch of the network in forward order: what its forward keeps for backward, the parameter gradients its
    backward creates, the bytes alive only while its backward runs, the trainable parameters whose gradients
    its backward completes (a tied embedding's: the lookup's segment), and its forward and backward's matmul FLOPs."""

    saved: int
    grads: int
    transient: int
    names: tuple[str, ...] = ()
    flops: int = 0


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


TOP_K_KEYS = ("top_k", "num_experts_per_tok", "experts_per_token", "moe_top_k", "num_selected_experts")
N_EXPERT_KEYS = ("n_experts", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class Unmodelled(Exception):
    """The activation estimate does not apply to this model (the reason is the message)."""


def activation_segments(
    model: nn.Module, labels: Mapping[str, str], *, tokens: int, itemsize: int, top_k: Optional[int]
) -> tuple[list[Segment], int, int, int]:
    """``(segments, held, saved, tied)`` of one training step of a language model over ``tokens`` tokens; ``tied``:
    the bytes of a tied embedding's gradient (begun by the head's backward, completed by the lookup's).

    Rules (an estimate, no tracing): every matrix multiply keeps about its input and its output for backward, so a
    weight ``[out, in]`` that sees ``n`` tokens costs ``n * (in + out)`` activations (attention scores are not
    stored: flash/SDPA attention); a routed expert sees ``tokens * top_k / n_experts`` tokens; embeddings keep their
    output; the LM head keeps its input, the logits (``held``: the caller's output keeps them through the step) and
    the fp32 log-softmax of the loss, and its backward briefly holds two fp32 gradients of the logits. A tied
    embedding's gradient is created by the head, and its lookup's backward briefly holds two of them.
    Segments: embeddings, each block of the largest ``nn.ModuleList``, then the head. FLOPs: ``6 n in out`` per
    weight (forward 2, backward 4), the head's too; attention's ``T x T`` products are left out.
    """
    vocab = config_value(model, ("vocab_size",))
    if vocab is None:
        raise Unmodelled(f"{type(model).__name__} has no config.vocab_size (activations are modelled for LMs)")
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
    saved, grads, biggest, flops = ([0] * (n_layers + 2) for _ in range(4))
    completes: list[list[str]] = [[] for _ in range(n_layers + 2)]
    for name, p in names.items():
        s = seg_of[name]
        if p.requires_grad:
            grads[head_seg if p is head_w else s] += p.numel() * itemsize
            completes[s].append(name)
        if p.ndim < 2 or id(p) in embeds or p is head_w:
            continue
        if labels.get(name) == Tier.EXPERT.value:
            k = top_k if top_k is not None else config_value(model, TOP_K_KEYS)
            if k is None:
                raise Unmodelled(f"{type(model).__name__}: experts per token unknown; pass top_k")
            if is_bank(p.ndim, Tier.EXPERT.value, None):
                n_tok = tokens * k * math.prod(p.shape[1:-2])  # the bank's slices share the routed tokens
            else:
                n_experts = routers.get(s) or config_value(model, N_EXPERT_KEYS)
                if n_experts is None:
                    raise Unmodelled(f"{name}: no router in its block and no config.num_experts")
                n_tok = tokens * k * math.prod(p.shape[:-2]) / n_experts
        else:
            n_tok = tokens * math.prod(p.shape[:-2])
        saved[s] += int(n_tok * (p.shape[-2] + p.shape[-1]) * itemsize)
        flops[s] += int(6 * n_tok * p.shape[-2] * p.shape[-1])
        biggest[s] = max(biggest[s], int(n_tok * max(p.shape[-2:]) * itemsize))
    logits, fp32_logits = tokens * vocab * itemsize, tokens * vocab * 4
    saved[0] += tokens * d_model * itemsize  # the embedding output
    saved[-1] += tokens * d_model * itemsize + fp32_logits  # head input, log-softmax output
    flops[-1] += 6 * tokens * vocab * d_model
    lookup = (1 + tied) * vocab * d_model * itemsize
    head_transient = 2 * fp32_logits + (logits if itemsize != 4 else 0)  # + the cast back, for 16-bit logits
    transients = [lookup] + [2 * biggest[i] for i in range(1, n_layers + 1)] + [head_transient]
    segments = [Segment(saved[i], grads[i], transients[i], tuple(completes[i]), flops[i]) for i in range(n_layers + 2)]
    tied_bytes = head_w.numel() * itemsize if tied and head_w.requires_grad else 0
    return segments, logits, sum(saved) + logits, tied_bytes


def backward_peak(segments: Sequence[Segment], held: int) -> tuple[int, int]:
    """``(peak, after)``: the most bytes alive during backward, and those left after it (held + all gradients)."""
    mem = held + sum(s.saved for s in segments)
    peak = mem
    for seg in reversed(segments):
        peak = max(peak, mem + seg.transient)
        mem += seg.grads
        peak = max(peak, mem)
        mem -= seg.saved
    return peak, mem


def backward_peak_stepped(segments: Sequence[Segment], held: int, in_flight: Sequence[int], tied: int) -> int:
    """The most bytes alive during a backward that steps and frees each gradient as it completes (an optimizer
    stepped inside backward): a segment's backward holds its transients or ``in_flight[i]`` (its largest gradient
    with that gradient's step temporaries), whichever is more, and a ``tied`` embedding's gradient is held from the
    head's backward to the lookup's (whose transients count it)."""
    mem = held + sum(s.saved for s in segments)
    peak = mem
    for i in range(len(segments) - 1, -1, -1):
        between = tied if 0 < i < len(segments) - 1 else 0
        peak = max(peak, mem + between + max(segments[i].transient, in_flight[i]))
        mem -= segments[i].saved
    return peak
