"""The families added after the Llama-shaped ones, each its `config.json` reading (`Family.from_hf`: what sets it
apart from Llama, as `ModelConfig` fields) and writing (`Family.to_hf`) in one place; `hf_config` reads the shared
fields, then a registered family's own. SmolLM3: NoPE layers (`no_rope_layers`). OLMo 2 and 3: norms after each
sub-layer only, q/k norms over the whole projection, RMSNorm scaled in float32; OLMo 3's sliding layers keep unscaled
RoPE, its full ones YaRN. gpt-oss: mixtures with biases, the clamped SwiGLU, attention sinks, sliding and full layers,
YaRN. Llama 4 (text): mixtures (sigmoid router scaling the experts' inputs, an ungated shared expert; Maverick's
between dense layers), NoPE full layers with temperature, chunked interleaved L2-normed RoPE layers. Qwen3.5 (text):
Gated DeltaNet layers between gated attention layers (Qwen3.5-MoE's MLPs Qwen2-MoE's); Qwen3-Next: theirs fused.
DeepSeek-V3: latent attention, dense first layers. Gemma 4 (text): full layers of their own head width, KV-sharing
last layers, per-layer inputs, a mixture beside the MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxtune.config import ModelConfig
from jaxtune.config.model import DENSE_MLP_MODULES, SHARED_EXPERT_MODULES
from jaxtune.errors import JaxtuneError


@dataclass(frozen=True, kw_only=True)
class Family:
    """model_type: transformers' name. from_hf(hf, where, rope) -> the family's `ModelConfig` fields, given
    `rope(params, default_theta)` -> (theta, RopeScaling | None) reading one RoPE entry. fixed: fields the family
    fixes (a config that changes one has no transformers counterpart). to_hf(cfg, hf) -> its own config.json keys,
    given the shared ones already written (`hf`). peft_experts_by_mlp_names: PEFT (under transformers 5) reads a
    LoRA adapter's gate_proj/up_proj/down_proj targets, a shared expert's too, as the routed experts.
    prediction_layers: the checkpoint's layers past num_hidden_layers are a multi-token-prediction head (read past).
    fused_experts: the experts are stored only as transformers' stacks a layer (`mlp.experts.gate_up_proj`)."""

    model_type: str
    from_hf: Callable[[dict, str, Callable], dict]
    fixed: dict[str, Any]
    to_hf: Callable[[ModelConfig, dict], dict]
    peft_experts_by_mlp_names: bool = False
    prediction_layers: bool = False
    fused_experts: bool = False


def _layer_types(windows: tuple[int, ...]) -> list[str]:
    return ["sliding_attention" if w else "full_attention" for w in windows]


def _one_window(cfg: ModelConfig) -> int | None:
    windows = set(cfg.sliding_windows) - {0}
    if len(windows) > 1:
        raise JaxtuneError(f"{cfg.architecture} has one sliding_window; this config has {sorted(windows)}")
    return windows.pop() if windows else None


def _bias(hf: dict) -> dict:
    return dict(qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)))


def _bias_to_hf(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias != cfg.o_bias:
        raise JaxtuneError(f"{cfg.architecture} has one attention_bias flag for q, k, v and o alike")
    return {"attention_bias": cfg.qkv_bias}


def _smollm3_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("no_rope_layer_interval") or 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(uses_rope) < layers:
        raise JaxtuneError(f"{where}: no_rope_layers has {len(uses_rope)} entries for {layers} layers")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or ["sliding_attention" if window and not uses_rope[i] else "full_attention"
                                      for i in range(layers)]
    return dict(nope_layers=tuple(i for i in range(layers) if not uses_rope[i]),
                sliding_windows=tuple(int(window or 0) if t == "sliding_attention" else 0 for t in types),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), mlp_bias=bool(hf.get("mlp_bias")),
                **_bias(hf))


def _smollm3_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    window = _one_window(cfg)
    return {**_bias_to_hf(cfg), "mlp_bias": cfg.mlp_bias, "use_sliding_window": window is not None,
            "sliding_window": window, "layer_types": _layer_types(cfg.sliding_windows),
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)]}


