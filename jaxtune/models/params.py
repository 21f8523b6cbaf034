"""Parameters declared before they exist: `param_specs(cfg)` is the single source of truth for the parameter tree, every
leaf's shape, logical axis names and initialiser; `abstract_params` (planner, `jax.eval_shape`), `logical_axes`
(sharding rules) and `init_params` (random weights) derive from it without allocating. The tree mirrors Hugging Face's
module names, so methods target `q_proj`, `v_proj`, ... directly: `embed_tokens` [V, D], `norm` [D], `lm_head.kernel`
[D, V] (absent when tied) and `layers`, each leaf stacked on a leading [L] axis for `lax.scan`: norms [L, D],
`q_proj.kernel` [L, D, H*hd], `k_proj`, `v_proj` [L, D, K*hd], `o_proj`, the gated MLP (Phi-3 fuses `qkv_proj` and
`gate_up_proj`); a mixture's `router` [L, D, E] and `experts` stacks [L, E, D, 2Fe] and [L, E, Fe, D], with Qwen2-MoE's
`shared_expert.*`; Qwen3.5's attention and `linear_attn.*` modules over their own layers (`ModelConfig.module_layers`).
Kernels are [in, out] (x @ kernel); HF stores [out, in].
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.config.model import GLOBAL, LATENT_NORMS, WIDE, hf_module_name

QK_NORMS = ("q_norm", "k_norm")  # Qwen3's and Gemma 3's RMSNorm weights over a head's queries and keys (self_attn)
MLP_MODULES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
BUFFERS = ("layer_scalar",)  # leaves transformers keeps as buffers (Gemma 4's): saved and loaded, never trained
# Gemma 4's norms of a mixture beside the MLP: the MLP's output, the experts' input, the experts' output
BESIDE_MLP_NORMS = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")


@dataclass(frozen=True)
class ParamSpec:
    """One leaf: its shape, a logical name per axis, and how to initialise it ("normal", "ones", "zeros")."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _linear(L: int, d_in: int, d_out: int, axes: tuple[str | None, str | None], bias: bool) -> dict:
    spec = {"kernel": ParamSpec((L, d_in, d_out), ("layers",) + axes)}
    if bias:
        spec["bias"] = ParamSpec((L, d_out), ("layers", axes[1]), "zeros")
    return spec


