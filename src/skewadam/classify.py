"""Automatic tiering: which parameters of an MoE model are ``backbone``, ``expert`` or ``router`` (data in, data out).

Tiers (`skewadam.tiers`):
    expert    the weights of ROUTED experts, each of which sees only the tokens routed to it: stacked banks
              ``[E, ...]``, per-expert modules of a list, per-expert biases.
    router    the module that scores the experts of each token: its weight, bias, and learned per-expert scales.
    backbone  everything else: attention, norms, embeddings, dense FFNs, SHARED experts (they see every token), and
              the many things called "gate" that are not routers (``gate_proj`` of a SwiGLU, attention output gates,
              forget gates, the sigmoid gate of a shared expert).

Structure decides, names come last. In order:
    1. User rules ``(pattern, tier)``: ``re.search`` on the full parameter name, first match wins.
    2. The model's own metadata: a Transformers config's expert-parallel plan (``base_model_ep_plan``: tensors marked
       ``grouped_gemm``, modules marked ``ep_dispatch_experts``), tensor-parallel ``moe_tp_experts`` modules, the
       experts classes Transformers decorates with ``use_experts_implementation``; and the marks libraries set on
       expert parameters: ``p.expert = True`` (fairscale, torchscale), ``p.allreduce = False`` (DeepSpeed,
       Megatron-LM), DeepSpeed's ``p.group_name`` and ``p.is_expert_group``. Marked tensors are experts.
    3. Shapes: an expert container is a module holding tensors with >= 3 dims stacked along dim 0 (``[E, ...]``,
       slices that are matrices), or >= 2 structurally identical sibling modules (a ``ModuleList``/``ModuleDict`` of
       expert MLPs). It is an MoE layer only next to a router, looked for in the container's module and up to three
       enclosing ones, nearest first, never in another layer of a layer stack (torchtitan: banks at
       ``moe.routed_experts.inner_experts``, router at ``moe.router.gate``). A router scores the E experts from a
       size D of the experts' weights: ``[E, D]`` (a ``Linear(D, E)``), flat ``[E*D]`` (OLMo-core), transposed
       ``[D, E]`` (``x @ w``), or ``[E, d]`` from a width foreign to the experts (a latent MoE); for declared experts
       also ``[E + s, D]`` (it scores shared or "skip" experts too), for marked ones ``[k*E, D]`` (this rank holds E
       of the experts). A candidate inside a block that maps its input back to a width it reads (its matrices'
       widths close a cycle, ``D -> F -> D``, as attention and MLPs do; or it holds convs, tables, banks) is a
       coincidence, not a router: a shared MLP whose rows divide ``E*F``, linear-attention projections with E rows;
       so is one whose output loose projections beside it map back to the width it reads (a latent MoE's up
       projection ``[D, L]``), and beside a latent MoE's ``D -> L -> D`` the router reads ``D``.
       The router is the module holding the matrix (every parameter: bias, per-expert scales, the first stage of a
       two-stage router as X-MoE's ``D -> 16 -> E``); banks ``[Eo, Ei, ...]`` also take the ``[Eo, D, Ei]`` second
       stage of a hierarchical router.
    4. Product-key experts (PEER, Doge's ``CDMoE``): ``E = k*k`` single-neuron experts as rows of ``Embedding(E, D)``
       tables next to a ``Linear(D, 2k)`` router whose two top-k pick them.
    5. Names, only inside a block already found by structure, with word-boundary rules: a child called ``experts``
       whose tensors flatten the experts (``[E*F, D]``, DBRX; ``[E*D, F]``, OLMo-core), E being the count the router
       gives that splits them into per-expert MLP matrices (`flattened_experts`); or, next to experts the metadata
       declares, a router called ``router``/``gate``/... when no matrix size reveals it. ``gate`` never matches
       ``gate_proj``; ``shared_experts`` never matches ``experts``.
Everything not labelled is backbone. Parameters with ``requires_grad=False`` are left out (`skewadam.groups.describe`
reports them); tied parameters appear once, under their first name. `label` returns all that tiering finds at once
(`Labels`: tiers, flattened experts, hidden matrices, output heads). Param groups and the census of the state they
cost are `skewadam.groups`.

Example:
    >>> from skewadam.bench.models import MoETransformer, get_config
    >>> labels = classify(MoETransformer(get_config("tiny")))
    >>> labels["blocks.1.moe.router.weight"], labels["blocks.1.moe.experts.w1"], labels["tok_emb.weight"]
    ('router', 'expert', 'backbone')
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Mapping, Optional, Sequence

from torch import Tensor, nn

from .structure import structure
from .tiers import Tier

__all__ = ["Labels", "label", "classify", "flattened_experts", "split_trainable", "hidden_matrices", "output_heads"]

Rules = Optional[Sequence[tuple[str, str]]]


# ----------------------------------------------------------------------------------------------------- labels
@dataclasses.dataclass(frozen=True)
class Labels:
    """All that automatic tiering says about a model, computed once by `label` and passed down (param groups, their
    census, the orthogonal groups), so that one call walks the model's structure once.

    Attributes:
        tiers: ``{name: tier}`` of every trainable parameter, in ``model.named_parameters()`` order (`classify`).
        experts: ``{name: E}`` of the flattened expert tensors, each stacking E experts along dim 0
            (`flattened_experts`).
        hidden: the hidden matrices (`hidden_matrices`), in parameter order.
        heads: the untied output heads (`output_heads`).
        trainable: ``{name: parameter}`` of the trainable parameters, tied ones once under their first name.
        frozen: ``{name: parameter}`` of the parameters with ``requires_grad=False``.
    """

    tiers: dict[str, str]
    experts: dict[str, int]
    hidden: tuple[str, ...]
    heads: tuple[str, ...]
    trainable: dict[str, Tensor]
    frozen: dict[str, Tensor]


def label(model: nn.Module, rules: Rules = None, *, tiers: Optional[Mapping[str, str]] = None) -> Labels:
    """Label ``model`` once: its tiers, flattened experts, hidden matrices and output heads (`Labels`).

    Args:
        model: any ``nn.Module`` (Transformers models, plain PyTorch, meta-device models).
        rules: ``(pattern, tier)`` pairs applied before the automatic tiers (`classify`).
        tiers: ``{name: tier}`` for every trainable parameter, instead of the automatic tiers and ``rules`` (labels
            made elsewhere); the rest follows from them.

    Example:
        >>> labels = label(model, rules=[(r"\\.shared_expert\\.", "expert")])
        >>> labels.tiers["blocks.1.moe.router.weight"], labels.hidden[:1]
        ('router', ('blocks.0.attn.wq.weight',))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected the model (an nn.Module), got {type(model).__name__}: tiers are read from the "
                        f"model's structure, so pass the model itself; for bare parameters use SkewAdam(params, "
                        f"tier='backbone'|'expert'|'router'), one param group per tier")
    trainable, frozen = split_trainable(model)
    found = structure(model)
    if tiers is None:
        tiers = _apply_rules(model, trainable, found.labels, rules)
    elif rules:
        raise ValueError("label(): pass rules or tiers, not both (tiers already decide every label)")
    else:
        tiers = _check_tiers(model, trainable, tiers)
    experts = {n: k for n, k in found.experts_in.items() if tiers.get(n) == Tier.EXPERT.value}
    hidden, heads = _hidden_and_heads(model, trainable, tiers)
    return Labels(tiers, experts, hidden, heads, trainable, frozen)


