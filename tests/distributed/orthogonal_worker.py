"""SkewAdam's orthogonal tier under FSDP2 and DDP, checked against one process on the global batch.

Run by ``test_orthogonal_distributed.py`` as ``torchrun --standalone --nproc_per_node=2 orthogonal_worker.py OUT_DIR
IMPL`` (CPU, gloo; every SkewAdam on kernel IMPL, the one-process references too, for the fused groups), with the reference MoE and the helpers of ``worker.py`` (float64, odd sizes, batch-additive loss). The
orthogonalisation needs whole matrices: a sharded matrix's update is all-gathered, orthogonalised and cut back to the
rank's shard; a bank sharded on its experts needs nothing. Rank 0 writes ``OUT_DIR/results.json`` as worker.py does.

Layouts, on 2 ranks: FSDP2 ``Shard(0)`` everywhere (uneven: 3 experts, vocab 67), torchtitan's (experts ``Shard(1)``
with one expert, attention ``Shard(1)``), int8 momentum under ``Shard(0)``, int8 momentum on the expert banks too
with experts ``Shard(1)`` (gathered), that with the Newton-Schulz options (an interval's due matrices picked from
gathered ones), DDP; a negative control (no gather); Adafactor's options (the Adam-style groups) under ``Shard(0)``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import worker  # the reference model and data helpers (and its float64 expert dispatch)
from checks import run_checks
from skewadam import SkewAdam, plan
from skewadam.groups import param_groups

W = worker.W
ARM = "skewadam-orthogonal-experts"


def build_opt(model, momentum_dtype: str = "fp32", expert_momentum: bool = False, **options) -> SkewAdam:
    """The arm's groups; ``expert_momentum``: every orthogonal group keeps momentum, the expert banks too;
    ``options``: SkewAdam's (the Newton-Schulz options)."""
    groups = param_groups(model, weight_decay=0.1, orthogonal="experts", log=False,
                          orthogonal_options={"momentum_dtype": momentum_dtype,
                                              **({"use_momentum": True} if expert_momentum else {})})
    return SkewAdam(groups, lr=worker.LR, **options)


def reference(cfg, data, momentum_dtype: str = "fp32", expert_momentum: bool = False, **options):
    model = worker.build(cfg)
    opt = build_opt(model, momentum_dtype, expert_momentum, **options)
    for idx, tgt in data:
        model(idx, tgt).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, worker.snapshot(model.named_parameters(), opt)


def check_fsdp2(n_experts: int, placement_fn=None, momentum_dtype: str = "fp32", gather: bool = True,
                expert_momentum: bool = False, **options) -> dict:
    cfg = worker.config(n_experts)
    data = worker.batches()
    model = worker.fsdp_model(cfg, placement_fn)
    opt = build_opt(model, momentum_dtype, expert_momentum, **options)
    if not gather:  # negative control: orthogonalise each shard on its own
        from skewadam.distributed import DTensorReducer

        opt._reducer = DTensorReducer()
        opt._reducer.gathers = lambda param, bank: False
    worker.train(worker.backward(model), opt, data)
    ref_model, ref = reference(cfg, data, momentum_dtype, expert_momentum, **options)
    out = {"max_diff": worker.max_diff(ref, worker.snapshot(model.named_parameters(), opt))}
    if gather:
        orth = {n for g in opt.param_groups if g["update"] == "orthogonal" for n in g["param_names"]}
        out["gathered_bytes_per_step"] = opt._reducer.gathered_bytes / len(data)
        # what the math needs: the full update of each orthogonal matrix whose matrix dims a mesh dim shards, less
        # this rank's shard (float64)
        named = dict(model.named_parameters())
        out["expected_gathered_bytes"] = sum(
            (p.numel() - p.to_local().numel()) * 8 for n, p in named.items()
            if n in orth and opt._reducer.gathers(p, p.ndim == 3))
        out["planned_gather_bytes_fp32"] = plan(ref_model, optimizers=[ARM], shards=W)[ARM].gather_bytes
        out["orthogonal"] = sorted(orth)
    return out


def experts_shard1(param):
    """torchtitan's expert placement (``Shard(1)``: one expert on 2 ranks, so its matrices are gathered), the rest on
    FSDP2's ``Shard(0)``: int8 momentum keeps its blocks along an unsharded last dim (a ``Shard(1)`` matrix is refused
    with int8 momentum, `skewadam.distributed.new_state_dtensor`)."""
    return Shard(1) if param.ndim == 3 and param.shape[0] < W else Shard(0)


def check_ddp() -> dict:
    cfg = worker.config(3)
    data = worker.batches()
    model = DDP(worker.build(cfg))
    opt = build_opt(model.module)
    worker.train(lambda idx, tgt: model(idx, tgt).loss.backward(), opt, data)
    _, ref = reference(cfg, data)
    return {"max_diff": worker.max_diff(ref, worker.snapshot(model.module.named_parameters(), opt)),
            "reducer": opt._reducer is not None}


def check_adafactor_options() -> dict:
    """Adafactor's options under FSDP2 ``Shard(0)`` (uneven): their per-unit statistics (the parameter's sum of
    squares for the relative step) are summed across shards with the others, so the run is one process's."""
    cfg, data = worker.config(3), worker.batches()

    def make(model):
        return SkewAdam(param_groups(model, weight_decay=0.1, log=False), lr=worker.LR, relative_step=True,
                        beta2_decay=-0.8)

    model = worker.fsdp_model(cfg)
    opt = make(model)
    worker.train(worker.backward(model), opt, data)
    ref_model = worker.build(cfg)
    ref_opt = make(ref_model)
    for idx, tgt in data:
        ref_model(idx, tgt).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"max_diff": worker.max_diff(worker.snapshot(ref_model.named_parameters(), ref_opt),
                                        worker.snapshot(model.named_parameters(), opt))}


def main(out_dir: Path, impl: str) -> None:
    os.environ["SKEWADAM_IMPL"] = impl  # every SkewAdam below, the one-process references too

    def named_checks() -> dict:
        worker.MESH = init_device_mesh("cpu", (W,))
        return {
            "fsdp2_shard0_uneven": lambda: check_fsdp2(3),
            "fsdp2_torchtitan_shard1": lambda: check_fsdp2(1, worker.torchtitan_placement),
            "fsdp2_int8_momentum": lambda: check_fsdp2(3, momentum_dtype="int8"),
            "fsdp2_experts_shard1_int8_expert_momentum": lambda: check_fsdp2(1, experts_shard1, "int8",
                                                                             expert_momentum=True),
            "fsdp2_experts_shard1_newton_schulz_options": lambda: check_fsdp2(
                1, experts_shard1, "int8", expert_momentum=True, ns_steps=4, ns_interval=2),
            "fsdp2_negative_control": lambda: check_fsdp2(3, gather=False),
            "ddp": check_ddp,
            "fsdp2_adafactor_options": check_adafactor_options,
        }

    run_checks(named_checks, out_dir, timeout=timedelta(seconds=180))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
