"""The step inside backward on sharded parameters (``SkewAdam(..., in_backward=True)``), checked against one process.

Run by ``test_in_backward_distributed.py`` as ``torchrun --standalone --nproc_per_node=2 in_backward_worker.py OUT_DIR
IMPL [CHECK ...]`` (CPU, gloo), once per kernel (``SKEWADAM_IMPL``, the one-process references included). It trains
`worker.py`'s float64 reference MoE and toy with the hooks on FSDP2's sharded parameters (FSDP2 runs them after its
reduce-scatter; the cross-rank reductions of each parameter's statistics run inside them) and records figures per
rank: the largest difference of parameters and state from one *regular* process on the global batch, whether every
gradient was freed by backward, the reducer's collectives per step. Layouts: uneven dim-0 shards, empty shards in
every tier, experts ``Shard(1)`` beside column-sharded attention (torchtitan's placement), int8 momentum; a non-finite
gradient on one rank; gradient accumulation through FSDP2's ``set_requires_gradient_sync(False)`` and through
``hold_gradients()``; DDP.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import worker
from checks import run_checks
from skewadam import SkewAdam
from worker import LR, Toy, batches, build, config, groups, local, max_diff, reference, snapshot, toy_batches


def _freed(model) -> bool:
    return all(p.grad is None for p in model.parameters())


def check_fsdp2(n_experts: int, placement_fn=None, momentum_dtype: str = "fp32", disable_reducer: bool = False) -> dict:
    cfg = config(n_experts)
    data = batches()
    model = worker.fsdp_model(cfg, placement_fn)
    opt = SkewAdam(groups(model.named_parameters(), momentum_dtype), lr=LR, in_backward=True)
    if disable_reducer:
        opt._reducer = lambda items: None
    freed = []
    for batch in data:
        model(*local(batch)).loss.backward()
        freed.append(_freed(model))
        opt.step()
        opt.zero_grad()
    out = {"max_diff": max_diff(reference(cfg, data, momentum_dtype), snapshot(model.named_parameters(), opt)),
           "freed": all(freed), "skipped_tensors": opt.skipped_tensors,
           "empty_local_shards": sorted(n for n, p in model.named_parameters() if p.to_local().numel() == 0)}
    if not disable_reducer:
        out["collectives_per_step"] = opt._reducer.collectives / len(data)
    return out


def check_toy(n_experts: int, momentum_dtype: str = "fp32") -> dict:
    """`worker.Toy` (an empty shard in every tier with one expert) sharded, stepped inside backward."""
    def model_opt(shard: bool):
        torch.manual_seed(0)
        model = Toy(n_experts).double()
        if shard:
            for child in model.children():
                fully_shard(child, mesh=worker.MESH)
            fully_shard(model, mesh=worker.MESH)
        return model, SkewAdam(groups(model.named_parameters(), momentum_dtype), lr=LR, in_backward=shard)

    data = toy_batches()
    rows = slice(dist.get_rank() * worker.TOY_BATCH // worker.W, (dist.get_rank() + 1) * worker.TOY_BATCH // worker.W)
    model, opt = model_opt(shard=True)
    ref_model, ref_opt = model_opt(shard=False)
    for x, y in data:
        model(x[rows], y[rows]).backward()
        assert _freed(model)
        opt.step()
        ref_model(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"max_diff": max_diff(snapshot(ref_model.named_parameters(), ref_opt),
                                 snapshot(model.named_parameters(), opt)),
            "empty_local_shards": sorted(n for n, p in model.named_parameters() if p.to_local().numel() == 0)}


def check_nonfinite() -> dict:
    """A NaN in one rank's gradient shard of one bank: that bank is skipped on every rank (the reducer's agreement
    inside its hook), the other tensors step."""
    cfg = config(3)
    model = worker.fsdp_model(cfg)
    opt = SkewAdam(groups(model.named_parameters()), lr=LR, in_backward=True)
    def poison(module, args) -> None:  # the unsharded gradient, as FSDP2's forward holds the unsharded parameter
        if dist.get_rank() == 1:
            module.experts.w1.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))

    model.get_submodule("blocks.1.moe").register_forward_pre_hook(poison)
    before = snapshot(model.named_parameters(), opt)
    model(*local(batches(1)[0])).loss.backward()
    opt.step()
    after = snapshot(model.named_parameters(), opt)
    others = [n for n in before[0] if n != "blocks.1.moe.experts.w1"]
    return {"bank_unchanged": torch.equal(before[0]["blocks.1.moe.experts.w1"], after[0]["blocks.1.moe.experts.w1"]),
            "others_moved": all(not torch.equal(before[0][n], after[0][n]) for n in others),
            "skipped_tensors": opt.skipped_tensors, "skipped_steps": opt.skipped_steps}


def check_accumulation(how: str) -> dict:
    """Two micro-batches per step (each half of this rank's rows, loss halved), accumulated by FSDP2 without syncing
    (``no_sync``: ``set_requires_gradient_sync(False)``) or by SkewAdam (``hold``: ``hold_gradients()``), against
    one process on the global batch."""
    cfg = config(3)
    data = batches()
    model = worker.fsdp_model(cfg)
    opt = SkewAdam(groups(model.named_parameters()), lr=LR, in_backward=True)
    for batch in data:
        idx, tgt = local(batch)
        half = idx.shape[0] // 2
        if how == "no_sync":
            model.set_requires_gradient_sync(False)
            (model(idx[:half], tgt[:half]).loss / 2).backward()
            model.set_requires_gradient_sync(True)
        else:
            with opt.hold_gradients():
                (model(idx[:half], tgt[:half]).loss / 2).backward()
        (model(idx[half:], tgt[half:]).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    return {"max_diff": max_diff(reference(cfg, data), snapshot(model.named_parameters(), opt)), "freed": _freed(model)}


def check_ddp() -> dict:
    """DDP all-reduces after the hooks: the refusal (or result) of stepping in backward under it."""
    cfg = config(3)
    data = batches()
    model = DDP(build(cfg))
    opt = SkewAdam(groups(model.module.named_parameters()), lr=LR, in_backward=True)
    try:
        for batch in data:
            model(*local(batch)).loss.backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return {"error_message": str(e)}
    return {"max_diff": max_diff(reference(cfg, data), snapshot(model.module.named_parameters(), opt))}


def named_checks() -> dict:
    worker.MESH = init_device_mesh("cpu", (worker.W,))
    return {
        "fsdp2_uneven": lambda: check_fsdp2(3),
        "fsdp2_empty_shards": lambda: check_fsdp2(1),
        "fsdp2_torchtitan_shard1": lambda: check_fsdp2(1, worker.torchtitan_placement),
        "fsdp2_int8_momentum": lambda: check_fsdp2(3, momentum_dtype="int8"),
        "fsdp2_negative_control": lambda: check_fsdp2(3, disable_reducer=True),
        "toy_every_tier_empty": lambda: check_toy(1),
        "toy_every_tier_empty_int8": lambda: check_toy(1, momentum_dtype="int8"),
        "nonfinite": check_nonfinite,
        "accumulate_no_sync": lambda: check_accumulation("no_sync"),
        "accumulate_hold": lambda: check_accumulation("hold"),
        "ddp": check_ddp,
    }


def main(out_dir: Path, impl: str) -> None:
    os.environ["SKEWADAM_IMPL"] = impl
    run_checks(named_checks, out_dir, only=sys.argv[3:], timeout=timedelta(seconds=180))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
