"""`skewadam.integrations.torchtitan.SkewAdamOptimizers` on a torchtitan MoE parallelized by torchtitan, 2 ranks.

Run by ``test_torchtitan_distributed.py`` as ``torchrun --standalone --nproc_per_node=2 torchtitan_worker.py OUT_DIR``
(CPU, gloo); ``SKEWADAM_IMPL`` picks the kernel. The tiny Qwen3 MoE (`torchtitan_cases`) is parallelized by
torchtitan's own functions (``parallelize_qwen3``'s EP and FSDP steps, in float64) in the two layouts torchtitan
gives routed experts:

- ``ep_shard0``: expert parallelism 2 (4 experts): experts ``(_StridedShard(0), Shard(0))`` on the (efsdp=1, ep=2)
  mesh, each rank holding 2 experts; dense parameters FSDP ``Shard(0)`` on fsdp=2.
- ``fsdp_shard1``: no expert parallelism and 1 expert, so the FSDP degree exceeds the expert count and torchtitan
  shards the experts ``Shard(1)``; the router ``[1, D]`` is an empty shard on rank 1.

Each trains a few steps with ``SkewAdamOptimizers`` from the same weights and global batch as one process does, in
float64 (torchtitan's grouped experts compute in bf16; here `_grouped_experts_fp64` replaces their forward, as
worker.py does for the reference MoE), with torchtitan's gradient scaling (sum over ranks, loss over the global
token count). ``dcp_resume`` saves with torchtitan's CheckpointManager in the ``ep_shard0`` layout, and a run
resumed from it must end bitwise equal to the uninterrupted one. Rank 0 writes ``OUT_DIR/results.json``:
``{check: {"rank0": figures, "rank1": figures}}``, a check that raised recording ``{"error": traceback}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: torchtitan_cases

import torchtitan.distributed.parallel_dims as parallel_dims_module  # noqa: E402
import torchtitan.distributed.utils as titan_dist  # noqa: E402
from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan_cases import BATCH, batches, tiny_qwen3_moe  # noqa: E402

from checks import run_checks  # noqa: E402
from skewadam import kernels  # noqa: E402
from skewadam.integrations.torchtitan import SkewAdamOptimizers  # noqa: E402

W = 2
STEPS = 3
LR = 1e-2


def _grouped_experts_fp64(self, x_RD, num_tokens_per_expert_E):
    """`GroupedExperts.forward` in the weights' dtype, one matmul per expert (no bf16 cast, no grouped_mm)."""
    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    out, start = [], 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start:start + n]
        out.append((F.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T)
        start += n
    return torch.cat(out + [x_RD[start:] * 0])  # rows past the experts' tokens (padding), as grouped_mm leaves them


GroupedExperts.forward = _grouped_experts_fp64
parallel_dims_module.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator is found
titan_dist.set_spmd_backend("partial_dtensor")


def config(num_experts: int) -> SkewAdamOptimizers.Config:
    # one expert is a dense FFN to `classify` (nothing to route); rules say what torchtitan's layer holds
    rules = [(r"\.inner_experts\.", "expert"), (r"\.router\.gate\.", "router")] if num_experts == 1 else []
    return SkewAdamOptimizers.Config(lr=LR, weight_decay=0.1, rules=rules)


def reference(num_experts: int, data) -> tuple[dict, dict]:
    """One process, global batch: parameters and optimizer state by name after training."""
    model = tiny_qwen3_moe(num_experts, seed=0).double()
    opt = config(num_experts).build(model_parts=[model])
    for tokens, labels in data:
        loss_sum(model, tokens, labels, tokens.numel()).backward()
        opt.step()
        opt.zero_grad()
    return snapshot(model, opt)


def parallel(num_experts: int, ep: int):
    """The reference's initial model parallelized by torchtitan (its FSDP gradient division off: the loss is scaled
    instead), and its optimizer."""
    dims = ParallelDims(dp_replicate=1, dp_shard=W, cp=1, tp=1, pp=1, ep=ep, world_size=W,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    model = tiny_qwen3_moe(num_experts, seed=0, enable_ep=ep > 1).double()
    # parallelize_qwen3's two steps (EP, then FSDP), with float64 compute and reduction: its config knows bf16/fp32
    if ep > 1:
        model.parallelize(dims)
    apply_fsdp_to_decoder(model, dims.get_mesh("fsdp"), param_dtype=torch.float64, reduce_dtype=torch.float64,
                          pp_enabled=False, ep_degree=ep, edp_mesh=dims.get_optional_mesh("efsdp") if ep > 1 else None)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # torchtitan's: sum, the loss is over the global token count
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model, config(num_experts).build(model_parts=[model])


def loss_sum(model, tokens, labels, n_tokens: int) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens


def local(batch):
    rows = slice(dist.get_rank() * BATCH // W, (dist.get_rank() + 1) * BATCH // W)
    return batch[0][rows], batch[1][rows]


def train(model, opt, data, schedule=None) -> None:
    for tokens, labels in data:
        loss_sum(model, *local((tokens, labels)), tokens.numel()).backward()
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(model, opt) -> tuple[dict, dict]:
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for optimizer in opt.optimizers:
        for p, s in optimizer.state.items():
            for key, t in s.items():
                state[f"{names[id(p)]}.{key}"] = full(t).detach().clone().to(torch.float64)
    return params, state


def max_diff(a, b) -> float:
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys(), "different parameters or state"
    return max(float((x - y).abs().max()) if x.numel() else 0.0
               for part in (0, 1) for x, y in ((a[part][k], b[part][k]) for k in a[part]))


def placements(model) -> dict[str, str]:
    return {n: f"{p.placements} on {p.device_mesh.mesh_dim_names}" for n, p in model.named_parameters()
            if n.startswith("layers.0.moe.")}


def check_layout(num_experts: int, ep: int) -> dict:
    data = batches(STEPS)
    model, opt = parallel(num_experts, ep)
    train(model, opt, data)
    return {"max_diff": max_diff(reference(num_experts, data), snapshot(model, opt)), "placements": placements(model),
            "tiers": [g["tier"] for g in opt.optimizers[0].param_groups],
            "backend": kernels.resolve_backend("auto", torch.device("cpu")).load().__name__}


def check_dcp_resume(ckpt_dir: Path, k1: int = 2, k2: int = 2) -> dict:
    """Save after k1 steps with torchtitan's CheckpointManager (its flat FQN-keyed optimizer state), train k2 more;
    a fresh model and optimizer (other weights) loaded from the checkpoint and trained the same k2 steps must end
    bitwise equal."""
    data = batches(k1 + k2)

    def run(seed_scale: float):
        model, opt = parallel(4, ep=2)
        if seed_scale != 1.0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(seed_scale)  # other weights: the checkpoint must bring them back
        schedule = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=k1 + k2 + 2)
        cfg = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
        manager = CheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=opt,
                                    lr_schedulers=schedule, states={}, sd_adapter=None, base_folder=str(ckpt_dir))
        return model, opt, schedule, manager

    model, opt, schedule, manager = run(1.0)
    train(model, opt, data[:k1], schedule)
    manager.save(k1)
    train(model, opt, data[k1:], schedule)
    a = snapshot(model, opt)

    model2, opt2, schedule2, manager2 = run(0.5)
    loaded = manager2.load(k1)
    train(model2, opt2, data[k1:], schedule2)
    return {"loaded": loaded, "max_diff": max_diff(a, snapshot(model2, opt2)),
            "lr": [g["lr"] for g in opt2.optimizers[0].param_groups]}


def main() -> None:
    out_dir = Path(sys.argv[1])

    def named_checks() -> dict:
        torch.manual_seed(0)
        return {
            "ep_shard0": lambda: check_layout(4, ep=2),
            "fsdp_shard1": lambda: check_layout(1, ep=1),
            "dcp_resume": lambda: check_dcp_resume(out_dir / "dcp"),
        }

    run_checks(named_checks, out_dir)


if __name__ == "__main__":
    main()
