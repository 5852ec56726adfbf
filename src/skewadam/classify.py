"""Automatic tiering: which parameters of an MoE model are ``backbone``, ``expert`` or ``router``.

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
       coincidence, not a router: a shared MLP whose rows divide ``E*F``, linear-attention projections with E rows.
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
Everything not labelled is backbone. Parameters with ``requires_grad=False`` are left out (`describe` reports them);
tied parameters appear once, under their first name.

Example:
    >>> from skewadam.models import MoETransformer, get_config
    >>> labels = classify(MoETransformer(get_config("tiny")))
    >>> labels["blocks.1.moe.router.weight"], labels["blocks.1.moe.experts.w1"], labels["tok_emb.weight"]
    ('router', 'expert', 'backbone')
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import math
import re
import warnings
from typing import Any, Iterable, Optional, Sequence

from torch import Tensor, nn

from .state import is_bank, spec_nbytes, state_spec
from .tiers import TIER_STATE, Tier

__all__ = ["classify", "flattened_experts", "describe", "param_groups", "split_kwargs", "Census", "TierCensus",
           "register_cli"]

logger = logging.getLogger("skewadam")

_TIERS = tuple(t.value for t in Tier)
# Attribute names of children that hold routed experts / score them: the last resort, inside a structural block.
_EXPERTS_NAME = re.compile(r"^(experts?|moe_experts|routed_experts)$")
_ROUTER_NAME = re.compile(r"^(router|gate|gating|wg|classifier|router_gate|moe_gate)$")
# Metadata values that mark routed-expert tensors / modules in Transformers' parallel plans.
_EP_TENSOR = {"grouped_gemm"}
_EP_MODULE = {"ep_dispatch_experts", "moe_tp_experts"}
_LIST_TYPES = (nn.ModuleList, nn.ModuleDict)


# ----------------------------------------------------------------------------------------------------- classify
def classify(model: nn.Module, rules: Optional[Sequence[tuple[str, str]]] = None) -> dict[str, str]:
    """Label every trainable parameter of ``model`` ``"backbone"``, ``"expert"`` or ``"router"``.

    Args:
        model: any ``nn.Module`` (Transformers models, plain PyTorch, meta-device models).
        rules: ``(pattern, tier)`` pairs applied before the automatic labels; ``re.search`` on the full parameter
            name (anchor with ``^...$`` for a full match), first match wins. A rule matching no trainable
            parameter is an error.

    Returns:
        ``{parameter name: tier}`` in ``model.named_parameters()`` order, trainable parameters only.

    Example:
        >>> classify(model, rules=[(r"\\.shared_expert\\.", "expert")])
    """
    return _classify(model, rules)[0]


def flattened_experts(model: nn.Module, rules: Optional[Sequence[tuple[str, str]]] = None) -> dict[str, int]:
    """How many experts each flattened expert tensor of ``model`` stacks along dim 0: ``{name: E}``.

    Flattened banks keep E experts as one 2-D tensor, ``[E*D, F]`` / ``[E*F, D]`` (OLMo-core's ``MoEMLP``,
    DBRX), viewed ``[E, D, F]`` in the forward; E is the number of experts their router scores. `param_groups` gives
    such tensors a group with the key ``experts=E``. Stacked banks ``[E, ...]`` state E in their shape and are not
    listed; nor is a tensor that ``rules`` move out of the ``expert`` tier.

    Example:
        >>> flattened_experts(olmo_core_moe)["blocks.0.feed_forward_moe.experts.mlp.w1"]
        32
    """
    return _classify(model, rules)[1]


def _classify(
    model: nn.Module, rules: Optional[Sequence[tuple[str, str]]]
) -> tuple[dict[str, str], dict[str, int]]:
    """`classify`'s labels and `flattened_experts`' counts, from one pass over the structure."""
    trainable, _ = _split_trainable(model)
    compiled = _compile_rules(rules)
    structure = _structure(model)
    auto = structure.labels
    labels: dict[str, str] = {}
    hits = [0] * len(compiled)
    for name in trainable:
        for i, (regex, tier) in enumerate(compiled):
            if regex.search(name):
                labels[name] = tier
                hits[i] += 1
                break
        else:
            labels[name] = auto.get(name, Tier.BACKBONE.value)
    unused = [rules[i] for i, n in enumerate(hits) if n == 0]  # type: ignore[index]
    if unused:
        raise ValueError(
            f"tier rule(s) {unused} match no trainable parameter of {type(model).__name__} (or every parameter they "
            f"match is claimed by an earlier rule); fix the pattern (re.search on names such as "
            f"{next(iter(trainable), '<none>')!r}) or drop the rule"
        )
    experts = {n: k for n, k in structure.experts_in.items() if labels.get(n) == Tier.EXPERT.value}
    return labels, experts


def _split_trainable(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
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


# ----------------------------------------------------------------------------------------------- structure
_MAX_UP = 3  # how many enclosing modules above an expert container may hold its router (torchtitan: moe.router.gate)
_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # a stack of layers: the router search never climbs into one

# Router forms, strongest evidence first (`_router_fits`).
_ROWS, _FLAT, _TRANSPOSED, _LATENT, _EXTRA, _EXTRA_FOREIGN, _EP_LOCAL = range(7)


@dataclasses.dataclass
class _Container:
    """A module that may hold routed experts, before a router confirms it."""

    path: str  # the experts module: a bank owner, a ModuleList/ModuleDict of experts, or a child called `experts`
    experts: list[str]  # names of the parameters that are expert if confirmed
    counts: set[int]  # candidate numbers of experts
    dims: set[int]  # sizes of the expert weights (the router's input size must be one)
    declared: bool  # named by the model's metadata or marked by the library: stands without a router
    scopes: list[str]  # the blocks to look for the router in, nearest first: the container's parent is scopes[near]
    opaque: bool  # the router is never inside `path` (lists, named children); a bank's owner may hold it
    flat: bool = False  # experts flattened into 2-D tensors [E*F, D]: the count comes from the router
    splits: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # flat: {E: sizes of the per-expert slices}
    levels: tuple[int, ...] = ()  # (E_outer, E_inner) of banks [Eo, Ei, ...] chosen by a two-stage router
    marked: bool = False  # the library marks its tensors (`_marked_expert`): this rank may hold only some experts
    near: int = 0  # index in `scopes` of the container's parent: farther out, a router must not look like a block

    @property
    def tensors(self) -> int:
        return len(self.experts)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _within(name: str, path: str) -> bool:
    return not path or name == path or name.startswith(path + ".")


class _Model:
    """The module tree of a model with each parameter's canonical (first) name, indexed once."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        names = {id(p): n for n, p in model.named_parameters()}
        self.direct: dict[str, list[tuple[str, Tensor]]] = {path: [] for path in self.modules}
        for path, m in self.modules.items():
            for _, p in m.named_parameters(recurse=False):
                name = names.get(id(p))
                if name is not None and _parent(name) == path:  # a tied tensor belongs to its first owner only
                    self.direct[path].append((name, p))
        self.shape = {n: tuple(int(s) for s in p.shape) for v in self.direct.values() for n, p in v}

    def subtree(self, root: str) -> Iterable[str]:
        return (path for path in self.modules if _within(path, root))

    def params(self, root: str) -> list[str]:
        return [n for path in self.subtree(root) for n, _ in self.direct[path]]


