"""The reference MoE language model of the paper, with size presets from a test toy to the 6.78B model.

Decoder-only transformer: learned token and position embeddings, tied LM head, pre-LayerNorm (with bias),
grouped-query attention, and blocks that alternate a dense SwiGLU FFN (even blocks) with a Mixture-of-Experts SwiGLU
FFN (odd blocks). All linear maps are bias-free.

MoE layer (per token ``x``, ``E`` experts, top ``k``):
    logits = router(x)                          (zero-initialised; + N(0, 0.5^2) noise in training)
    probs = softmax(logits); w, idx = topk(probs, k); w = w / sum(w)
    y = sum_j w_j * expert_{idx_j}(x),   expert(x) = w2 @ (silu(w1 @ x) * (w3 @ x))
    balance_loss = coef * E * sum_i mean_prob_i * token_frac_i     (uniform routing gives exactly coef)
    z_loss = z_coef * mean(logsumexp(logits)^2)                     (on the noise-free logits)
where ``mean_prob_i`` is the mean routing probability of expert i over tokens, and ``token_frac_i`` the fraction
of the ``N*k`` top-k assignments that went to expert i. Losses are summed over MoE layers.

Experts are stacked 3-D tensors. Dispatch sorts the ``N*k`` (token, expert) assignments by expert so each expert's
tokens are contiguous, then runs all experts at once with grouped matmuls (`expert_dispatch`): no Python loop over
tokens or experts.

Shape legend: B batch, T sequence, D d_model, V vocab, H query heads, G kv heads, K head dim, F FFN hidden,
E experts, N tokens (B*T), A assignments (N*k).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MoEConfig", "MoEOutput", "MoETransformer", "get_config", "CONFIGS", "expert_dispatch"]


@dataclasses.dataclass
class MoEConfig:
    """Architecture and MoE loss settings. Defaults are the paper's where it states them."""

    vocab_size: int = 50257
    block_size: int = 256  # learned positions: the longest sequence the model accepts
    n_layer: int = 2  # even blocks dense, odd blocks MoE
    d_model: int = 4096
    n_head: int = 32
    n_kv_head: int = 8
    d_ff: int = 4096  # hidden size of the dense SwiGLU FFN
    d_expert: int = 4096  # hidden size of each expert's SwiGLU FFN
    n_experts: int = 128
    top_k: int = 2
    router_noise_std: float = 0.5  # std of the Gaussian noise added to router logits in training
    balance_coef: float = 0.05
    z_loss_coef: float = 1e-4
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name}={value!r}: a size, must be an integer >= 1")
            if f.type in ("float", float) and (not isinstance(value, (int, float)) or not value >= 0
                                               or not math.isfinite(value)):
                raise ValueError(f"{f.name}={value!r}: must be a finite number >= 0")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} (GQA)")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")


CONFIGS: dict[str, MoEConfig] = {
    # unit tests: a few thousand parameters, runs in milliseconds
    "tiny": MoEConfig(vocab_size=256, block_size=32, n_layer=2, d_model=32, n_head=4, n_kv_head=2,
                      d_ff=64, d_expert=32, n_experts=4),
    # the CPU benchmark (`skewadam bench`): byte vocabulary, expert-dominated like the paper's model
    "cpu": MoEConfig(vocab_size=256, block_size=128, n_layer=4, d_model=128, n_head=4, n_kv_head=2,
                     d_ff=256, d_expert=256, n_experts=8),
    # the 10x study (docs/study/scale.md): 20,296,320 parameters, 77.5% of them in 4 MoE layers of 8 experts (`cpu`:
    # 77.9%); wider and deeper than `cpu`, and no hidden matrix has the token or position table's shape
    "cpu-20m": MoEConfig(vocab_size=256, block_size=128, n_layer=8, d_model=320, n_head=8, n_kv_head=4,
                         d_ff=512, d_expert=512, n_experts=8),
    # the paper's model: 6,784,135,168 parameters, 97% of them in the 128 experts
    "paper-6.78b": MoEConfig(),
}


