"""The architecture of a decoder: what `config.json` says, as a frozen, hashable dataclass (a static jit argument)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
                 "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                 "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                 "GptOssForCausalLM", "Llama4ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                 "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM", "Gemma4ForCausalLM")
# A layer's linear modules by their Hugging Face names: separate, or Phi-3's fused query/key/value and gate/up.
SEPARATE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SHARED_EXPERT_MODULES = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")  # Qwen2-MoE
# Gated DeltaNet's linear modules (Qwen3.5's linear-attention layers), under transformers' `linear_attn`
LINEAR_ATTENTION_MODULES = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                            "linear_attn.in_proj_a", "linear_attn.out_proj")
# Qwen3-Next's: a key head's queries, keys, values and gates side by side in one projection, its b and a in another
FUSED_LINEAR_ATTENTION_MODULES = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj")
# DeepSeek-V3's multi-head latent attention: queries through a low-rank bottleneck (or `q_proj` alone), keys and
# values from a shared latent `kv_a_proj_with_mqa` (beside one rotated key all heads share) expanded by `kv_b_proj`
LATENT_ATTENTION_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LATENT_NORMS = ("q_a_layernorm", "kv_a_layernorm")  # RMSNorms of the two latents (epsilon 1e-6, as transformers')
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj") + LATENT_ATTENTION_MODULES  # self_attn's
ATTENTION_LEAVES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm", "sinks",
                    *LATENT_ATTENTION_MODULES, *LATENT_NORMS)  # self_attn's
MIXTURE_LEAVES = ("router", "experts", "shared_expert_gate") + SHARED_EXPERT_MODULES  # a mixture layer's own
DENSE_MLP_MODULES = SEPARATE_MODULES[4:]  # gate_proj, up_proj, down_proj
EXPERT_MODULES = ("gate_up_proj", "down_proj")  # a mixture's experts, stacked [E, in, out] (gate and up fused)
# Every family's linear module names (Phi-3's fused ones last: a module's index seeds its adapter dropout masks).
LINEAR_MODULE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                       "in_proj_qkvz", "in_proj_ba", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# Gemma 4's stacks of one Hugging Face module whose shape differs by layer, named module + suffix: its full-attention
# layers' attention (`global_head_dim`), its KV-sharing layers' double-wide MLP (`wide_shared_mlp`)
GLOBAL, WIDE = "@global", "@wide"
PER_LAYER_INPUT_MODULES = ("per_layer_input_gate", "per_layer_projection")  # Gemma 4's per-layer input branch


class LayerKind(NamedTuple):
    """What a layer scan switches on (`ModelConfig.layer_kinds`): its token mixer is linear attention, its feed-forward
    a dense MLP in a mixture, its attention Gemma 4's full one of its own width, it shares an earlier layer's keys and
    values."""

    linear: bool = False
    dense: bool = False
    full: bool = False
    sharing: bool = False


def hf_module_name(name: str) -> str:
    """The Hugging Face name of our stack `name` (`GLOBAL`, `WIDE` suffixes dropped)."""
    return name.split("@", 1)[0]


# the gated MLP's activation: SwiGLU, GeGLU with tanh-approximated GELU, or gpt-oss's clamped SwiGLU
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in transformers' `rope_parameters` (`rope_scaling` before v5).

    kind: "linear" divides every frequency by `factor`; "llama3" divides only the low frequencies and
    interpolates the band between (Llama 3.1 report, section 3.3 of transformers' `_compute_llama3_parameters`);
    "longrope" (Phi-3) divides frequency i by `short_factor[i]`, or by `long_factor[i]` when a call's positions
    reach past `original_max_position_embeddings`, and scales cos and sin by `attention_factor`; "yarn" (Peng et
    al. 2023; gpt-oss, OLMo 3) keeps the frequencies that turn more than `beta_fast` times over the original
    length, divides those turning fewer than `beta_slow` times by `factor`, ramps linearly between (the ramp's
    ends rounded outward when `truncate`), and scales cos and sin by `attention_factor`; `mscale_all_dim`, DeepSeek's
    term of it that also scales its attention's softmax (squared; read by its family, kept for its config);
    "proportional" (Gemma 4's full layers) keeps the first `rotated_fraction` x head_dim / 2 frequencies of the
    whole head's (divided by `factor`) and sets the rest to 0: the head keeps its width, those pairs unrotated.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0
    rotated_fraction: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    `sliding_windows` has one entry per layer: 0 for full causal attention, w > 0 to let a query at index i see
    keys at indices j with i - w < j <= i (Mistral; Qwen2 and Qwen3 layers marked "sliding_attention"), w < 0 for
    chunked attention (Llama 4): j <= i in the same chunk of -w slots, j // -w == i // -w (in a cache of padded or
    packed prompts, by RoPE position, as transformers chunks a prompt alone).
    `qk_norm`: an RMSNorm over each head's query and key before RoPE, with weights [head_dim] (Qwen3, Gemma 3).

    Gemma 2 and 3: `hidden_act` "gelu_tanh"; `norm_unit_offset`, every RMSNorm scales by (1 + weight), multiplied
    in float32 before the cast back; `scale_embeddings`, embeddings times sqrt(hidden_size) in the compute dtype;
    `sandwich_norms`, four norms a layer (each sub-layer's output normalised before the residual add, the MLP's
    input by `pre_feedforward_layernorm`); `query_pre_attn_scalar`, scores scaled by its inverse square root in
    place of head_dim's; `attn_logit_softcap` and `final_logit_softcap`, c * tanh(x / c) on the attention scores
    and on the logits; `local_rope_theta`, the RoPE base of sliding layers (Gemma 3; unscaled), while full layers
    use `rope_theta` and `rope_scaling`.

    SmolLM3: `nope_layers`, the layers that rotate neither queries nor keys (NoPE, every 4th by default).
    OLMo 2 and 3: `post_norms`, each sub-layer's output normalised before the residual add and its input not
    (x + norm(attn(x)), norms `post_attention_layernorm` and `post_feedforward_layernorm`); `qk_norm_whole`, the
    query and key norms over the whole projection (weights [H*hd], [K*hd]) rather than a head; `norm_float32_scale`,
    RMSNorm's weight multiplied in float32 before the cast back (as Gemma's). OLMo 3's sliding layers keep the
    unscaled RoPE of `local_rope_theta`, its full layers `rope_scaling` (YaRN).

    Llama 4: `rope_interleaved`, RoPE rotating adjacent pairs (2i, 2i + 1) rather than halves; `qk_l2_norm`, queries
    and keys of the RoPE layers scaled to unit RMS after rotation (no weight); `temperature_floor` > 0, the NoPE
    layers' queries times log1p(floor((slot + 1) / temperature_floor)) * temperature_scale + 1 (in a cache, position
    for slot).

    Phi-3: `fused_projections`, one `qkv_proj` [D, q + 2 kv] and one `gate_up_proj` [D, 2F] (gate first) in
    place of q/k/v_proj and gate/up_proj; `partial_rotary_factor`, RoPE on the first head_dim x factor dimensions
    of each head only.

    Qwen2.5-VL: `mrope_section`, M-RoPE's rotary frequencies split into chunks read from the time, row and column
    position streams in turn, when a forward is given positions [3, B, T] (`rope.mrope_angles`); [B, T]: plain RoPE.
    Qwen3-VL: `mrope_interleaved`, the row and column streams on every third frequency instead (`rope.mrope_streams`).

    Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): `num_experts` > 0 replaces every layer's MLP by a router
    (a linear map to E logits; softmax in float32, the top `experts_per_token`, renormalised to sum to 1 when
    `normalize_top_k`) and E gated MLPs of width `expert_size` (0: intermediate_size), run as grouped matmuls
    over the tokens sorted by expert. `shared_expert_size` > 0 (Qwen2-MoE) adds a gated MLP every token passes
    through, scaled by sigmoid(shared_expert_gate(x)); its modules are `shared_expert.{gate,up,down}_proj`.
    gpt-oss: `router_bias` and `expert_bias`, biases on the router's logits and on each expert's gate_up and down
    products; hidden_act "clamped_swiglu", (clip(up, -limit, limit) + 1) * g sigmoid(alpha g) with g = min(gate,
    limit) (`swiglu_alpha`, `swiglu_limit`); `attention_sinks`, a learned logit per query head joining its softmax's
    denominator (layer leaf `sinks` [H]).
    Llama 4: `router_activation` "sigmoid", each of the top k logits' sigmoid (not a softmax) weighting its expert;
    `expert_input_scaled`, that weight multiplying the expert's input rather than its output; a shared expert with
    no gate (`shared_expert_gated` False).
    Qwen3.5: `linear_attention_layers`, the layers whose token mixer is Gated DeltaNet (`models/gated_deltanet.py`:
    `linear_num_key_heads` x `linear_key_head_dim` queries and keys, `linear_num_value_heads` x
    `linear_value_head_dim` values, a causal depthwise convolution of `linear_conv_kernel` taps over them, a gated
    RMSNorm before `out_proj`); their modules `linear_attn.*` are stacked over those layers only, the attention's
    over the others (`module_layers`). `attention_output_gate`: q_proj gives each head its queries then a gate,
    sigmoid(gate) scaling the head's output before o_proj. Qwen3-Next: `linear_attention_fused`, Gated DeltaNet's
    projections as `linear_attn.in_proj_qkvz` (per key head: its query, key, then its value heads' values and gates)
    and `linear_attn.in_proj_ba` (per key head: its value heads' b, then their a).
    `dense_layers` (Llama 4 Maverick, every other layer): in a mixture, the layers whose feed-forward is a gated MLP
    of `intermediate_size` (modules gate/up/down_proj) instead; the mixture's leaves are stacked over the others.
    DeepSeek-V3: `kv_lora_rank` > 0, multi-head latent attention: keys and values of every head expanded by
    `kv_b_proj` from one normed latent of that width, `qk_rope_head_dim` further dimensions of a key (shared by the
    heads) and of each query rotated (interleaved), the others not; head_dim is a query's and key's width (rotated
    last), `v_head_dim` a value's; queries through a latent of `q_lora_rank` (0: `q_proj` alone). The decode cache
    holds the latent and the rotated key. Its router ("sigmoid"): experts chosen by their sigmoid scores plus
    `router_choice_bias` (the aux-loss-free `e_score_correction_bias`, which no gradient reaches) within the
    `router_top_groups` best of `router_groups` groups (a group's worth: its two best), weighted by their scores
    (renormalised with `normalize_top_k`) times `routed_scaling_factor`; its first layers dense (`dense_layers`).
    Gemma 4: `global_head_dim` > 0, the full-attention layers' head width (their own stacks, `GLOBAL`; their keys and
    values `global_kv_heads` heads, 0: num_kv_heads) while the sliding layers keep head_dim; `values_from_keys`, the
    full layers' values the k_proj output (no v_proj); `value_norm`, values RMS-normed over a head (no weight);
    `shared_kv_layers`, the last layers computing only queries and attending over the keys and values of the last
    earlier layer of their kind (sliding or full); `wide_shared_mlp`, those layers' MLP twice intermediate_size
    (`WIDE`); `per_layer_input_size` P > 0, a per-layer input: a [per_layer_vocab_size, L x P] embedding plus a
    projection of the embeddings, added as a third residual branch gate/multiply/project/norm; `experts_beside_mlp`,
    a mixture beside every layer's MLP (its router reads the un-normed residual through its own scale, its weights
    times a per-expert scale; three more norms); `layer_scalar`, each layer's output times its `layer_scalar`.
    Its norms scale by the weight (no unit offset) in float32 and attention is unscaled (query_pre_attn_scalar 1).
    `router_aux_loss_coef`: the weight of the load-balancing loss (Switch Transformer eq. 4, over every layer's
    routing), a training term when `output_router_logits` (as in transformers, whose configs ship it off).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    fused_projections: bool = False
    partial_rotary_factor: float = 1.0
    nope_layers: tuple[int, ...] = ()
    rope_interleaved: bool = False
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    qk_l2_norm: bool = False
    temperature_floor: int = 0
    temperature_scale: float = 0.1
    post_norms: bool = False
    qk_norm_whole: bool = False
    norm_float32_scale: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    normalize_top_k: bool = True
    shared_expert_size: int = 0
    shared_expert_gated: bool = True
    router_activation: str = "softmax"
    expert_input_scaled: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False
    linear_attention_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    linear_attention_fused: bool = False
    attention_output_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_groups: int = 1
    router_top_groups: int = 1
    router_choice_bias: bool = False
    routed_scaling_factor: float = 1.0
    global_head_dim: int = 0
    global_kv_heads: int = 0
    values_from_keys: bool = False
    value_norm: bool = False
    shared_kv_layers: int = 0
    wide_shared_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    experts_beside_mlp: bool = False
    layer_scalar: bool = False
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.num_experts and not self.expert_size:  # Mixtral's experts are as wide as a dense MLP
            object.__setattr__(self, "expert_size", self.intermediate_size)
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} is not in 1..num_experts={self.num_experts}")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers={self.nope_layers} names a layer outside 0..{self.num_layers - 1}")
        if self.post_norms and self.sandwich_norms:
            raise ValueError("post_norms and sandwich_norms are two different layer layouts; pick one")
        if self.dense_layers and (not self.num_experts or any(not 0 <= i < self.num_layers for i in self.dense_layers)
                                  or len(self.dense_layers) == self.num_layers):
            raise ValueError(f"dense_layers={self.dense_layers} must name some, not all, of the layers "
                             f"0..{self.num_layers - 1} of a mixture (num_experts={self.num_experts})")
        if any(not 0 <= i < self.num_layers for i in self.linear_attention_layers):
            raise ValueError(f"linear_attention_layers={self.linear_attention_layers} names a layer outside "
                             f"0..{self.num_layers - 1}")
        if self.linear_attention_layers and (not self.linear_num_value_heads or not self.linear_num_key_heads
                                             or self.linear_num_value_heads % self.linear_num_key_heads):
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a positive multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.kv_lora_rank:  # every head its own keys and values, expanded from the latent
            object.__setattr__(self, "num_kv_heads", self.num_heads)
            if not (0 < self.qk_rope_head_dim < self.head_dim and 0 < self.v_head_dim <= self.head_dim):
                raise ValueError(f"latent attention needs 0 < qk_rope_head_dim={self.qk_rope_head_dim} < head_dim="
                                 f"{self.head_dim} and 0 < v_head_dim={self.v_head_dim} <= head_dim")
        if self.num_experts and (self.num_experts % self.router_groups or not 0 < self.router_top_groups
                                 <= self.router_groups or (self.router_groups > 1
                                                           and self.num_experts < 2 * self.router_groups)):
            raise ValueError(f"router_groups={self.router_groups} must divide num_experts={self.num_experts} into "
                             f"groups of two or more, router_top_groups={self.router_top_groups} be in "
                             "1..router_groups")
        if self.shared_kv_layers and not self.global_head_dim:
            raise ValueError("shared_kv_layers is Gemma 4's, whose full layers have their own stacks: set "
                             "global_head_dim (its head_dim where the widths agree)")
        if self.shared_kv_layers:
            first = self.num_layers - self.shared_kv_layers
            kinds = {not w for w in self.sliding_windows[:first]}
            if not 0 < self.shared_kv_layers < self.num_layers or any((not w) not in kinds
                                                                         for w in self.sliding_windows[first:]):
                raise ValueError(f"shared_kv_layers={self.shared_kv_layers}: each of the last layers shares the keys "
                                 "and values of an earlier layer of its kind (sliding or full); some kind has none")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_modules(self) -> tuple[str, ...]:
        """The names of a layer's linear modules, attention's then the MLP's (a mixture's shared expert, if any:
        its experts are not among them); Gemma 4's stacks of other shapes as `GLOBAL` and `WIDE` names."""
        if self.kv_lora_rank:
            attention = LATENT_ATTENTION_MODULES if self.q_lora_rank else ("q_proj",) + LATENT_ATTENTION_MODULES[2:]
            return attention + DENSE_MLP_MODULES * bool(self.dense_layers or not self.num_experts) + (
                SHARED_EXPERT_MODULES * bool(self.shared_expert_size))
        if self.global_head_dim:
            by_width = tuple(name + suffix for suffix in ("", GLOBAL) for name in SEPARATE_MODULES[:4]
                             if not (suffix and name == "v_proj" and self.values_from_keys))
            mlp = tuple(name + suffix for suffix in ("", WIDE) for name in DENSE_MLP_MODULES)
            return tuple(name for name in by_width + mlp if self.module_layers(name))
        linear = ((FUSED_LINEAR_ATTENTION_MODULES if self.linear_attention_fused else LINEAR_ATTENTION_MODULES)
                  * bool(self.linear_attention_layers))
        if self.num_experts:
            return (SEPARATE_MODULES[:4] + DENSE_MLP_MODULES * bool(self.dense_layers)
                    + SHARED_EXPERT_MODULES * bool(self.shared_expert_size) + linear)
        return (FUSED_MODULES if self.fused_projections else SEPARATE_MODULES) + linear

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose token mixer is softmax attention (all but `linear_attention_layers`)."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_attention_layers)

    def module_layers(self, name: str) -> tuple[int, ...]:
        """The layers holding module (or bare leaf) `name` of a layer, in order: its stack's rows are theirs."""
        if name.startswith("linear_attn."):
            return self.linear_attention_layers
        base, wide, global_ = hf_module_name(name), name.endswith(WIDE), name.endswith(GLOBAL)
        if global_ and not self.global_head_dim:
            return ()
        if self.global_head_dim and base in ATTENTION_LEAVES:  # Gemma 4: the full layers' own stacks
            of_kind = tuple(i for i in self.attention_layers if (i in self.global_layers) == global_)
            if base in ("k_proj", "v_proj", "k_norm"):  # the KV-sharing layers compute no keys or values
                of_kind = tuple(i for i in of_kind if i not in self.kv_sharing_layers)
            return () if base == "v_proj" and global_ and self.values_from_keys else of_kind
        if name in ATTENTION_LEAVES:
            return self.attention_layers
        if self.dense_layers and name in MIXTURE_LEAVES:
            return self.mixture_layers
        if self.dense_layers and name in DENSE_MLP_MODULES:
            return self.dense_layers
        if base in DENSE_MLP_MODULES and (wide or self.wide_shared_mlp):  # Gemma 4's: the sharing layers' wide
            return tuple(i for i in range(self.num_layers)
                         if (i in self.kv_sharing_layers) == wide) if self.wide_shared_mlp else ()
        return tuple(range(self.num_layers))

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Gemma 4's full-attention layers, whose attention has its own shapes (`global_head_dim`); () otherwise."""
        return tuple(i for i in self.attention_layers if not self.sliding_windows[i]) if self.global_head_dim else ()

    @property
    def kv_sharing_layers(self) -> tuple[int, ...]:
        """The last `shared_kv_layers` layers, which attend over an earlier layer's keys and values."""
        return tuple(range(self.num_layers - self.shared_kv_layers, self.num_layers))

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for a KV-sharing layer the last layer
        before them of its kind (sliding or full)."""
        if layer not in self.kv_sharing_layers:
            return layer
        first = self.num_layers - self.shared_kv_layers
        full = not self.sliding_windows[layer]
        return max(i for i in range(first) if (not self.sliding_windows[i]) == full)

    @property
    def global_view(self) -> ModelConfig:
        """The config a full-attention layer of Gemma 4 computes its attention with (its head width and heads)."""
        return self.replace(head_dim=self.global_head_dim, num_kv_heads=self.global_kv_heads or self.num_kv_heads,
                            global_head_dim=0, shared_kv_layers=0, wide_shared_mlp=False)

    @property
    def mixture_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward is the mixture (a mixture's all but `dense_layers`; none without one)."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers) if self.num_experts else ()

    @property
    def stacked_by_kind(self) -> bool:
        """Whether some modules are stacked over only some layers (layers of several kinds, or all linear): the layer
        scans then read each layer's rows by kind (`models/layer_groups.py`)."""
        return bool(self.linear_attention_layers or self.dense_layers or self.global_head_dim or self.shared_kv_layers)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's `LayerKind`: what the layer scan switches on."""
        linear, dense, full, sharing = (set(a) for a in (self.linear_attention_layers, self.dense_layers,
                                                          self.global_layers, self.kv_sharing_layers))
        return tuple(LayerKind(i in linear, i in dense, i in full, i in sharing) for i in range(self.num_layers))

    def layer_stacks(self, modules: tuple[str, ...] | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(module, its layers) of each of `modules` (default `linear_modules`): what a method's per-layer rules
        walk."""
        return tuple((name, self.module_layers(name)) for name in (self.linear_modules if modules is None else modules))

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates: the leading ones (latent attention: its `qk_rope_head_dim`)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_table_of_layer(self) -> tuple[int, ...]:
        """Which of `rope.rope_tables`' tables each layer rotates by: 0 the full layers' (`rope_theta`,
        `rope_scaling`), 1 the sliding layers' own (`local_rope_theta`), the last the identity (`nope_layers`)."""
        local = self.local_rope_theta is not None
        nope = 1 + local
        return tuple(nope if i in self.nope_layers else int(local and w > 0)
                     for i, w in enumerate(self.sliding_windows))

    @property
    def attention_scale(self) -> float:
        """The factor of q k^T: 1 / sqrt(query_pre_attn_scalar), by default 1 / sqrt(head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def tiny_config(**overrides) -> ModelConfig:
    """A tiny Llama shape (about 0.2M parameters) for tests, examples and the demo."""
    base: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    base.update(overrides)
    return ModelConfig(**base)
