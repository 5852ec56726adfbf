"""Train an OLMo-core MoE (a tiny OLMoE) under FSDP2 with SkewAdam, checkpoint it with DCP, and resume bitwise.

    torchrun --standalone --nproc_per_node=2 examples/train_olmo_core.py --steps 6 --checkpoint /tmp/olmo_ckpt   # CPU
    torchrun --standalone --nproc_per_node=8 examples/train_olmo_core.py --experts 64 --d-model 2048       # GPUs, NCCL

The model is OLMo-core's own: ``TransformerConfig.olmoe_1B_7B`` shrunk (layers, width, experts, top-k), built and
initialised by OLMo-core and sharded by its ``apply_fsdp`` (``fully_shard`` per block, ``Shard(0)``). Its experts
are *flattened banks*: ``w1``/``w2``/``w3`` hold E experts as one ``[E*H, D]`` tensor, so FSDP2's row shards can cut
an expert (the default 5 experts over 2 ranks cut expert 2 in half). ``SkewAdam.from_model`` tiers the model
(`skewadam.classify`: routed experts, router, backbone) and steps each rank's rows of a bank as the experts they
belong to (`skewadam.distributed.flat_bank_pieces`), all-reducing only per-expert statistics, so training is what one
process does on the global batch.

The run trains ``--steps`` steps, saving model and optimizer with `torch.distributed.checkpoint` after
``--save-at``; then a fresh model and optimizer (another initialisation) load the checkpoint and train the same
remaining steps, and the example checks that they end bitwise equal to the uninterrupted run, parameters and
optimizer state, on every rank.

Data: byte-level Shakespeare (`skewadam.bench.data`, vocabulary 256); each rank draws its own batches, seeded by
rank and step. On CPU, OLMo-core's expert dispatch (``olmo_core.kernels.moe``: Triton kernels that need a GPU) is
replaced by the same gather and scatter written in torch (`cpu_dispatch`); the model is otherwise unchanged.
"""

from __future__ import annotations

import argparse
import os
import types

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from skewadam import SkewAdam, plan
from skewadam.bench.data import VOCAB_SIZE, get_batch, load_corpus
from skewadam.distributed import flat_bank_pieces


