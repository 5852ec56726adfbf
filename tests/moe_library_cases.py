"""Mixture-of-Experts models from the codebases outside Transformers, with the tiers each parameter must get.

Each `Case` builds a model from the real library (on the meta device where the library allows it, else a tiny CPU
config) and states the expected labels, written from reading that library's MoE layer: ``expert`` / ``router`` are
regexes (``re.search``) on parameter names, everything else trainable is backbone. ``note`` says what in the source
decided the less obvious labels. A case whose library is not installed is skipped (`Case.requires`).

Shared rules of the reading: routed experts see only the tokens routed to them (expert); the router is every
parameter of the module whose output is scored over the E experts and fed to a top-k (its bias, scales, a first
projection of a two-stage router); shared experts run on every token and so are backbone, as is the gate that scales
them (it scores no routed expert). Buffers (expert-bias load balancing) are not parameters. The untied output head
(`Case.head`) is the projection to the vocabulary that produces the logits, read from each library's forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import warnings
from typing import Callable

import torch
from torch import nn

#: Sizes of the hand-built layers (DeepSpeed, fairscale, lucidrains, st-moe): width, expert width, experts.
D, F, E = 32, 16, 8
#: Each library's untied output head (the hand-built layers sit in `_Model`, whose head is `head`).
_HEADS = {"torchtitan": r"^lm_head\.weight$", "olmo_core": r"^lm_head\.w_out\.weight$",
          "megatron": r"^output_layer\.weight$", "litgpt": r"^lm_head\.weight$"}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str  # "<library>:<model>"
    build_fn: Callable[[], nn.Module]
    expert: str
    router: str
    requires: tuple[str, ...]  # modules that must import
    note: str = ""
    flat: int = 0  # the number of experts its flattened expert tensors [E*F, D] stack (0: it has none)

    @property
    def library(self) -> str:
        return self.id.split(":")[0]

    @property
    def head(self) -> str:
        """A regex matching the name of the untied output head."""
        return _HEADS.get(self.library, r"^head\.weight$")

    def missing(self) -> str:
        """The first required module that does not import, with the reason ("" if all import)."""
        for mod in self.requires:
            try:
                importlib.import_module(mod)
            except Exception as e:  # a library can fail at import for reasons other than absence (ImportError)
                return f"{mod}: {type(e).__name__}: {e}"
        return ""

    def build(self) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.build_fn()

    def expected(self, model: nn.Module) -> dict[str, str]:
        """``{trainable name: tier}`` by this case's rules."""
        labels = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if re.search(self.expert, name):
                labels[name] = "expert"
            elif self.router and re.search(self.router, name):
                labels[name] = "router"
            else:
                labels[name] = "backbone"
        return labels


@contextlib.contextmanager
def one_process_group():
    """A 1-rank gloo process group for libraries that need one to build a layer (fairscale, megatron, torchscale)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- torchtitan
def _torchtitan(family: str, flavor: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        spec = importlib.import_module(f"torchtitan.models.{family}").model_registry(flavor, **kwargs)
        with torch.device("meta"):
            return spec.model.build()

    return build


_TT_EXPERT = r"\.moe\.routed_experts\.inner_experts\."
_TT_ROUTER = r"\.moe\.router\.gate\.(weight|bias)$"
_TT_NOTE = ("common/moe.py MoE: router = TokenChoiceTopKRouter whose gate Linear(D, E) feeds sigmoid/softmax -> topk; "
            "routed_experts.inner_experts holds the [E, ...] banks; expert_bias_E is a buffer; shared_experts "
            "(FeedForward) run on every token")


def _tt(family, flavor, requires=("torchtitan",), note="", expert=_TT_EXPERT, **kwargs) -> Case:
    return Case(f"torchtitan:{family}/{flavor}" + "".join(f"+{k}={v}" for k, v in kwargs.items()),
                _torchtitan(family, flavor, **kwargs), expert, _TT_ROUTER, requires, note or _TT_NOTE)


# ------------------------------------------------------------------------------------------------- OLMo-core
def _olmo(name: str = "llama_like_moe", *, moe=None, router=None, latent=None, **kwargs) -> Callable[[], nn.Module]:
    """An OLMo-core ``MoETransformer`` (2 layers, d_model 256): a `TransformerConfig` preset, or ``llama_like_moe``
    (16 experts of width 64, top 2); ``moe`` / ``router`` set fields of its ``MoEConfig`` / ``MoERouterConfig``,
    ``latent`` those of a ``LatentMoEConfig`` of width 128 (experts run in L < D between latent_down_proj and
    latent_up_proj)."""

    def build():
        from olmo_core.nn.moe.moe import LatentMoEConfig
        from olmo_core.nn.transformer import TransformerConfig

        sizes = dict(n_heads=4, num_experts=16, top_k=2, expert_hidden_size=64) if name == "llama_like_moe" else {}
        cfg = getattr(TransformerConfig, name)(vocab_size=256, n_layers=2, d_model=256, **{**sizes, **kwargs})
        ffn = cfg.block.feed_forward_moe
        for target, fields in ((ffn, moe), (ffn.router, router)):
            for key, value in (fields or {}).items():
                setattr(target, key, value)
        if latent is not None:
            ffn.latent_moe = LatentMoEConfig(latent_dim=128, **latent)
        return cfg.build(init_device="meta")

    return build


def _olmo_v2(module: str = "qwen", fn: str = "build_debug_qwen3_moe_config", edit=None, **kwargs):
    """An OLMo-core ``OLMoDDPModel`` (its fused MoE-v2 blocks) from one of its debug builders; ``edit(block config)``
    changes every block's config before the build."""

    def build():
        cfg = getattr(importlib.import_module(f"olmo_core.nn.moe.v2.{module}"), fn)(vocab_size=256, **kwargs)
        for block in (cfg.block.values() if isinstance(cfg.block, dict) else [cfg.block]) if edit else ():
            edit(block)
        return cfg.build(init_device="meta")

    return build


