"""A tiny torchtitan Qwen3-MoE that trains on the CPU, for the `skewadam.integrations.torchtitan` tests.

Built with torchtitan's own Qwen3 MoE layer builder (the one its ``debugmodel_moe`` flavor uses) at a few thousand
parameters per expert bank. FlexAttention has no CPU backward, so attention is torchtitan's SDPA module (causal,
no document masks), as its graph-trainer tests configure it.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH = 128, 16, 4


def tiny_qwen3_moe(num_experts: int = 4, seed: int = 0, *, enable_ep: bool = False, meta: bool = False) -> nn.Module:
    """Qwen3 MoE, 2 layers, width 32, ``num_experts`` experts of width 16 (top 2), weights initialised by torchtitan
    from ``seed`` (left on the meta device with ``meta``, to be parallelized first). The sharding configs are set as
    torchtitan's trainer sets them (``enable_ep``: expert parallelism)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    dim, head_dim = 32, 8
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=_build_qwen3_moe_layers(
            n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=16,
            num_experts=num_experts, top_k=min(2, num_experts), attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1e6),
        ),
    )
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=enable_ep)
    with torch.device("meta"):
        model = config.build()
    return model if meta else init(model, seed)


def init(model: nn.Module, seed: int) -> nn.Module:
    """Materialise ``model`` on the CPU with torchtitan's initialisation, from ``seed``."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def batches(steps: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def loss_fn(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