LINEAR_AXES = {  # logical axes (in, out) of each per-layer linear module's kernel, keyed by its Hugging Face name
    "q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
    "o_proj": ("q_heads", "embed"), "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"), "qkv_proj": ("embed", "q_heads"), "gate_up_proj": ("embed", "mlp"),
    "shared_expert.gate_proj": ("embed", "mlp"), "shared_expert.up_proj": ("embed", "mlp"),
    "shared_expert.down_proj": ("mlp", "embed"),
    # Gated DeltaNet's: its heads' query, key and value columns are one projection, convolved before the split
    "linear_attn.in_proj_qkv": ("embed", None), "linear_attn.in_proj_z": ("embed", None),
    "linear_attn.in_proj_b": ("embed", None), "linear_attn.in_proj_a": ("embed", None),
    "linear_attn.out_proj": (None, "embed"), "linear_attn.in_proj_qkvz": ("embed", None),
    "linear_attn.in_proj_ba": ("embed", None),
    # latent attention's: the latents unsplit, the heads' queries and their keys and values split by head
    "q_a_proj": ("embed", None), "q_b_proj": (None, "q_heads"), "kv_a_proj_with_mqa": ("embed", None),
    "kv_b_proj": (None, "q_heads"),
}
EXPERT_AXES = {"gate_up_proj": ("layers", "experts", "embed", "mlp"),  # a mixture's expert stacks [L, E, in, out]
               "down_proj": ("layers", "experts", "mlp", "embed")}


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, tuple[str | None, str | None]]]:
    """(in, out, logical axes) of each per-layer linear module of `cfg`, keyed by its Hugging Face name."""
    D, F, S, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.shared_expert_size, cfg.q_size, cfg.kv_size
    keys, values, heads = cfg.linear_key_size, cfg.linear_value_size, cfg.linear_num_value_heads
    sizes = {"q_proj": (D, q * (1 + cfg.attention_output_gate)), "k_proj": (D, kv), "v_proj": (D, kv),
             "o_proj": (q, D), "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D),
             "qkv_proj": (D, q + 2 * kv), "gate_up_proj": (D, 2 * F), "shared_expert.gate_proj": (D, S),
             "shared_expert.up_proj": (D, S), "shared_expert.down_proj": (S, D),
             "linear_attn.in_proj_qkv": (D, 2 * keys + values), "linear_attn.in_proj_z": (D, values),
             "linear_attn.in_proj_b": (D, heads), "linear_attn.in_proj_a": (D, heads),
             "linear_attn.out_proj": (values, D), "linear_attn.in_proj_qkvz": (D, 2 * keys + 2 * values),
             "linear_attn.in_proj_ba": (D, 2 * heads)}
    if cfg.kv_lora_rank:  # latent attention: a query and key of head_dim, a value of v_head_dim, each head
        H, hd, v, rope = cfg.num_heads, cfg.head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        sizes.update({"q_proj": (D, H * hd), "q_a_proj": (D, cfg.q_lora_rank), "q_b_proj": (cfg.q_lora_rank, H * hd),
                      "kv_a_proj_with_mqa": (D, cfg.kv_lora_rank + rope),
                      "kv_b_proj": (cfg.kv_lora_rank, H * (hd - rope + v)), "o_proj": (H * v, D)})
    if cfg.global_head_dim:  # Gemma 4: the full layers' attention of their own width, the sharing layers' wide MLP
        g = cfg.global_view
        sizes.update({"q_proj" + GLOBAL: (D, g.q_size), "k_proj" + GLOBAL: (D, g.kv_size),
                      "v_proj" + GLOBAL: (D, g.kv_size), "o_proj" + GLOBAL: (g.q_size, D),
                      "gate_proj" + WIDE: (D, 2 * F), "up_proj" + WIDE: (D, 2 * F), "down_proj" + WIDE: (2 * F, D)})
    return {name: (*sizes[name], LINEAR_AXES[hf_module_name(name)]) for name in cfg.linear_modules}


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree of `cfg` as `ParamSpec` leaves."""
    L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    bias = {"q_proj": cfg.qkv_bias, "k_proj": cfg.qkv_bias, "v_proj": cfg.qkv_bias, "qkv_proj": cfg.qkv_bias,
            "o_proj": cfg.o_bias, "gate_proj": cfg.mlp_bias, "up_proj": cfg.mlp_bias, "gate_up_proj": cfg.mlp_bias,
            "down_proj": cfg.mlp_bias}
    unit = "zeros" if cfg.norm_unit_offset else "ones"  # a norm's scale is 1 either way
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if cfg.sandwich_norms else ()
    norms = ("post_attention_layernorm", "post_feedforward_layernorm") if cfg.post_norms else norms
    norms += BESIDE_MLP_NORMS * cfg.experts_beside_mlp + ("post_per_layer_input_norm",) * bool(cfg.per_layer_input_size)
    layers: dict[str, ParamSpec | dict] = {name: ParamSpec((L, D), ("layers", "embed"), unit) for name in norms}
    La = len(cfg.attention_layers)
    if cfg.qk_norm_whole:  # OLMo: over all heads' queries, and keys
        layers["q_norm"] = ParamSpec((La, cfg.q_size), ("layers", None), unit)
        layers["k_norm"] = ParamSpec((La, cfg.kv_size), ("layers", None), unit)
    elif cfg.qk_norm:
        for suffix, width in (("", cfg.head_dim), (GLOBAL, cfg.global_head_dim)):
            layers.update({name + suffix: ParamSpec((len(cfg.module_layers(name + suffix)), width), ("layers", None),
                                                    unit) for name in QK_NORMS if cfg.module_layers(name + suffix)})
    if cfg.kv_lora_rank:  # latent attention's norms of its latents
        widths = {"q_a_layernorm": cfg.q_lora_rank, "kv_a_layernorm": cfg.kv_lora_rank}
        layers.update({name: ParamSpec((La, widths[name]), ("layers", None), unit) for name in LATENT_NORMS
                       if widths[name]})
    for name, (d_in, d_out, axes) in linear_shapes(cfg).items():
        layers[name] = _linear(len(cfg.module_layers(name)), d_in, d_out, axes, bias.get(hf_module_name(name), False))
    if cfg.num_experts:
        layers.update(expert_specs(cfg))
    if cfg.attention_sinks:  # gpt-oss: a logit per query head in its softmax's denominator
        layers["sinks"] = ParamSpec((La, cfg.num_heads), ("layers", None))
    if cfg.linear_attention_layers:
        layers.update(linear_attention_specs(cfg))
    if cfg.layer_scalar:  # Gemma 4's, a buffer transformers saves
        layers["layer_scalar"] = ParamSpec((L, 1), ("layers", None), "ones")
    specs = {
        "embed_tokens": ParamSpec((V, D), ("vocab", "table_embed")),
        "layers": layers,
        "norm": ParamSpec((D,), ("embed",), unit),
    }
    if cfg.per_layer_input_size:
        P = cfg.per_layer_input_size
        layers["per_layer_input_gate"] = _linear(L, D, P, ("embed", None), False)
        layers["per_layer_projection"] = _linear(L, P, D, (None, "embed"), False)
        specs.update({"embed_tokens_per_layer": ParamSpec((cfg.per_layer_vocab_size, L * P), ("vocab", None)),
                      "per_layer_model_projection": {"kernel": ParamSpec((D, L * P), ("embed", None))},
                      "per_layer_projection_norm": ParamSpec((P,), (None,), unit)})
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = {"kernel": ParamSpec((D, V), ("table_embed", "vocab"))}
    return specs


def expert_specs(cfg: ModelConfig) -> dict:
    """A mixture's router, experts and (Qwen2-MoE) shared expert gate, stacked over its layers."""
    L, D, E, F = len(cfg.mixture_layers), cfg.hidden_size, cfg.num_experts, cfg.expert_size
    router: dict[str, ParamSpec] = {"kernel": ParamSpec((L, D, E), ("layers", "embed", None))}
    gate_up: dict[str, ParamSpec] = {"kernel": ParamSpec((L, E, D, 2 * F), EXPERT_AXES["gate_up_proj"])}
    down: dict[str, ParamSpec] = {"kernel": ParamSpec((L, E, F, D), EXPERT_AXES["down_proj"])}
    if cfg.router_bias:  # gpt-oss
        router["bias"] = ParamSpec((L, E), ("layers", None), "zeros")
    if cfg.router_choice_bias:  # DeepSeek-V3's, transformers' name
        router["e_score_correction_bias"] = ParamSpec((L, E), ("layers", None), "zeros")
    if cfg.experts_beside_mlp:  # Gemma 4's: the router's input scale, each expert's weight's
        router["scale"] = ParamSpec((L, D), ("layers", "embed"), "ones")
        router["per_expert_scale"] = ParamSpec((L, E), ("layers", None), "ones")
    if cfg.expert_bias:
        gate_up["bias"] = ParamSpec((L, E, 2 * F), ("layers", "experts", "mlp"), "zeros")
        down["bias"] = ParamSpec((L, E, D), ("layers", "experts", "embed"), "zeros")
    specs: dict[str, dict] = {"router": router, "experts": {"gate_up_proj": gate_up, "down_proj": down}}
    if cfg.shared_expert_size and cfg.shared_expert_gated:
        specs["shared_expert_gate"] = {"kernel": ParamSpec((L, D, 1), ("layers", "embed", None))}
    return specs