def _set(**fields):
    """An ``edit`` of `_olmo_v2`: ``part=dict(field=value)`` sets fields of a block config's part."""
    def edit(block):
        for part, values in fields.items():
            for key, value in values.items():
                setattr(getattr(block, part), key, value)

    return edit


def _v2_latent(block):
    """The routed experts in a latent width 128 (biased projections, a norm before the up projection)."""
    from olmo_core.nn.moe.moe import LatentMoEConfig

    block.latent_moe = LatentMoEConfig(latent_dim=128, bias=True, up_proj_input_norm_enabled=True)
    block.routed_experts.d_model = 128


def _v2_emo(block):
    """EMO routing: a document-level pool of experts (`EmoRouterV2`)."""
    from olmo_core.nn.moe.emo import EmoRouterConfig

    block.routed_experts_router.emo = EmoRouterConfig(eos_token_id=0, min_document_expert_pool=2,
                                                      max_document_expert_pool=4)


_OLMO_EXPERT, _OLMO_ROUTER = r"\.feed_forward_moe\.experts\.mlp\.w[123]$", r"\.feed_forward_moe\.router\.weight$"
_V2_EXPERT, _V2_ROUTER = r"\.routed_experts\.[wb]_", r"\.routed_experts_router\."


def _oc(case_id, build, note, flat=0) -> Case:
    return Case(f"olmo_core:{case_id}", build, _OLMO_EXPERT, _OLMO_ROUTER, ("olmo_core",), note, flat)


def _v2(case_id, build, note, expert=_V2_EXPERT) -> Case:
    return Case(f"olmo_core:v2/{case_id}", build, expert, _V2_ROUTER, ("olmo_core",), note)


# ------------------------------------------------------------------------------------------------- megatron-core
def _megatron(**kwargs) -> Callable[[], nn.Module]:
    """GPTModel with the local (non-TransformerEngine) layer spec, initialised on the CPU (grouped experts need TE)."""

    def build():
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        with one_process_group():
            parallel_state.initialize_model_parallel()
            try:
                cfg = TransformerConfig(num_layers=2, hidden_size=D, num_attention_heads=4, num_moe_experts=E,
                                        moe_router_topk=2, moe_ffn_hidden_size=F, ffn_hidden_size=64,
                                        use_cpu_initialization=True, **kwargs)
                spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
                return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=64)
            finally:
                parallel_state.destroy_model_parallel()

    return build