def classify(model: nn.Module, rules: Rules = None) -> dict[str, str]:
    """Label every trainable parameter of ``model`` ``"backbone"``, ``"expert"`` or ``"router"``.

    Args:
        model: any ``nn.Module`` (Transformers models, plain PyTorch, meta-device models).
        rules: ``(pattern, tier)`` pairs applied before the automatic labels; ``re.search`` on the full parameter
            name (anchor with ``^...$`` for a full match), first match wins. A rule matching no trainable
            parameter is an error.

    Returns:
        ``{parameter name: tier}`` in ``model.named_parameters()`` order, trainable parameters only (`label` gives
        the rest of what tiering finds).

    Example:
        >>> classify(model, rules=[(r"\\.shared_expert\\.", "expert")])
    """
    return dict(label(model, rules).tiers)


def flattened_experts(model: nn.Module, rules: Rules = None) -> dict[str, int]:
    """How many experts each flattened expert tensor of ``model`` stacks along dim 0: ``{name: E}``.

    Flattened banks keep E experts as one 2-D tensor, ``[E*D, F]`` / ``[E*F, D]`` (OLMo-core's ``MoEMLP``,
    DBRX), viewed ``[E, D, F]`` in the forward; E is the number of experts their router scores. `param_groups` gives
    such tensors a group with the key ``experts=E``. Stacked banks ``[E, ...]`` state E in their shape and are not
    listed; nor is a tensor that ``rules`` move out of the ``expert`` tier.

    Example:
        >>> flattened_experts(olmo_core_moe)["blocks.0.feed_forward_moe.experts.mlp.w1"]
        32
    """
    return dict(label(model, rules).experts)