OLMO_FIXED = dict(post_norms=True, qk_norm=True, qk_norm_whole=True, norm_float32_scale=True, hidden_act="silu",
                  mlp_bias=False)


def _olmo2_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    return {**OLMO_FIXED, **_bias(hf)}


def _olmo3_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window", 4096)
    if "sliding_attention" in types and not window:
        raise JaxtuneError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
    by_type = hf.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        theta, scaling = rope(by_type.get("full_attention") or {}, 500_000.0)
        local_theta, local_scaling = rope(by_type.get("sliding_attention") or {}, 500_000.0)
    else:  # one entry (or `rope_scaling`): the full layers', as transformers' `convert_rope_params_to_dict`
        theta, scaling = rope(by_type or hf.get("rope_scaling") or {}, hf.get("rope_theta", 500_000.0))
        local_theta, local_scaling = theta, None
    if local_scaling is not None:
        raise JaxtuneError(f"{where}: scaled RoPE on sliding layers is not supported")
    return {**OLMO_FIXED, **_bias(hf), "rope_theta": theta, "rope_scaling": scaling,
            "local_rope_theta": local_theta if "sliding_attention" in types else None,
            "sliding_windows": tuple(int(window) if t == "sliding_attention" else 0 for t in types)}


def _olmo2_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    if set(cfg.sliding_windows) != {0}:
        raise JaxtuneError("Olmo2ForCausalLM has no sliding layers (Olmo3ForCausalLM has)")
    return _bias_to_hf(cfg)


def _olmo3_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    local_theta = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **hf.get("rope_parameters", {})}
    return {**_bias_to_hf(cfg), "sliding_window": _one_window(cfg), "layer_types": _layer_types(cfg.sliding_windows),
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}}


def _gpt_oss_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window = int(hf.get("sliding_window") or 0)
    if "sliding_attention" in types and not window:
        raise JaxtuneError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
    return dict(num_experts=int(hf.get("num_local_experts") or hf["num_experts"]),
                experts_per_token=int(hf["num_experts_per_tok"]), expert_size=int(hf["intermediate_size"]),
                intermediate_size=int(hf["intermediate_size"]), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
                output_router_logits=bool(hf.get("output_router_logits", False)),
                sliding_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                **GPT_OSS_FIXED, **_bias(hf))


def _gpt_oss_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    if cfg.intermediate_size != cfg.expert_size:
        raise JaxtuneError(f"{cfg.architecture} has no dense MLP: intermediate_size is its experts' width")
    return {**_bias_to_hf(cfg), "hidden_act": "silu", "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token, "swiglu_alpha": cfg.swiglu_alpha,
            "swiglu_limit": cfg.swiglu_limit, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": cfg.output_router_logits, "sliding_window": _one_window(cfg),
            "layer_types": _layer_types(cfg.sliding_windows)}


GPT_OSS_FIXED = dict(hidden_act="clamped_swiglu", router_bias=True, expert_bias=True, attention_sinks=True,
                     normalize_top_k=True, mlp_bias=False, shared_expert_size=0, norm_float32_scale=True)


def _llama4_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    layers = int(hf["num_hidden_layers"])
    step = int(hf.get("interleave_moe_layer_step") or 1)
    moe_layers = hf.get("moe_layers")
    moe_layers = set(range(step - 1, layers, step) if moe_layers is None else moe_layers)
    if not moe_layers or moe_layers - set(range(layers)):
        raise JaxtuneError(f"{where}: moe_layers {sorted(moe_layers)} must name some of the layers 0..{layers - 1}")
    interval = int(hf.get("no_rope_layer_interval") or 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    chunk = int(hf.get("attention_chunk_size") or 0)
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in uses_rope]
    if "chunked_attention" in types and not chunk:
        raise JaxtuneError(f"{where}: layer_types has chunked layers but attention_chunk_size is {chunk}")
    return dict(nope_layers=tuple(i for i in range(layers) if not uses_rope[i]),
                sliding_windows=tuple(-chunk if t == "chunked_attention" else 0 for t in types),
                qk_l2_norm=bool(hf.get("use_qk_norm", True)),
                temperature_floor=int(hf.get("floor_scale", 8192)) if hf.get("attn_temperature_tuning", True) else 0,
                temperature_scale=float(hf.get("attn_scale", 0.1)),
                num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                expert_size=int(hf["intermediate_size"]), shared_expert_size=int(hf["intermediate_size"]),
                intermediate_size=int(hf.get("intermediate_size_mlp") or hf["intermediate_size"]),
                dense_layers=tuple(i for i in range(layers) if i not in moe_layers),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
                output_router_logits=bool(hf.get("output_router_logits", False)), **LLAMA4_FIXED, **_bias(hf))


