"""What a model's structure says about its MoE layers: the module tree, expert containers and the routers beside them.

`skewadam.classify` documents the rules (structure first, scoped names last); this module implements them. It returns
labels only for the parameters structure calls expert or router (the rest is backbone) and, for flattened banks, how
many experts each stacks along dim 0. Nothing here applies user rules or prints.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
from typing import Iterable, Optional, Sequence

from torch import Tensor, nn

from .tiers import Tier

__all__ = ["Structure", "structure"]

# Attribute names of children that hold routed experts / score them: the last resort, inside a structural block.
_EXPERTS_NAME = re.compile(r"^(experts?|moe_experts|routed_experts)$")
_ROUTER_NAME = re.compile(r"^(router|gate|gating|wg|classifier|router_gate|moe_gate)$")
# Metadata values that mark routed-expert tensors / modules in Transformers' parallel plans.
_EP_TENSOR = {"grouped_gemm"}
_EP_MODULE = {"ep_dispatch_experts", "moe_tp_experts"}
_LIST_TYPES = (nn.ModuleList, nn.ModuleDict)


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
        self.order = list(self.modules)  # depth first: a module's subtree follows it
        self.index = {path: i for i, path in enumerate(self.order)}
        names = {id(p): n for n, p in model.named_parameters()}
        self.direct: dict[str, list[tuple[str, Tensor]]] = {path: [] for path in self.modules}
        for path, m in self.modules.items():
            for _, p in m.named_parameters(recurse=False):
                name = names.get(id(p))
                if name is not None and _parent(name) == path:  # a tied tensor belongs to its first owner only
                    self.direct[path].append((name, p))
        self.shape = {n: tuple(int(s) for s in p.shape) for v in self.direct.values() for n, p in v}

    def subtree(self, root: str) -> Iterable[str]:
        return itertools.takewhile(lambda p: _within(p, root), itertools.islice(self.order, self.index[root], None))

    def params(self, root: str) -> list[str]:
        return [n for path in self.subtree(root) for n, _ in self.direct[path]]


@dataclasses.dataclass
class Structure:
    """What structure says about a model: labels of the experts and routers found, and for each flattened expert
    tensor (``[E*F, D]``) the number of experts it stacks along dim 0."""

    labels: dict[str, str]
    experts_in: dict[str, int]


def structure(model: nn.Module) -> Structure:
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
    return Structure(labels, experts_in)


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
    a router ends in scores), then those whose output no loose matrix maps back either (`_maps_back`: a latent
    MoE's up projection), then (in a latent MoE, `_loose`) those that read its ``D``, then by form, then (flattened
    experts) by how cleanly E splits them."""
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
                    rank = (*_split_misfit(c.splits[k], width), form) if c.flat else (form,)
                    cands.append(((block_like, (name, width, k), *rank), name, k, unit))
        if cands:
            loose, sources = _loose(tree, scope, c, excluded)
            cands = [((r[0], _maps_back(loose, *r[1]), bool(sources) and r[1][1] not in sources, *r[2:]), *rest)
                     for r, *rest in cands]
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


def _loose(tree: _Model, scope: str, c: _Container, excluded: set[str]) -> tuple[dict[str, tuple[int, int]], set]:
    """``({name: (in, out)}, sources)``: the matrices in ``scope`` outside the experts and block-like units (loose
    beside a router), and the widths ``D`` they map into one the experts read and back (a latent ``D -> L -> D``)."""
    out = {}
    for owner in tree.subtree(scope):
        if (c.opaque and _within(owner, c.path)) or (owner != scope and _within(c.path, owner)):
            continue
        if owner == scope or not _block_like(tree, _unit(tree, scope, owner, c)[1], 0, _ROWS, excluded):
            out.update((n, tree.shape[n][::-1]) for n, _ in tree.direct[owner]
                       if n not in excluded and len(tree.shape[n]) == 2)
    inner = {tree.shape[n][-1] for n in c.experts} if c.flat else c.dims  # widths the experts surely read
    return out, {a for a, b in out.values() if b in inner and (b, a) in out.values()}


def _maps_back(loose: dict[str, tuple[int, int]], name: str, width: int, k: int) -> bool:
    """Whether the loose matrices other than ``name`` lead from its output size ``k`` back to the ``width`` it
    reads: then it is a step on the way back to the residual stream, not a router (whose scores feed a top-k)."""
    seen, todo = set(), [k]
    while todo:
        node = todo.pop()
        todo += {b for other, (a, b) in loose.items() if other != name and a == node} - seen
        seen.update(todo)
    return width in seen


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
    shapes = {n: tree.shape[n] for n in tree.params(scope) if n not in excluded and len(tree.shape[n]) == 3}
    return [n for n, (o, a, b) in shapes.items()
            if o == outer and inner in (a, b) and (b if a == inner else a) in c.dims]


def _router_unit(tree: _Model, scope: str, unit: str, name: str, excluded: set[str], n_experts: int) -> list[str]:
    """All parameters of the router: those of its `_unit`; when the tensor sits directly on the block, it and the
    block's other per-expert vectors ``[E]``."""
    if unit == scope:
        return [name] + [n for n, p in tree.direct[scope]
                         if p.ndim == 1 and p.shape[0] == n_experts and n not in excluded]
    return [n for n in tree.params(unit) if n not in excluded]


def _heavy(tree: _Model, root: str) -> bool:
    return any(isinstance(tree.modules[path], (nn.Embedding, nn.modules.conv._ConvNd))
               or any(p.ndim >= 3 for _, p in tree.direct[path]) for path in tree.subtree(root))