def cpu_dispatch() -> None:
    """OLMo-core's dropless token gather/scatter (``olmo_core.ops.moe``'s kernels: megablocks' semantics) in torch,
    for CPUs: ``gather`` copies token ``i // top_k`` to row ``i`` of the expert-sorted order, ``scatter`` puts rows
    back (scaled by their routing weights) and sums each token's ``top_k`` copies, ``scatter_wgrad`` is the weights'
    gradient. Legend: T tokens x top_k rows, N tokens, D width."""
    import olmo_core.ops.moe as ops

    def gather(x_ND, indices, bin_ids, weights, bins, top_k):
        out_TD = x_ND[indices // top_k]
        return out_TD if weights is None else out_TD * weights[indices, None].to(out_TD.dtype)

    def scatter(x_TD, indices, bin_ids, weights, bins, top_k):
        out_TD = torch.zeros_like(x_TD)
        out_TD[indices] = x_TD if weights is None else x_TD * weights[indices, None].to(x_TD.dtype)
        return out_TD.view(-1, top_k, x_TD.shape[1]).sum(1)

    def scatter_wgrad(x_TD, grad_ND, indices, bin_ids, bins, top_k):
        out_T = torch.zeros(indices.shape[0], dtype=x_TD.dtype, device=x_TD.device)
        out_T[indices] = (x_TD * grad_ND[indices // top_k]).sum(-1)
        return out_T

    ops.kernels = types.SimpleNamespace(gather=gather, scatter=scatter, scatter_wgrad=scatter_wgrad)


def config(args):
    """OLMo-core's OLMoE config, shrunk."""
    from olmo_core.nn.transformer import TransformerConfig

    cfg = TransformerConfig.olmoe_1B_7B(vocab_size=VOCAB_SIZE, d_model=args.d_model, n_layers=args.layers,
                                        n_heads=args.heads)
    moe = cfg.block.feed_forward_moe
    moe.num_experts, moe.hidden_size, moe.router.top_k = args.experts, args.expert_hidden, args.top_k
    return cfg


def build(args, mesh, device: torch.device, seed: int):
    """The model, built and initialised by OLMo-core on every rank alike, then sharded by its apply_fsdp."""
    torch.manual_seed(seed)
    model = config(args).build(init_device=device.type)
    model.init_weights(device=device)
    model.apply_fsdp(dp_mesh=mesh)
    return model


def train(model, optimizer, steps: range, corpus, args, device: torch.device, log: bool) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank() * 10_007 + step)
        x, y = (t.to(device) for t in get_batch(corpus.train, args.batch_size, args.seq, gen))
        loss = model(x, labels=y).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if log:
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # SUM (gloo has no AVG)
            r = optimizer._reducer  # (counted since the optimizer's first step, step 1)
            if dist.get_rank() == 0:
                print(f"step {step:3d} | loss {loss.item() / dist.get_world_size():.4f} | optimizer comms "
                      f"{r.collectives / step:.0f} all-reduces, {r.bytes / step:,.0f} B per step | skipped "
                      f"{optimizer.skipped_steps}", flush=True)


def state_of(model, optimizer) -> list[torch.Tensor]:
    """This rank's shards of every parameter and state tensor, in a fixed order."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    for p in model.parameters():
        local += [v.to_local() if isinstance(v, DTensor) else v for _, v in sorted(optimizer.state[p].items())]
    return local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=None, help="checkpoint after this step (default: half way)")
    ap.add_argument("--checkpoint", required=True, help="DCP directory to save model+optimizer to")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=5)
    ap.add_argument("--expert-hidden", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    save_at = args.steps // 2 if args.save_at is None else args.save_at

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        cpu_dispatch()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    corpus = load_corpus()

    def model_and_optimizer(seed: int):
        model = build(args, mesh, device, seed)
        return model, SkewAdam.from_model(model, lr=args.lr, weight_decay=0.1, log=False)

    model, optimizer = model_and_optimizer(args.seed)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"OLMo-core OLMoE ({args.layers} layers, {args.experts} experts of width {args.expert_hidden}, top "
              f"{args.top_k}): {n:,} parameters on {dist.get_world_size()} {device.type} rank(s)")
        for g in optimizer.param_groups:
            flat = f", flattened banks of {g['experts']} experts" if g.get("experts") else ""
            print(f"  {g['tier']:8s} {len(g['params']):2d} tensors{flat}")
        planned = plan(config(args).build(init_device="meta"), optimizers=["skewadam"], shards=dist.get_world_size())
        print(f"planned all-reduces of SkewAdam's statistics: {planned['skewadam'].reduce_bytes:,} B per step")
    for name, p in model.named_parameters():
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        if group.get("experts"):  # what FSDP2's rows of the first bank hold, on each rank
            pieces = flat_bank_pieces(p, group["experts"])
            held = ", ".join(f"expert {pc.first + i}: {pc.rows} rows" for pc in pieces for i in range(pc.experts)
                             if pc.rows)
            print(f"rank {rank}: {name} {list(p.shape)} rows {list(p.to_local().shape)[:1]} -> {held}", flush=True)
            break

    train(model, optimizer, range(1, save_at + 1), corpus, args, device, log=True)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.checkpoint)
    if rank == 0:
        print(f"saved model and optimizer after step {save_at} to {args.checkpoint}")
    train(model, optimizer, range(save_at + 1, args.steps + 1), corpus, args, device, log=True)

    resumed, resumed_optimizer = model_and_optimizer(args.seed + 1)  # another initialisation: all of it is loaded
    msd, osd = get_state_dict(resumed, resumed_optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.checkpoint)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=msd, optim_state_dict=osd)
    train(resumed, resumed_optimizer, range(save_at + 1, args.steps + 1), corpus, args, device, log=False)
    a, b = state_of(model, optimizer), state_of(resumed, resumed_optimizer)
    same = torch.tensor(float(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))), device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"resumed from step {save_at}: {'bitwise equal' if same.item() == 1 else 'DIFFERENT'} to the "
              f"uninterrupted run at step {args.steps} ({len(a)} tensors per rank)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