def _llama4_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    chunks = set(-w for w in cfg.sliding_windows if w < 0)
    if len(chunks) > 1 or any(w > 0 for w in cfg.sliding_windows) or cfg.expert_size != cfg.shared_expert_size:
        raise JaxtuneError(f"{cfg.architecture}: one attention chunk, no sliding windows and a shared expert as wide "
                           "as each expert are what transformers' Llama 4 holds")
    return {**_bias_to_hf(cfg), "intermediate_size": cfg.expert_size, "intermediate_size_mlp": cfg.intermediate_size,
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_layers": list(cfg.mixture_layers), "interleave_moe_layer_step": _interleave_step(cfg),
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)],
            "attention_chunk_size": chunks.pop() if chunks else None,
            "layer_types": ["chunked_attention" if w < 0 else "full_attention" for w in cfg.sliding_windows],
            "use_qk_norm": cfg.qk_l2_norm, "attn_temperature_tuning": bool(cfg.temperature_floor),
            "floor_scale": cfg.temperature_floor or 8192, "attn_scale": cfg.temperature_scale,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": cfg.output_router_logits}


def _interleave_step(cfg: ModelConfig) -> int:
    """Llama 4's interleave_moe_layer_step: s when the mixtures are layers s - 1, 2s - 1, ... (moe_layers, written
    beside it, rules either way)."""
    return next((s for s in range(1, cfg.num_layers + 1)
                 if cfg.mixture_layers == tuple(range(s - 1, cfg.num_layers, s))), 1)


LLAMA4_FIXED = dict(rope_interleaved=True, router_activation="sigmoid", expert_input_scaled=True,
                    shared_expert_gated=False, normalize_top_k=False, hidden_act="silu", mlp_bias=False)


def _qwen3_5_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("full_attention_interval") or 4)
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                      for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise JaxtuneError(f"{where}: layer_types {types} is not one of linear_attention / full_attention a layer")
    return dict(linear_attention_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **QWEN3_5_FIXED, **_bias(hf))


def _qwen3_5_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    return {**_bias_to_hf(cfg), "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads, "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim, "linear_conv_kernel_dim": cfg.linear_conv_kernel,
            "layer_types": ["linear_attention" if i in cfg.linear_attention_layers else "full_attention"
                            for i in range(cfg.num_layers)],
            "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": cfg.partial_rotary_factor}}


def _qwen3_5_moe_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    return {**_qwen3_5_from_hf(hf, where, rope), "num_experts": int(hf["num_experts"]),
            "experts_per_token": int(hf["num_experts_per_tok"]), "expert_size": int(hf["moe_intermediate_size"]),
            "intermediate_size": int(hf["moe_intermediate_size"]),
            "shared_expert_size": int(hf["shared_expert_intermediate_size"]),
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0)),
            "output_router_logits": bool(hf.get("output_router_logits", False)), **QWEN3_5_MOE_FIXED}


def _qwen3_5_moe_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    if not cfg.num_experts or not cfg.shared_expert_size or cfg.intermediate_size != cfg.expert_size:
        raise JaxtuneError(f"{cfg.architecture}: every layer a mixture with a shared expert, intermediate_size its "
                           "experts' width")
    return {**_qwen3_5_to_hf(cfg, hf), "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_size, "shared_expert_intermediate_size": cfg.shared_expert_size,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": cfg.output_router_logits}