@dataclasses.dataclass
class _Structure:
    """What structure says about a model: labels of the experts and routers found, and for each flattened expert
    tensor (``[E*F, D]``) the number of experts it stacks along dim 0."""

    labels: dict[str, str]
    experts_in: dict[str, int]


def _structure(model: nn.Module) -> _Structure:
    """Labels of the parameters structure (and scoped names) call expert or router (the rest is backbone), and the
    expert counts of flattened banks."""
    tree = _Model(model)
    declared_tensors, declared_modules = _declared_experts(tree)
    marked = {n for v in tree.direct.values() for n, p in v if _marked_expert(p)}
    labels: dict[str, str] = {}
    experts_in: dict[str, int] = {}
    for c in _find_containers(tree, declared_tensors, declared_modules, marked):
        if any(n in labels for n in c.experts):
            continue  # already part of a confirmed container (a bank inside a listed expert), or its router
        router = _find_router(tree, c, {n for n, t in labels.items() if t == Tier.EXPERT.value})
        if router is None and not c.declared:
            continue
        if c.flat and router is not None:
            k = min(router[1])
            experts_in.update((n, k) for n in c.experts)
        for n in c.experts:
            labels[n] = Tier.EXPERT.value
        for n in router[0] if router else ():
            labels.setdefault(n, Tier.ROUTER.value)
    for experts_, router_ in _product_key_experts(tree):
        for n in experts_:
            labels.setdefault(n, Tier.EXPERT.value)
        for n in router_:
            labels.setdefault(n, Tier.ROUTER.value)
    for n in declared_tensors | marked:
        labels[n] = Tier.EXPERT.value
    return _Structure(labels, experts_in)


