"""DeepSpeed: SkewAdam's own math under ZeRO stages 1, 2 and 3 (`initialize`, a drop-in for ``deepspeed.initialize``).

ZeRO hands the client optimizer one flat 1-D fp32 partition per param group (stages 1 and 2, and the BF16 optimizer
of ``"bf16": {"enabled": true}``) or per sub-group (stage 3): runs of elements that cut tensors anywhere. `initialize`
calls ``deepspeed.initialize`` with the same arguments and return, then registers each partition with the SkewAdam
it was given (`attach`), read from DeepSpeed's own bookkeeping: which tensors each rank's partition holds, from which
element. SkewAdam then steps every partition as pieces of those tensors (`skewadam.zero`, `skewadam.pieces`): the
factored statistics, per-expert sums, idle experts and RMS clip of one process, with the sums that pieces share
added over the data-parallel group, and the state kept in each tensor's own layout.

Checkpoints: ``engine.save_checkpoint``/``load_checkpoint`` resume bitwise at the world size they were saved at; each
rank's optimizer state is its pieces in the tensors' layout, saved with where they lie, so `consolidate` merges a
checkpoint directory into one process's ``{"module": master weights, "optimizer": SkewAdam.state_dict()}`` (what one
process resumes from, or saves) and `load_consolidated` loads that into an engine of any world size.

Plain ``deepspeed.initialize`` with a SkewAdam raises at the first step, naming `initialize` (nothing is stepped).
The step inside backward (``in_backward=True``) is refused: ZeRO reduces gradients into partitions after backward,
so no rank holds a whole gradient inside it.

DeepSpeed is an optional dependency (``pip install deepspeed``; on CPU ``DS_BUILD_OPS=0``); ``import skewadam`` never
imports it.

Example:
    >>> from skewadam.integrations.deepspeed import initialize
    >>> opt = SkewAdam.from_model(model, lr=3e-3, weight_decay=0.1)
    >>> engine, opt, _, _ = initialize(model=model, optimizer=opt, config={"train_micro_batch_size_per_gpu": 4,
    ...                                                                     "zero_optimization": {"stage": 2}})
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    import deepspeed
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("skewadam.integrations.deepspeed needs DeepSpeed: pip install deepspeed (on a CPU-only "
                      "machine: DS_BUILD_OPS=0 pip install deepspeed)") from e

from .. import kernels
from ..optimizer import SkewAdam
from ..pieces import Layout, TensorLayout
from ..state import check_state, state_flags
from ..validation import resolve_group
from ..zero import Partition, ZeroSteps, merge_pieces

__all__ = ["initialize", "attach", "prepare_with", "consolidate", "load_consolidated"]

_IN_BACKWARD = ("SkewAdam(in_backward=True) under DeepSpeed: ZeRO reduces each gradient into partitions after "
                "backward, so no rank holds a whole gradient inside it, and stage 0 all-reduces after the hooks "
                "would have stepped; build the optimizer with in_backward=False")

#: Settings `initialize` adds to a config that does not set them: SkewAdam is a ZeRO client optimizer DeepSpeed has
#: not tested, and one that steps ZeRO-Offload's CPU partitions itself (its C++ kernel), not DeepSpeedCPUAdam.
CONFIG_DEFAULTS = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def initialize(*args: Any, **kwargs: Any) -> tuple:
    """``deepspeed.initialize(*args, **kwargs)`` (the same arguments and return), with a SkewAdam ``optimizer``
    stepping ZeRO's partitions as pieces of its tensors (`attach`). The config (a dict or a JSON file, as ``config``
    or ``config_params``) gets `CONFIG_DEFAULTS` where it does not set them. Raises ValueError, before DeepSpeed
    starts, for a SkewAdam with ``in_backward=True`` and for bf16 or fp16 under ZeRO stage 0.

    Example:
        >>> engine, opt, _, _ = initialize(model=model, optimizer=SkewAdam.from_model(model), config=ds_config)
    """
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    optimizer = bound.arguments.get("optimizer")
    if not isinstance(optimizer, SkewAdam):
        return deepspeed.initialize(*args, **kwargs)
    if optimizer.in_backward:
        raise ValueError(_IN_BACKWARD)
    for key in ("config", "config_params"):
        if bound.arguments.get(key) is not None:
            bound.arguments[key] = config = _with_defaults(bound.arguments[key])
            stage = config.get("zero_optimization", {}).get("stage", 0) if isinstance(config, dict) else None
            if stage == 0 and any(config.get(k, {}).get("enabled") for k in ("bf16", "fp16")):
                raise ValueError("ZeRO stage 0 with bf16 or fp16: DeepSpeed's mixed-precision wrapper for a client "
                                 "optimizer steps it once with zero gradients when it is built, which would count a "
                                 "step and decay every second moment; use ZeRO stage 1, 2 or 3, or fp32")
    _expert_groups(optimizer)
    out = deepspeed.initialize(*bound.args, **bound.kwargs)
    attach(optimizer, out[0].optimizer)
    return out


def prepare_with(accelerator: Any) -> None:
    """Make ``accelerator.prepare`` (Accelerate's DeepSpeed plugin; Transformers' Trainer prepares through it, and
    `skewadam.integrations.hf.SkewAdamTrainer` calls this itself) register the partitions of the SkewAdam it hands
    DeepSpeed (`attach`; DeepSpeed-MoE's experts in groups of their own first), refusing one that steps inside
    backward.

    Example:
        >>> accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2)); prepare_with(accelerator)
        >>> model, opt = accelerator.prepare(model, SkewAdam.from_model(model))
    """
    prepare = accelerator._prepare_deepspeed

    def _prepare_deepspeed(*args: Any) -> Any:
        skewadam = next((a for a in args if isinstance(a, SkewAdam)), None)
        if skewadam is not None:
            if skewadam.in_backward:
                raise ValueError(_IN_BACKWARD)
            _expert_groups(skewadam)
        result = prepare(*args)
        if skewadam is not None:
            attach(skewadam, accelerator.deepspeed_engine_wrapped.engine.optimizer)
        return result

    accelerator._prepare_deepspeed = _prepare_deepspeed


def _expert_groups(optimizer: SkewAdam) -> None:
    """Give DeepSpeed-MoE's experts (``allreduce=False`` parameters of ``deepspeed.moe.layer.MoE``) param groups of
    their own, as ZeRO needs them (``"moe": True`` and their expert-parallel group's ``"name"``: ZeRO partitions and
    SkewAdam reduces them over that group's data-parallel ranks): each group holding some is split into its other
    tensors and its experts per expert-parallel group, with its settings (tier, lr, ...). Nothing changes without
    such experts."""
    from deepspeed.moe.utils import is_moe_param

    if not any(is_moe_param(p) for group in optimizer.param_groups for p in group["params"]):
        return
    groups = []
    for group in optimizer.param_groups:
        names = group.get("param_names") or [None] * len(group["params"])
        split: dict[Any, list] = {}
        for p, name in zip(group["params"], names):
            split.setdefault(p.group_name if is_moe_param(p) else None, []).append((p, name))
        for key, members in split.items():
            sub = {**group, "params": [p for p, _ in members]}
            if group.get("param_names"):
                sub["param_names"] = [n for _, n in members]
            groups.append(sub if key is None else {**sub, "moe": True, "name": key})
    optimizer.param_groups[:] = groups


def _with_defaults(config: Any) -> Any:
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    return {**CONFIG_DEFAULTS, **config} if isinstance(config, dict) else config


def attach(optimizer: SkewAdam, zero_optimizer: Any) -> None:
    """Register the flat partitions ``zero_optimizer`` (``engine.optimizer``: DeepSpeed's ZeRO stage 1/2 or 3
    optimizer, or its BF16 optimizer) hands ``optimizer``, so that SkewAdam steps each as pieces of its tensors; for
    engines built by plain ``deepspeed.initialize`` (Accelerate, Transformers' Trainer). Nothing to do when
    ``zero_optimizer`` is ``optimizer`` itself (ZeRO stage 0 in fp32).

    Example:
        >>> engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config); attach(opt, engine.optimizer)
    """
    if zero_optimizer is optimizer:
        return
    zero = optimizer.__dict__.get("_zero") or ZeroSteps()
    for flat, group, params, ranges, pg, first_id in _partitions(optimizer, zero_optimizer):
        spec = state_flags(group)
        tensors = [TensorLayout.for_spec(tuple(getattr(p, "ds_shape", p.shape)), spec) for p in params]
        world = len(ranges)
        rank = dist.get_rank(group=pg) if world > 1 else 0
        names = [zero_optimizer.param_names[p] for p in params]
        zero.add(Partition(flat, Layout(tensors, ranges), rank, pg, first_id, names), group)
    optimizer._zero = zero


def _partitions(optimizer: SkewAdam, zo: Any):
    """``(flat partition, param group, its tensors, every rank's runs, process group, first stream id)`` of each
    partition ``zo`` steps, from DeepSpeed's bookkeeping (checked against its own mapping of this rank's pieces)."""
    kind = type(zo).__name__
    if kind in ("DeepSpeedZeroOptimizer", "BF16_Optimizer"):  # stages 1 and 2; bf16 under stage 1
        lp = zo.bit16_groups if kind == "DeepSpeedZeroOptimizer" else zo.bf16_groups
        flats = zo.bit16_groups_flat if kind == "DeepSpeedZeroOptimizer" else zo.bf16_groups_flat
        parts = zo.single_partition_of_fp32_groups if kind == "DeepSpeedZeroOptimizer" else \
            zo.fp32_groups_flat_partition
        first = 0
        for i, group in enumerate(optimizer.param_groups):
            params, pg, flat = lp[i], zo.real_dp_process_group[i], flats[i]
            world = dist.get_world_size(group=pg)
            # where each parameter lives in the flat buffer (round_robin_gradients reorders them), then the runs
            offsets = [(p.data_ptr() - flat.data_ptr()) // flat.element_size() for p in params]
            ranges = _flat_ranges(params, offsets, flat.numel() // world, world)
            if kind == "BF16_Optimizer" or not zo.round_robin_gradients:  # (DeepSpeed's own map ignores the order)
                _check_mapping(params, ranges[dist.get_rank(group=pg)])
            yield parts[i], group, params, ranges, pg, first
            first += len(params)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        for j, params in enumerate(zo.fp16_groups):
            gi = zo.sub_group_to_group_id[j]
            pg = zo._get_sub_group_process_group(j)
            world = dist.get_world_size(group=pg)
            ranges: list[list] = [[] for _ in range(world)]
            at = 0
            for k, p in enumerate(params):
                part = p.ds_tensor.ds_numel
                for r in range(world):
                    a, b = min(p.ds_numel, r * part), min(p.ds_numel, (r + 1) * part)
                    if a < b:
                        ranges[r].append((k, a, b, at))
                at += part
            flat = zo.fp32_partitioned_groups_flat[j]
            if flat.numel() != at:
                raise RuntimeError(f"DeepSpeed's stage-3 sub-group {j} holds {flat.numel()} elements, its "
                                   f"parameters' partitions {at}: this DeepSpeed version partitions otherwise than "
                                   f"skewadam.integrations.deepspeed reads it")
            first = sum(len(ps) for s, ps in enumerate(zo.fp16_groups)  # tensors of earlier groups and sub-groups
                        if (zo.sub_group_to_group_id[s], s) < (gi, j))
            yield flat, optimizer.param_groups[gi], params, ranges, pg, first
    else:
        raise TypeError(f"skewadam.integrations.deepspeed does not know DeepSpeed's {kind} (engine.optimizer): "
                        f"SkewAdam steps the partitions of ZeRO stages 1-3 and of the BF16 optimizer")


def _flat_ranges(params: list, offsets: list[int], part: int, world: int) -> list[list[tuple]]:
    """Every rank's runs ``(tensor, start, stop, offset in its partition)`` of tensors at ``offsets`` in a flat buffer
    cut into ``world`` partitions of ``part`` elements."""
    out: list[list[tuple]] = [[] for _ in range(world)]
    for k, (p, o) in enumerate(zip(params, offsets)):
        for r in range(world):
            a, b = max(o, r * part), min(o + p.numel(), (r + 1) * part)
            if a < b:
                out[r].append((k, a - o, b - o, a - r * part))
    return out


def _check_mapping(params: list, runs: list[tuple]) -> None:
    """This rank's runs as DeepSpeed maps them itself (``_hp_mapping``: the fragment of each parameter it holds)."""
    mine = {k: (a, b, off) for k, a, b, off in runs}
    for k, p in enumerate(params):
        m = getattr(p, "_hp_mapping", None)
        got = None if m is None else (m.lp_fragment_address.start, m.lp_fragment_address.start
                                      + m.lp_fragment_address.numel, m.hp_fragment_address.start)
        if got != mine.get(k):
            raise RuntimeError(f"DeepSpeed maps parameter {k} {tuple(p.shape)} of this rank's partition to {got}, "
                               f"skewadam read {mine.get(k)} from its offsets: this DeepSpeed version partitions "
                               f"otherwise than skewadam.integrations.deepspeed reads it")


def consolidate(checkpoint_dir: str | Path, tag: str | None = None) -> dict:
    """One process's checkpoint from the ZeRO checkpoint ``checkpoint_dir`` (``engine.save_checkpoint``'s; ``tag``:
    default its ``latest``) of a SkewAdam stepped by `initialize`, on any number of ranks: ``{"module": {name: fp32
    master weight}, "optimizer": a SkewAdam state dict}``, as ``{"module": model.state_dict(), "optimizer":
    SkewAdam.from_model(model).state_dict()}`` of one process holds them (the same groups, in the tensors' layouts).
    Reads the files only: no process group, no engine.

    Example:
        >>> full = consolidate("ckpt")  # saved on 2 ranks
        >>> model.load_state_dict(full["module"]); opt.load_state_dict(full["optimizer"])  # one process resumes
    """
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)

    folder = Path(checkpoint_dir) / (tag or (Path(checkpoint_dir) / "latest").read_text().strip())
    ranks = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
             for f in sorted(folder.glob("*optim_states.pt"))]
    saved = [sd.get(BASE_OPTIMIZER_STATE) or sd[OPTIMIZER_STATE_DICT] for sd in ranks]
    flats = [sd.get(SINGLE_PARTITION_OF_FP32_GROUPS) or sd[FP32_FLAT_GROUPS] for sd in ranks]
    if not saved or any("zero" not in sd for sd in saved):
        raise ValueError(f"{folder}: no SkewAdam state saved by skewadam.integrations.deepspeed in its "
                         f"*optim_states.pt files; consolidate reads checkpoints of engines built by initialize()")
    order = sorted(range(len(saved)), key=lambda r: next(iter(saved[r]["zero"].values()))["rank"])
    saved, flats = [saved[r] for r in order], [flats[r] for r in order]
    groups = [dict(g, params=[]) for g in saved[0]["param_groups"]]
    module, state = {}, {}
    for j, k in enumerate(sorted(saved[0]["zero"])):
        group = next(g for g, sg in zip(groups, saved[0]["param_groups"]) if k in sg["params"])
        described = [sd["zero"][k] for sd in saved]
        spec = state_flags(group)
        specs = [spec.spec(t[0], flats[0][j].dtype) for t in described[0]["tensors"]]
        weights, whole = merge_pieces(described, [sd["state"].get(k, {}) for sd in saved], [f[j] for f in flats],
                                      specs)
        module.update(weights)
        for i, name in enumerate(described[0]["names"]):
            group["params"].append(described[0]["first"] + i)
            state[described[0]["first"] + i] = whole[name]
    optimizer = {"state": state, "param_groups": groups, "skipped_steps": saved[0].get("skipped_steps", 0)}
    return {"module": module, "optimizer": optimizer}