# ------------------------------------------------------------------------------------------------- DeepSpeed
class _Block(nn.Module):
    """A pre-norm transformer block around a library's MoE layer (for layers that come without a model)."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(D)
        self.moe = moe


class _Model(nn.Module):
    def __init__(self, *moes: nn.Module, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(_Block(m) for m in moes)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)


def _mlp(d: int = D, f: int = F) -> nn.Module:
    return nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d))


def _deepspeed(**kwargs) -> Callable[[], nn.Module]:
    def build():
        from deepspeed.moe.layer import MoE

        return _Model(*(MoE(hidden_size=D, expert=_mlp(), **kwargs) for _ in range(2)))

    return build


class _DeepSpeedGroupedMoE(nn.Module):
    """DeepSpeed's grouped-GEMM experts (``is_expert_group`` marks) and token-choice router, as AutoEP composes them."""

    def __init__(self):
        super().__init__()
        from deepspeed.moe.ep_experts import GroupedExperts
        from deepspeed.moe.ep_router import TokenChoiceTopKRouter

        self.router = TokenChoiceTopKRouter(dim=D, num_experts=E, num_expert_groups=None, num_limited_groups=None,
                                            top_k=2, score_func="softmax", route_norm=False, route_scale=1.0,
                                            gate_bias=True)
        self.experts = GroupedExperts(dim=D, hidden_dim=F, num_experts=E, use_grouped_mm=False)
        self.shared_experts = _mlp()


# ------------------------------------------------------------------------------------------------- litgpt
def _litgpt(name: str, **overrides) -> Callable[[], nn.Module]:
    def build():
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config.from_name(name, n_layer=2, **overrides)
        with torch.device("meta"):
            return GPT(config)

    return build


# ------------------------------------------------------------------------------------------------- fairscale-style
def _fairscale(k: int = 2) -> Callable[[], nn.Module]:
    def build():
        from fairscale.nn.moe import MOELayer, Top2Gate

        with one_process_group():
            return _Model(*(MOELayer(Top2Gate(D, E), nn.ModuleList(_mlp() for _ in range(E))) for _ in range(k)))

    return build


def _lucidrains_moe(hierarchical: bool = False) -> Callable[[], nn.Module]:
    def build():
        from mixture_of_experts import HeirarchicalMoE, MoE

        with torch.device("meta"):
            if hierarchical:
                return _Model(HeirarchicalMoE(D, num_experts=(4, 4), hidden_dim=F), HeirarchicalMoE(D, (4, 4)))
            return _Model(MoE(D, num_experts=E, hidden_dim=F), MoE(D, num_experts=E))

    return build


def _st_moe(block: bool = False) -> Callable[[], nn.Module]:
    def build():
        from st_moe_pytorch import MoE, SparseMoEBlock

        with torch.device("meta"):
            moes = [MoE(D, num_experts=E, is_distributed=False) for _ in range(2)]
            if block:
                moes = [SparseMoEBlock(m, add_ff_before=True, add_ff_after=True) for m in moes]
            return _Model(*moes)

    return build


def _torchscale(use_xmoe: bool = False) -> Callable[[], nn.Module]:
    """torchscale's X-MoE layer as its Decoder builds one (gate, `make_experts`, `MOELayer`), in our block: the
    Decoder itself imports timm (drop path), which the MoE code does not need."""

    def build():
        from torchscale.architecture.config import DecoderConfig
        from torchscale.component.feedforward_network import make_experts
        from torchscale.component.xmoe.moe_layer import MOELayer
        from torchscale.component.xmoe.routing import Top1Gate, Top2Gate

        args = DecoderConfig(decoder_embed_dim=D, decoder_ffn_embed_dim=F, moe_freq=1, moe_expert_count=E,
                             use_xmoe=use_xmoe, moe_top1_expert=use_xmoe)
        gate = Top1Gate if use_xmoe else Top2Gate
        with one_process_group():
            return _Model(*(MOELayer(gate(D, E, use_xmoe=use_xmoe), make_experts(args, D, F), args)
                            for _ in range(2)))

    return build