def _apply_rules(model: nn.Module, trainable: dict[str, Tensor], auto: dict[str, str], rules: Rules) -> dict[str, str]:
    """Every trainable parameter's tier: the first of ``rules`` that matches its name, else structure's (``auto``)."""
    compiled = _compile_rules(rules)
    tiers: dict[str, str] = {}
    hits = [0] * len(compiled)
    for name in trainable:
        for i, (regex, tier) in enumerate(compiled):
            if regex.search(name):
                tiers[name] = tier
                hits[i] += 1
                break
        else:
            tiers[name] = auto.get(name, Tier.BACKBONE.value)
    unused = [rules[i] for i, n in enumerate(hits) if n == 0]  # type: ignore[index]
    if unused:
        raise ValueError(
            f"tier rule(s) {unused} match no trainable parameter of {type(model).__name__} (or every parameter they "
            f"match is claimed by an earlier rule); fix the pattern (re.search on names such as "
            f"{next(iter(trainable), '<none>')!r}) or drop the rule"
        )
    return tiers


def _check_tiers(model: nn.Module, trainable: dict[str, Tensor], tiers: Mapping[str, str]) -> dict[str, str]:
    """``tiers`` in parameter order, refused unless it labels every trainable parameter with a known tier."""
    missing = [n for n in trainable if n not in tiers]
    if missing:
        raise ValueError(f"labels miss trainable parameter(s) {missing[:5]} of {type(model).__name__}: label every "
                         f"one (skewadam.classify.classify gives them all)")
    out = {}
    for name in trainable:
        try:
            out[name] = Tier.parse(tiers[name]).value
        except ValueError as e:
            raise ValueError(f"labels[{name!r}]: {e}") from None
    return out


