"""Train a small torchtitan MoE with SkewAdam on the CPU, checkpointing and resuming through torchtitan's own
CheckpointManager.

The model is a torchtitan registry flavor (default: DeepSeek-V3 ``debugmodel``, 8 routed experts and a shared one
per MoE layer) cut to ``--layers`` layers, with torchtitan's SDPA attention (FlexAttention has no CPU backward). The
optimizer is `skewadam.integrations.torchtitan.SkewAdamOptimizers`: in a torchtitan run the same switch is
``config.optimizer = SkewAdamOptimizers.Config(lr=..., weight_decay=...)`` (README, "torchtitan").

    pip install 'skewadam[torchtitan]'
    python examples/train_torchtitan.py --steps 20 --ckpt runs/titan --stop-at 10   # saves at step 10, stops
    python examples/train_torchtitan.py --steps 20 --ckpt runs/titan                # resumes at 10, trains to 20
"""

from __future__ import annotations

import argparse
import importlib
import logging

import torch
import torch.nn.functional as F
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

from skewadam.integrations.torchtitan import SkewAdamOptimizers


def build_model(family: str, flavor: str, layers: int) -> torch.nn.Module:
    config = importlib.import_module(f"torchtitan.models.{family}").model_registry(flavor).model
    config.layers = config.layers[:layers]
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def batch(step: int, vocab: int, args) -> torch.Tensor:
    """A learnable stream: runs of consecutive token ids from random starts, the same for a given step."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, vocab, (args.batch, 1), generator=g)
    return (starts + torch.arange(args.seq + 1)) % vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="deepseek_v3",
                   help="torchtitan.models.<family> (qwen3, gpt_oss, kimi_k2_7, ...)")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--layers", type=int, default=2, help="keep the first N layers (DeepSeek-V3: the 1st is dense)")
    p.add_argument("--steps", type=int, default=20, help="train up to this step")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt", default="", help="checkpoint folder: resume from its latest step, save at the last")
    p.add_argument("--stop-at", type=int, default=0, help="save and stop at this step (an interrupted run)")
    p.add_argument("--in-backward", action="store_true", help="step each tensor inside backward, freeing its gradient")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # SkewAdam logs its tier census

    torch.manual_seed(0)
    model = build_model(args.family, args.flavor, args.layers)
    optimizers = SkewAdamOptimizers.Config(lr=args.lr, weight_decay=0.1,
                                           in_backward=args.in_backward).build(model_parts=[model])
    schedule = LRSchedulersContainer.Config(warmup_steps=5).build(optimizers=optimizers, training_steps=args.steps)
    stop = args.stop_at or args.steps
    manager = CheckpointManager(
        CheckpointManager.Config(enable=bool(args.ckpt), folder="checkpoint", interval=stop, keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedule, states={},
        sd_adapter=None, base_folder=args.ckpt)
    start = 0
    if args.ckpt and manager.load():  # the latest step saved in the folder
        start = schedule.schedulers[0].last_epoch
        print(f"resumed at step {start}")

    vocab = model.tok_embeddings.num_embeddings
    for step in range(start + 1, stop + 1):
        ids = batch(step, vocab, args)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        lr = optimizers.optimizers[0].param_groups[0]["lr"]
        optimizers.step()
        optimizers.zero_grad()
        schedule.step()
        print(f"step {step:4d}  loss {loss.item():.4f}  lr {lr:.2e}")
        manager.save(step)  # at the interval only


if __name__ == "__main__":
    main()
