"""The one source of truth for the optimizer state a parameter holds, and the bytes an optimizer actually holds.

`state_flags` resolves a param group's state settings (its tier's defaults, the ``use_momentum``/``use_factored``/
``bank`` overrides, ``momentum_dtype``, ``update``, ``experts``) into its `TierSpec`, validating them (the one place
these keys are checked); `state_spec` says which tensors (name, shape, dtype) a parameter of a given shape keeps
under them. `SkewAdam` allocates exactly these and validates loaded state against them (`check_state`); the census
(`skewadam.groups.describe`) and the planner (`skewadam.bench.planner`) sum exactly these, so none of them can
disagree. `measure_state` counts what any ``torch.optim.Optimizer`` holds.

Names follow torch: ``step``, ``exp_avg`` (first moment), ``exp_avg_sq`` (full second moment), ``row_var``
``[..., R, 1]`` and ``col_var`` ``[..., 1, C]`` (factored second moment, over the last two dims).

``momentum_dtype`` stores ``exp_avg`` compactly: ``"fp32"`` (the statistics dtype: fp32, or fp64 for fp64
parameters), ``"bf16"``, or ``"int8"`` (block-wise, with ``exp_avg_scale`` ``[..., ceil(C / 256)]``; tensors with
< 2 dims keep the statistics dtype, see `skewadam.kernels.quant`).

``update`` is what a group's update is made of: ``"adam"`` (the default: momentum and/or a second moment, as above)
or ``"orthogonal"`` (the orthogonalised momentum of `skewadam.kernels.orthogonal`: ``exp_avg`` only, no second
moment; without momentum, as for expert banks orthogonalised per expert from the gradient, only ``step``).

A *bank* is a stacked expert tensor ``[E, ...]`` whose slices along dim 0 are treated as separate experts: its
``step`` holds one count per slice, and whether a slice is factored depends on the slice's rank, not the bank's. A
*flattened* bank ``[E*D, ...]`` (group key ``experts``) is stepped as the bank ``[E, D, ...]`` and keeps that bank's
state in its own row layout where the state spans each expert's rows (``exp_avg [E*D, F]``, ``row_var [E*D, 1]``)
and per expert elsewhere (``col_var [E, 1, F]``, ``step [E]``): `TierSpec.spec`.

Step counters (``step``) are reported apart from the statistics (moments), because the paper's figures count only
the latter.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .tiers import TIER_STATE, Tier

try:  # DTensor (FSDP2): a shard's local tensor is what this process holds
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

#: int8 momentum (`skewadam.kernels.quant`): elements per block along the last dim, each block with one fp32 scale.
BLOCK = 256


def num_blocks(last_dim: int) -> int:
    """int8 scales per row of ``last_dim`` elements: ``ceil(last_dim / BLOCK)``, at least one."""
    return max(1, math.ceil(last_dim / BLOCK))

__all__ = [
    "BLOCK", "num_blocks", "StateTensor", "TierSpec", "state_flags", "state_spec", "check_state", "spec_nbytes",
    "is_bank", "is_factored", "state_dtype_for", "COUNTER_KEYS", "MOMENTUM_DTYPES", "UPDATES", "StateBytes",
    "measure_state", "UNTIERED", "format_bytes", "BINARY_UNITS", "spanned_dims", "flat_bank_merged",
]

#: State entries that are bookkeeping (step counts), reported apart from the statistics themselves.
COUNTER_KEYS = frozenset({"step"})
MOMENTUM_DTYPES = ("fp32", "bf16", "int8")
UPDATES = ("adam", "orthogonal")  # a group's ``update``: the tiers' Adam-style update, or orthogonalised momentum
UNTIERED = "untiered"  # tier of a param group that names none (a plain torch optimizer)


class StateTensor(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def state_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """The statistics dtype (the state's moments and the kernels' math): fp32 for 16-bit parameters, the parameter's
    own dtype otherwise. The one definition: `state_spec`, every kernel and the planner ask it."""
    return torch.float32 if param_dtype in (torch.bfloat16, torch.float16) else param_dtype


def is_bank(ndim: int, tier: str, bank: bool | None) -> bool:
    """A tensor is a bank when its group says so, or (``bank=None``) when it is an expert tensor with >= 3 dims."""
    if bank is None:
        return tier == "expert" and ndim >= 3
    return bank


def is_factored(shape: Sequence[int], *, use_factored: bool, bank: bool) -> bool:
    """Factored iff the group asks for it and the (slice) tensor has >= 2 dims."""
    slice_rank = len(shape) - 1 if bank else len(shape)
    return use_factored and slice_rank >= 2


def state_spec(
    shape: Sequence[int],
    param_dtype: torch.dtype,
    *,
    use_momentum: bool,
    use_factored: bool,
    bank: bool,
    momentum_dtype: str = "fp32",
    update: str = "adam",
) -> dict[str, StateTensor]:
    """The state tensors of one parameter, in allocation order (``update="orthogonal"``: no second moment).

    Example:
        >>> spec = state_spec((8, 64, 32), torch.bfloat16, use_momentum=False, use_factored=True, bank=True)
        >>> {k: v.shape for k, v in spec.items()}
        {'step': (8,), 'row_var': (8, 64, 1), 'col_var': (8, 1, 32)}
    """
    shape = tuple(int(s) for s in shape)
    dtype = state_dtype_for(param_dtype)
    spec = {"step": StateTensor((shape[0],) if bank else (), torch.float32)}
    if use_momentum:
        if momentum_dtype == "int8" and len(shape) >= 2:
            spec["exp_avg"] = StateTensor(shape, torch.int8)
            spec["exp_avg_scale"] = StateTensor(shape[:-1] + (num_blocks(shape[-1]),), torch.float32)
        else:
            spec["exp_avg"] = StateTensor(shape, torch.bfloat16 if momentum_dtype == "bf16" else dtype)
    if update == "orthogonal":
        return spec
    if is_factored(shape, use_factored=use_factored, bank=bank):
        spec["row_var"] = StateTensor(shape[:-1] + (1,), dtype)
        spec["col_var"] = StateTensor(shape[:-2] + (1, shape[-1]), dtype)
    else:
        spec["exp_avg_sq"] = StateTensor(shape, dtype)
    return spec


def spanned_dims(key: str, ndim: int, state_ndim: int) -> range | set[int]:
    """The dims of an ``ndim``-dim parameter that its state ``key`` (of ``state_ndim`` dims) spans at full size; the
    others it has reduced to 1 (``row_var`` the last, ``col_var`` the rows) or dropped (a bank's ``step [E]`` keeps
    only the experts).

    Example:
        >>> spanned_dims("col_var", 2, 2)  # [1, C] of an [R, C] matrix
        {1}
    """
    if key in ("exp_avg", "exp_avg_sq"):
        return range(ndim)
    if key == "row_var":
        return set(range(ndim)) - {ndim - 1}
    if key == "col_var":
        return set(range(ndim)) - {ndim - 2}
    if key == "exp_avg_scale":  # int8 momentum: one scale per block of the last dim (`skewadam.kernels.quant`)
        return set(range(ndim)) - {ndim - 1}
    if key == "step":  # [E] for a bank (its dim 0), () otherwise
        return range(state_ndim)
    raise KeyError(f"skewadam.state does not know how state {key!r} relates to its parameter's dims")


def flat_bank_merged(key: str, view_ndim: int) -> bool:
    """Whether a flattened bank keeps state ``key`` with its view's dims 0 and 1 merged (`TierSpec.spec`): where the
    state spans each expert's rows (view dim 1), as the parameter does, so it shards like the parameter.

    Example:
        >>> flat_bank_merged("row_var", 3), flat_bank_merged("col_var", 3)  # [E*D, 1], and [E, 1, F] as the view's
        (True, False)
    """
    return key != "step" and 1 in spanned_dims(key, view_ndim, view_ndim)


class TierSpec(NamedTuple):
    """What one param group's tensors keep and how they are updated: its tier's defaults with the group's
    overrides, resolved and validated once (`state_flags`). `state_spec` turns it into a parameter's tensors."""

    tier: str
    momentum: Optional[str]  # the first moment's storage (`MOMENTUM_DTYPES`), None without momentum
    second_moment: str  # "factored" (units of >= 2 dims; "full" below), "full", or "none" (the orthogonal update)
    update: str = "adam"  # `UPDATES`: the tiers' Adam-style update, or orthogonalised momentum
    bank: Optional[bool] = None  # None: the bank rule of `is_bank`
    experts: Optional[int] = None  # flattened banks: each tensor stacks this many experts along dim 0

    @property
    def use_momentum(self) -> bool:
        """The group key this spec resolves: whether it keeps a first moment."""
        return self.momentum is not None

    @property
    def use_factored(self) -> bool:
        """The group key this spec resolves: whether units of >= 2 dims keep a factored second moment."""
        return self.second_moment == "factored"

    def is_bank(self, ndim: int) -> bool:
        """Whether a parameter of this group with ``ndim`` dims is a bank (`is_bank`; a flattened bank always is)."""
        return self.experts is not None or is_bank(ndim, self.tier, self.bank)

    def view_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape the kernels see: a flattened bank ``[E*D, ...]`` as the stacked bank ``[E, D, ...]``."""
        if self.experts is None:
            return tuple(shape)
        return (self.experts, shape[0] // self.experts, *shape[1:])

    def spec(self, shape: Sequence[int], param_dtype: torch.dtype, *, stacked: bool = False) -> dict[str, StateTensor]:
        """`state_spec` of a parameter of this group. A flattened bank ``[E*D, ...]`` keeps its stacked bank's
        (`view_shape`) with dims 0 and 1 merged where the state spans each expert's rows (`flat_bank_merged`:
        ``exp_avg [E*D, F]``, ``row_var [E*D, 1]``, ...), so it shards like the parameter and a checkpoint loads
        across world sizes; the per-expert rest as the stacked bank keeps it (``col_var [E, 1, F]``, ``step [E]``).
        ``stacked``: the stacked bank's own layout (what checkpoints of earlier versions hold)."""
        view = self.view_shape(shape)
        spec = state_spec(view, param_dtype, use_momentum=self.use_momentum, use_factored=self.use_factored,
                          bank=self.is_bank(len(view)), momentum_dtype=self.momentum or "fp32", update=self.update)
        if self.experts is None or stacked:
            return spec
        return {key: StateTensor((st.shape[0] * st.shape[1], *st.shape[2:]), st.dtype)
                if flat_bank_merged(key, len(view)) else st for key, st in spec.items()}

    def planned(self, shape: Sequence[int], param_dtype: torch.dtype) -> tuple[tuple[int, ...], bool, dict]:
        """A parameter of this group as a step's temporaries are planned for (``step_transient_bytes`` of
        `skewadam.kernels.BACKENDS`): the shape the kernels see (`view_shape`), its bank flag, its state (stacked)."""
        view = self.view_shape(shape)
        return view, self.is_bank(len(view)), self.spec(shape, param_dtype, stacked=True)


