"""Tiny configs of every Mixture-of-Experts family in Hugging Face Transformers, with the tiers each parameter must get.

Each `Family` names a config class and model class of ``transformers.models.<module>``, tiny config keyword
arguments (an MoE layer included), and the expected labels written from reading the family's modeling code:
``expert`` / ``router`` are regexes (``re.search``) on parameter names, everything else trainable is backbone, and
``frozen`` matches the parameters the family itself creates with ``requires_grad=False`` (left out of the tiers).
The note says what in the forward decided the less obvious labels. Models are built on the meta device: no memory.

Shared reading of the Transformers 5 code: routed experts are ``XxxExperts`` modules holding ``gate_up_proj``
``[E, 2F, D]`` and ``down_proj`` ``[E, D, F]`` (``up_proj`` alone for non-gated experts); the router is ``gate`` or
``router`` (``XxxTopKRouter``, a ``weight [E, D]``) whose logits feed ``torch.topk``; DeepSeek-style
``e_score_correction_bias`` is an ``nn.Buffer`` (not a parameter) unless noted; ``shared_expert(s)`` / ``shared_mlp``
run on every token and so are backbone, as is the per-token sigmoid ``shared_expert_gate`` ``[1, D]`` that scales them.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import warnings

import torch

#: Sizes every tiny config gets, where the config class has the field.
TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    shared_expert_intermediate_size=48, num_local_experts=8, num_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, pad_token_id=0, bos_token_id=0, eos_token_id=0,
)

BANK = r"\.experts\.(gate_up_proj|down_proj)$"  # the stacked routed experts of Transformers 5
GATE = r"\.mlp\.gate\.weight$"  # `self.gate = XxxTopKRouter(config)`: weight [E, D]
ROUTER = r"\.mlp\.router\.weight$"  # `self.router = XxxTopKRouter(config)`


@dataclasses.dataclass(frozen=True)
class Family:
    module: str  # transformers.models.<module>
    config: str
    model: str
    kwargs: dict
    expert: str
    router: str  # "" when nothing routes: the experts are chosen otherwise
    frozen: str = ""
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.module}:{self.model}"

    def build(self) -> torch.nn.Module:
        mod = importlib.import_module(f"transformers.models.{self.module}")
        config_cls = getattr(mod, self.config)
        fields = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set()
        kwargs = {k: v for k, v in TINY.items() if k in fields}
        kwargs.update(self.kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = config_cls(**kwargs)
            with torch.device("meta"):
                return getattr(mod, self.model)(config)

    def expected(self, model: torch.nn.Module) -> tuple[dict[str, str], list[str]]:
        """``({trainable name: tier}, [frozen names])`` by this family's rules."""
        labels, frozen = {}, []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                frozen.append(name)
            elif re.search(self.expert, name):
                labels[name] = "expert"
            elif self.router and re.search(self.router, name):
                labels[name] = "router"
            else:
                labels[name] = "backbone"
        return labels, frozen


def _deepseek(module, config, model, kwargs=None, note="", **extra) -> Family:
    """DeepSeek-V3-style block: `experts` bank, `gate` TopkRouter (bias-correction buffer), `shared_experts` MLP."""
    return Family(module, config, model, kwargs or {}, BANK, GATE,
                  note=note or "DeepSeek-V3 block: routed bank + gate; shared_experts MLP sees every token", **extra)