def _qwen3_next_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    if not int(hf.get("num_experts") or 0):
        return {**_qwen3_5_from_hf(hf, where, rope), "linear_attention_fused": True}
    layers, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step") or 1)
    dense = sorted({*(hf.get("mlp_only_layers") or []), *(i for i in range(layers) if (i + 1) % step)})
    fields = {**_qwen3_5_moe_from_hf(hf, where, rope), "normalize_top_k": bool(hf.get("norm_topk_prob", True)),
              "linear_attention_fused": True}
    if dense:  # mlp_only_layers / decoder_sparse_step: dense MLPs of intermediate_size between the mixtures
        fields.update(dense_layers=tuple(dense), intermediate_size=int(hf["intermediate_size"]))
    return fields


def _qwen3_next_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    if not cfg.num_experts:
        return {**_qwen3_5_to_hf(cfg, hf), "num_experts": 0}
    dense = cfg.replace(dense_layers=(), intermediate_size=cfg.expert_size)  # the mixtures' fields, checked
    return {**_qwen3_5_moe_to_hf(dense, hf), "norm_topk_prob": cfg.normalize_top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_layers), "intermediate_size": cfg.intermediate_size}


def _deepseek_v3_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    if hf.get("attention_bias"):
        raise JaxtuneError(f"{where}: attention_bias is not supported for DeepSeek-V3 (its releases have none)")
    layers, first_dense = int(hf["num_hidden_layers"]), int(hf.get("first_k_dense_replace") or 0)
    rope_dim, nope = int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
    _, scaling = rope(hf.get("rope_parameters") or hf.get("rope_scaling") or {}, 10000.0)
    scale = 1.0  # YaRN's softmax scale: its mscale_all_dim term squared
    if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
        scale = (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2
    experts = int(hf.get("n_routed_experts") or 0)
    return dict(head_dim=nope + rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=int(hf["v_head_dim"]),
                kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                num_kv_heads=int(hf["num_attention_heads"]), query_pre_attn_scalar=(nope + rope_dim) / scale**2,
                rope_interleaved=bool(hf.get("rope_interleave", True)), num_experts=experts,
                experts_per_token=int(hf["num_experts_per_tok"]) if experts else 0,
                expert_size=int(hf["moe_intermediate_size"]) if experts else 0,
                shared_expert_size=int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"]),
                dense_layers=tuple(range(min(first_dense, layers))) if experts else (),
                router_groups=int(hf.get("n_group") or 1), router_top_groups=int(hf.get("topk_group") or 1),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                normalize_top_k=bool(hf.get("norm_topk_prob", True)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
                output_router_logits=bool(hf.get("output_router_logits", False)), **DEEPSEEK_V3_FIXED)


def _deepseek_v3_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    rope = cfg.qk_rope_head_dim
    if cfg.num_experts and cfg.dense_layers != tuple(range(len(cfg.dense_layers))):
        raise JaxtuneError(f"{cfg.architecture}'s dense layers are its first (first_k_dense_replace), not "
                           f"{cfg.dense_layers}")
    if cfg.shared_expert_size % max(cfg.expert_size, 1):
        raise JaxtuneError(f"{cfg.architecture}'s shared experts are whole experts: shared_expert_size "
                           f"{cfg.shared_expert_size} is no multiple of expert_size {cfg.expert_size}")
    return {"head_dim": rope, "qk_rope_head_dim": rope, "qk_nope_head_dim": cfg.head_dim - rope,
            "v_head_dim": cfg.v_head_dim, "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "rope_interleave": cfg.rope_interleaved, "attention_bias": False,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_size, "n_shared_experts": cfg.shared_expert_size // max(
                cfg.expert_size, 1), "first_k_dense_replace": len(cfg.dense_layers), "n_group": cfg.router_groups,
            "topk_group": cfg.router_top_groups, "routed_scaling_factor": cfg.routed_scaling_factor,
            "norm_topk_prob": cfg.normalize_top_k, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": cfg.output_router_logits}


def _gemma4_from_hf(hf: dict, where: str, rope: Callable) -> dict:
    if hf.get("attention_bias"):
        raise JaxtuneError(f"{where}: attention_bias is not supported for Gemma 4 (transformers' has none)")
    layers = int(hf["num_hidden_layers"])
    types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(layers)])
    types[-1] = "full_attention"  # as transformers forces it
    by_type = hf.get("rope_parameters") or {}
    theta, scaling = rope(by_type.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                            "rope_theta": 1e6}, 1e6)
    local_theta, local_scaling = rope(by_type.get("sliding_attention") or {}, 10_000.0)
    if local_scaling is not None:
        raise JaxtuneError(f"{where}: scaled RoPE on sliding layers is not supported")
    per_layer = hf.get("per_layer_config") or {}
    full = next((per_layer.get(i, per_layer.get(str(i))) for i, t in enumerate(types) if t == "full_attention"
                 and (i in per_layer or str(i) in per_layer)), None)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    if full is None:  # the keys transformers turns into per_layer_config
        full = {"head_dim": hf.get("global_head_dim", 512)}
        if k_eq_v and hf.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
    experts = int(hf.get("num_experts") or 0) if hf.get("enable_moe_block") else 0
    full_kv = int(full.get("num_key_value_heads") or 0)
    full_kv = 0 if full_kv == int(hf.get("num_key_value_heads", 0)) else full_kv  # 0: the sliding layers' count
    P = int(hf.get("hidden_size_per_layer_input") or 0)
    return dict(sliding_windows=tuple(int(hf.get("sliding_window", 512)) if t == "sliding_attention" else 0
                                      for t in types),
                rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                global_head_dim=int(full["head_dim"]), global_kv_heads=full_kv,
                values_from_keys=k_eq_v, shared_kv_layers=int(hf.get("num_kv_shared_layers") or 0),
                wide_shared_mlp=bool(hf.get("use_double_wide_mlp", False)), per_layer_input_size=P,
                per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input", hf["vocab_size"])) if P else 0,
                experts_beside_mlp=bool(experts), num_experts=experts,
                experts_per_token=int(hf["top_k_experts"]) if experts else 0,
                expert_size=int(hf["moe_intermediate_size"]) if experts else 0,
                final_logit_softcap=float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **GEMMA4_FIXED)