def _product_key_experts(tree: _Model) -> list[tuple[list[str], list[str]]]:
    """Product-key experts (PEER; Transformers' Doge ``CDMoE``): ``E = k*k`` single-neuron experts stored as rows of
    ``Embedding(E, D)`` tables, chosen per token by two top-k over a ``Linear(D, 2*k)`` (or ``(D, k)``) router next
    to them. Returns ``[(expert tensor names, router tensor names)]``."""
    found = []
    for path, m in tree.modules.items():
        if not path:
            continue  # the token embedding lives at the root
        tables = [(_join(path, n), c) for n, c in m.named_children() if isinstance(c, nn.Embedding)]
        sizes = {c.num_embeddings for _, c in tables}
        if not tables or len(sizes) != 1:
            continue
        rows = sizes.pop()
        k = int(round(rows ** 0.5))
        if k < 2 or k * k != rows:
            continue
        width = {c.embedding_dim for _, c in tables}
        routers = [
            _join(path, n)
            for n, c in m.named_children()
            if isinstance(c, nn.Linear) and c.out_features in (k, 2 * k) and c.in_features in width
        ]
        if routers:
            experts = [n for t, _ in tables for n in tree.params(t)]
            found.append((experts, [n for r in routers for n in tree.params(r)]))
    return found


def _marked_expert(p: Tensor) -> bool:
    """Marks libraries set on routed-expert parameters: ``p.expert = True`` (fairscale, torchscale, fairseq),
    ``p.allreduce = False`` (DeepSpeed, Megatron-LM: reduced over the expert-data-parallel group only), DeepSpeed's
    ``p.group_name`` (its expert-parallel group) and ``p.is_expert_group = True`` (its grouped-GEMM banks)."""
    return (
        getattr(p, "expert", None) is True
        or getattr(p, "allreduce", None) is False
        or getattr(p, "is_expert_group", None) is True
        or isinstance(getattr(p, "group_name", None), str)
    )