FAMILIES: list[Family] = [
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM", {}, BANK, GATE,
           note="MixtralSparseMoeBlock: gate (TopKRouter, softmax->topk) + experts bank; nothing shared"),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", {}, BANK, GATE,
           note="shared_expert runs on all tokens; shared_expert_gate [1, D] is a per-token sigmoid on its output, "
                "not a router over experts: backbone"),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}, BANK, GATE),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {}, BANK, GATE,
           note="as Qwen2-MoE; the gated-delta-net linear attention (in_proj_ba, A_log, dt_bias) is backbone"),
    Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}, BANK, GATE,
           note="Qwen3-Next block (shared_expert + sigmoid shared_expert_gate: backbone)"),
    Family("qwen3_vl_moe", "Qwen3VLMoeConfig", "Qwen3VLMoeModel",
           {"text_config": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [1, 1, 2]}},
            "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                              "out_hidden_size": 32, "deepstack_visual_indexes": [0]}},
           r"^language_model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$",
           r"^language_model\.layers\.\d+\.mlp\.gate\.weight$",
           note="vision-language model: the text config's expert-parallel plan is matched under language_model.; "
                "the vision tower is dense (backbone)"),
    Family("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerModel",
           {"shared_expert_intermediate_size": 48, "mlp_only_layers": []}, BANK, GATE,
           note="talker text block = Qwen2-MoE block (shared_expert + sigmoid shared_expert_gate: backbone)"),
    Family("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", {}, BANK, GATE,
           note="Qwen2-MoE block; hyper-connection mixers (block_inject_weight [4, D]) are backbone"),
    Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", {}, BANK, GATE),
    Family("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM", {}, BANK, GATE),
    _deepseek("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", {"n_group": 2, "topk_group": 1},
              note="group-limited greedy TopkRouter (weight only) + bank; shared_experts MLP on every token"),
    _deepseek("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
              {"first_k_dense_replace": 1, "n_group": 2, "topk_group": 1},
              note="sigmoid TopkRouter; e_score_correction_bias is an nn.Buffer (aux-loss-free balancing, updated "
                   "outside the optimizer), so only gate.weight is a router parameter"),
    _deepseek("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM",
              {"first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"], "n_group": 2, "topk_group": 1},
              note="V3 block; the sparse-attention indexer (weights_proj) is attention: backbone"),
    _deepseek("deepseek_v4", "DeepseekV4Config", "DeepseekV4ForCausalLM", {},
              note="early layers use a HashRouter: experts picked by token id (tid2eid buffer) but gate.weight still "
                   "scores them (weights = score_fn(logits).gather): router; hyper-connections backbone"),
    _deepseek("deepseek_ocr2", "DeepseekOcr2TextConfig", "DeepseekOcr2TextModel",
              {"mlp_layer_types": ["dense", "sparse"]}),
    _deepseek("dots1", "Dots1Config", "Dots1ForCausalLM", {"first_k_dense_replace": 1, "n_shared_experts": 1}),
    _deepseek("dots3_note", "Dots3NoteTextConfig", "Dots3NoteForCausalLM", {"num_key_value_heads": 4}),
    _deepseek("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", {"first_k_dense_replace": 1}),
    _deepseek("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", {}),
    _deepseek("glm4v_moe", "Glm4vMoeTextConfig", "Glm4vMoeTextModel", {"first_k_dense_replace": 1}),
    _deepseek("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
              {"mlp_layer_types": ["dense", "sparse"], "first_k_dense_replace": 1}),
    _deepseek("glm5_next", "Glm5NextTextConfig", "Glm5NextTextModel",
              {"num_key_value_heads": 4, "mlp_layer_types": ["dense", "sparse"]},
              note="V3 block; linear-attention forget_gate (f_a_proj, f_b_proj, A_log, dt_bias) is backbone"),
    _deepseek("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", {},
              note="V3 block; KDA forget_gate and output gate (g_a_proj, g_b_proj) are attention: backbone"),
    _deepseek("axk1", "AXK1Config", "AXK1ForCausalLM", {},
              note="V3 block; post_mlp_layernorm inside the block normalises the summed output: backbone"),
    _deepseek("axk2", "AXK2Config", "AXK2ForCausalLM", {}),
    _deepseek("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", {"first_k_dense_replace": 1},
              note="V3 block; linear-attention forget_gate and g_proj are backbone"),
    _deepseek("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM", {}),
    _deepseek("hy_v4", "HYV4Config", "HYV4ForCausalLM", {},
              note="V3 block; attention gate_proj (output gate) and hyper-connections are backbone"),
    _deepseek("mistral4", "Mistral4Config", "Mistral4Model", {}),
    _deepseek("mistral_large4", "MistralLarge4TextConfig", "MistralLarge4TextModel", {}),
    _deepseek("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM", {}),
    _deepseek("unlimited_ocr", "UnlimitedOcrTextConfig", "UnlimitedOcrTextModel", {}),
    _deepseek("step3p7", "Step3p7TextConfig", "Step3p7TextModel", {"mlp_layer_types": ["dense", "sparse"]},
              note="sigmoid TopKRouter + bank + shared_experts; attention g_proj (head gate) is backbone"),
    Family("mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", {}, BANK, GATE),
    Family("beam", "BeamConfig", "BeamForCausalLM", {"mlp_layer_types": ["dense", "sparse"]}, BANK, GATE,
           note="attention gate_proj / gate_bias are per-head output gates: backbone"),
    Family("flint", "FlintConfig", "FlintForCausalLM", {"decoder_sparse_step": 1, "mlp_only_layers": []}, BANK, GATE),
    Family("mellum", "MellumConfig", "MellumForCausalLM", {}, BANK, GATE),
    Family("kolibri1", "Kolibri1Config", "Kolibri1ForCausalLM", {}, BANK, GATE),
    Family("laguna", "LagunaConfig", "LagunaForCausalLM", {}, BANK, GATE, frozen=r"\.gate\.e_score_correction_bias$",
           note="e_score_correction_bias is an nn.Parameter with requires_grad=False: frozen, left out"),
    Family("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {}, BANK, GATE,
           frozen=r"\.moe_statics\.e_score_correction_bias$",
           note="gate = TopKRouter (weight) + moe_statics whose e_score_correction_bias has requires_grad=False"),
    Family("ernie4_5_vl_moe", "Ernie4_5_VLMoeTextConfig", "Ernie4_5_VLMoeTextModel",
           {"moe_intermediate_size": [16, 16], "moe_num_experts": 8, "hidden_size": 256, "num_attention_heads": 2,
            "num_key_value_heads": 1},
           r"\.(text|vision)_moe\.experts\.(gate_up_proj|down_proj)$", r"\.(text|vision)_moe\.gate\.weight$",
           frozen=r"\.moe_statics\.e_score_correction_bias$",
           note="two routed MoEs per layer (text_moe, vision_moe: modality decides which) + shared_experts"),
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM", {},
           r"\.experts\.(gate_up_proj|down_proj)(_bias)?$", r"\.mlp\.router\.(weight|bias)$",
           note="router = F.linear(x, weight, bias) -> topk: bias is the router's; the experts' biases [E, F] are "
                "per-expert"),
    Family("openai_privacy_filter", "OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterModel", {},
           r"\.experts\.(gate_up_proj|down_proj)(_bias)?$", r"\.mlp\.router\.(weight|bias)$",
           note="GPT-OSS block"),
    Family("switch_transformers", "SwitchTransformersConfig", "SwitchTransformersModel",
           {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2,
            "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1, "expert_capacity": 4},
           r"\.mlp\.experts\.expert_\d+\.", r"\.mlp\.router\.classifier\.weight$",
           note="SparseMLP: router.classifier Linear(D, E) -> top-1; experts = ModuleDict of per-expert DenseActDense"),
    Family("nllb_moe", "NllbMoeConfig", "NllbMoeModel",
           {"d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_layers": 2, "decoder_layers": 2,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_sparse_step": 2,
            "decoder_sparse_step": 2, "expert_capacity": 4},
           r"\.ffn\.experts\.expert_\d+\.", r"\.ffn\.router\.classifier\.",
           note="Top2Router classifier Linear(D, E) (+ bias if router_bias); experts ModuleDict (with a parameter-free "
                "dropout child), per-expert fc1/fc2 biases are expert"),
    Family("dbrx", "DbrxConfig", "DbrxForCausalLM",
           {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
            "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2}},
           r"\.ffn\.experts\.mlp\.(w1|v1|w2)$", r"\.ffn\.router\.layer\.weight$",
           note="experts flattened to 2-D [E*F, D] (viewed per expert in forward); router.layer Linear(D, E)"),
    Family("jamba", "JambaConfig", "JambaForCausalLM", {}, r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$",
           r"\.feed_forward\.router\.weight$",
           note="Mamba mixer (conv1d [C,1,K] next to dt_proj [C, r]) is backbone, not an expert bank"),
    Family("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", {},
           r"\.block_sparse_moe\.experts\.", r"\.block_sparse_moe\.router\.weight$"),
    Family("granitemoe_swa", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", {},
           r"\.block_sparse_moe\.experts\.", r"\.block_sparse_moe\.router\.weight$"),
    Family("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
           {"shared_intermediate_size": 24},
           r"\.block_sparse_moe\.experts\.", r"\.block_sparse_moe\.router\.weight$",
           note="shared_mlp (input_linear/output_linear) sits beside the MoE and sees every token: backbone"),
    Family("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
           {"mamba_n_heads": 4, "mamba_d_head": 16, "shared_intermediate_size": 24},
           r"\.block_sparse_moe\.experts\.", r"\.block_sparse_moe\.router\.weight$"),
    Family("phimoe", "PhimoeConfig", "PhimoeForCausalLM", {}, BANK, r"\.mlp\.router\.weight$",
           note="router = PhimoeTopKRouter(nn.Linear) with sparsemixer top-2"),
    Family("jetmoe", "JetMoeConfig", "JetMoeForCausalLM", {},
           r"\.(mlp|self_attention\.experts)\.(input|output)_linear\.weight$", r"\.router\.layer\.weight$",
           note="MoE MLP and mixture-of-attention-heads (MoA): ParallelExperts weight [E, out, in] chosen by "
                "TopKGating.layer; the block's output bias [D] is added for every token: backbone"),
    Family("llama4", "Llama4TextConfig", "Llama4ForCausalLM", {"intermediate_size_mlp": 64},
           r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$", r"\.feed_forward\.router\.weight$",
           note="experts see every token but pre-scaled by sigmoid(router score), -inf (so 0) off the top-k: routed; "
                "shared_expert MLP on all tokens: backbone; router is an nn.Linear subclass"),
    Family("hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {}, BANK, r"\.mlp\.gate\.wg\.weight$",
           note="gate = HunYuanMoEV1Gate holding wg Linear(D, E); shared_mlp on every token: backbone"),
    Family("hy_v3", "HYV3Config", "HYV3ForCausalLM", {}, BANK, GATE),
    Family("minimax", "MiniMaxConfig", "MiniMaxForCausalLM", {}, BANK, GATE,
           note="lightning-attention output_gate Linear(D, D) is attention: backbone"),
    Family("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", {}, BANK, GATE),
    Family("minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", {"shared_intermediate_size": 24},
           BANK, GATE, note="shared_experts DenseMLP (gate_up_proj Linear) on every token: backbone"),
    Family("aria", "AriaTextConfig", "AriaTextForCausalLM", {}, BANK, ROUTER),
    Family("afmoe", "AfmoeConfig", "AfmoeForCausalLM", {}, BANK, r"\.mlp\.router\.gate\.weight$",
           frozen=r"\.mlp\.expert_bias$",
           note="router = TokenChoiceRouter holding gate Linear(D, E); expert_bias (topk selection bias) has "
                "requires_grad=False; attention gate_proj is an output gate: backbone"),
    Family("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeForCausalLM", {"num_shared_experts": 1}, BANK, GATE),
    Family("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
           {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
           r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$", r"\.feed_forward\.gate\.weight$",
           note="expert_bias (use_expert_bias) is an nn.Buffer; short-conv mixer is backbone"),
    Family("inkling", "InklingTextConfig", "InklingForCausalLM", {}, BANK, r"\.mlp\.gate\.(weight|global_scale)$",
           note="gate.weight is [E + S, D]: it also scores the S shared experts (their gammas), global_scale scales "
                "all weights: router; shared_experts is a 3-D bank [S, ...] but runs on every token: backbone"),
    Family("inkling2", "Inkling2TextConfig", "Inkling2ForCausalLM", {}, BANK, GATE),
    Family("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM", {"enable_moe_block": True},
           r"\.layers\.\d+\.experts\.(gate_up_proj|down_proj)$",
           r"\.layers\.\d+\.router\.(proj\.weight|scale|per_expert_scale)$",
           note="MoE on the decoder layer beside the dense mlp (backbone); router = norm, x*scale, proj -> topk, "
                "weights * per_expert_scale[idx]: all router"),
    Family("diffusion_gemma", "DiffusionGemmaTextConfig", "DiffusionGemmaEncoderTextModel", {},
           r"(^|\.)layers\.\d+\.experts\.(gate_up_proj|down_proj)$",
           r"(^|\.)layers\.\d+\.router\.(proj\.weight|scale|per_expert_scale)$", note="Gemma 4 MoE layer"),
    Family("muse_spark", "MuseSparkTextConfig", "MuseSparkTextModel", {"moe_hidden_size": 16}, BANK, GATE,
           note="pre_expert_proj / pre_expert_norm / post_expert_proj run on every token; experts.post_expert_norm "
                "[H] is applied to every expert's output (shared across experts): backbone"),
    Family("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM",
           {"moe_latent_size": 16, "moe_shared_expert_intermediate_size": 24, "mamba_num_heads": 4,
            "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 8},
           r"\.mixer\.experts\.(up_proj|down_proj)$", r"\.mixer\.gate\.weight$",
           note="non-gated experts (up_proj only) in a latent space: fc1/fc2_latent_proj project every token: "
                "backbone; the router reads the hidden state before them"),
    Family("longcat_flash", "LongcatFlashConfig", "LongcatFlashForCausalLM",
           {"zero_expert_num": 2, "expert_ffn_hidden_size": 16},
           r"\.mlp\.experts\.(gate_up_proj|down_proj)$", r"\.mlp\.router\.classifier\.weight$",
           note="router scores E + Z experts (Z zero-compute identity experts); gate_up_proj has E + Z slices, "
                "down_proj E: both routed banks"),
    Family("zaya", "ZayaConfig", "ZayaForCausalLM", {"router_hidden_size": 16, "num_experts_per_tok": 1}, BANK, r"\.mlp\.gate\.",
           note="router is an MLP (down_proj -> router_mlp: norm, fc1, fc2, out_proj [E + 1 skip]) plus "
                "router_states_scale: the whole ZayaRouter scores experts"),
    Family("doge", "DogeConfig", "DogeForCausalLM", {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 2},
           r"\.mlp\.(down|up)_embed\.weight$", r"\.mlp\.router_gate\.weight$",
           note="CDMoE: product-key experts (PEER): E = k^2 single-neuron experts as rows of down_embed/up_embed, "
                "picked by two top-k over router_gate Linear(D, 2k); the dense gate/up/down_proj MLP runs on every "
                "token: backbone"),
    Family("vitpose_backbone", "VitPoseBackboneConfig", "VitPoseBackbone",
           {"num_experts": 4, "part_features": 8, "image_size": [32, 32], "patch_size": [16, 16]},
           r"\.mlp\.experts\.\d+\.", "",
           note="ViTPose++ NaiveMoe: one Linear per dataset, picked by the dataset index (no learned router): each "
                "sees only its dataset's samples, so expert; fc1/fc2 run on every token"),
]