CASES: list[Case] = [
    # torchtitan 0.3.0: every model registry with MoE flavors (llama3, flux, muse_glimmer are dense)
    _tt("qwen3", "debugmodel_moe"),
    _tt("qwen3", "30B-A3B"),
    _tt("deepseek_v3", "debugmodel", note=_TT_NOTE + "; DeepSeek-V3 keeps dense feed_forward layers first"),
    _tt("deepseek_v3", "debugmodel", num_mtp_layers=1,
        note="multi-token-prediction layer: one more MoE block (its own router and banks) after the trunk"),
    _tt("deepseek_v3", "16B"),
    _tt("gpt_oss", "debugmodel", expert=r"\.moe\.routed_experts\.inner_experts\.mlp[12]_(weight|bias)_",
        note="GptOssGroupedExperts: per-expert biases mlp1_bias_EG [E, 2F], mlp2_bias_ED [E, D] are expert; "
             "router gate Linear(D, E) with a bias (F.linear -> topk): router"),
    _tt("gpt_oss", "20b", expert=r"\.moe\.routed_experts\.inner_experts\.mlp[12]_(weight|bias)_"),
    _tt("kimi_k2_7", "debugmodel", note=_TT_NOTE + "; the vision encoder (pos_embed [16, 16, D]) is dense"),
    _tt("kimi_k2_7", "moonlight-16B-A3B"),
    _tt("qwen3_5", "debugmodel_moe", requires=("torchtitan", "fla"),
        note="gated-delta-net linear attention (in_proj_a/b [H, D], conv_q/k/v) is backbone; shared_experts is a "
             "SigmoidGatedFeedForward whose gate Linear(D, 1) scales the always-on FFN: backbone"),
    _tt("qwen3_5", "35B-A3B", requires=("torchtitan", "fla")),
    # OLMo-core 3.0.0: every MoE variant of its TransformerConfig (MoEType default/dropless, the four MoE block
    # types, shared MLP, latent MoE with its options, router gating and expert bias) and of its fused MoE-v2 blocks
    # (router bias, score correction, grouped and EMO routing, expert biases and activations, shared experts, latent)
    _oc("smallmoe", _olmo("smallmoe"),
        "MoELinearRouter.weight is flat [E*D] (viewed [E, D] in get_expert_logits); MoEMLP banks flattened w1/w3 "
        "[E*D, F], w2 [E*F, D]; shared_mlp FeedForward [2D, D] (rows divide E*F) runs on every token", 32),
    _oc("small_hybrid_moe", _olmo("small_hybrid_moe"),
        "hybrid block (moe_hybrid_reordered_norm): a dense feed_forward beside the MoE, both on every token's path; "
        "only the MoE routes", 32),
    _oc("small_hybrid_moe/moe_hybrid", _olmo("small_hybrid_moe", block_name="moe_hybrid"),
        "the hybrid block without reordered norms", 32),
    _oc("olmoe_1B_7B", _olmo("olmoe_1B_7B"), "DroplessMoEMLP: w1/w2/w3 all [E*F, D]", 64),
    _oc("llama_like_moe/dropping+sigmoid+expert_bias", _olmo(capacity_factor=1.25,
                                                             router=dict(gating_function="sigmoid", bias_gamma=1e-3)),
        "MoE with a capacity factor (tokens over capacity dropped); sigmoid gating; bias_gamma's expert bias "
        "(DeepSeek-V3's load balancing) is a buffer, not a parameter", 16),
    _oc("llama_like_moe/dropless+shared+topk_softmax", _olmo(dropless=True, reordered_norm=True,
                                                             shared_expert_hidden_size=128,
                                                             router=dict(gating_function="topk_softmax",
                                                                         jitter_eps=0.1, normalize_expert_weights=1.0)),
        "DroplessMoE (moe_reordered_norm block) with a shared_mlp on every token; topk_softmax gating", 16),
    _oc("llama_like_moe/2_experts_top1", _olmo(num_experts=2, top_k=1), "two experts, top 1: router [2*D]", 2),
    _oc("latent_moe", _olmo(shared_expert_hidden_size=128, latent={}),
        "MoEBase with latent_moe: the router reads the model width D ([E*D]), the flattened experts the latent "
        "width L; latent_down_proj [L, D] / latent_up_proj [D, L] run on every routed token's path: backbone", 16),
    _oc("latent_moe/bias+norm", _olmo(latent=dict(bias=True, up_proj_input_norm_enabled=True)),
        "latent projections with biases and an RMSNorm before latent_up_proj: backbone", 16),
    _oc("latent_moe/dropless+bias", _olmo(dropless=True, latent=dict(bias=True)),
        "DroplessMoEMLP in the latent width: w1/w2/w3 all [E*F, L], so many E split them; latent_up_proj [D, L] "
        "(rows 256 = 16*16) maps the experts' output back to D: backbone; the router reads D, E = 16", 16),
    _oc("latent_moe/dropless+bias+norm+shared", _olmo(dropless=True, shared_expert_hidden_size=128,
                                                      latent=dict(bias=True, up_proj_input_norm_enabled=True)),
        "the dropless latent MoE with every option and a shared_mlp", 16),
    _v2("qwen3_moe", _olmo_v2(),
        "OLMoDDP block: routed_experts banks [E, ...] and routed_experts_router (flat [E*D]) sit on the block next "
        "to a gated-delta-net attention whose w_a/w_b are [E, D] by coincidence (heads == experts); "
        "shared_experts_router [S*D] gates the always-on shared experts: backbone"),
    _v2("qwen3_moe/no_shared", _olmo_v2(shared_expert_intermediate_size=None), "routed experts only"),
    _v2("qwen3_moe/biases", _olmo_v2(edit=_set(routed_experts_router=dict(bias=True),
                                               routed_experts=dict(bias=True))),
        "router bias [E]; expert biases b_up_gate [E, 2F], b_down [E, D]"),
    _v2("qwen3_moe/relu2", _olmo_v2(edit=_set(routed_experts=dict(activation="relu2"))),
        "ungated experts: w_up_gate [E, F, D] like w_down"),
    _v2("qwen3_moe/2_shared", _olmo_v2(edit=_set(shared_experts=dict(num_experts=2),
                                                 shared_experts_router=dict(num_experts=2, top_k=2))),
        "two shared experts (w_down [2, H, D], every token) and their sigmoid router [2*D]: backbone"),
    _v2("qwen3_moe/latent", _olmo_v2(edit=_v2_latent),
        "routed experts in the latent width: banks [E, 2F, L], [E, F, L]; latent projections backbone"),
    _v2("qwen3_moe/score_bias+groups", _olmo_v2(edit=_set(routed_experts_router=dict(
        score_correction_bias=True, n_group=2, topk_group=1))),
        "score_correction_bias is a buffer; grouped routing (n_group, topk_group) has no parameters"),
    _v2("qwen3_moe/emo", _olmo_v2(edit=_v2_emo), "EmoRouterV2: the same flat weight, document-level pools"),
    _v2("gpt_oss", _olmo_v2("gpt_oss", "build_debug_gpt_oss_20b_config"),
        "RoutedExperts with per-expert biases b_up_gate [E, 2F], b_down [E, D]; router flat weight + bias [E]"),
    _v2("nemotron3_nano", _olmo_v2("nemotron", "build_debug_nemotron3_nano_config"),
        "NemotronMoE mixer (a block's `attention` slot) holding routed_experts + router + shared_experts "
        "(column-packed [D, S*H] and [S, H, D]: always on, backbone); other blocks are Mamba or attention",
        expert=r"\.routed_experts\.w_"),
    # megatron-core 0.19.2 (local spec)
    Case("megatron:moe", _megatron(), r"\.mlp\.experts\.local_experts\.\d+\.", r"\.mlp\.router\.(weight|bias)$",
         ("megatron.core",),
         "SequentialMLP local_experts (per-expert MLPs with biases); TopKRouter weight [E, D] + bias [E] "
         "(add_bias_linear); expert params carry allreduce=True here (no expert parallelism)"),
    Case("megatron:moe_shared", _megatron(add_bias_linear=False, moe_shared_expert_intermediate_size=64),
         r"\.mlp\.experts\.local_experts\.\d+\.", r"\.mlp\.router\.weight$", ("megatron.core",),
         "SharedExpertMLP on every token: backbone"),
    Case("megatron:moe_shared_gate", _megatron(add_bias_linear=False, moe_shared_expert_intermediate_size=64,
                                               moe_shared_expert_gate=True),
         r"\.mlp\.experts\.local_experts\.\d+\.", r"\.mlp\.router\.weight$", ("megatron.core",),
         "shared_experts.gate_weight [1, D]: sigmoid gate of the shared expert's output: backbone"),
    Case("megatron:moe_layer_freq", _megatron(moe_layer_freq=[0, 1]), r"\.mlp\.experts\.local_experts\.\d+\.",
         r"\.mlp\.router\.(weight|bias)$", ("megatron.core",), "first layer dense MLP, second MoE"),
    # DeepSpeed 0.19.8
    Case("deepspeed:moe_top1", _deepspeed(num_experts=E, k=1),
         r"\.deepspeed_moe\.experts\.deepspeed_experts\.\d+\.", r"\.deepspeed_moe\.gate\.wg\.weight$",
         ("deepspeed",), "Experts marks every expert param allreduce=False, group_name=ep_size_1; TopKGate.wg "
                         "Linear(D, E) -> top1gating"),
    Case("deepspeed:moe_residual_e2", _deepspeed(num_experts=2, k=1, use_residual=True),
         r"\.deepspeed_moe\.experts\.deepspeed_experts\.\d+\.", r"\.deepspeed_moe\.gate\.wg\.weight$",
         ("deepspeed",), "Residual MoE: mlp runs on every token and coefficient Linear(D, 2) softmax-mixes it with "
                         "the MoE output (scores no expert; [2, D] like the 2-expert router): backbone"),
    Case("deepspeed:grouped_experts", lambda: _Model(_DeepSpeedGroupedMoE(), _DeepSpeedGroupedMoE()),
         r"\.moe\.experts\.w[123]$", r"\.moe\.router\.gate\.(weight|bias)$", ("deepspeed",),
         "ep_experts.GroupedExperts banks marked is_expert_group=True; ep_router gate Linear(D, E)"),
    # litgpt 0.5.13
    Case("litgpt:Mixtral-8x7B-v0.1", _litgpt("Mixtral-8x7B-v0.1"), r"\.mlp\.experts\.\d+\.", r"\.mlp\.gate\.weight$",
         ("litgpt",), "LLaMAMoE: gate Linear(D, E) -> topk; experts ModuleList of LLaMAMLP"),
    Case("litgpt:Qwen3-30B-A3B", _litgpt("Qwen3-30B-A3B"), r"\.mlp\.experts\.\d+\.", r"\.mlp\.gate\.weight$",
         ("litgpt",)),
    Case("litgpt:deepseek-style", _litgpt("Mixtral-8x7B-v0.1", n_expert=8, n_expert_per_token=2, n_shared_expert=1,
                                          n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=2,
                                          moe_intermediate_size=512),
         r"\.mlp\.experts\.\d+\.", r"\.mlp\.gate\.weight$", ("litgpt",),
         "GroupedTopkRouter (weight [E, D], e_score_correction_bias buffer) + shared_experts LLaMAMLP: backbone"),
    # fairscale 0.4.13, mixture-of-experts 0.2.3, st-moe-pytorch 0.1.8, torchscale 0.3.0
    Case("fairscale:moe_layer", _fairscale(), r"\.moe\.experts\.\d+\.", r"\.moe\.gate\.wg\.weight$", ("fairscale",),
         "MOELayer marks expert params p.expert = True; Top2Gate.wg Linear(D, E)"),
    Case("mixture_of_experts:moe", _lucidrains_moe(), r"\.moe\.experts\.w[12]$", r"\.moe\.gate\.w_gating$",
         ("mixture_of_experts",), "Top2Gating.w_gating is transposed [D, E]; Experts banks w1 [E, D, H], w2 [E, H, D]"),
    Case("mixture_of_experts:hierarchical", _lucidrains_moe(hierarchical=True), r"\.moe\.experts\.w[12]$",
         r"\.moe\.gate_(outer|inner)\.w_gating$", ("mixture_of_experts",),
         "two-stage routing: gate_outer [D, Eo] picks a group, gate_inner [Eo, D, Ei] an expert in it; experts "
         "banks [Eo, Ei, D, H]"),
    Case("st_moe:moe", _st_moe(), r"\.moe\.experts\.experts\.\d+\.", r"\.moe\.gate\.to_gates\.weight$",
         ("st_moe_pytorch",), "TopNGating.to_gates Linear(D, E); Experts ModuleList of Expert (GEGLU mult_bias)"),
    Case("st_moe:sparse_block", _st_moe(block=True), r"\.moe\.moe\.experts\.experts\.\d+\.",
         r"\.moe\.moe\.gate\.to_gates\.weight$", ("st_moe_pytorch",),
         "SparseMoEBlock: ff_before/ff_after are dense Expert FFNs (prenorm) on every token: backbone"),
    Case("torchscale:top2", _torchscale(), r"\.moe\.experts\.\d+\.", r"\.moe\.gate\.wg\.weight$",
         ("torchscale",), "MOELayer marks p.expert = True; Top2Gate.wg Linear(D, E); experts FeedForwardNetwork"),
    Case("torchscale:xmoe", _torchscale(use_xmoe=True), r"\.moe\.experts\.\d+\.",
         r"\.moe\.gate\.(wg|wg_reduction\.weight)$", ("torchscale",),
         "X-MoE two-stage router: wg_reduction Linear(D, 16) then cosine scores against wg [E, 16]"),
]