def state_flags(group: Mapping[str, Any], where: str = "") -> TierSpec:
    """Resolve and validate the state settings of a param group (or of any mapping of group settings; other keys
    are ignored) into its `TierSpec`: the one place these keys are checked, ``where`` naming the group in errors.

    ``tier`` (default ``"backbone"``) sets the momentum and the second moment (`skewadam.tiers.TIER_STATE`) where
    the group's ``use_momentum``/``use_factored`` are ``None`` or absent; ``momentum_dtype`` (default ``"fp32"``)
    stores the momentum; ``update`` (default ``"adam"``): an ``"orthogonal"`` group keeps no second moment and takes
    no ``use_factored=True`` and no flattened banks; ``bank`` stays ``None`` (the bank rule) unless given;
    ``experts`` (flattened banks) is an int >= 1 of ``expert`` groups. The optimizer, the census and the planner
    all resolve through here.

    Example:
        >>> state_flags({"tier": "expert", "use_momentum": True, "lr": 1e-3})
        TierSpec(tier='expert', momentum='fp32', second_moment='factored', update='adam', bank=None, experts=None)
    """
    at, of = (f" in {where}", f"{where}: ") if where else ("", "")
    try:
        tier = Tier.parse(group.get("tier") or Tier.BACKBONE)
    except ValueError as e:
        raise ValueError(f"{of}{e}") from None
    for key in ("use_momentum", "use_factored", "bank"):
        if group.get(key) is not None and not isinstance(group[key], bool):
            raise ValueError(f"Invalid {key}{at}: {group[key]!r} (expected True, False or None)")
    use_momentum, use_factored = (TIER_STATE[tier][k] if group.get(k) is None else group[k]
                                  for k in ("use_momentum", "use_factored"))
    momentum_dtype = group.get("momentum_dtype") or "fp32"
    if momentum_dtype not in MOMENTUM_DTYPES:
        raise ValueError(f"Invalid momentum_dtype{at}: {momentum_dtype!r} (expected one of {MOMENTUM_DTYPES})")
    update = group.get("update") or "adam"
    if update not in UPDATES:
        raise ValueError(f"Invalid update{at}: {update!r} (expected one of {UPDATES})")
    experts = group.get("experts")
    if experts is not None:
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
            raise ValueError(f"Invalid experts{at}: {experts!r} (expected an int >= 1: the number of experts each "
                             "tensor stacks along dim 0)")
        if tier != Tier.EXPERT:
            raise ValueError(f"{of}experts={experts} is a key of 'expert' groups, got tier {tier.value!r}")
    second_moment = "factored" if use_factored else "full"
    if update == "orthogonal":
        if group.get("use_factored"):
            raise ValueError(f"{of}update='orthogonal' keeps no second moment: leave use_factored unset (or False), "
                             f"or use update='adam'")
        if experts is not None:
            raise ValueError(f"{of}update='orthogonal' takes matrices or stacked banks [E, A, B], not flattened banks "
                             f"(experts={experts}): leave these tensors in an update='adam' group")
        second_moment = "none"
    return TierSpec(tier.value, momentum_dtype if use_momentum else None, second_moment, update, group.get("bank"),
                    experts)


