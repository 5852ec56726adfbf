"""Models by name: the reference MoE presets and the public configs of well-known MoE models, built without downloads.

`load_model(spec)` takes a preset name (case-insensitive) or the path of a Hugging Face ``config.json`` (or the folder
that holds one) and builds the model on the meta device by default, so a 671B model costs no memory: shapes, names
and parameter counts are exact, the values are not allocated.

Presets:
  * every `skewadam.bench.models` config (``tiny``, ``cpu``, ``paper-6.78b``): the reference MoE transformer;
  * Hugging Face architectures, written from each model's public ``config.json`` (architecture keys only; tokenizer
    ids, quantization and runtime keys left out). Their parameter counts, as Transformers builds them, match the
    published totals (`HF_PRESETS` lists each source and total; tests check them).

`bench_model` builds what a bench run trains from the same specs: the corpus's vocabulary, a context that holds the
bench's window, and `lm_losses` gives any of them the reference model's outputs (the model's own causal-LM loss and
its router's auxiliary loss), so one training loop serves both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, NamedTuple, Optional, Union

import torch
from torch import nn

from .extras import quiet_imports

__all__ = ["HF_PRESETS", "HFPreset", "load_model", "preset_names", "known", "bench_model", "BenchModel", "lm_losses",
           "check_trains", "full_size"]


class HFPreset(NamedTuple):
    source: str  # the Hugging Face repository whose config.json this is
    published: str  # the total parameter count its authors publish
    config: dict[str, Any]  # config.json facts, with ``model_type``


HF_PRESETS: dict[str, HFPreset] = {
    "mixtral-8x7b": HFPreset("mistralai/Mixtral-8x7B-v0.1", "46.7B", dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
        router_aux_loss_coef=0.02, tie_word_embeddings=False,
    )),
    "deepseek-v3": HFPreset("deepseek-ai/DeepSeek-V3", "671B", dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )),
    "qwen3-30b-a3b": HFPreset("Qwen/Qwen3-30B-A3B", "30.5B", dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
        tie_word_embeddings=False,
    )),
    "olmoe-1b-7b": HFPreset("allenai/OLMoE-1B-7B-0924", "6.9B", dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, clip_qkv=None,
        router_aux_loss_coef=0.01, tie_word_embeddings=False,
    )),
    "gpt-oss-120b": HFPreset("openai/gpt-oss-120b", "116.8B", dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        experts_per_token=4, attention_bias=True, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072,
        rope_theta=150000, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                             original_max_position_embeddings=4096, truncate=False),
        initial_context_length=4096, swiglu_limit=7.0, rms_norm_eps=1e-5, router_aux_loss_coef=0.9,
        tie_word_embeddings=False,
    )),
}


def preset_names() -> list[str]:
    """Every name `load_model` accepts besides a path: the reference configs, then the Hugging Face presets."""
    from .models import CONFIGS

    return [*CONFIGS, *HF_PRESETS]


def known(spec: Union[str, os.PathLike]) -> bool:
    """Whether ``spec`` names a preset (case-insensitive) or an existing path `load_model` may read."""
    key = os.fspath(spec)
    return key.lower() in preset_names() or os.path.exists(key)


def load_model(
    spec: Union[str, os.PathLike],
    device: Union[str, torch.device] = "meta",
    dtype: Optional[torch.dtype] = None,
    overrides: Optional[dict[str, Any]] = None,
) -> nn.Module:
    """Build a model from a preset name or a Hugging Face ``config.json`` path, on ``device`` (meta: no memory).

    Args:
        spec: a preset (`preset_names`; case-insensitive) or a ``config.json`` path, or the folder holding one.
        device: where the parameters live; ``"meta"`` allocates nothing.
        dtype: parameter dtype, allocated directly (no fp32 copy first); default the model's own (fp32).
        overrides: config values to change, e.g. ``{"num_hidden_layers": 2}`` (`skewadam.bench.models.MoEConfig` fields
            for the reference presets).

    Example:
        >>> model = load_model("deepseek-v3")  # 671,026,404,352 parameters, none allocated
    """
    if dtype is None:
        return _build(spec, device, overrides or {})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate the parameters in ``dtype`` directly, not via an fp32 copy
    try:
        return _build(spec, device, overrides or {}).to(dtype)
    finally:
        torch.set_default_dtype(default)


def _build(spec: Union[str, os.PathLike], device: Union[str, torch.device], overrides: dict[str, Any]) -> nn.Module:
    from . import models

    key = os.fspath(spec)
    name = key.lower()
    if name in models.CONFIGS:
        try:
            config = models.get_config(name, **overrides)
        except TypeError as e:
            raise ValueError(f"preset {name!r}: {e}; fields are those of skewadam.bench.models.MoEConfig") from None
        with torch.device(device):
            model = models.MoETransformer(config)
    elif name in HF_PRESETS or os.path.isdir(key) or os.path.isfile(key) or key.endswith(".json"):
        model = _hf_model(_hf_raw(key), device, overrides, origin=_origin(key))
    else:
        raise ValueError(
            f"{key!r} is neither a preset nor a config.json path; presets: {', '.join(preset_names())}"
        )
    return model


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        what = "not a regular file" if os.path.exists(file) else "no such file"
        raise FileNotFoundError(f"{file}: {what}; pass a Hugging Face config.json or the folder that holds it")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text (byte {e.start}); is this a config.json?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{file}: no 'model_type' key; is this a Hugging Face model config.json?")
    return raw


#: Config keys that are sizes or counts (hidden_size, num_hidden_layers, n_routed_experts, head_dim, q_lora_rank...).
_SIZE_KEY = re.compile(r"(_size|_dim|_rank|_layers|_heads|_experts|_length)$|^(num|n)_")


def _origin(key: str) -> str:
    return f"preset {key.lower()!r}" if key.lower() in HF_PRESETS else key


def _hf_raw(key: str) -> dict[str, Any]:
    """The config.json facts of a Hugging Face preset or path."""
    return dict(HF_PRESETS[key.lower()].config) if key.lower() in HF_PRESETS else _read_config(key)


def _transformers(origin: str):
    try:
        with quiet_imports():  # transformers loads torchao, whose import logs lines that are not ours to show
            import transformers
    except ImportError:
        raise ImportError(f"building {origin} needs Hugging Face Transformers: pip install 'skewadam[hf]'") from None
    return transformers


def _hf_model(raw: dict[str, Any], device: Union[str, torch.device], overrides: dict[str, Any],
              origin: str) -> nn.Module:
    transformers = _transformers(origin)
    unknown = [k for k in overrides if k not in raw and not hasattr(_default_config(transformers, raw), k)]
    if unknown:
        sizes = ", ".join(sorted(k for k in raw if _SIZE_KEY.search(k))[:4])
        raise ValueError(f"{origin}: {', '.join(map(repr, unknown))} not a key of its config ({raw['model_type']}); "
                         f"--set takes the config's own keys, e.g. {sizes}")
    raw = {**raw, **overrides}
    typed = [f"{k}={v!r}" for k, v in raw.items() if _SIZE_KEY.search(k) and isinstance(v, (str, float, bool))]
    if typed:
        raise ValueError(f"{origin}: {', '.join(typed)}: sizes and counts are integers (in config.json, 32, not "
                         f"\"32\"; on the command line, --set hidden_size=32)")
    negative = [f"{k}={v}" for k, v in raw.items() if _SIZE_KEY.search(k) and isinstance(v, int) and v < 0]
    if negative:
        raise ValueError(f"{origin}: negative size(s) {', '.join(negative)}; sizes and counts must be >= 0")
    model_type = raw.pop("model_type")
    for key in ("quantization_config", "torch_dtype", "dtype", "transformers_version"):
        raw.pop(key, None)  # storage and runtime facts: the model is built unquantized, in `load_model`'s dtype
    from huggingface_hub.errors import StrictDataclassError  # Transformers' configs check their fields' types

    try:
        config = transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, TypeError, StrictDataclassError) as e:
        raise ValueError(f"{origin}: {' '.join(str(e).split())}") from None
    _check_structure(config, raw, origin)
    with torch.device(device), quiet_imports():
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM, transformers.AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:
                continue
            except (TypeError, StrictDataclassError) as e:
                raise ValueError(f"{origin}: building the model failed ({' '.join(str(e).split())}): a config value "
                                 f"of the wrong type?") from None
    raise ValueError(f"{origin}: Transformers has no model class for model_type {model_type!r}")


#: Config keys of the expert count and the experts per token, in the spellings of the architectures Transformers has.
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_top_k")


def _check_structure(config: Any, raw: dict[str, Any], origin: str) -> None:
    """Refuse a Transformers config that builds but cannot run, naming the keys as ``raw`` (the config.json and
    --set) spells them: no layers, no experts, more experts per token than experts, query heads that the key-value
    heads do not divide (``num_key_value_heads`` unset takes the config class's default)."""
    settings = config.to_dict()  # the config's own keys; the aliases of its attribute_map point at them
    alias = {key: name for name, key in getattr(config, "attribute_map", {}).items() if name in raw}

    def value(keys: tuple[str, ...]) -> Optional[tuple[str, int]]:
        found = [(alias.get(k, k), settings[k]) for k in keys if isinstance(settings.get(k), int)]
        return found[0] if found else None

    problems = []
    if (layers := value(("num_hidden_layers",))) and layers[1] < 1:
        problems.append("num_hidden_layers=0: the model needs a layer")
    experts, top_k = value(_EXPERTS), value(_TOP_K)
    if experts and experts[1] < 1 and top_k and top_k[1] > 0:
        problems.append(f"{experts[0]}=0 with {top_k[0]}={top_k[1]}: routing needs an expert")
    elif experts and top_k and top_k[1] > experts[1]:
        problems.append(f"{top_k[0]}={top_k[1]} > {experts[0]}={experts[1]}: a token cannot go to more experts than "
                        f"there are")
    heads, kv = value(("num_attention_heads",)), value(("num_key_value_heads",))
    if heads and kv and kv[1] > 0 and heads[1] % kv[1]:
        problems.append(f"num_attention_heads={heads[1]} is not a multiple of num_key_value_heads={kv[1]} (set it, "
                        f"or --set num_key_value_heads=<a divisor>)")
    if problems:
        raise ValueError(f"{origin}: {'; '.join(problems)}")


def _default_config(transformers, raw: dict[str, Any]):
    """The Transformers config class's defaults for ``raw``'s model type (its every key)."""
    try:
        return transformers.AutoConfig.for_model(raw["model_type"])
    except ValueError:
        return object()  # an unknown model type: building says so


# ------------------------------------------------------------------------------------------- bench models
class BenchModel(NamedTuple):
    """What a bench run trains, and the facts its log records."""

    model: nn.Module
    block_size: int  # tokens per training window
    balance_floor: Optional[float]  # the balance loss of perfectly uniform routing; None without one
    config: dict[str, Any]  # the model's settings as built (JSON)


def bench_model(spec: Union[str, os.PathLike], overrides: Optional[dict[str, Any]] = None, *, vocab_size: int,
                block_size: Optional[int] = None, device: Union[str, torch.device] = "cpu",
                dtype: Optional[torch.dtype] = None) -> BenchModel:
    """The model a bench run trains: ``spec`` (as `load_model` takes it) with config ``overrides``, its vocabulary
    the corpus's ``vocab_size``, holding windows of ``block_size`` tokens (default: a reference preset's own, or the
    ``cpu`` preset's 128 for a Transformers config, whose context is its own). Token ids a Transformers config names
    beyond the vocabulary (its tokenizer's) are dropped. Built from the config: nothing is downloaded.

    Example:
        >>> bench_model("mixtral-8x7b", {"hidden_size": 64, "num_hidden_layers": 2}, vocab_size=256).model
    """
    from . import models

    overrides = dict(overrides or {})
    if "vocab_size" in overrides:
        raise ValueError(f"--set vocab_size: the vocabulary is the corpus's ({vocab_size} byte tokens), not a setting")
    key = os.fspath(spec)
    if key.lower() in models.CONFIGS:
        window = {} if block_size is None else {"block_size": block_size}
        model = load_model(key, device, dtype, {**overrides, **window, "vocab_size": vocab_size})
        cfg = model.config
        return BenchModel(model, cfg.block_size, cfg.balance_coef * (cfg.n_layer // 2), dataclasses.asdict(cfg))
    if not known(key):
        raise ValueError(f"{key!r} is neither a preset nor a config.json path; presets: {', '.join(preset_names())}")
    T = block_size or models.CONFIGS["cpu"].block_size
    raw = {**_hf_raw(key), **overrides, "vocab_size": vocab_size}
    defaults = _default_config(_transformers(_origin(key)), raw)
    ids = {k: v for k, v in (defaults.to_dict() if hasattr(defaults, "to_dict") else {}).items()
           if k.endswith("_token_id")} | {k: v for k, v in raw.items() if k.endswith("_token_id")}
    raw |= {k: None for k, v in ids.items() if isinstance(v, int) and v >= vocab_size}  # the tokenizer's, not ours
    if isinstance(raw.get("max_position_embeddings"), int) and raw["max_position_embeddings"] < T:
        raise ValueError(f"{_origin(key)}: max_position_embeddings={raw['max_position_embeddings']} is shorter than "
                         f"the window of {T} tokens; use a smaller --block-size or --set max_position_embeddings={T}")
    overrides = {k: v for k, v in raw.items() if k != "model_type"}
    model = load_model(key, device, dtype, overrides)
    config = model.config
    coef, top_k = getattr(config, "router_aux_loss_coef", None), _top_k(config)
    floor = coef * top_k if hasattr(config, "output_router_logits") and coef and top_k else None
    return BenchModel(model, T, floor, {"model_type": raw["model_type"], **overrides})


def check_trains(built: BenchModel, origin: str) -> None:
    """One forward and backward of one window through ``built`` (a `bench_model`, on its parameters' device): a
    config that builds but cannot train, in a way no check of its keys sees, is refused here in one line
    (ValueError), not in each run.

    Example:
        >>> check_trains(bench_model("tiny", vocab_size=256), "tiny")
    """
    device = next(built.model.parameters()).device
    x_BT = torch.randint(0, built.config["vocab_size"], (1, built.block_size),
                         generator=torch.Generator().manual_seed(0)).to(device)
    try:
        lm_losses(built.model, x_BT, x_BT).loss.backward()
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{origin}: builds, but one forward and backward of a {built.block_size}-token window on "
                         f"{device.type.upper()} failed ({type(e).__name__}: {first}): change the sizes it names"
                         ) from None
    finally:
        built.model.zero_grad(set_to_none=True)


def _top_k(config) -> Optional[int]:
    for key in ("num_experts_per_tok", "experts_per_token", "moe_top_k", "top_k"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def lm_losses(model: nn.Module, x_BT: torch.Tensor, y_BT: torch.Tensor):
    """The reference model's outputs (`skewadam.bench.models.MoEOutput`: loss, lm_loss, balance_loss, z_loss) for
    any bench model: a Transformers model's own causal-LM loss on next tokens ``y_BT`` (``shift_labels``: the batch
    is already shifted) and its router's auxiliary loss times its ``router_aux_loss_coef``, as its forward adds it.

    Example:
        >>> out = lm_losses(model, x, y); out.loss.backward()
    """
    from .models import MoEOutput, MoETransformer

    if isinstance(model, MoETransformer):
        return model(x_BT, y_BT)
    config = model.config
    routed = hasattr(config, "output_router_logits")
    y_BT = y_BT.contiguous()  # the loss views it flat
    out = model(input_ids=x_BT, labels=y_BT, shift_labels=y_BT, **({"output_router_logits": True} if routed else {}))
    aux = getattr(out, "aux_loss", None)
    zero = out.loss.new_zeros(())
    balance = config.router_aux_loss_coef * aux if aux is not None else zero
    return MoEOutput(out.logits, out.loss, out.loss - balance, balance, zero)


def full_size(spec: Union[str, os.PathLike]) -> str:
    """The full-size model of a bench's ``spec``: the paper's 6.78B model for the reference presets, the config
    itself (without the bench's ``--set``) for a Transformers one: where the optimizer state matters."""
    from .models import CONFIGS

    key = os.fspath(spec)
    return "paper-6.78b" if key.lower() in CONFIGS else key
