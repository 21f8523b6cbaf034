"""Hugging Face `config.json` <-> `ModelConfig` (`load_config`, `config_from_hf`, `config_to_hf`), for the
architectures jaxtune computes exactly (`config.model.ARCHITECTURES`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxtune.config import ARCHITECTURES, ModelConfig, RopeScaling
from jaxtune.errors import JaxtuneError
from jaxtune.io.gguf import is_gguf
from jaxtune.io.json import read_json
from jaxtune.io.storage import is_url, local_model_dir
from jaxtune.models.gguf import gguf_config
from jaxtune.models.hf_families import FAMILIES, family_to_hf

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
               "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
               "Qwen3MoeForCausalLM": "qwen3_moe", **{arch: f.model_type for arch, f in FAMILIES.items()}}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
MOE = ("MixtralForCausalLM",) + QWEN_MOE
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> ours
# the architectures rotating part of each head
PARTIAL_ROTARY = ("Phi3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# vision-language checkpoints whose text model jaxtune reads (as transformers' AutoModelForCausalLM does): its
# `text_config`, its `model.language_model.*` tensors; the vision tower (read apart: `models.vision`, Gemma 3's) and a
# multi-token-prediction head are left
VISION_LANGUAGE = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
                   "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
                   "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                   "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                   "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
                   "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}
# M-RoPE's (transformers' `mrope_section`: Qwen2.5-VL's chunks in turn, Qwen3-VL's and Qwen3.5's (MoE too)
# interleaved whatever the config's `mrope_interleaved` says); Qwen2.5-VL's hub releases keep the text's keys at the top
MROPE_INTERLEAVED = ("Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                     "Qwen3_5MoeForConditionalGeneration")
MROPE = ("Qwen2_5_VLForConditionalGeneration", *MROPE_INTERLEAVED)
# transformers' defaults of a composite's text config, on which the released configs rely (Gemma 3's `text_config`
# names only what differs from `Gemma3TextConfig`'s)
COMPOSITE_TEXT_DEFAULTS = {"Gemma3ForConditionalGeneration": dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    query_pre_attn_scalar=256, sliding_window=4096)}


def model_dir(path: str | Path) -> Path:
    """The local directory of a model: `path`, or for a bucket URL a copy of its small files (its weights are read
    from the bucket by range, `io.storage`)."""
    if is_url(path):
        return local_model_dir(str(path))
    path = Path(path)
    if not path.exists():
        raise JaxtuneError(f"{path}: model directory not found")
    if not path.is_dir():
        raise JaxtuneError(f"{path}: expected a model directory (config.json + *.safetensors), found a file")
    return path


def _rope(hf: dict, where: str, params: dict | None = None, theta: float | None = None
          ) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); earlier versions `rope_scaling`.
    params = dict((hf.get("rope_parameters") or hf.get("rope_scaling") or {}) if params is None else params)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0) if theta is None else theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if _partial_rotary_factor(hf) != 1.0 and not set(hf.get("architectures") or []) & set(PARTIAL_ROTARY):
        raise JaxtuneError(f"{where}: partial_rotary_factor != 1 is not supported (only {', '.join(PARTIAL_ROTARY)}'s)")
    if kind in ("default", "mrope"):  # "mrope": Qwen2-VL's older name of its unscaled frequencies
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
        )
    if kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
        factor = float(params.get("factor") or hf["max_position_embeddings"] / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:  # YaRN's 0.1 ln(s) + 1, or DeepSeek's ratio of two such terms
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            yarn = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
            attention_factor = yarn(mscale) / yarn(mscale_all_dim) if mscale and mscale_all_dim else yarn()
        # transformers reads `truncate` from the top of rope_parameters (a per-layer-type dict has none: True)
        truncate = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get("truncate", True)
        return theta, RopeScaling("yarn", factor, original_max_position_embeddings=original,
                                  attention_factor=float(attention_factor),
                                  beta_fast=float(params.get("beta_fast") or 32),
                                  beta_slow=float(params.get("beta_slow") or 1), truncate=bool(truncate),
                                  mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
    if kind == "proportional":  # Gemma 4's full layers: a fraction of the whole head's frequencies, the rest 0
        return theta, RopeScaling("proportional", float(params.get("factor", 1.0)),
                                  rotated_fraction=float(params.get("partial_rotary_factor", 1.0)))
    if kind in ("longrope", "su"):  # Phi-3's; "su" its older name
        original = int(params.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
        factor = float(params.get("factor") or hf.get("max_position_embeddings", original) / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:  # LongRoPE's choice, as transformers' `_compute_longrope_parameters`
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return theta, RopeScaling("longrope", factor, original_max_position_embeddings=original,
                                  short_factor=tuple(map(float, params["short_factor"])),
                                  long_factor=tuple(map(float, params["long_factor"])),
                                  attention_factor=float(attention_factor))
    raise JaxtuneError(f"{where}: rope type {kind!r} is not supported (supported: default, linear, llama3, longrope, "
                       "yarn, proportional)")


def _partial_rotary_factor(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0)


def _gemma3_rope(hf: dict, where: str) -> tuple[float, RopeScaling | None, float]:
    """(full layers' base, their scaling, sliding layers' base): transformers 5 keeps one `rope_parameters` entry a
    layer type; earlier versions `rope_theta`, `rope_scaling` (full layers) and `rope_local_base_freq`."""
    by_type = hf.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        theta, scaling = _rope(hf, where, by_type.get("full_attention") or {}, 1_000_000.0)
        local = dict(by_type.get("sliding_attention") or {})
    else:
        theta, scaling = _rope(hf, where, hf.get("rope_scaling") or {}, hf.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    local_theta, local_scaling = _rope(hf, where, local, 10_000.0)
    if local_scaling is not None:
        raise JaxtuneError(f"{where}: scaled RoPE on sliding layers is not supported")
    return theta, scaling, local_theta


def _sliding_windows(hf: dict, arch: str, num_layers: int, where: str) -> tuple[int, ...]:
    window = hf.get("sliding_window")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return (int(window or 0),) * num_layers
    if arch in GEMMA:  # Gemma 2: every other layer from the first; Gemma 3: five of every six; absent: 4096 wide
        window = hf.get("sliding_window", 4096)
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(
            hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        if not window and "sliding_attention" in layer_types:
            raise JaxtuneError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") + QWEN_MOE:
        if not hf.get("use_sliding_window", False) or not window:
            return (0,) * num_layers
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(num_layers)
        ]
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    return (0,) * num_layers


def _experts(hf: dict, arch: str, layers: int, where: str) -> dict:
    """The mixture fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config (every layer sparse: a scanned stack)."""
    if arch not in MOE:
        return {}
    step, dense_layers = int(hf.get("decoder_sparse_step", 1) or 1), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense_layers:
        raise JaxtuneError(f"{where}: decoder_sparse_step={step}, mlp_only_layers={dense_layers}: jaxtune's "
                           "mixtures have experts in every layer")
    experts = int(hf.get("num_local_experts") or hf["num_experts"])
    fields = dict(num_experts=experts, experts_per_token=int(hf["num_experts_per_tok"]),
                  router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
                  output_router_logits=bool(hf.get("output_router_logits", False)))
    if arch == "MixtralForCausalLM":
        return {**fields, "expert_size": int(hf["intermediate_size"]), "normalize_top_k": True}
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return {**fields, "expert_size": int(hf["moe_intermediate_size"]),
            "normalize_top_k": bool(hf.get("norm_topk_prob", False)), "shared_expert_size": shared}


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Translate a transformers config dict; `where` names the file in error messages."""
    archs = hf.get("architectures") or []
    composite = next((a for a in archs if a in VISION_LANGUAGE), None)
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved = False
    if composite is not None:
        text = hf.get("text_config") or ({k: v for k, v in hf.items() if k != "vision_config"}
                                          if composite in MROPE else None)
        if not text:
            raise JaxtuneError(f"{where}: {composite} without a text_config (its text model's settings)")
        text = {**COMPOSITE_TEXT_DEFAULTS.get(composite, {}), **text}
        if composite in MROPE:
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            mrope_section = tuple(int(v) for v in rope.get("mrope_section", ()))
        mrope_interleaved = composite in MROPE_INTERLEAVED
        special = {k: hf[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id") if hf.get(k) is not None}
        hf = {**text, **special, "architectures": [VISION_LANGUAGE[composite]],  # the composite's ids: generation's
              "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
        archs = hf["architectures"]
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        found = ", ".join(archs) or f"model_type={hf.get('model_type')!r}"
        raise JaxtuneError(f"{where}: unsupported architecture {found}; supported: {', '.join(ARCHITECTURES)}")
    gemma, gemma3 = arch in GEMMA, arch == "Gemma3ForCausalLM"
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS:
        raise JaxtuneError(f"{where}: hidden activation {act!r} is not supported ({', '.join(HF_ACTIVATIONS)})")
    if hf.get("use_bidirectional_attention") and (composite, hf["use_bidirectional_attention"]) != (
            "Gemma4ForConditionalGeneration", "vision"):  # Gemma 4's images' spans: its vision unit's mask
        raise JaxtuneError(f"{where}: use_bidirectional_attention is not supported (a decoder attends causally)")
    try:
        heads = int(hf["num_attention_heads"])
        layers = int(hf["num_hidden_layers"])
        theta, scaling, local_theta = _gemma3_rope(hf, where) if gemma3 else (*_rope(hf, where), None)
        eos = hf.get("eos_token_id")
        qwen = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and hf.get("qkv_bias", True))
        cap = lambda key: float(hf[key]) if gemma and hf.get(key) else None
        family = FAMILIES[arch].from_hf(hf, where, lambda params, theta: _rope(hf, where, params, theta)
                                        ) if arch in FAMILIES else {}
        return ModelConfig(**{**dict(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"] if "moe_intermediate_size" not in hf  # a mixture alone:
                                  else hf.get("intermediate_size") or hf["moe_intermediate_size"]),  # its experts
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),  # Gemma's configs tie by default
            qkv_bias=qwen or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            o_bias=not qwen and arch != "Qwen2MoeForCausalLM" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, arch, layers, where),
            hidden_act=HF_ACTIVATIONS[act],
            norm_unit_offset=gemma,
            scale_embeddings=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)) if gemma else None,
            attn_logit_softcap=cap("attn_logit_softcapping"),
            final_logit_softcap=cap("final_logit_softcapping"),
            local_rope_theta=local_theta,
            fused_projections=arch == "Phi3ForCausalLM",
            partial_rotary_factor=_partial_rotary_factor(hf),
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            **_experts(hf, arch, layers, where),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            pad_token_id=hf.get("pad_token_id"),
        ), **family})
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise JaxtuneError(f"{where}: {e}") from None