#: State whose values are sums of squares (EMAs of ``g^2``, int8 momentum's block maxima): never negative.
NONNEGATIVE_KEYS = frozenset({"exp_avg_sq", "row_var", "col_var", "exp_avg_scale"})


def check_state(state: Mapping[str, Any], spec: Mapping[str, StateTensor], where: str) -> None:
    """Raise ``ValueError`` unless ``state`` holds exactly the tensors of ``spec``: the same keys, each a tensor of
    the spec's (global, for DTensors) shape and dtype, with values a step can have left: finite, never negative
    where they are sums of squares (`NONNEGATIVE_KEYS`), step counts whole numbers >= 0. ``where`` names the
    parameter and its group in the message. (Reads every value: a host sync for device tensors, once per load.)"""
    if set(state) != set(spec):
        missing, extra = sorted(set(spec) - set(state)), sorted(set(state) - set(spec))
        raise ValueError(
            f"{where}: state has keys {sorted(state)}, expected {list(spec)}"
            + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else "")
            + "; it was saved under other state settings (tier, update, use_momentum, use_factored, bank, "
            "momentum_dtype) "
            "or for another parameter: load it where the settings and parameters match"
        )
    for key, want in spec.items():
        value = state[key]
        if not isinstance(value, Tensor):
            raise ValueError(f"{where}: state {key!r} is a {type(value).__name__}, expected a tensor "
                             f"{list(want.shape)} {want.dtype}")
        if tuple(value.shape) != want.shape or value.dtype != want.dtype:
            raise ValueError(
                f"{where}: state {key!r} is {list(value.shape)} {value.dtype}, expected {list(want.shape)} "
                f"{want.dtype} for this parameter; the state belongs to a parameter of another shape or dtype"
            )
        local = value.to_local() if isinstance(value, DTensor) else value
        if not local.is_floating_point():
            continue  # int8 momentum codes: every value is one
        bad = ~local.isfinite()
        rule = "finite"
        if key == "step":
            bad |= (local < 0) | (local != local.round())
            rule = "a whole number >= 0"
        elif key in NONNEGATIVE_KEYS:
            bad |= local < 0
            rule = "finite and >= 0"
        if bool(bad.any()):
            first = local[bad].reshape(-1)[0].item()
            raise ValueError(f"{where}: state {key!r} holds {int(bad.sum())} value(s) that are not {rule} (e.g. "
                             f"{first}), which no step leaves: the checkpoint is corrupted; load another one (nothing "
                             f"was loaded)")