def get_config(name: str, **overrides) -> MoEConfig:
    """A copy of the named preset (``tiny``, ``cpu``, ``cpu-20m``, ``paper-6.78b``) with ``overrides`` applied.

    Example:
        >>> cfg = get_config("cpu", vocab_size=1024)
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}: use one of {sorted(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides)


class MoEOutput(NamedTuple):
    logits: Tensor  # [B, T, V]
    loss: Optional[Tensor]  # lm_loss + balance_loss + z_loss
    lm_loss: Optional[Tensor]  # mean cross-entropy, nats per token
    balance_loss: Optional[Tensor]  # summed over MoE layers
    z_loss: Optional[Tensor]  # summed over MoE layers


class Attention(nn.Module):
    """Causal grouped-query attention: G kv heads shared by H/G query heads each."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x_BTD: Tensor) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BHTK = self.wq(x_BTD).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k_BGTK = self.wk(x_BTD).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v_BGTK = self.wv(x_BTD).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, is_causal=True, enable_gqa=True)
        return self.wo(y_BHTK.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """Dense FFN: ``w2 @ (silu(w1 @ x) * (w3 @ x))``."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """E SwiGLU experts stored as stacked tensors: w1, w3 ``[E, F, D]``, w2 ``[E, D, F]``."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_expert))


def expert_dispatch(x_ND: Tensor, expert_NK: Tensor, weight_NK: Tensor, experts: Experts) -> Tensor:
    """``y_n = sum_j weight_nj * expert_{expert_nj}(x_n)`` for all tokens at once.

    The ``A = N*k`` (token, expert) assignments are sorted by expert (stable), so each expert's inputs form one
    contiguous run of ``x_AD``; each SwiGLU matmul is then one ``F.grouped_mm`` over the ragged runs (no host sync, no
    padding), and the weighted outputs are summed back per token with ``index_add_``: the fastest of three
    dispatches on CPU (``docs/bench/design.md``).
    """
    E = experts.w1.shape[0]
    k = expert_NK.shape[1]
    expert_A = expert_NK.reshape(-1)
    order_A = torch.argsort(expert_A, stable=True)
    token_A = order_A // k  # the token of each sorted assignment
    offs_E = torch.bincount(expert_A, minlength=E).cumsum(0).to(torch.int32)  # end of each expert's run
    x_AD = x_ND[token_A]
    h_AF = F.silu(F.grouped_mm(x_AD, experts.w1.transpose(-2, -1), offs=offs_E))
    h_AF = h_AF * F.grouped_mm(x_AD, experts.w3.transpose(-2, -1), offs=offs_E)
    y_AD = F.grouped_mm(h_AF, experts.w2.transpose(-2, -1), offs=offs_E)
    y_AD = y_AD * weight_NK.reshape(-1)[order_A, None].to(y_AD.dtype)
    return torch.zeros_like(x_ND).index_add_(0, token_A, y_AD)


class MoE(nn.Module):
    """Noisy top-k router over SwiGLU experts, with the load-balancing and router z-losses (module docstring)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert)

    def forward(self, x_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        logits_NE = self.router(x_ND).float()
        z_loss = cfg.z_loss_coef * torch.logsumexp(logits_NE, dim=-1).square().mean()
        if self.training and cfg.router_noise_std > 0:
            logits_NE = logits_NE + torch.randn_like(logits_NE) * cfg.router_noise_std
        probs_NE = logits_NE.softmax(dim=-1)
        weight_NK, expert_NK = probs_NE.topk(cfg.top_k, dim=-1)
        weight_NK = weight_NK / weight_NK.sum(dim=-1, keepdim=True)
        token_frac_E = torch.bincount(expert_NK.reshape(-1), minlength=cfg.n_experts).float() / expert_NK.numel()
        balance_loss = cfg.balance_coef * cfg.n_experts * (probs_NE.mean(dim=0) * token_frac_E).sum()
        y_ND = expert_dispatch(x_ND, expert_NK, weight_NK, self.experts)
        return y_ND.view_as(x_BTD), balance_loss, z_loss


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if index % 2 == 0:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)
        else:
            self.moe = MoE(cfg)

    def forward(self, x: Tensor) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        x = x + self.attn(self.ln1(x))
        if hasattr(self, "ffn"):
            return x + self.ffn(self.ln2(x)), None, None
        y, balance_loss, z_loss = self.moe(self.ln2(x))
        return x + y, balance_loss, z_loss


class MoETransformer(nn.Module):
    """Decoder-only MoE language model (module docstring). ``forward(idx, targets=None) -> MoEOutput``.

    Example:
        >>> model = MoETransformer(get_config("tiny"))
        >>> out = model(idx_BT, targets=targets_BT)
        >>> out.loss.backward()
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, 0.02) everywhere; residual output projections (attn.wo, ffn.w2, experts.w2) scaled by
        1/sqrt(2*n_layer) (GPT-2); router zero; LayerNorm weight 1, bias 0. No-op on the meta device."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                p.fill_(1.0)
            elif name.endswith("bias") or name.endswith("router.weight"):
                p.zero_()
            elif name.endswith(("attn.wo.weight", "ffn.w2.weight", "experts.w2")):
                p.normal_(0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                p.normal_(0.0, std)

    def forward(self, idx_BT: Tensor, targets_BT: Optional[Tensor] = None) -> MoEOutput:
        """Logits of the next token at every position and, given targets, the losses.

        Args:
            idx_BT: token ids ``[B, T]``, ``T <= block_size``.
            targets_BT: next-token ids ``[B, T]``, or None for logits only.

        Returns:
            `MoEOutput`: ``logits`` ``[B, T, V]``; with targets, ``loss = lm_loss + balance_loss + z_loss`` (the
            MoE losses summed over MoE layers, zero without any) and each term; without, None for all four.
        """
        B, T = idx_BT.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}; crop the input")
        x = self.tok_emb(idx_BT) + self.pos_emb(torch.arange(T, device=idx_BT.device))
        balance_loss = z_loss = None
        for block in self.blocks:
            x, bal, z = block(x)
            if bal is not None:
                balance_loss = bal if balance_loss is None else balance_loss + bal
                z_loss = z if z_loss is None else z_loss + z
        logits_BTV = F.linear(self.ln_f(x), self.tok_emb.weight)
        if targets_BT is None:
            return MoEOutput(logits_BTV, None, None, None, None)
        lm_loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.reshape(-1))
        zero = lm_loss.new_zeros(())
        balance_loss = zero if balance_loss is None else balance_loss
        z_loss = zero if z_loss is None else z_loss
        return MoEOutput(logits_BTV, lm_loss + balance_loss + z_loss, lm_loss, balance_loss, z_loss)

    def num_params(self) -> int:
        """Parameter count (the tied LM head counted once)."""
        return sum(p.numel() for p in self.parameters())
