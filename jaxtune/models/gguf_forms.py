"""Each architecture as llama.cpp's `convert_hf_to_gguf.py` writes it and its loader reads it back (`GGUFForm`):
`general.architecture`, tensor names where they differ from a Llama's, how expert stacks are split, the metadata beyond
the shared keys, and what llama.cpp's loader fixes rather than reads (a config that differs is refused by name).
SmolLM3: NoPE every 4th layer. OLMo 2 and 3 ("olmo2"): post-norms, sliding layers three in four with the full layers'
RoPE base. gpt-oss: sinks, biased experts split from interleaved stacks, sliding every other layer, alpha 1.702, limit
7. Llama 4: chunks of 8192, NoPE and temperature (floor 8192, scale 0.1) every 4th layer. DeepSeek-V3 ("deepseek2"):
`kv_b_proj` split into per-head key (transposed) and value expansions, the choice bias, shared experts, dense first
layers, YaRN's mscale as mscale_all_dim. Qwen3.5, its MoE, Qwen3-Next: Gated DeltaNet layers, norms stored 1 + w.
Gemma 4: per-layer head widths, KV heads and MLP widths as arrays, proportional RoPE as `rope_freqs`, KV sharing from
fixed layers, the fused expert stack whole; the final soft cap written 0 when absent (llama.cpp's default is 30)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.latent_attention import LATENT_EPS

# GGUF module -> transformers module (Llama's layout; a form's `names` adds to or replaces these)
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
POST_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def _none(*_) -> dict:
    return {}


def _nothing_refused(cfg: ModelConfig) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class GGUFForm:
    """arch: `general.architecture`. architectures: the transformers classes written so (the first is read back,
    unless `config_from` says otherwise). permuted_qk: query and key rows interleaved for llama.cpp's rotary kernel
    (a Llama's). names: GGUF module -> transformers module, over `LAYER_NAMES` (a key "module.suffix": that whole
    tensor -> its transformers name in the layer). experts: where a layer's expert stacks live ("mlp" or
    "feed_forward") and `interleaved` how gate and up share `gate_up_proj`'s columns. config_from(key, hf, names) ->
    config.json keys of the family, given `key(name, default)` reading `{arch}.{name}`, the shared keys (`hf`) and
    the file's tensor names. metadata(cfg) -> `{arch}.{name}` -> value, beside the shared keys or in place of their
    values (DeepSeek's key lengths). refused(cfg) -> what llama.cpp's loader fixes that `cfg` differs in.
    untied_head: llama.cpp requires `output.weight`. windows: its loader reads sliding or chunked layers
    for this architecture (their pattern is `refused`'s to check). yarn(factor): where it reads YaRN, the
    attention factor it scales cos and sin by. output_bias: it reads the output projection's bias. unadapted: the
    modules its graph multiplies without its LoRA hook (a GGUF LoRA on them is refused). lora_unwritten: the
    modules (prefixes) whose GGUF LoRA is not written here (their tensors reordered or split). unit_norms: RMSNorm
    weights stored 1 + w (transformers' zero-centred w). delta_net: how Gated DeltaNet's value heads are stored,
    "tiled" (Qwen3.5's: r rounds of the key heads, llama.cpp repeating queries and keys tiled) or "grouped"
    (Qwen3-Next's: each key head's r together, `in_proj_qkvz` split into queries, keys, values and the gate).
    proportional: the full layers' RoPE is proportional, stored as `rope_freqs` (1 a rotated frequency, 1e30 an
    unrotated one; Gemma 4's). spm_vocab: the tokenizer model its converter writes a byte-fallback BPE vocabulary
    (spaces as U+2581) as ("gemma4"); "": byte-level ones alone."""

    arch: str
    architectures: tuple[str, ...]
    model_type: str
    permuted_qk: bool = False
    names: dict[str, str] = field(default_factory=dict)
    experts: str = ""
    interleaved: bool = False
    config_from: Callable[[Callable[..., Any], dict, set[str]], dict] = _none
    metadata: Callable[[ModelConfig], dict[str, Any]] = _none
    refused: Callable[[ModelConfig], list[str]] = _nothing_refused
    untied_head: bool = False
    windows: bool = False
    yarn: Callable[[float], float] | None = None
    output_bias: bool = False
    unadapted: tuple[str, ...] = ()
    lora_unwritten: tuple[str, ...] = ()
    unit_norms: bool = False
    delta_net: str = ""
    proportional: bool = False
    spm_vocab: str = ""

    def layer_names(self) -> dict[str, str]:
        return {**LAYER_NAMES, **self.names}


def _yarn_attention(factor: float) -> float:
    """llama.cpp's YaRN attention factor: 0.1 ln(factor) + 1 (its loader reads no other)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _every(period: int, layers: int) -> list[bool]:
    """Layer i is the period's last (i % period == period - 1): llama.cpp's fixed patterns."""
    return [i % period == period - 1 for i in range(layers)]


def _smollm3_refused(cfg: ModelConfig) -> list[str]:
    nope = tuple(i for i, last in enumerate(_every(4, cfg.num_layers)) if last)
    return ([f"NoPE layers {cfg.nope_layers} (llama.cpp's are every 4th: {nope})"] * (cfg.nope_layers != nope)
            + ["sliding-window layers"] * any(cfg.sliding_windows))


def _olmo_config(key, hf: dict, names: set[str]) -> dict:
    window = int(key("attention.sliding_window", 0))
    if not window:
        return {}
    layers = hf["num_hidden_layers"]
    full = {"rope_type": "default", **hf.pop("rope_scaling", {}), "rope_theta": hf["rope_theta"]}
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "sliding_window": window,
            "layer_types": ["full_attention" if last else "sliding_attention" for last in _every(4, layers)],
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": hf["rope_theta"]}}}


def _olmo_metadata(cfg: ModelConfig) -> dict[str, Any]:
    windows = set(cfg.sliding_windows) - {0}
    if not windows:
        return {}
    return {"attention.sliding_window": windows.pop(), "attention.sliding_window_pattern": [
        bool(w) for w in cfg.sliding_windows]}


def _olmo_refused(cfg: ModelConfig) -> list[str]:
    windows = set(cfg.sliding_windows) - {0}
    if not windows:
        return []
    full = _every(4, cfg.num_layers)
    return ([f"sliding layers {[bool(w) for w in cfg.sliding_windows]} (llama.cpp's: all but every 4th)"]
            * any(bool(w) == last for w, last in zip(cfg.sliding_windows, full))
            + [f"sliding windows {sorted(windows)} (one)"] * (len(windows) > 1)
            + [f"a sliding layers' RoPE base {cfg.local_rope_theta} other than the full ones' {cfg.rope_theta}"]
            * (cfg.local_rope_theta not in (None, cfg.rope_theta)))


def _gpt_oss_config(key, hf: dict, names: set[str]) -> dict:
    layers = hf["num_hidden_layers"]
    scaling = hf.pop("rope_scaling", None)
    return {"num_local_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
            "intermediate_size": int(key("expert_feed_forward_length")),
            "sliding_window": int(key("attention.sliding_window")),
            "layer_types": ["full_attention" if last else "sliding_attention" for last in _every(2, layers)],
            # released checkpoints leave YaRN's ramp unrounded (llama.cpp rounds it)
            "rope_parameters": {"rope_type": "default", "rope_theta": hf["rope_theta"]} if scaling is None else
            {**scaling, "rope_theta": hf["rope_theta"], "truncate": False}}


def _gpt_oss_metadata(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention.sliding_window": max(cfg.sliding_windows), "expert_feed_forward_length": cfg.expert_size}


def _gpt_oss_refused(cfg: ModelConfig) -> list[str]:
    sliding = [not last for last in _every(2, cfg.num_layers)]
    return ([f"swiglu alpha {cfg.swiglu_alpha} and limit {cfg.swiglu_limit} (llama.cpp's: 1.702 and 7)"]
            * ((cfg.swiglu_alpha, cfg.swiglu_limit) != (1.702, 7.0))
            + [f"sliding layers {[bool(w) for w in cfg.sliding_windows]} (llama.cpp's: every other, from the "
               "first)"] * ([bool(w) for w in cfg.sliding_windows] != sliding)
            + [f"sliding windows {sorted(set(cfg.sliding_windows) - {0})} (one)"]
            * (len(set(cfg.sliding_windows) - {0}) > 1))


LLAMA4_CHUNK, LLAMA4_FLOOR, LLAMA4_SCALE = 8192, 8192, 0.1  # what llama.cpp's Llama 4 loader fixes


def _llama4_config(key, hf: dict, names: set[str]) -> dict:
    layers, experts = hf["num_hidden_layers"], int(key("expert_count"))
    chunked = int(key("attention.sliding_window", LLAMA4_CHUNK)) != 0
    return {"num_local_experts": experts, "num_experts_per_tok": int(key("expert_used_count")),
            "intermediate_size": int(key("expert_feed_forward_length")),
            "intermediate_size_mlp": hf["intermediate_size"],
            "interleave_moe_layer_step": int(key("interleave_moe_layer_step")),
            "no_rope_layers": [int(not (last and chunked)) for last in _every(4, layers)],
            "attention_chunk_size": LLAMA4_CHUNK if chunked else None,
            "layer_types": ["full_attention" if last or not chunked else "chunked_attention"
                            for last in _every(4, layers)],
            "attn_temperature_tuning": chunked, "floor_scale": LLAMA4_FLOOR, "attn_scale": LLAMA4_SCALE,
            "use_qk_norm": experts != 128}


def _llama4_metadata(cfg: ModelConfig) -> dict[str, Any]:
    return {"expert_feed_forward_length": cfg.expert_size, "interleave_moe_layer_step": 1}


def _llama4_refused(cfg: ModelConfig) -> list[str]:
    last = _every(4, cfg.num_layers)
    windows = [0 if is_last else -LLAMA4_CHUNK for is_last in last]
    return ([f"attention chunks {sorted(set(cfg.sliding_windows))} (llama.cpp's: chunks of {LLAMA4_CHUNK}, every "
             "4th layer global)"] * (list(cfg.sliding_windows) != windows)
            + [f"NoPE layers {cfg.nope_layers} (llama.cpp's: every 4th)"]
            * (cfg.nope_layers != tuple(i for i, x in enumerate(last) if x))
            + [f"temperature floor {cfg.temperature_floor} and scale {cfg.temperature_scale} (llama.cpp's: "
               f"{LLAMA4_FLOOR} and {LLAMA4_SCALE})"]
            * ((cfg.temperature_floor, cfg.temperature_scale) != (LLAMA4_FLOOR, LLAMA4_SCALE))
            + [f"the query/key L2 norm {'on' if cfg.qk_l2_norm else 'off'} with {cfg.num_experts} experts "
               "(llama.cpp's: off with 128, on otherwise)"] * (cfg.qk_l2_norm != (cfg.num_experts != 128))
            + [f"dense layers {list(cfg.dense_layers)} between the mixtures (Maverick's: not written as GGUF here)"]
            * bool(cfg.dense_layers))


DEEPSEEK2_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                   "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                   "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction_bias",
                   "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}  # attn_kv_b: files from before k_b/v_b


def _deepseek2_config(key, hf: dict, names: set[str]) -> dict:
    gating = int(key("expert_gating_func", 2))  # absent where the converter's config.json named no scoring_func
    if gating != 2:
        raise JaxtuneError(f"metadata deepseek2.expert_gating_func {gating} is not supported (1 softmax: DeepSeek-V2's "
                           "router; DeepSeek-V3's is 2, sigmoid)")
    rope, groups, scaling = int(key("rope.dimension_count")), int(key("expert_group_count", 1)), hf.get("rope_scaling")
    mscale = round(float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored as 0.1 mscale_all_dim
    return {"num_key_value_heads": hf["num_attention_heads"], "head_dim": rope, "qk_rope_head_dim": rope,
            # a file from before the k_b/v_b split has no *_mla lengths: its key and value lengths are the heads'
            "qk_nope_head_dim": int(key("attention.key_length_mla", 0) or key("attention.key_length")) - rope,
            "v_head_dim": int(key("attention.value_length_mla", 0) or key("attention.value_length")),
            "q_lora_rank": int(key("attention.q_lora_rank", 0)) or None,
            "kv_lora_rank": int(key("attention.kv_lora_rank")), "n_routed_experts": int(key("expert_count")),
            "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")),
            "n_shared_experts": int(key("expert_shared_count")), "n_group": groups,
            "topk_group": int(key("expert_group_used_count", 1)) if groups > 1 else 1,
            "routed_scaling_factor": float(key("expert_weights_scale", 0.0)) or 1.0,  # 0: unscaled
            "norm_topk_prob": bool(key("expert_weights_norm", False)),
            "first_k_dense_replace": int(key("leading_dense_block_count", 0)), "num_nextn_predict_layers": 0,
            # llama.cpp takes mscale as mscale_all_dim: cos and sin unscaled
            **({} if scaling is None else {"rope_scaling": {**scaling, "mscale": mscale, "mscale_all_dim": mscale,
                                                            "attention_factor": 1.0}})}


def _deepseek2_metadata(cfg: ModelConfig) -> dict[str, Any]:
    s = cfg.rope_scaling
    # every group chosen is no grouping, which llama.cpp asserts against (it wants fewer chosen than there are)
    groups = (cfg.router_groups, cfg.router_top_groups) if cfg.router_top_groups < cfg.router_groups else (1, 1)
    return {"attention.head_count_kv": 1, "attention.key_length": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            "attention.value_length": cfg.kv_lora_rank, "attention.key_length_mla": cfg.head_dim,
            "attention.value_length_mla": cfg.v_head_dim, "attention.q_lora_rank": cfg.q_lora_rank,
            "attention.kv_lora_rank": cfg.kv_lora_rank, "rope.dimension_count": cfg.qk_rope_head_dim,
            "leading_dense_block_count": len(cfg.dense_layers), "expert_feed_forward_length": cfg.expert_size,
            "expert_shared_count": cfg.shared_expert_size // cfg.expert_size, "expert_group_count": groups[0],
            "expert_group_used_count": groups[1], "expert_weights_scale": float(cfg.routed_scaling_factor),
            "expert_weights_norm": cfg.normalize_top_k, "expert_gating_func": 2,  # sigmoid; its default is softmax
            **({"rope.scaling.yarn_log_multiplier": 0.1 * s.mscale_all_dim} if s is not None and s.kind == "yarn"
               else {})}


def _deepseek2_refused(cfg: ModelConfig) -> list[str]:
    s = cfg.rope_scaling
    kind, betas = (None, (32.0, 1.0)) if s is None else (s.kind, (s.beta_fast, s.beta_slow))
    return ([f"an RMSNorm epsilon {cfg.rms_norm_eps:g} (llama.cpp's latent norms take it, transformers' keep "
             f"{LATENT_EPS:g})"] * (not math.isclose(cfg.rms_norm_eps, LATENT_EPS, rel_tol=1e-6))
            + ["RoPE on halves (rope_interleave false; llama.cpp's rotates pairs)"] * (not cfg.rope_interleaved)
            + ["no routed experts"] * (not cfg.num_experts) + ["no shared expert"] * (not cfg.shared_expert_size)
            + [f"rope scaling {kind!r} (llama.cpp's deepseek2 reads YaRN's alone)"]
            * (kind in ("linear", "llama3"))
            + [f"YaRN betas {betas[0]:g} and {betas[1]:g} (llama.cpp's deepseek2 loader keeps 32 and 1)"]
            * (kind == "yarn" and betas != (32.0, 1.0)))


QWEN35_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
                "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
GDN_EPS = 1e-6  # transformers' (FLA's) query/key L2 norms' epsilon; llama.cpp's takes rms_norm_eps


def _qwen35_config(key, hf: dict, names: set[str]) -> dict:
    """Qwen3.5's, its MoE's and Qwen3-Next's config.json keys; the multi-token-prediction layers past the trunk
    (`nextn_predict_layers`) are not read."""
    layers = hf["num_hidden_layers"] - int(key("nextn_predict_layers", 0))
    recurrent, interval = key("attention.recurrent_layers", []), int(key("full_attention_interval", 4))
    values = int(key("ssm.time_step_rank"))
    out = {"num_hidden_layers": layers, "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
           "linear_key_head_dim": int(key("ssm.state_size")), "linear_num_key_heads": int(key("ssm.group_count")),
           "linear_num_value_heads": values, "linear_value_head_dim": int(key("ssm.inner_size")) // values,
           "layer_types": ["linear_attention" if (recurrent[i] if recurrent else (i + 1) % interval)
                           else "full_attention" for i in range(layers)],
           "rope_parameters": {"rope_type": "default", "rope_theta": hf["rope_theta"],
                               "partial_rotary_factor": int(key("rope.dimension_count")) / hf["head_dim"]}}
    if int(key("expert_count", 0)):
        out.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")),
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # llama.cpp renormalises
    return out


def _qwen35_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3.5's M-RoPE sections (which text alone, every section at its position, does not feel) in its releases'
    proportions, 11, 11 and 10 of 32 rotated pairs."""
    values, pairs = cfg.linear_num_value_heads, int(cfg.head_dim * cfg.partial_rotary_factor) // 2
    third = round(pairs * 11 / 32)
    return {"rope.dimension_count": int(cfg.head_dim * cfg.partial_rotary_factor),
            "ssm.conv_kernel": cfg.linear_conv_kernel, "ssm.state_size": cfg.linear_key_head_dim,
            "ssm.group_count": cfg.linear_num_key_heads, "ssm.time_step_rank": values,
            "ssm.inner_size": cfg.linear_value_head_dim * values,
            "attention.recurrent_layers": [i in cfg.linear_attention_layers for i in range(cfg.num_layers)],
            "full_attention_interval": 4,
            **({"rope.dimension_sections": [third, third, pairs - 2 * third, 0]}
               if cfg.architecture != "Qwen3NextForCausalLM" else {}),
            **({"expert_feed_forward_length": cfg.expert_size,
                "expert_shared_feed_forward_length": cfg.shared_expert_size} if cfg.num_experts else {})}


def _qwen35_refused(cfg: ModelConfig) -> list[str]:
    keys, values = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return ([f"Gated DeltaNet key heads {cfg.linear_key_head_dim} wide, value heads {cfg.linear_value_head_dim} "
             "(llama.cpp's: one width)"] * (cfg.linear_key_head_dim != cfg.linear_value_head_dim)
            + [f"{values} Gated DeltaNet value heads over {keys} key heads (llama.cpp's: a multiple)"]
            * bool(values % keys)
            + [f"an RMSNorm epsilon {cfg.rms_norm_eps:g} (llama.cpp's Gated DeltaNet L2 norms take it, transformers' "
               f"keep {GDN_EPS:g})"] * (not math.isclose(cfg.rms_norm_eps, GDN_EPS, rel_tol=1e-6))
            + ["top-k weights not renormalised (llama.cpp's are)"] * bool(cfg.num_experts and not cfg.normalize_top_k)
            + [f"dense MLP layers {list(cfg.dense_layers)} (llama.cpp's: a mixture every layer)"]
            * bool(cfg.dense_layers)
            + [f"rope scaling {s.kind!r} (not written for these here)" for s in (cfg.rope_scaling,) if s is not None]
            + ["attention biases"] * cfg.qkv_bias)


GEMMA4_NAMES = {"ffn_norm": "pre_feedforward_layernorm", **POST_NORMS, "ffn_gate_inp": "router.proj",
                "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
                "post_ffw_norm_2": "post_feedforward_layernorm_2", "inp_gate": "per_layer_input_gate",
                "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
                "ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
                "ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
                "layer_output_scale.weight": "layer_scalar"}  # the expert stack whole, [E, 2F, D] (gate's rows first)
GEMMA4_SOFTCAP = 30.0  # llama.cpp's final soft cap where the file names none


def _per_layer(value, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def _gemma4_config(key, hf: dict, names: set[str]) -> dict:
    """Gemma 4's config.json keys: head widths, KV heads and MLP widths by layer kind (the full layers' in
    `per_layer_config`), values from the keys where no KV-holding full layer has `attn_v`, a mixture where layers have
    a router, llama.cpp's soft cap of 30 where the file names none (0: none)."""
    layers = hf["num_hidden_layers"]
    sliding = [bool(s) for s in key("attention.sliding_window_pattern")]
    kv, widths = _per_layer(key("attention.head_count_kv", hf["num_attention_heads"]), layers), _per_layer(
        key("feed_forward_length"), layers)
    shared, width = int(key("attention.shared_kv_layers", 0)), widths[0]
    wide = widths == [width] * (layers - shared) + [2 * width] * shared
    if not (wide or widths == [width] * layers):
        raise JaxtuneError(f"metadata gemma4.feed_forward_length {widths} is not supported (transformers' Gemma 4: "
                           "one width, or twice it on the KV-sharing layers)")
    full = [i for i, s in enumerate(sliding) if not s]
    # experts where a layer has a router (the converter writes expert_count whenever the config names one)
    experts = int(key("expert_count", 0)) if any(n.endswith(".ffn_gate_inp.weight") for n in names) else 0
    cap = float(key("final_logit_softcapping", GEMMA4_SOFTCAP))
    rope = hf.pop("rope_scaling", None) or {"partial_rotary_factor": 1.0}  # no full layer: no rope_freqs
    return {"head_dim": int(key("attention.key_length_swa")),
            "num_key_value_heads": kv[sliding.index(True)] if any(sliding) else kv[0],
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "sliding_window": int(key("attention.sliding_window")), "hidden_activation": "gelu_pytorch_tanh",
            "per_layer_config": {str(i): {"head_dim": int(key("attention.key_length")), "num_key_value_heads": kv[i]}
                                 for i in full},
            "attention_k_eq_v": not any(f"blk.{i}.attn_v.weight" in names for i in full if i < layers - shared),
            "num_kv_shared_layers": shared, "intermediate_size": width, "use_double_wide_mlp": wide and shared > 0,
            "hidden_size_per_layer_input": int(key("embedding_length_per_layer_input", 0)),
            "vocab_size_per_layer_input": hf["vocab_size"], "enable_moe_block": experts > 0,
            "num_experts": experts or None, "top_k_experts": int(key("expert_used_count")) if experts else None,
            "moe_intermediate_size": int(key("expert_feed_forward_length")) if experts else None,
            "final_logit_softcapping": cap or None,
            "rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": hf["rope_theta"],
                                                   "partial_rotary_factor": rope["partial_rotary_factor"]},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": float(key("rope.freq_base_swa", 10_000.0))}}}


def _gemma4_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """Head widths and RoPE bases by layer kind (`_swa` keys: sliding layers'), KV heads and MLP widths as arrays
    a layer where they differ by layer, the soft cap always (0: none)."""
    sliding, sharing = [bool(w) for w in cfg.sliding_windows], set(cfg.kv_sharing_layers)
    full_kv = cfg.global_kv_heads or cfg.num_kv_heads
    local_theta = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
    return {"attention.key_length": cfg.global_head_dim, "attention.value_length": cfg.global_head_dim,
            "attention.key_length_swa": cfg.head_dim, "attention.value_length_swa": cfg.head_dim,
            "rope.dimension_count": cfg.global_head_dim, "rope.dimension_count_swa": cfg.head_dim,
            "rope.freq_base_swa": float(local_theta), "attention.sliding_window": max(cfg.sliding_windows),
            "attention.sliding_window_pattern": sliding, "attention.shared_kv_layers": cfg.shared_kv_layers,
            "embedding_length_per_layer_input": cfg.per_layer_input_size,
            "final_logit_softcapping": float(cfg.final_logit_softcap or 0.0),
            **({"attention.head_count_kv": [cfg.num_kv_heads if s else full_kv for s in sliding]}
               if cfg.global_kv_heads else {}),
            **({"feed_forward_length": [cfg.intermediate_size * (1 + (i in sharing)) for i in range(cfg.num_layers)]}
               if cfg.wide_shared_mlp else {}),
            **({"expert_feed_forward_length": cfg.expert_size} if cfg.num_experts else {})}


def _gemma4_refused(cfg: ModelConfig) -> list[str]:
    """What llama.cpp's gemma4 loader fixes: a KV-sharing layer reads layer S - 2 (sliding) or S - 1 (full), S the
    first sharing layer (transformers': the last earlier layer of its kind), and asserts S >= 2."""
    first, windows = cfg.num_layers - cfg.shared_kv_layers, cfg.sliding_windows
    factor = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.factor
    return ([f"num_kv_shared_layers {cfg.shared_kv_layers} after layers {[bool(w) for w in windows[:first]]} sliding "
             f"(llama.cpp's shared layers read layers {first - 2} and {first - 1}: sliding, then full)"]
            * bool(cfg.shared_kv_layers and first >= 2 and (not windows[first - 2] or windows[first - 1]))
            + [f"{first} layers holding keys and values (llama.cpp's: 2 or more)"] * (first < 2)
            + [f"sliding windows {sorted(set(windows) - {0})} (one)"] * (len(set(windows) - {0}) > 1)
            + [f"vocab_size_per_layer_input {cfg.per_layer_vocab_size} (llama.cpp's: the vocabulary, "
               f"{cfg.vocab_size})"] * bool(cfg.per_layer_input_size and cfg.per_layer_vocab_size != cfg.vocab_size)
            + [f"a proportional RoPE factor {factor:g} (llama.cpp's: 1)"] * (factor != 1))


FORMS = {form.arch: form for form in (
    GGUFForm(arch="llama", architectures=("LlamaForCausalLM", "MistralForCausalLM"), model_type="llama",
             permuted_qk=True),
    GGUFForm(arch="mistral", architectures=("MistralForCausalLM",), model_type="mistral", permuted_qk=True),
    GGUFForm(arch="qwen2", architectures=("Qwen2ForCausalLM",), model_type="qwen2"),
    GGUFForm(arch="qwen3", architectures=("Qwen3ForCausalLM",), model_type="qwen3"),
    GGUFForm(arch="smollm3", architectures=("SmolLM3ForCausalLM",), model_type="smollm3", permuted_qk=True,
             config_from=lambda key, hf, names: {"use_sliding_window": False}, refused=_smollm3_refused),
    GGUFForm(arch="olmo2", architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"), model_type="olmo2",
             names=POST_NORMS, config_from=_olmo_config, metadata=_olmo_metadata, refused=_olmo_refused,
             untied_head=True, windows=True, yarn=_yarn_attention),
    GGUFForm(arch="gpt-oss", architectures=("GptOssForCausalLM",), model_type="gpt_oss",
             names={"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                    "ffn_gate_inp": "mlp.router"},
             experts="mlp", interleaved=True, config_from=_gpt_oss_config, metadata=_gpt_oss_metadata,
             refused=_gpt_oss_refused, untied_head=True, windows=True, yarn=_yarn_attention, output_bias=True),
    GGUFForm(arch="llama4", architectures=("Llama4ForCausalLM",), model_type="llama4_text",
             names={"ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                    "ffn_down": "feed_forward.down_proj", "ffn_gate_inp": "feed_forward.router",
                    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
                    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
                    "ffn_down_shexp": "feed_forward.shared_expert.down_proj"},
             experts="feed_forward", config_from=_llama4_config, metadata=_llama4_metadata, refused=_llama4_refused,
             windows=True, yarn=_yarn_attention),
    GGUFForm(arch="deepseek2", architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3",
             names=DEEPSEEK2_NAMES, experts="mlp", config_from=_deepseek2_config, metadata=_deepseek2_metadata,
             refused=_deepseek2_refused, yarn=lambda factor: 1.0,  # its mscale over mscale_all_dim, taken as 1
             unadapted=("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj")),
    *(GGUFForm(arch=arch, architectures=(architecture,), model_type=model_type, names=QWEN35_NAMES, experts="mlp",
               config_from=_qwen35_config, metadata=_qwen35_metadata, refused=_qwen35_refused, unit_norms=True,
               delta_net=delta_net, lora_unwritten=("linear_attn.",))
      for arch, architecture, model_type, delta_net in (
          ("qwen35", "Qwen3_5ForCausalLM", "qwen3_5_text", "tiled"),
          ("qwen35moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "tiled"),
          ("qwen3next", "Qwen3NextForCausalLM", "qwen3_next", "grouped"))),
    GGUFForm(arch="gemma4", architectures=("Gemma4ForCausalLM",), model_type="gemma4_text", names=GEMMA4_NAMES,
             experts="mlp", config_from=_gemma4_config, metadata=_gemma4_metadata, refused=_gemma4_refused,
             windows=True, proportional=True, spm_vocab="gemma4"),
)}


def form_of(architecture: str) -> GGUFForm | None:
    """The form a transformers class is written in (a dense Mistral as a Llama, as llama.cpp's converter does)."""
    return next((f for f in FORMS.values() if architecture in f.architectures), None)