def spec_nbytes(spec: dict[str, StateTensor]) -> tuple[int, int]:
    """``(statistics, counters)`` bytes of a `state_spec`: moments apart from step counts (the paper counts only
    the former)."""
    stats = sum(st.nbytes for key, st in spec.items() if key not in COUNTER_KEYS)
    return stats, sum(st.nbytes for key, st in spec.items() if key in COUNTER_KEYS)


# ----------------------------------------------------------------------------------------------------- measured
#: The units of `format_bytes`, largest first.
BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def format_bytes(n: int) -> str:
    """Bytes in binary units, the one convention of every table we print: ``B``, ``KiB`` (2^10), ``MiB`` (2^20),
    ``GiB`` (2^30), ``TiB`` (2^40), two decimals (the paper's "GB" are GiB).

    Example:
        >>> format_bytes(1_380_029_764)
        '1.29 GiB'
    """
    for unit, scale in BINARY_UNITS[:-1]:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of optimizer state.

    Attributes:
        statistics: moments (``exp_avg``, ``exp_avg_sq``, ``row_var``, ``col_var``, ...): what the paper counts.
        counters: step counts (`COUNTER_KEYS`).
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


class Tally:
    """Sums state bytes per tier and key into a `StateBytes`. Measured tensors (`add_tensor`) are counted by
    storage: each view charges the bytes of its span that no earlier tensor covered, and a storage's bytes that no
    view covers (a view keeps its whole storage alive) go to the first tensor seen in it. So shared tensors count
    once and the total is the memory held. Planned tensors (`add`) are counted as given."""

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