def load_consolidated(engine: Any, optimizer: SkewAdam, full: dict) -> None:
    """Load one process's ``{"module": master weights by name, "optimizer": SkewAdam state dict}`` (`consolidate`'s,
    or a one-process run's ``model.state_dict()`` and ``SkewAdam.from_model(model).state_dict()``) into ``engine``
    (`initialize`'s, on any number of ranks; every rank calls it): each rank copies its pieces of the weights and of
    the state, after checking all of it (nothing is changed on an error).

    Example:
        >>> engine, opt, *_ = initialize(model=model, optimizer=SkewAdam.from_model(model), config=config)
        >>> load_consolidated(engine, opt, torch.load("one_process.pt"))
    """
    saved = full["optimizer"]
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(saved['param_groups'])} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}: build the optimizer as the checkpoint's was built")
    names = {i: n for g in saved["param_groups"] for i, n in zip(g["params"], g.get("param_names") or [])}
    whole = {names[i]: st for i, st in saved["state"].items()}
    settings = [resolve_group(sg, {}, idx) for idx, sg in enumerate(saved["param_groups"])]
    parts = list(optimizer._zero.partitions.values())
    for part in parts:  # every check first
        idx = next(i for i, g in enumerate(optimizer.param_groups) if g is part.param_group)
        spec = state_flags(settings[idx])
        for i, (name, t) in enumerate(zip(part.names, part.layout.tensors)):
            if name not in whole or name not in full["module"] or tuple(full["module"][name].shape) != t.shape:
                raise ValueError(f"the checkpoint has no state or weight {t.shape} of {name!r} (param group {idx}): "
                                 f"load a checkpoint of this model, stepped with the same groups")
            check_state(whole[name], spec.spec(t.shape, part.flat.dtype), f"{name!r}'s state in the checkpoint")
    for part in parts:
        idx = next(i for i, g in enumerate(optimizer.param_groups) if g is part.param_group)
        part.param_group.update({k: v for k, v in settings[idx].items() if k != "params"})
        state = optimizer.state[part.flat]
        state.clear()
        part.allocate(state, part.param_group, kernels.resolve_backend(optimizer._impl, part.flat.device).device_steps)
        part.load_full(state, full["module"], whole)
    optimizer.skipped_steps = int(saved.get("skipped_steps", 0))
    zo = engine.optimizer
    if hasattr(zo, "update_lp_params"):  # stages 1 and 2, the BF16 optimizer: the weights from the masters
        zo.update_lp_params()
    else:  # stage 3
        for j in range(len(zo.fp16_groups)):
            zo._reassign_or_swap_out_partitioned_parameters(j)
