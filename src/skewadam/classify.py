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
       ``grouped_gemm``, modules marked ``ep_dispatch_experts``), tensor-parallel ``moe_tp_experts`` modules, and the
       experts classes Transformers decorates with ``use_experts_implementation``.
    3. Shapes: an expert container is a module holding tensors with >= 3 dims stacked along dim 0 (``[E, ...]``), or
       >= 2 structurally identical sibling modules (a ``ModuleList``/``ModuleDict`` of expert MLPs). It is an MoE
       layer only next to a router: a matrix ``[E, D]`` (a ``Linear(D, E)``) in the same block whose row count is the
       number of experts E and whose input size D is a size of the experts' weights; the router is the block's child
       holding it (every parameter of that child: bias, per-expert scales, a router MLP). For experts the metadata
       declares, a router that also scores shared or "skip" experts (``[E + s, D]``, s <= E) is accepted when no
       exact match exists.
    4. Product-key experts (PEER, Doge's ``CDMoE``): ``E = k*k`` single-neuron experts as rows of ``Embedding(E, D)``
       tables next to a ``Linear(D, 2k)`` router whose two top-k pick them.
    5. Names, only inside a block already found by structure, with word-boundary rules: a child called ``experts``
       whose tensors flatten the experts (``[E*F, D]``, DBRX), or, next to experts the metadata declares, a router
       called ``router``/``gate``/... when no matrix size reveals it. ``gate`` never matches ``gate_proj``; ``shared_experts`` never matches
       ``experts``.
Everything not labelled is backbone. Parameters with ``requires_grad=False`` are left out (`skewadam.groups.describe`
reports them); tied parameters appear once, under their first name. Param groups and the census of the state they
cost are `skewadam.groups`.

Example:
    >>> from skewadam.models import MoETransformer, get_config
    >>> labels = classify(MoETransformer(get_config("tiny")))
    >>> labels["blocks.1.moe.router.weight"], labels["blocks.1.moe.experts.w1"], labels["tok_emb.weight"]
    ('router', 'expert', 'backbone')
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional, Sequence

from torch import Tensor, nn

from .tiers import Tier

__all__ = ["classify", "split_trainable", "hidden_matrices"]

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
    trainable, _ = split_trainable(model)
    compiled = _compile_rules(rules)
    auto = _structural_labels(model)
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
    return labels


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


# ----------------------------------------------------------------------------------------------- structure
@dataclasses.dataclass
class _Container:
    """A module that may hold routed experts, before a router confirms it."""

    path: str  # the experts module: a bank owner, a ModuleList/ModuleDict of experts, or a child called `experts`
    experts: list[str]  # names of the parameters that are expert if confirmed
    counts: set[int]  # candidate numbers of experts
    dims: set[int]  # sizes of the expert weights (the router's input size must be one)
    declared: bool  # named by the model's metadata: stands without a router
    scopes: list[str]  # the blocks to look for the router in, nearest first
    opaque: bool  # the router is never inside `path` (lists, named children); a bank's owner may hold it
    flat: bool = False  # experts flattened into 2-D tensors [E*F, D]: the count comes from the router

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
        self.shape = {n: p.shape for v in self.direct.values() for n, p in v}

    def subtree(self, root: str) -> Iterable[str]:
        return (path for path in self.modules if _within(path, root))

    def params(self, root: str) -> list[str]:
        return [n for path in self.subtree(root) for n, _ in self.direct[path]]


def _structural_labels(model: nn.Module) -> dict[str, str]:
    """``{name: tier}`` for the parameters structure (and scoped names) call expert or router; the rest is backbone."""
    tree = _Model(model)
    declared_tensors, declared_modules = _declared_experts(tree)
    labels: dict[str, str] = {}
    experts: set[str] = set()
    for c in _find_containers(tree, declared_tensors, declared_modules):
        if any(n in experts for n in c.experts):
            continue  # already part of a confirmed container (e.g. a bank inside a listed expert)
        router = _find_router(tree, c, experts)
        if router is None and not c.declared:
            continue
        if c.flat:
            k = next(iter(router[1]))  # type: ignore[index]
            c.experts = [n for n in c.experts if tree.shape[n][0] % k == 0]
        for n in c.experts:
            labels[n] = Tier.EXPERT.value
            experts.add(n)
        for n in router[0] if router else ():
            labels.setdefault(n, Tier.ROUTER.value)
    for experts_, router_ in _product_key_experts(tree):
        for n in experts_:
            labels.setdefault(n, Tier.EXPERT.value)
        for n in router_:
            labels.setdefault(n, Tier.ROUTER.value)
    for n in declared_tensors:
        labels[n] = Tier.EXPERT.value
    return labels


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


def _find_containers(tree: _Model, declared_tensors: set[str], declared_modules: set[str]) -> list[_Container]:
    out: list[_Container] = []
    for path, m in tree.modules.items():
        direct = tree.direct[path]
        declared = path in declared_modules or any(n in declared_tensors for n, _ in direct)
        # (a) a bank: tensors with >= 3 dims stacked along dim 0 (or >= 2, where the metadata says so)
        banks = [p for _, p in direct if (p.ndim >= 3 or (declared and p.ndim >= 2)) and p.shape[0] >= 2]
        if banks and (declared or not _is_torch_layer(m)):
            counts = {p.shape[0] for p in banks}
            members = [n for n, p in direct if p.ndim >= 1 and p.shape[0] in counts]
            dims = _common_dims(p.shape[1:] for p in banks)
            out.append(_Container(path, members, counts, dims, declared, [path, _parent(path)], opaque=declared))
            continue
        # (b) a ModuleList/ModuleDict of >= 2 structurally identical modules
        if isinstance(m, _LIST_TYPES):
            sigs = [s for s in map(_signature, m.children()) if s]  # parameter-free children (dropout) aside
            if len(sigs) >= 2 and len(set(sigs)) == 1:
                # names last: a list called `experts` is one even when no router picks its members (ViTPose++:
                # the dataset index does)
                declared = declared or bool(_EXPERTS_NAME.match(path.rpartition(".")[2]))
                sig = sigs[0]
                dims = _common_dims(shape for _, shape, _ in sig if len(shape) >= 2) or {
                    s for _, shape, _ in sig for s in shape
                }
                out.append(
                    _Container(path, tree.params(path), {len(sigs)}, dims, declared, [_parent(path)], opaque=True)
                )
            continue
        # (c) names last: a child called `experts` whose tensors flatten the experts (DBRX: [E*F, D]); needs a router
        if _EXPERTS_NAME.match(path.rpartition(".")[2]):
            inside = tree.params(path)
            flat = [n for n in inside if len(tree.shape[n]) == 2]
            if flat and all(len(tree.shape[n]) <= 2 for n in inside):  # banks below are found by (a)
                dims = _common_dims(tree.shape[n] for n in flat)
                out.append(_Container(path, flat, set(), dims, False, [_parent(path)], opaque=True, flat=True))
    # Innermost first: experts claim their tensors before an enclosing list of identical layers is considered.
    out.sort(key=lambda c: -c.path.count("."))
    return out


def _common_dims(shapes: Iterable[Sequence[int]]) -> set[int]:
    """Sizes shared by all the shapes (the model width, for an up and a down projection); all sizes if none is."""
    sets = [set(int(s) for s in shape) for shape in shapes]
    if not sets:
        return set()
    return set.intersection(*sets) or set.union(*sets)


def _find_router(tree: _Model, c: _Container, experts: set[str]) -> Optional[tuple[list[str], set[int]]]:
    """The router of container ``c``: ``(its parameter names, the number(s) of experts it scores)`` or None."""
    excluded = set(c.experts) | experts
    for scope in c.scopes:
        if scope not in tree.modules or (scope == c.path and c.opaque):
            continue
        cands = []  # (rank, name, n_experts): lower rank is stronger evidence
        for owner in tree.subtree(scope):
            if isinstance(tree.modules[owner], nn.Embedding) or (c.opaque and _within(owner, c.path)):
                continue
            if owner != scope and _within(c.path, owner):
                continue  # a module enclosing the experts below the block: not the router
            for name, p in tree.direct[owner]:
                if name not in excluded and p.ndim == 2:
                    rank = _router_rank(int(p.shape[0]), int(p.shape[1]), c)
                    if rank is not None:
                        cands.append((rank[0], name, rank[1]))
        if cands:
            best = min(r for r, _, _ in cands)
            params: list[str] = []
            counts: set[int] = set()
            for rank, name, k in cands:
                if rank == best:
                    counts.add(k)
                    params.extend(_router_unit(tree, scope, name, c, excluded, k))
            return list(dict.fromkeys(params)), counts
        # names last, for experts the model's metadata declares: a router-named child of this block
        for child_name, child in tree.modules[scope].named_children() if c.declared else ():
            child_path = _join(scope, child_name)
            if _ROUTER_NAME.match(child_name) and not _within(c.path, child_path):
                params = [n for n in tree.params(child_path) if n not in excluded]
                if params:
                    return params, set(c.counts)
    return None


def _router_rank(rows: int, cols: int, c: _Container) -> Optional[tuple[int, int]]:
    """How well a ``[rows, cols]`` matrix fits a router of ``c``: ``(rank, n_experts)``, rank 0 best, or None."""
    fits_input = cols in c.dims
    if c.flat:  # experts [E*F, D]: the router is [E, D] with E | E*F
        return (0, rows) if fits_input and rows >= 2 and any(d % rows == 0 and d > rows for d in c.dims) else None
    if rows in c.counts:  # an input size foreign to the experts (a latent MoE) needs a real bank: >= 2 tensors
        return (0, rows) if fits_input else ((1, rows) if c.tensors >= 2 else None)
    for n in sorted(c.counts) if c.declared else ():
        if n < rows <= 2 * n:  # declared experts whose router also scores shared or "skip" experts
            return (2, n) if fits_input else (3, n)
    return None


def _router_unit(tree: _Model, scope: str, name: str, c: _Container, excluded: set[str], n_experts: int) -> list[str]:
    """All parameters of the router: the child of the block that holds the router matrix (its bias, per-expert scales,
    a router MLP); when the matrix sits directly on the block, it and the block's other per-expert vectors ``[E]``."""
    owner = _parent(name)
    if owner == scope:
        return [name] + [
            n for n, p in tree.direct[scope] if p.ndim == 1 and p.shape[0] == n_experts and n not in excluded
        ]
    child = _join(scope, owner[len(scope) + 1:].split(".")[0] if scope else owner.split(".")[0])
    if _within(c.path, child) or _heavy(tree, child):
        child = owner  # the child is more than a router (it encloses the experts, or holds banks, convs, tables)
    return [n for n in tree.params(child) if n not in excluded]


def _heavy(tree: _Model, root: str) -> bool:
    return any(
        isinstance(tree.modules[path], (nn.Embedding, nn.modules.conv._ConvNd))
        or any(p.ndim >= 3 for _, p in tree.direct[path])
        for path in tree.subtree(root)
    )


# ------------------------------------------------------------------------------------------------ hidden matrices
def hidden_matrices(model: nn.Module, labels: Optional[dict[str, str]] = None) -> list[str]:
    """Names of the hidden matrices of ``model``: the 2-D backbone weights that are not embeddings, the output
    head, norms, biases or the router, i.e. what Muon-style orthogonal updates are for (`skewadam.steppers`).

    Embeddings are found by structure: ``nn.Embedding`` weights, any parameter tied to one (the same tensor under
    another name), and the weight of ``model.get_output_embeddings()`` where the model has it (Transformers' LM
    head, tied or not). ``labels`` are `classify`'s (computed if not given); only ``backbone`` tensors qualify.

    Example:
        >>> hidden_matrices(MoETransformer(get_config("tiny")))[:2]
        ['blocks.0.attn.wq.weight', 'blocks.0.attn.wk.weight']
    """
    labels = classify(model) if labels is None else labels
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(getattr(head, "weight", None), Tensor):
        tables.add(id(head.weight))
    trainable, _ = split_trainable(model)
    return [n for n, p in trainable.items()
            if labels.get(n) == Tier.BACKBONE.value and p.ndim == 2 and id(p) not in tables]