def measure_state(optimizer: torch.optim.Optimizer, tiers: Optional[Mapping[int, str]] = None) -> StateBytes:
    """Bytes held in ``optimizer.state``, per tier (the param group's ``tier`` key, or ``tiers[id(p)]``) and per
    state key.

    Memory is counted once per storage: a tensor shared between parameters once, views by the part of the storage
    they cover (the rest of a storage that views keep alive goes to the first one seen), DTensor state at its local
    shard's size, tensor subclasses by their inner tensors, a dict of state (a ZeRO partition's, one per tensor:
    `skewadam.zero`) by its keys. Works for any ``torch.optim.Optimizer`` (and anything with its ``param_groups`` and
    ``state``); non-tensor state (Python numbers) holds no tensor memory and is skipped.

    Example:
        >>> opt.step(); measure_state(opt).by_tier
        {'backbone': 1365349700, 'expert': 12582912, 'router': 2097152}
    """
    tier_of = {id(p): str(g.get("tier", UNTIERED)) for g in optimizer.param_groups for p in g["params"]}
    tier_of.update(tiers or {})
    tally = Tally()
    for p, state in optimizer.state.items():
        tier = tier_of.get(id(p), UNTIERED)
        for key, value in state.items():
            for inner, v in value.items() if isinstance(value, dict) else ((key, value),):
                for t in _plain_tensors(v):
                    tally.add_tensor(tier, inner, t)
    return tally.result()