def _gemma4_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    full_kv = cfg.global_kv_heads or cfg.num_kv_heads
    if not cfg.values_from_keys and full_kv != cfg.num_kv_heads:
        raise JaxtuneError(f"{cfg.architecture}: full layers have their own key/value heads only with "
                           "attention_k_eq_v")
    scaling = cfg.rope_scaling
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling is not None:
        full = {"rope_type": scaling.kind, "rope_theta": cfg.rope_theta, "factor": scaling.factor,
                **({"partial_rotary_factor": scaling.rotated_fraction} if scaling.kind == "proportional" else {})}
    return {"rope_scaling": None, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "final_logit_softcapping": cfg.final_logit_softcap, "sliding_window": _one_window(cfg),
            "layer_types": _layer_types(cfg.sliding_windows),
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}},
            "per_layer_config": {str(i): {"head_dim": cfg.global_head_dim, "num_key_value_heads": full_kv}
                                 for i in cfg.global_layers},
            "attention_k_eq_v": cfg.values_from_keys, "num_kv_shared_layers": cfg.shared_kv_layers,
            "use_double_wide_mlp": cfg.wide_shared_mlp, "hidden_size_per_layer_input": cfg.per_layer_input_size,
            "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
            "enable_moe_block": cfg.experts_beside_mlp, "num_experts": cfg.num_experts or None,
            "top_k_experts": cfg.experts_per_token or None, "moe_intermediate_size": cfg.expert_size or None}


GEMMA4_FIXED = dict(hidden_act="gelu_tanh", scale_embeddings=True, sandwich_norms=True, norm_unit_offset=False,
                    norm_float32_scale=True, qk_norm=True, value_norm=True, query_pre_attn_scalar=1.0,
                    attn_logit_softcap=None, layer_scalar=True, normalize_top_k=True, router_activation="softmax",
                    mlp_bias=False, qkv_bias=False, o_bias=False)
DEEPSEEK_V3_FIXED = dict(router_activation="sigmoid", router_choice_bias=True, shared_expert_gated=False,
                         hidden_act="silu", mlp_bias=False, qkv_bias=False, o_bias=False, sliding_windows=())