def _declared_experts(tree: _Model) -> tuple[set[str], set[str]]:
    """Tensors and modules a Transformers model declares routed experts: its config's parallel plans (``layers.*.``
    patterns, matched as suffixes so one plan serves ``model.layers...`` and ``language_model.layers...``), and the
    experts classes Transformers decorates with ``use_experts_implementation``."""
    tensors: set[str] = set()
    mods: set[str] = set()
    seen: set[int] = set()
    for root, module in tree.modules.items():
        cfg = getattr(module, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for attr in ("base_model_ep_plan", "base_model_tp_plan"):
            plan = getattr(cfg, attr, None)
            for pattern, style in plan.items() if isinstance(plan, dict) else ():
                if not isinstance(style, str) or style not in _EP_TENSOR | _EP_MODULE:
                    continue
                regex = re.compile(r"(?:^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
                for path in tree.subtree(root):
                    if style in _EP_MODULE and regex.search(path):
                        mods.add(path)
                    elif style in _EP_TENSOR:
                        tensors.update(n for n, _ in tree.direct[path] if regex.search(n))
    for path, m in tree.modules.items():  # the decorator's marks
        if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate"):
            mods.add(path)
    return tensors, mods


def _is_torch_layer(m: nn.Module) -> bool:
    """Built-in torch layers (Conv, Linear, norms, ...) never hold an expert bank, even with 3-D weights."""
    return type(m).__module__.startswith("torch.nn.modules")


def _signature(m: nn.Module) -> tuple:
    return tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())


def _scopes(tree: _Model, path: str, own: bool) -> list[str]:
    """Where the router of experts at ``path`` may live, nearest first: (the bank's owner,) then up to `_MAX_UP`
    enclosing modules, never into a stack of layers (the router of one MoE block is not in another block)."""
    out = [path] if own else []
    for _ in range(_MAX_UP):
        if not path:
            break
        path = _parent(path)
        if isinstance(tree.modules[path], _STACKS):
            break
        out.append(path)
    return out


def _find_containers(
    tree: _Model, declared_tensors: set[str], declared_modules: set[str], marked: set[str]
) -> list[_Container]:
    """Every module that may hold routed experts: banks, lists of identical modules, a child called ``experts``
    holding flattened tensors. Containers the model's metadata declares, or whose tensors the library marks
    (`_marked_expert`), stand without a router."""
    out: list[_Container] = []
    for path, m in tree.modules.items():
        direct = tree.direct[path]
        declared = path in declared_modules or any(n in declared_tensors for n, _ in direct)
        # (a) a bank: tensors with >= 3 dims stacked along dim 0 (or >= 2, where the metadata says so), whose
        # slices are matrices (a depthwise conv's [C, 1, K] is not a stack of C experts)
        banks = [p for _, p in direct
                 if (p.ndim >= 3 and min(p.shape[1:]) >= 2 or (declared and p.ndim >= 2)) and p.shape[0] >= 2]
        if banks and (declared or not _is_torch_layer(m)):
            is_marked = any(n in marked for n, p in direct if p.ndim >= 3)
            counts = {p.shape[0] for p in banks}
            members = [n for n, p in direct if p.ndim >= 1 and p.shape[0] in counts]
            dims = _common_dims(p.shape[1:] for p in banks)
            levels = {tuple(p.shape[:2]) for p in banks if p.ndim >= 4}
            out.append(_Container(path, members, counts, dims, declared or is_marked, _scopes(tree, path, own=True),
                                  opaque=declared, levels=levels.pop() if len(levels) == 1 else (), marked=is_marked,
                                  near=1))
            continue
        # (b) a ModuleList/ModuleDict of >= 2 structurally identical modules
        if isinstance(m, _LIST_TYPES):
            sigs = [s for s in map(_signature, m.children()) if s]  # parameter-free children (dropout) aside
            if len(sigs) >= 2 and len(set(sigs)) == 1:
                inside = tree.params(path)
                is_marked = all(n in marked for n in inside)
                # names last: a list called `experts` is one even when no router picks its members (ViTPose++:
                # the dataset index does)
                declared = declared or is_marked or bool(_EXPERTS_NAME.match(path.rpartition(".")[2]))
                sig = sigs[0]
                dims = _common_dims(shape for _, shape, _ in sig if len(shape) >= 2) or {
                    s for _, shape, _ in sig for s in shape
                }
                out.append(_Container(path, inside, {len(sigs)}, dims, declared, _scopes(tree, path, own=False),
                                      opaque=True, marked=is_marked))
            continue
        # (c) names last: a child called `experts` whose tensors flatten the experts (DBRX, OLMo-core: [E*F, D]);
        # needs a router, which tells E
        if _EXPERTS_NAME.match(path.rpartition(".")[2]):
            inside = tree.params(path)
            flat = [n for n in inside if len(tree.shape[n]) == 2]
            if flat and all(len(tree.shape[n]) <= 2 for n in inside):  # banks below are found by (a)
                splits = _flat_splits([tree.shape[n] for n in flat])
                dims = set().union(*splits.values())
                out.append(_Container(path, flat, set(splits), dims, False, _scopes(tree, path, own=False),
                                      opaque=True, flat=True, splits=splits))
    # Innermost first: experts claim their tensors before an enclosing list of identical layers is considered; at
    # one depth the largest first (a bank before the second-stage router of a two-stage MoE beside it).
    out.sort(key=lambda c: (-c.path.count("."), -sum(math.prod(tree.shape[n]) for n in c.experts)))
    return out


def _common_dims(shapes: Iterable[Sequence[int]]) -> set[int]:
    """Sizes shared by all the shapes (the model width, for an up and a down projection); all sizes if none is."""
    sets = [set(int(s) for s in shape) for shape in shapes]
    if not sets:
        return set()
    return set.intersection(*sets) or set.union(*sets)


def _find_router(tree: _Model, c: _Container, experts: set[str]) -> Optional[tuple[list[str], set[int]]]:
    """The router of container ``c``: ``(its parameter names, the number(s) of experts it scores)`` or None.

    In the nearest scope that has one, the best-ranked tensors that fit a router of ``c`` (`_router_fits`): first
    those whose module does not feed its output back to the width it reads (`_block_like`: attention and MLPs do,
    a router ends in scores), then by form, then (flattened experts) by how cleanly E splits them."""
    excluded = set(c.experts) | experts
    for i, scope in enumerate(c.scopes):
        if scope not in tree.modules or (scope == c.path and c.opaque):
            continue
        cands = []  # (rank, name, n_experts, unit): lower rank is stronger evidence
        widths = {s for n in tree.params(scope) if n not in excluded and len(tree.shape[n]) >= 2 for s in tree.shape[n]}
        for owner in tree.subtree(scope):
            if isinstance(tree.modules[owner], nn.Embedding) or (c.opaque and _within(owner, c.path)):
                continue
            if owner != scope and _within(c.path, owner):
                continue  # a module enclosing the experts below the block: not the router
            for name, _ in tree.direct[owner]:
                fits = [] if name in excluded else _router_fits(tree.shape[name], c, widths)
                unit, child = _unit(tree, scope, owner, c) if fits else (owner, owner)
                for form, k, width in fits:
                    block_like = child != scope and _block_like(tree, child, width, form, excluded)
                    if block_like and (c.marked or not c.declared or i > c.near):
                        continue  # a coincidental shape in attention or an MLP beside the experts
                    rank = (block_like, *_split_misfit(c.splits[k], width), form) if c.flat else (block_like, form)
                    cands.append((rank, name, k, unit))
        if cands:
            best = min(r for r, _, _, _ in cands)
            params: list[str] = []
            counts: set[int] = set()
            for rank, name, k, unit in cands:
                if rank == best:
                    counts.add(k)
                    params.extend(_router_unit(tree, scope, unit, name, excluded, k))
            params.extend(_second_stage(tree, scope, c, excluded))
            return list(dict.fromkeys(params)), counts
        # names last, for experts the model's metadata declares: a router-named child of this block
        for child_name, child in tree.modules[scope].named_children() if c.declared else ():
            child_path = _join(scope, child_name)
            if _ROUTER_NAME.match(child_name) and not _within(c.path, child_path):
                params = [n for n in tree.params(child_path) if n not in excluded]
                if params:
                    return params, set(c.counts)
    return None


def _router_fits(shape: tuple[int, ...], c: _Container, widths: set[int]) -> list[tuple[int, int, int]]:
    """The ways a tensor of ``shape`` can be the router of ``c``: ``[(form, n_experts, input width)]``.

    Forms: ``[E, D]`` (a ``Linear(D, E)``), flat ``[E*D]`` (OLMo-core; a size no matrix of the block has, unlike a
    norm's or a bias's), transposed ``[D, E]`` (``x @ w``), ``[E, d]`` reading a width foreign to the experts (a
    latent MoE; needs a real bank of >= 2 tensors), ``[E + s, D]`` scoring shared or "skip" experts too (declared
    experts only), and ``[k*E_local, D]`` for marked experts of which this rank holds ``E_local`` (expert
    parallelism). ``D`` is a size of the experts' weights; ``widths`` are the sizes of the block's other matrices."""
    out = []
    if len(shape) == 1:
        for k in sorted(c.counts) if shape[0] not in widths else ():
            d, r = divmod(shape[0], k)
            if not r and d >= 2:
                if d in (c.splits[k] if c.flat else c.dims):
                    out.append((_FLAT, k, d))
                elif c.flat or c.tensors >= 2:
                    out.append((_LATENT, k, d))
        return out
    if len(shape) != 2:
        return out
    rows, cols = shape
    if c.flat:
        return [(_ROWS if cols in c.splits[rows] else _LATENT, rows, cols)] if rows in c.splits else []
    if rows in c.counts:
        if cols in c.dims:
            out.append((_ROWS, rows, cols))
        elif c.tensors >= 2:
            out.append((_LATENT, rows, cols))
    if cols in c.counts and rows in c.dims:
        out.append((_TRANSPOSED, cols, rows))
    for n in sorted(c.counts) if c.declared else ():
        if n < rows <= 2 * n:  # declared experts whose router also scores shared or "skip" experts
            out.append((_EXTRA if cols in c.dims else _EXTRA_FOREIGN, n, cols))
    for n in sorted(c.counts) if c.marked else ():
        if rows % n == 0 and rows > 2 * n and cols in c.dims:
            out.append((_EP_LOCAL, rows, cols))
    return out


def _flat_splits(shapes: list[tuple[int, ...]]) -> dict[int, set[int]]:
    """Every number of experts ``k >= 2`` that flattened 2-D tensors ``[k*a, b]`` may stack along dim 0, with the sizes
    of the per-expert matrices ``[a, b]`` it gives: an MLP's experts split into ``[F, D]`` and ``[D, F]``, 2 sizes."""
    g = math.gcd(*(rows for rows, _ in shapes))
    divisors = {d for i in range(1, math.isqrt(g) + 1) if g % i == 0 for d in (i, g // i)}
    return {
        k: {s for rows, cols in shapes for s in (rows // k, cols)}
        for k in sorted(divisors)
        if k >= 2 and all(rows // k >= 2 for rows, _ in shapes)
    }


def _split_misfit(sizes: set[int], width: int) -> tuple[bool, bool, int]:
    """How badly a number of experts splits flattened banks into per-expert matrices of ``sizes`` (`_flat_splits`),
    for a router reading ``width``, lowest best: an MLP's experts give at most two sizes, ``[F, D]`` and ``[D, F]``,
    one of them the router's width (``D``; not so in a latent MoE); then fewer sizes (``D == F`` gives one)."""
    mlp = len(sizes) <= 2
    return not (mlp and width in sizes), not mlp, len(sizes)


def _unit(tree: _Model, scope: str, owner: str, c: _Container) -> tuple[str, str]:
    """``(unit, child)`` of a router tensor held by ``owner`` in the block ``scope``: ``child`` is the largest module
    below ``scope`` that holds it but not the experts (a router, or the attention or MLP a coincidental shape sits
    in), and ``unit`` the module the router's parameters are taken from: ``child`` (its bias, per-expert scales, a
    router MLP), or ``owner`` when ``child`` is more than a router (it holds banks, convs, tables). Both are
    ``scope`` when the tensor sits on the block itself."""
    if owner == scope:
        return scope, scope
    child = owner
    while _parent(child) != scope and not _within(c.path, _parent(child)):
        child = _parent(child)
    return (owner if _heavy(tree, child) else child), child


def _block_like(tree: _Model, unit: str, width: int, form: int, excluded: set[str]) -> bool:
    """Whether ``unit`` is a block that maps its input back to a width it reads, as attention and MLPs do (their
    output returns to the residual stream), rather than ending in scores as a router does, one or two stages
    (X-MoE: ``D -> 16 -> E``). Read from the widths: each matrix ``[out, in]`` of the unit is an edge ``in -> out``,
    and a block closes a cycle (``D -> F -> D``; attention ``D -> H*hd -> D``). Units with convs, tables or banks
    are blocks too."""
    if _heavy(tree, unit):
        return True
    mats = [tree.shape[n] for n in tree.params(unit) if n not in excluded and len(tree.shape[n]) >= 2]
    if form == _TRANSPOSED:  # x @ w layouts: any other matrix of that width is part of a block
        return sum(width in shape for shape in mats) > 1
    edges: dict[int, set[int]] = collections.defaultdict(set)
    for shape in mats:
        edges[shape[-1]].add(shape[-2])
    return _has_cycle(edges)


def _has_cycle(edges: dict[int, set[int]]) -> bool:
    done: set[int] = set()
    for start in list(edges):
        stack, path = [(start, iter(edges[start]))], {start}
        while stack:
            node, succ = stack[-1]
            nxt = next(succ, None)
            if nxt is None:
                stack.pop()
                path.discard(node)
                done.add(node)
            elif nxt in path:
                return True
            elif nxt not in done:
                path.add(nxt)
                stack.append((nxt, iter(edges.get(nxt, ()))))
    return False


def _second_stage(tree: _Model, scope: str, c: _Container, excluded: set[str]) -> list[str]:
    """For banks ``[Eo, Ei, ...]`` the second-stage router beside the first: ``[Eo, D, Ei]`` tensors scoring the
    ``Ei`` experts within each of the ``Eo`` groups (the hierarchical MoE of Shazeer et al. 2017)."""
    if not c.levels:
        return []
    outer, inner = c.levels
    found = []
    for n in tree.params(scope):
        shape = tree.shape[n]
        if n in excluded or len(shape) != 3 or shape[0] != outer or inner not in shape[1:]:
            continue
        width = shape[2] if shape[1] == inner else shape[1]
        if width in c.dims:
            found.append(n)
    return found


def _router_unit(tree: _Model, scope: str, unit: str, name: str, excluded: set[str], n_experts: int) -> list[str]:
    """All parameters of the router: those of its `_unit`; when the tensor sits directly on the block, it and the
    block's other per-expert vectors ``[E]``."""
    if unit == scope:
        return [name] + [
            n for n, p in tree.direct[scope] if p.ndim == 1 and p.shape[0] == n_experts and n not in excluded
        ]
    return [n for n in tree.params(unit) if n not in excluded]


def _heavy(tree: _Model, root: str) -> bool:
    return any(
        isinstance(tree.modules[path], (nn.Embedding, nn.modules.conv._ConvNd))
        or any(p.ndim >= 3 for _, p in tree.direct[path])
        for path in tree.subtree(root)
    )


# ---------------------------------------------------------------------------------------------------- census
@dataclasses.dataclass
class TierCensus:
    """One tier's share of the model and what its optimizer state costs."""

    tensors: int
    params: int
    share: float  # of all trainable parameters
    state_bytes: int  # moments (exp_avg, exp_avg_sq, row_var, col_var), as `skewadam.state.state_spec` allocates
    counter_bytes: int  # step counts


@dataclasses.dataclass
class Census:
    """Per-tier counts of a model's trainable parameters, the optimizer state they cost, and the frozen ones."""

    tiers: dict[str, TierCensus]
    frozen_tensors: int
    frozen_params: int
    frozen_names: list[str]
    model: str = ""

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tiers.values())

    @property
    def state_bytes(self) -> int:
        return sum(t.state_bytes for t in self.tiers.values())

    @property
    def counter_bytes(self) -> int:
        return sum(t.counter_bytes for t in self.tiers.values())

    def table(self) -> str:
        """The census as a fixed-width table."""
        head = f"{'tier':<9} {'tensors':>8} {'params':>16} {'share':>7} {'state':>11} {'steps':>9}"
        lines = [f"SkewAdam tiers of {self.model}" if self.model else "SkewAdam tiers", head, "-" * len(head)]
        for tier, t in self.tiers.items():
            lines.append(
                f"{tier:<9} {t.tensors:>8,} {t.params:>16,} {t.share:>7.2%} {_bytes(t.state_bytes):>11} "
                f"{_bytes(t.counter_bytes):>9}"
            )
        lines.append("-" * len(head))
        total_t = sum(t.tensors for t in self.tiers.values())
        lines.append(
            f"{'total':<9} {total_t:>8,} {self.params:>16,} {1 if self.params else 0:>7.2%} "
            f"{_bytes(self.state_bytes):>11} {_bytes(self.counter_bytes):>9}"
        )
        if self.frozen_tensors:
            lines.append(f"frozen (requires_grad=False, not optimized): {self.frozen_tensors:,} tensors, "
                         f"{self.frozen_params:,} params")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tiers": {k: dataclasses.asdict(v) for k, v in self.tiers.items()},
            "params": self.params,
            "state_bytes": self.state_bytes,
            "counter_bytes": self.counter_bytes,
            "frozen": {"tensors": self.frozen_tensors, "params": self.frozen_params, "names": self.frozen_names},
        }


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def describe(
    model: nn.Module,
    rules: Optional[Sequence[tuple[str, str]]] = None,
    tier_options: Optional[dict[str, dict[str, Any]]] = None,
    *,
    labels: Optional[dict[str, str]] = None,
) -> Census:
    """Census of ``model`` under SkewAdam: per tier the tensors, parameters, share and optimizer-state bytes.

    State bytes are those `skewadam.state.state_spec` allocates for each parameter under its tier's flags (overridden
    by ``tier_options[tier]`` keys ``use_momentum``/``use_factored``/``bank``), with the optimizer's bank rule
    (`skewadam.state.is_bank`). Warns when a tier is empty.

    Example:
        >>> print(describe(model).table())
    """
    options = _check_tier_options(tier_options)
    trainable, frozen = _split_trainable(model)
    labels = classify(model, rules) if labels is None else labels
    rows = {t: [0, 0, 0, 0] for t in _TIERS}
    for name, p in trainable.items():
        tier = labels[name]
        opt = options.get(tier, {})
        flags = {k: opt.get(k) if opt.get(k) is not None else v for k, v in TIER_STATE[Tier(tier)].items()}
        spec = state_spec(p.shape, p.dtype, **flags, bank=is_bank(p.ndim, tier, opt.get("bank")))
        stats, counters = spec_nbytes(spec)
        row = rows[tier]
        row[0] += 1
        row[1] += p.numel()
        row[2] += stats
        row[3] += counters
    total = sum(r[1] for r in rows.values())
    census = Census(
        tiers={t: TierCensus(r[0], r[1], r[1] / total if total else 0.0, r[2], r[3]) for t, r in rows.items()},
        frozen_tensors=len(frozen),
        frozen_params=sum(p.numel() for p in frozen.values()),
        frozen_names=list(frozen),
        model=type(model).__name__,
    )
    _warn_empty(census)
    return census


def _warn_empty(census: Census) -> None:
    empty = [t for t, c in census.tiers.items() if c.tensors == 0]
    if not empty or census.params == 0:
        return
    if Tier.EXPERT.value in empty and Tier.ROUTER.value in empty:
        msg = (
            f"{census.model}: no expert and no router parameters found (a dense model?); SkewAdam then behaves like "
            "factored Adam with momentum on everything. If this is an MoE model, label its tensors with "
            "rules=[(pattern, tier), ...]"
        )
    else:
        msg = (
            f"{census.model}: tier(s) {empty} are empty; if the model has routed experts and a router, check "
            "skewadam.classify(model) and add rules=[(pattern, tier), ...] for what it missed"
        )
    warnings.warn(msg, stacklevel=3)


# ------------------------------------------------------------------------------------------------ param groups
_GROUP_OPTIONS = ("rules", "tier_options", "exempt_1d", "log", "weight_decay")


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `SkewAdam.from_model` keyword arguments into ``(param_groups kwargs, SkewAdam kwargs)``."""
    group = {k: v for k, v in kwargs.items() if k in _GROUP_OPTIONS}
    return group, {k: v for k, v in kwargs.items() if k not in _GROUP_OPTIONS}


def _check_tier_options(tier_options: Optional[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for tier, opts in (tier_options or {}).items():
        try:
            key = Tier.parse(tier).value
        except ValueError as e:
            raise ValueError(f"tier_options: {e}") from None
        if not isinstance(opts, dict):
            raise ValueError(f"tier_options[{tier!r}] must be a dict of param group settings, e.g. {{'lr': 1e-4}}")
        if "params" in opts or "tier" in opts:
            raise ValueError(f"tier_options[{tier!r}] may not set 'params' or 'tier'; use rules=[...] to move tensors")
        if "experts" in opts:
            raise ValueError(f"tier_options[{tier!r}] may not set 'experts': param_groups sets it per flattened bank "
                             "from the model's structure (skewadam.classify.flattened_experts)")
        out[key] = dict(opts)
    return out


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float = 0.0,
    rules: Optional[Sequence[tuple[str, str]]] = None,
    tier_options: Optional[dict[str, dict[str, Any]]] = None,
    exempt_1d: bool = False,
    log: bool = True,
) -> list[dict[str, Any]]:
    """SkewAdam param groups for ``model``: one per non-empty tier (two with ``exempt_1d``), labelled by `classify`.

    The paper's defaults: ``weight_decay`` on backbone and expert tensors, none on the router. ``exempt_1d`` moves
    tensors with < 2 dims (norms, biases, scalars) of each tier into a group without weight decay, as common practice
    does. ``tier_options={"router": {"lr": 1e-4}}`` overrides any group setting per tier (applied last; an exempted
    group keeps ``weight_decay=0``). Groups carry ``param_names``. Flattened expert banks (`flattened_experts`) go
    to an expert group of their own per count E with the key ``experts=E``: each tensor stacks E experts along dim 0.
    With ``log`` the census goes to the ``skewadam`` logger (INFO).

    Example:
        >>> opt = SkewAdam(param_groups(model, weight_decay=0.1, exempt_1d=True), lr=3e-4)
    """
    options = _check_tier_options(tier_options)
    labels, flat = _classify(model, rules)
    census = describe(model, tier_options=tier_options, labels=labels)
    if log:
        logger.info("%s", census.table())
        if census.frozen_names:
            logger.info("frozen parameters left out of the optimizer: %s", census.frozen_names)
    trainable, _ = _split_trainable(model)
    groups = []
    for tier in _TIERS:
        default_wd = 0.0 if tier == Tier.ROUTER.value else weight_decay
        names = [n for n, t in labels.items() if t == tier]
        split = [(names, False)]
        if exempt_1d:
            split = [([n for n in names if trainable[n].ndim >= 2], False), ([n for n in names if trainable[n].ndim < 2], True)]
        split = [([n for n in m if flat.get(n) == k], exempt, k)
                 for m, exempt in split for k in [None, *sorted({flat[n] for n in m if n in flat})]]
        for members, exempt, experts in split:
            if not members:
                continue
            group = {"params": [trainable[n] for n in members], "param_names": members, "tier": tier,
                     "weight_decay": default_wd}
            if experts is not None:
                group["experts"] = experts
            group.update(options.get(tier, {}))
            if exempt:
                group["weight_decay"] = 0.0
            groups.append(group)
    return groups


# ----------------------------------------------------------------------------------------------------- CLI
def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tiers",
        help="print the SkewAdam tier census of a model (config.json or preset), built on the meta device",
        description="Label a model's parameters backbone/expert/router and print per-tier counts and optimizer state. "
        "The model is built on the meta device, so any size costs no memory.",
    )
    p.add_argument("config", metavar="CONFIG", help="a Hugging Face config.json (or its folder), or a preset name")
    p.add_argument("--json", action="store_true", help="print the census as JSON")
    p.add_argument("--rule", action="append", default=[], metavar="PATTERN=TIER",
                   help="user rule (regex on parameter names), first match wins; repeatable")
    p.add_argument("--list", action="store_true", help="also list every parameter with its tier")
    p.set_defaults(func=_cli_tiers)


def _cli_tiers(args: argparse.Namespace) -> int:
    rules = []
    for r in args.rule:
        pattern, sep, tier = r.rpartition("=")
        if not sep:
            raise SystemExit(f"--rule {r!r}: expected PATTERN=TIER, e.g. --rule '\\.router\\.=router'")
        rules.append((pattern, tier))
    model = _load_model(args.config)
    labels = classify(model, rules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        census = describe(model, labels=labels)
    if args.json:
        out = census.to_dict()
        out["warnings"] = [str(w.message) for w in caught]
        if args.list:
            out["labels"] = labels
        print(json.dumps(out, indent=2))
    else:
        print(census.table())
        for w in caught:
            print(f"warning: {w.message}")
        if args.list:
            for name, tier in labels.items():
                print(f"{tier:<9} {name}")
    return 0


def _load_model(spec: str) -> nn.Module:
    """The model of a preset name or a Hugging Face ``config.json``, on the meta device (`skewadam.presets`)."""
    from .presets import load_model

    try:
        return load_model(spec, device="meta")
    except (ValueError, OSError, ImportError) as e:
        raise SystemExit(f"skewadam tiers: {e}") from None