def linear_attention_specs(cfg: ModelConfig) -> dict:
    """Gated DeltaNet's leaves besides its linear modules, stacked over its layers, as transformers names them: the
    depthwise convolution's `conv1d.weight` [C, 1, taps], `dt_bias` and `A_log` [value heads], the gated RMSNorm's
    `norm.weight` [value head dim]."""
    L, N = len(cfg.linear_attention_layers), cfg.linear_num_value_heads
    C = 2 * cfg.linear_key_size + cfg.linear_value_size
    conv = ParamSpec((L, C, 1, cfg.linear_conv_kernel), ("layers", None, None, None))
    return {"linear_attn.conv1d": {"weight": conv},
            "linear_attn.dt_bias": ParamSpec((L, N), ("layers", None), "ones"),
            "linear_attn.A_log": ParamSpec((L, N), ("layers", None), "zeros"),
            "linear_attn.norm": {"weight": ParamSpec((L, cfg.linear_value_head_dim), ("layers", None), "ones")}}


def is_norm(name: str) -> bool:
    """Whether a leaf named `name` (the final `norm`, a layer's `*_layernorm`, `q_norm`, `k_norm`, Gated DeltaNet's
    `linear_attn.norm`, Gemma 4's per-layer input norms) is a norm scale."""
    name = hf_module_name(name)
    return (name in ("norm", "linear_attn.norm", "per_layer_projection_norm", "post_per_layer_input_norm")
            or re.sub(r"_\d$", "", name).endswith("layernorm") or name in QK_NORMS)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s: nothing is allocated."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), param_specs(cfg), is_leaf=_is_spec)


def logical_axes(cfg: ModelConfig) -> dict:
    """The parameter tree with a tuple of logical axis names at each leaf."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random weights: normal(0, initializer_range) for matrices, norms scaling by 1, zeros for biases.

    Wrap in `jax.jit(..., static_argnums=(0, 2), out_shardings=...)` to create sharded weights in place, or in
    `jax.eval_shape` to count parameters without allocating.
    """
    specs, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=_is_spec)
    keys = jax.random.split(key, len(specs))
    dtype = jnp.dtype(dtype)

    def make(spec: ParamSpec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (cfg.initializer_range * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(specs, keys)])


def count_params(tree) -> int:
    """Number of scalars in a tree of arrays, `ShapeDtypeStruct`s or `ParamSpec`s."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree, is_leaf=_is_spec))