QWEN3_5_MOE_FIXED = dict(normalize_top_k=True, shared_expert_gated=True, router_activation="softmax")
QWEN3_5_FIXED = dict(attention_output_gate=True, norm_unit_offset=True, qk_norm=True, hidden_act="silu",
                     mlp_bias=False, sliding_windows=())


FAMILIES = {
    "SmolLM3ForCausalLM": Family(model_type="smollm3", from_hf=_smollm3_from_hf, to_hf=_smollm3_to_hf, fixed={}),
    "Olmo2ForCausalLM": Family(model_type="olmo2", from_hf=_olmo2_from_hf, to_hf=_olmo2_to_hf,
                               fixed={**OLMO_FIXED, "nope_layers": ()}),
    "Olmo3ForCausalLM": Family(model_type="olmo3", from_hf=_olmo3_from_hf, to_hf=_olmo3_to_hf,
                               fixed={**OLMO_FIXED, "nope_layers": ()}),
    "GptOssForCausalLM": Family(model_type="gpt_oss", from_hf=_gpt_oss_from_hf, to_hf=_gpt_oss_to_hf,
                                fixed=GPT_OSS_FIXED),
    "Llama4ForCausalLM": Family(model_type="llama4_text", from_hf=_llama4_from_hf, to_hf=_llama4_to_hf,
                                fixed=LLAMA4_FIXED),
    "Qwen3_5ForCausalLM": Family(model_type="qwen3_5_text", from_hf=_qwen3_5_from_hf, to_hf=_qwen3_5_to_hf,
                                 fixed={k: v for k, v in QWEN3_5_FIXED.items() if k != "sliding_windows"}),
    "Qwen3_5MoeForCausalLM": Family(model_type="qwen3_5_moe_text", from_hf=_qwen3_5_moe_from_hf,
                                    to_hf=_qwen3_5_moe_to_hf,
                                    fixed={**{k: v for k, v in QWEN3_5_FIXED.items() if k != "sliding_windows"},
                                           **QWEN3_5_MOE_FIXED}),
    "Qwen3NextForCausalLM": Family(model_type="qwen3_next", from_hf=_qwen3_next_from_hf, to_hf=_qwen3_next_to_hf,
                                   fixed={**{k: v for k, v in QWEN3_5_FIXED.items() if k != "sliding_windows"},
                                          "linear_attention_fused": True, "shared_expert_gated": True,
                                          "router_activation": "softmax"}, peft_experts_by_mlp_names=True),
    "DeepseekV3ForCausalLM": Family(model_type="deepseek_v3", from_hf=_deepseek_v3_from_hf,
                                    to_hf=_deepseek_v3_to_hf,
                                    fixed={k: v for k, v in DEEPSEEK_V3_FIXED.items() if k != "sliding_windows"},
                                    peft_experts_by_mlp_names=True, prediction_layers=True),
    "Gemma4ForCausalLM": Family(model_type="gemma4_text", from_hf=_gemma4_from_hf, to_hf=_gemma4_to_hf,
                                fixed=GEMMA4_FIXED, fused_experts=True),
}


def peft_unloadable(cfg: ModelConfig) -> tuple[str, ...]:
    """The linear modules whose LoRA PEFT does not load on `cfg`'s family (a shared expert's and a dense layer's MLP,
    where PEFT takes their names for the routed experts')."""
    family = FAMILIES.get(cfg.architecture)
    if family is None or not family.peft_experts_by_mlp_names:
        return ()
    return SHARED_EXPERT_MODULES + DENSE_MLP_MODULES * bool(cfg.dense_layers)


def family_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    """The registered family's own config.json keys (`hf`: the shared ones already written, its RoPE entry
    included)."""
    family = FAMILIES[cfg.architecture]
    for name, value in family.fixed.items():
        if getattr(cfg, name) != value:
            raise JaxtuneError(f"{cfg.architecture} has {name}={value!r}, this config {getattr(cfg, name)!r}")
    # explicit where unscaled: gpt-oss's config class would put its own YaRN in an absent entry's place
    hf = {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, **hf}
    return {"rope_parameters": hf["rope_parameters"], **family.to_hf(cfg, hf)}