def load_config(path: str | Path) -> ModelConfig:
    """`ModelConfig` of the Hugging Face model directory (or GGUF file) `path`."""
    if is_gguf(path):
        return config_from_hf(gguf_config(path), f"{path} (GGUF metadata)")
    path = model_dir(path) / "config.json"
    return config_from_hf(read_json(path), str(path))


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A config.json dict that transformers reads back as the same architecture."""
    windows = set(cfg.sliding_windows) - {0}
    hf: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": {v: k for k, v in HF_ACTIVATIONS.items()}.get(cfg.hidden_act, cfg.hidden_act),
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else (cfg.eos_token_id or [None])[0],
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_position_embeddings)
        if s.kind == "yarn":
            scaling.update(original_max_position_embeddings=s.original_max_position_embeddings,
                           attention_factor=s.attention_factor, beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                           truncate=s.truncate, **({"mscale_all_dim": s.mscale_all_dim} if s.mscale_all_dim else {}))
        if s.kind == "proportional":
            scaling["partial_rotary_factor"] = s.rotated_fraction
        if s.kind == "longrope":
            scaling.update(short_factor=list(s.short_factor), long_factor=list(s.long_factor),
                           attention_factor=s.attention_factor,
                           original_max_position_embeddings=s.original_max_position_embeddings)
            hf["original_max_position_embeddings"] = s.original_max_position_embeddings
        hf["rope_scaling"] = scaling
        hf["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    phi3 = cfg.architecture == "Phi3ForCausalLM"
    if cfg.fused_projections != phi3 or (cfg.partial_rotary_factor != 1.0 and cfg.architecture not in PARTIAL_ROTARY):
        raise JaxtuneError(f"{cfg.architecture}: fused projections are Phi3ForCausalLM's, a partial rotary factor "
                           f"{' and '.join(PARTIAL_ROTARY)}'s")
    if phi3:
        if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
            raise JaxtuneError("Phi3ForCausalLM has no biases")
        hf["partial_rotary_factor"] = cfg.partial_rotary_factor
        if "rope_parameters" in hf:
            hf["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.architecture not in FAMILIES and (cfg.architecture in MOE) != bool(cfg.num_experts):
        raise JaxtuneError(f"{cfg.architecture} with num_experts={cfg.num_experts}: mixtures are "
                           f"{', '.join(MOE)}")
    if cfg.num_experts and cfg.architecture in MOE:
        hf.update(_experts_to_hf(cfg))
    if cfg.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") + GEMMA:
        if cfg.qkv_bias != cfg.o_bias:
            raise JaxtuneError(f"{cfg.architecture} has one attention_bias flag for q, k, v and o alike")
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.architecture == "LlamaForCausalLM":
        hf["mlp_bias"] = cfg.mlp_bias
    elif cfg.architecture in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        if len(set(cfg.sliding_windows)) > 1:
            raise JaxtuneError(f"{cfg.architecture} has one sliding_window for every layer, this config "
                               f"{sorted(set(cfg.sliding_windows))}")
        hf["sliding_window"] = max(windows) if windows else None
    elif cfg.architecture in GEMMA:
        hf.update(_gemma_to_hf(cfg, hf))
    elif cfg.architecture in FAMILIES:
        hf.update(family_to_hf(cfg, hf))
        if hf.get("rope_scaling", "") is None:  # a family whose rope_parameters are by layer type (Gemma 4)
            del hf["rope_scaling"]
    else:
        hf["use_sliding_window"] = bool(windows)
        hf["sliding_window"] = max(windows) if windows else None
        hf["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.sliding_windows]
        hf["max_window_layers"] = next((i for i, w in enumerate(cfg.sliding_windows) if w), cfg.num_layers)
    return hf


def _experts_to_hf(cfg: ModelConfig) -> dict:
    """A mixture's own keys; Mixtral always renormalises its top k and only Qwen2-MoE has a shared expert."""
    mixtral, qwen2 = cfg.architecture == "MixtralForCausalLM", cfg.architecture == "Qwen2MoeForCausalLM"
    if (mixtral and not cfg.normalize_top_k) or (bool(cfg.shared_expert_size) and not qwen2):
        raise JaxtuneError(f"{cfg.architecture} has no {'unnormalised top k' if mixtral else 'shared expert'}")
    if cfg.architecture in QWEN_MOE and cfg.o_bias:
        raise JaxtuneError(f"{cfg.architecture} has no o_proj bias")
    out: dict[str, Any] = {"num_experts_per_tok": cfg.experts_per_token,
                           "router_aux_loss_coef": cfg.router_aux_loss_coef,
                           "output_router_logits": cfg.output_router_logits}
    if mixtral:
        if cfg.expert_size != cfg.intermediate_size:
            raise JaxtuneError("MixtralForCausalLM's experts are intermediate_size wide")
        return {**out, "num_local_experts": cfg.num_experts}
    out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_size,
               norm_topk_prob=cfg.normalize_top_k, decoder_sparse_step=1, mlp_only_layers=[])
    if qwen2:
        out.update(shared_expert_intermediate_size=cfg.shared_expert_size, qkv_bias=cfg.qkv_bias)
    return out


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _gemma_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    """Gemma 2 and 3's own keys (their flags are fixed by the architecture; a config that changes one has no
    transformers counterpart)."""
    gemma3 = cfg.architecture == "Gemma3ForCausalLM"
    fixed = dict(norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True, qk_norm=gemma3,
                 hidden_act="gelu_tanh", mlp_bias=False)
    if not gemma3:
        fixed["local_rope_theta"] = None
    for name, value in fixed.items():
        if getattr(cfg, name) != value:
            raise JaxtuneError(f"{cfg.architecture} has {name}={value!r}, this config {getattr(cfg, name)!r}")
    windows = set(cfg.sliding_windows) - {0}
    if len(windows) > 1:
        raise JaxtuneError(f"{cfg.architecture} has one sliding_window; this config has {sorted(windows)}")
    out = {
        "hidden_activation": hf["hidden_act"],
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),  # transformers: an int
        "attn_logit_softcapping": cfg.attn_logit_softcap,
        "final_logit_softcapping": cfg.final_logit_softcap,
        "sliding_window": max(windows) if windows else None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in cfg.sliding_windows],
    }
    if gemma3:
        full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **hf.get("rope_parameters", {})}
        local_theta = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
        out["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
        out["rope_local_base_freq"] = local_theta  # transformers < 5
    return out