def split_trainable(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``({name: parameter}, {name: parameter})`` of the trainable and the frozen parameters (tied ones once)."""
    trainable, frozen = {}, {}
    for name, p in model.named_parameters():  # deduplicates tied parameters: first name wins
        (trainable if p.requires_grad else frozen)[name] = p
    return trainable, frozen


def _compile_rules(rules: Optional[Sequence[tuple[str, str]]]) -> list[tuple[re.Pattern, str]]:
    compiled = []
    for rule in rules or ():
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"tier rule {rule!r} must be a (pattern, tier) pair, e.g. (r'\\.router\\.', 'router')")
        pattern, tier = rule
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"tier rule {rule!r}: invalid regular expression ({e})") from None
        try:
            tier = Tier.parse(tier).value
        except ValueError as e:
            raise ValueError(f"tier rule {rule!r}: {e}") from None
        compiled.append((regex, tier))
    return compiled


# ------------------------------------------------------------------------------------------------ hidden matrices
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def hidden_matrices(model: nn.Module, labels: Optional[Mapping[str, str]] = None) -> list[str]:
    """Names of the hidden matrices of ``model``: the 2-D backbone weights that are not embeddings, the output
    head, norms, biases or the router, i.e. what Muon-style orthogonal updates are for (`skewadam.steppers`).

    Embeddings and heads are found by structure, never by a shape alone: embedding tables (``nn.Embedding``, or any
    module with ``num_embeddings``, ``embedding_dim`` and a 2-D ``weight``: Megatron's ``VocabParallelEmbedding``), any
    parameter tied to one, and the output heads (`output_heads`). ``labels`` are ``{name: tier}`` (`classify`'s,
    computed if not given); only ``backbone`` tensors qualify.

    Example:
        >>> hidden_matrices(MoETransformer(get_config("tiny")))[:2]
        ['blocks.0.attn.wq.weight', 'blocks.0.attn.wk.weight']
    """
    return list(_given(model, labels)[0])


def output_heads(model: nn.Module, labels: Optional[Mapping[str, str]] = None) -> list[str]:
    """Names of the untied output heads of ``model``: the matrices that produce the logits over the vocabulary.

    Where a module of the model answers ``get_output_embeddings()`` with a module (Transformers' LM heads), its
    weights are the heads. Otherwise a head is a backbone projection to the vocabulary (a matrix with an embedding
    table's row count V: the out_features of an ``nn.Linear``, either side of a bare parameter) outside the layers
    of the model's stacks (`_layers`) that ends the network: no other matrix of its unit has a side V, the unit being
    the largest module around it that holds no layers (the matrix alone when its own module holds some). So
    torchtitan's ``output`` and OLMo-core's ``lm_head.w_out`` are heads; a block's FFN or fused qkv of the
    table's shape is not, nor is anything when the head is tied to the table. A head whose unit also holds a matrix
    with a side V by coincidence is not found (it is then a hidden matrix). ``labels`` as for `hidden_matrices`.

    Example:
        >>> output_heads(torchtitan_qwen3_moe)  # torchtitan's Decoder: tok_embeddings, layers, norm, lm_head
        ['lm_head.weight']
    """
    return list(_given(model, labels)[1])


def _given(model: nn.Module, labels: Optional[Mapping[str, str]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(hidden matrices, output heads)`` under ``labels`` (the automatic ones if None)."""
    if labels is None:
        found = label(model)
        return found.hidden, found.heads
    trainable, _ = split_trainable(model)
    return _hidden_and_heads(model, trainable, _check_tiers(model, trainable, labels))


def _hidden_and_heads(model: nn.Module, trainable: dict[str, Tensor],
                      tiers: dict[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`hidden_matrices` and `output_heads` of ``model`` under ``tiers``."""
    heads = _output_heads(model, trainable, tiers)
    left_out = {id(w) for w in _tables(model)} | {id(trainable[n]) for n in heads}
    hidden = tuple(n for n, p in trainable.items()
                   if tiers[n] == Tier.BACKBONE.value and p.ndim == 2 and id(p) not in left_out)
    return hidden, tuple(heads)


def _output_heads(model: nn.Module, trainable: dict[str, Tensor], tiers: dict[str, str]) -> list[str]:
    tables = {id(w) for w in _tables(model)}
    declared = [m for m in model.modules() if callable(getattr(m, "get_output_embeddings", None))]
    answered = [head for head in (m.get_output_embeddings() for m in declared) if isinstance(head, nn.Module)]
    if answered:
        found = {id(p) for head in answered for p in head.parameters() if p.ndim >= 2 and id(p) not in tables}
        return [n for n, p in trainable.items() if id(p) in found]
    expert_ids = {id(p) for n, p in trainable.items() if tiers[n] == Tier.EXPERT.value}
    sizes = {w.shape[0] for w in _tables(model) if id(w) not in expert_ids}  # product-key experts' tables aside
    modules = dict(model.named_modules())
    layers = _layers(modules)
    stacked = {a for path in layers for a in _ancestors(path)[1:]}  # the modules that hold layers
    heads = []
    for name, p in trainable.items():
        if tiers[name] != Tier.BACKBONE.value or p.ndim != 2 or id(p) in tables:
            continue
        owner, _, local = name.rpartition(".")
        vocab = {p.shape[0]} if isinstance(modules[owner], nn.Linear) and local == "weight" else set(p.shape)
        if not vocab & sizes or any(a in layers for a in _ancestors(owner)):
            continue  # inside a layer of a stack: a block's matrix (a fused qkv as wide as the vocabulary), not a head
        if any(_ends_unit(modules, stacked, owner, p, v, tables) for v in vocab & sizes):
            heads.append(name)
    return heads


def _ancestors(path: str) -> list[str]:
    """``path`` and every module above it, the root ``""`` last."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _tables(model: nn.Module) -> list[Tensor]:
    """The weight of every embedding table: a module that looks rows up in a 2-D ``weight``."""
    return [m.weight for m in model.modules()
            if isinstance(getattr(m, "weight", None), Tensor) and m.weight.ndim == 2
            and all(isinstance(getattr(m, a, None), int) for a in ("num_embeddings", "embedding_dim"))]


def _layers(modules: dict[str, nn.Module]) -> set[str]:
    """Paths of the layers of stacks: composite modules (with a child holding parameters: a block, an MLP) that are
    elements of a ``ModuleList``, or one of >= 2 children of a class in a ``ModuleDict``/``Sequential``."""
    out = set()
    for path, m in modules.items():
        if isinstance(m, _CONTAINERS):
            classes = collections.Counter(type(c) for c in m.children())
            for key, c in m.named_children():
                if any(next(g.parameters(), None) is not None for g in c.children()) and (
                        isinstance(m, nn.ModuleList) or classes[type(c)] >= 2):
                    out.add(f"{path}.{key}" if path else key)
    return out


def _ends_unit(modules: dict[str, nn.Module], stacked: set[str], owner: str, p: Tensor, vocab: int,
               tables: set[int]) -> bool:
    """Whether ``p``, held by the module at ``owner``, is the only matrix with a side ``vocab`` in its unit: the
    largest module around it that holds no layers (``stacked``), or ``p`` alone if ``owner`` holds some."""
    if owner in stacked:
        return True
    unit = owner
    while unit and unit.rpartition(".")[0] not in stacked:
        unit = unit.rpartition(".")[0]
    return not any(q is not p and id(q) not in tables and q.ndim >= 2 and vocab in q.shape
                   for q in modules[unit].parameters())
