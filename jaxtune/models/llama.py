"""The Llama-family decoder (Llama, Mistral, Qwen2 and 3, Gemma 2 and 3, Phi-3, and the mixtures Mixtral, Qwen2-MoE,
Qwen3-MoE) as pure functions over `params.py`'s tree: `forward` (logits [B, T, V]), `decoder`, `decoder_layer`.

One block is written once and run over the stacked layers with `lax.scan`, so compile time does not grow with
depth, under a `Remat` policy (`remat.py`). Attention is blockwise (`attention.py`), the backend's fused kernel
where it covers the mask (`kernels/`), or across a mesh's context axis (`context_attention.py`); a
mixture's MLP is `moe.py`; `tiled_mlp` runs the MLP in tiles of tokens. Numerics follow transformers: RMSNorm and
softmax in float32, RoPE angles in float32 cast to the compute dtype, the rest in the compute dtype; "float64"
compute (under `jax.enable_x64`) widens the float32 parts too: the tests' float64 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.config.model import LayerKind, hf_module_name
from jaxtune.errors import JaxtuneError
from jaxtune.models.adapters import Adapters, adapter_forward, layer_adapters
from jaxtune.models.attention import AttentionMask, blockwise_attention, live_blocks, training_mask
from jaxtune.models.context_attention import (
    ContextLayout,
    context_attention,
    context_layout,
    gather_outputs,
    spread_inputs,
    with_ring_kernel,
)
from jaxtune.models.head import head_logits
from jaxtune.models.kernels import KERNELS, AttentionShape, FusedAttention, KernelCall, choose_kernel
from jaxtune.models.latent_attention import heads_output, latent_cache_entry, latent_keys_values, latent_queries
from jaxtune.models.layer_groups import scan_kv_sharing_layers, scan_layers_by_kind
from jaxtune.models.linear import dense, project, scaled, wide
from jaxtune.models.linear_attention import gated_deltanet_layer
from jaxtune.models.moe import routed_experts, router_loss
from jaxtune.models.multimodal import DeepStack, PlacedEmbeddings, add_deepstack, place_embeddings
from jaxtune.models.norms import rms_norm, unscaled_rms_norm
from jaxtune.models.quant import BitPattern
from jaxtune.models.remat import remat_layer
from jaxtune.models.rope import LayerRope, apply_rope, layer_rope, rope_tables
from jaxtune.models.tiles import cut_tiles, join_tiles, tile_count
from jaxtune.parallel.rules import constrain, context_ways, gathered, mesh_in_context, platform_in_context


def norm(x_BxTxD: jax.Array, weight_D: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The model's RMSNorm (`rms_norm` with its epsilon and, for Gemma and OLMo, their products)."""
    return rms_norm(x_BxTxD, weight_D, cfg.rms_norm_eps, cfg.norm_unit_offset, cfg.norm_float32_scale)


def embed(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig, dtype) -> jax.Array:
    """Token embeddings [B, T, D] in the compute dtype; Gemma multiplies them by sqrt(D) rounded to that dtype.
    A table held as its bits (`quant.as_bit_patterns`) gives the tokens' rows of bits, then their values. With a
    context axis each device looks up its own tokens in the table gathered over ZeRO-3's axes (left to XLA, the
    lookup came out split by the hidden size and was replicated to reach the tokens' split)."""
    table = params["embed_tokens"]
    if context_ways() > 1:
        tokens_BxT = constrain(tokens_BxT, ("batch", "seq"))
        bits = gathered(getattr(table, "bits", table), ("vocab", "table_embed"))
        table = BitPattern(bits, table.dtype) if isinstance(table, BitPattern) else bits
    if isinstance(table, BitPattern):
        x_BxTxD = jax.lax.bitcast_convert_type(table.bits[tokens_BxT], table.dtype).astype(dtype)
    else:
        x_BxTxD = table.astype(dtype)[tokens_BxT]
    return x_BxTxD * jnp.asarray(cfg.hidden_size**0.5, dtype) if cfg.scale_embeddings else x_BxTxD


def per_layer_inputs(params: dict, tokens_BxT: jax.Array, x_BxTxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 4's per-layer inputs [L, B, T, P]: (norm(projection of the scaled embeddings x / sqrt(D)) + the
    tokens' per-layer embeddings x sqrt(P)) / sqrt(2), layer i's the i-th P-wide slice."""
    B, T, D = x_BxTxD.shape
    L, P, dtype = cfg.num_layers, cfg.per_layer_input_size, x_BxTxD.dtype
    tokens_BxTxLP = params["embed_tokens_per_layer"].astype(dtype)[tokens_BxT] * jnp.asarray(P**0.5, dtype)
    context_BxTxLP = scaled(dense(x_BxTxD, params["per_layer_model_projection"]), D**-0.5)
    context_BxTxLxP = norm(context_BxTxLP.reshape(B, T, L, P), params["per_layer_projection_norm"], cfg)
    inputs_BxTxLxP = scaled(context_BxTxLxP + tokens_BxTxLP.reshape(B, T, L, P), 2**-0.5)
    return jnp.moveaxis(inputs_BxTxLxP, 2, 0)


def project_qkv(x_BxTxD, layer, rope: LayerRope, cfg: ModelConfig, adapters: Adapters):
    """Rotated queries [B, T, K, G, hd] (G query heads share each of the K key/value heads), rotated keys and
    values [B, T, K, hd], and the output gate [B, T, H*hd] (`attention_output_gate`) or None; Llama 4's L2 norm on
    rotating layers, its temperature on the others; latent attention's every head's (its values zero-padded to hd,
    `latent_attention.py`). Gemma 4: values the raw keys where the layer has no v_proj, RMS-normed without weight
    (`value_norm`); a layer without k_proj (sharing another's) gives None for keys and values."""
    B, T, _ = x_BxTxD.shape
    K, G, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    if cfg.kv_lora_rank:
        q_BxTxHxh = latent_queries(x_BxTxD, layer, rope, cfg, adapters)
        k_BxTxHxh, v_BxTxHxh = latent_keys_values(latent_cache_entry(x_BxTxD, layer, rope, cfg, adapters), layer,
                                                  cfg, adapters)
        return q_BxTxHxh[:, :, :, None], k_BxTxHxh, v_BxTxHxh, None
    gate_BxTxQ = None
    if "qkv_proj" in layer:  # Phi-3: one projection, split as [queries | keys | values]
        qkv_BxTxE = project(x_BxTxD, layer, "qkv_proj", adapters)
        q_BxTxQ, k_BxTxV, v_BxTxV = jnp.split(qkv_BxTxE, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    else:
        q_BxTxQ, k_BxTxV, v_BxTxV = (project(x_BxTxD, layer, name, adapters) if name in layer else None
                                     for name in ("q_proj", "k_proj", "v_proj"))
        v_BxTxV = k_BxTxV if v_BxTxV is None else v_BxTxV  # Gemma 4's full layers: values from the keys' projection
    if k_BxTxV is None:  # Gemma 4's KV-sharing layers: queries only
        q_BxTxHxh = q_BxTxQ.reshape(B, T, K * G, hd)
        q_BxTxHxh = norm(q_BxTxHxh, layer["q_norm"], cfg) if cfg.qk_norm else q_BxTxHxh
        q_BxTxHxh = apply_rope(q_BxTxHxh, rope.cos, rope.sin, cfg.rope_interleaved)
        return q_BxTxHxh.reshape(B, T, K, G, hd), None, None, None
    if cfg.attention_output_gate:  # Qwen3.5: each head's queries, then its gate
        q_BxTxHx2h = q_BxTxQ.reshape(B, T, K * G, 2 * hd)
        q_BxTxQ, gate_BxTxQ = (a.reshape(B, T, K * G * hd) for a in jnp.split(q_BxTxHx2h, 2, axis=-1))
    q_BxTxHxh, k_BxTxKxh = q_BxTxQ.reshape(B, T, K * G, hd), k_BxTxV.reshape(B, T, K, hd)
    if cfg.qk_norm_whole:  # OLMo 2, 3: all heads' queries, and keys, normalised together before RoPE
        q_BxTxHxh = norm(q_BxTxQ, layer["q_norm"], cfg).reshape(B, T, K * G, hd)
        k_BxTxKxh = norm(k_BxTxV, layer["k_norm"], cfg).reshape(B, T, K, hd)
    elif cfg.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalised before RoPE
        q_BxTxHxh = norm(q_BxTxHxh, layer["q_norm"], cfg)
        k_BxTxKxh = norm(k_BxTxKxh, layer["k_norm"], cfg)
    q_BxTxHxh, k_BxTxKxh = (apply_rope(a, rope.cos, rope.sin, cfg.rope_interleaved) for a in (q_BxTxHxh, k_BxTxKxh))
    if cfg.qk_l2_norm:  # Llama 4: after the rotation, on the layers that rotate
        normed = unscaled_rms_norm(q_BxTxHxh, cfg.rms_norm_eps), unscaled_rms_norm(k_BxTxKxh, cfg.rms_norm_eps)
        if rope.rotates is None:
            q_BxTxHxh, k_BxTxKxh = normed
        else:
            q_BxTxHxh, k_BxTxKxh = (jnp.where(rope.rotates, n, a) for n, a in zip(normed, (q_BxTxHxh, k_BxTxKxh)))
    if rope.q_scale_T is not None:  # Llama 4's temperature, in float32 and rounded once
        q_scale_BxT = rope.q_scale_T if rope.q_scale_T.ndim == 2 else rope.q_scale_T[None]  # a cache's: per row
        q_BxTxHxh = (q_BxTxHxh * q_scale_BxT[:, :, None, None]).astype(q_BxTxHxh.dtype)
    v_BxTxKxh = v_BxTxV.reshape(B, T, K, hd)
    if cfg.value_norm:
        v_BxTxKxh = unscaled_rms_norm(v_BxTxKxh, cfg.rms_norm_eps)
    return q_BxTxHxh.reshape(B, T, K, G, hd), k_BxTxKxh, v_BxTxKxh, gate_BxTxQ


def output_projection(out_BxTxQ: jax.Array, gate_BxTxQ: jax.Array | None, layer: dict, adapters: Adapters):
    """o_proj of the heads' outputs [B, T, H*hd], each first scaled by sigmoid(gate) where the layer gates them."""
    if gate_BxTxQ is not None:
        out_BxTxQ = out_BxTxQ * jax.nn.sigmoid(gate_BxTxQ.astype(wide(gate_BxTxQ.dtype))).astype(out_BxTxQ.dtype)
    return project(out_BxTxQ, layer, "o_proj", adapters)


def layer_sinks(layer: dict, cfg: ModelConfig) -> jax.Array | None:
    """One layer's attention sinks [H] (gpt-oss) as [K, G], query head k * G + g of key/value head k; None without."""
    return layer["sinks"].reshape(cfg.num_kv_heads, -1) if "sinks" in layer else None


def attend(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, mask: AttentionMask, window, live_QxC, layer, cfg: ModelConfig,
           adapters: Adapters, fused: FusedAttention | None = None, gate_BxTxQ: jax.Array | None = None) -> jax.Array:
    """The attention core shared by the full forward and the cached decode: softmax(q k^T scale) v over the S keys
    that `mask` allows within `window` (with the model's scale and soft cap), then `output_projection` (gated by
    `gate_BxTxQ` where given); returns [B, T, D].

    fused: the full forward's fused kernel (`kernels.choose_kernel`, which takes none where the layer has sinks);
    None: `attention.blockwise_attention`.
    """

    def blockwise():
        k_BxKxSxh, v_BxKxSxh = (jnp.transpose(a, (0, 2, 1, 3)) for a in (k_BxSxKxh, v_BxSxKxh))
        q_BxKxGxTxh = jnp.transpose(q_BxTxKxGxh, (0, 2, 3, 1, 4))
        out = blockwise_attention(q_BxKxGxTxh, k_BxKxSxh, v_BxKxSxh, mask, window, live_QxC,
                                  scale=cfg.attention_scale, softcap=cfg.attn_logit_softcap,
                                  sinks_KxG=layer_sinks(layer, cfg))
        return jnp.transpose(out, (0, 3, 1, 2, 4))

    with jax.named_scope("kernel"):
        if fused is None:
            out_BxTxKxGxh = blockwise()
        else:
            call = KernelCall(mask, window, live_QxC, fused, cfg.attention_scale, cfg.attn_logit_softcap, blockwise,
                              layer_sinks(layer, cfg))
            out_BxTxKxGxh = KERNELS[fused.kind].attend(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, call)
    return output_projection(heads_output(out_BxTxKxGxh, cfg), gate_BxTxQ, layer, adapters)


def attention(x_BxTxD, layer, rope: LayerRope, mask: AttentionMask, window, live_QxC, cfg: ModelConfig,
              adapters: Adapters, fused: FusedAttention | None = None, context: ContextLayout | None = None,
              shared_kv: tuple[jax.Array, jax.Array] | None = None):
    """Grouped-query self-attention of one layer (after any prefix keys/values): ([B, T, D], the layer's keys and
    values [B, T, K, hd] each).

    context: the tokens' layout on a context axis (`context_attention.py`; `mask` then the tokens' own).
    shared_kv: the keys and values of the layer this one shares them with (Gemma 4), for a layer computing none."""
    B, T, _ = x_BxTxD.shape
    q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, gate_BxTxQ = project_qkv(x_BxTxD, layer, rope, cfg, adapters)
    if k_BxSxKxh is None:
        assert shared_kv is not None, "a layer without keys shares another's"
        k_BxSxKxh, v_BxSxKxh = shared_kv
    kv = (k_BxSxKxh, v_BxSxKxh)
    K, hd = cfg.num_kv_heads, cfg.head_dim
    as_batch = lambda a: jnp.broadcast_to(a.astype(x_BxTxD.dtype), (B,) + a.shape)  # noqa: E731
    if context is not None:
        prefix_BxPxKxh = ((as_batch(layer["prefix"]["key"]), as_batch(layer["prefix"]["value"])) if "prefix" in layer
                          else (jnp.zeros((B, 0, K, hd), x_BxTxD.dtype),) * 2)
        k_BxKxTxh, v_BxKxTxh, prefix_k, prefix_v = (jnp.transpose(a, (0, 2, 1, 3))
                                                     for a in (k_BxSxKxh, v_BxSxKxh, *prefix_BxPxKxh))
        with jax.named_scope("kernel"):
            out = context_attention(jnp.transpose(q_BxTxKxGxh, (0, 2, 3, 1, 4)), k_BxKxTxh, v_BxKxTxh, prefix_k,
                                    prefix_v, mask, window, context, scale=cfg.attention_scale,
                                    softcap=cfg.attn_logit_softcap, sinks_KxG=layer_sinks(layer, cfg))
        return output_projection(heads_output(jnp.transpose(out, (0, 3, 1, 2, 4)), cfg), gate_BxTxQ, layer,
                                 adapters), kv
    if "prefix" in layer:  # learned keys/values, used as they are (no rotation), as PEFT's past_key_values
        k_BxSxKxh = jnp.concatenate([as_batch(layer["prefix"]["key"]), k_BxSxKxh], axis=1)
        v_BxSxKxh = jnp.concatenate([as_batch(layer["prefix"]["value"]), v_BxSxKxh], axis=1)
    return attend(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, mask, window, live_QxC, layer, cfg, adapters, fused,
                  gate_BxTxQ), kv


# The activation is computed in float32 (float64) and rounded once, as torch's bfloat16 kernels compute it: in
# bfloat16 XLA:CPU rounds after each of its five operations, converting there and back around each.
@jax.named_scope("activation")
def _swiglu(gate_BxTxF: jax.Array, up_BxTxF: jax.Array) -> jax.Array:
    return jax.nn.silu(gate_BxTxF.astype(wide(gate_BxTxF.dtype))).astype(gate_BxTxF.dtype) * up_BxTxF


@jax.named_scope("activation")
def _geglu(gate_BxTxF: jax.Array, up_BxTxF: jax.Array) -> jax.Array:  # transformers' gelu_pytorch_tanh
    return jax.nn.gelu(gate_BxTxF.astype(wide(gate_BxTxF.dtype)), approximate=True).astype(gate_BxTxF.dtype) * up_BxTxF


@jax.named_scope("activation")
def _clamped_swiglu(gate_BxTxF: jax.Array, up_BxTxF: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit); in float32 (float64)."""
    g = jnp.minimum(gate_BxTxF.astype(wide(gate_BxTxF.dtype)), limit)
    up = jnp.clip(up_BxTxF.astype(g.dtype), -limit, limit)
    return ((up + 1) * (g * jax.nn.sigmoid(g * alpha))).astype(gate_BxTxF.dtype)


# Elementwise, so the backward recomputes them from gate and up (fused into the gradient's own pass) rather than
# keeping silu(gate), its sigmoid and the product as three more [B, T, F] arrays per layer.
GATED = {"silu": jax.checkpoint(_swiglu), "gelu_tanh": jax.checkpoint(_geglu)}


def gated_activation(cfg: ModelConfig):
    """act(gate, up) of `cfg`'s gated MLPs and experts."""
    if cfg.hidden_act == "clamped_swiglu":
        return jax.checkpoint(lambda g, u: _clamped_swiglu(g, u, cfg.swiglu_alpha, cfg.swiglu_limit))
    return GATED[cfg.hidden_act]


def gated_mlp(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, adapters: Adapters, prefix: str = "") -> jax.Array:
    """down(act(gate(x)) * up(x)) through the layer's `{prefix}gate_proj`, ...: SwiGLU, or GeGLU with tanh-GELU
    (Gemma); Phi-3's gate and up are the halves of one projection."""
    if "gate_up_proj" in layer:
        gate_BxTxF, up_BxTxF = jnp.split(project(x_BxTxD, layer, "gate_up_proj", adapters), 2, axis=-1)
    else:
        gate_BxTxF, up_BxTxF = (project(x_BxTxD, layer, prefix + name, adapters)
                                for name in ("gate_proj", "up_proj"))
    hidden = gated_activation(cfg)(gate_BxTxF, up_BxTxF)
    return project(hidden, layer, prefix + "down_proj", adapters)


def mlp(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, adapters: Adapters, expert_hook=None, valid_BxT=None):
    """(the layer's feed-forward output [B, T, D], its routing sums or None): the gated MLP, or a mixture of
    experts (`moe.py`) plus Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(x)).

    expert_hook: the method's part of the experts' grouped products (`AdapterForward.experts`), or None.
    valid_BxT: the tokens the routing sums count (not padding); None: all of them."""
    if "experts" not in layer:
        return gated_mlp(x_BxTxD, layer, cfg, adapters), None
    valid_BxT = jnp.ones(x_BxTxD.shape[:2], bool) if valid_BxT is None else valid_BxT
    out_BxTxD, routing = routed_experts(x_BxTxD, layer, cfg, valid_BxT, gated_activation(cfg), expert_hook)
    if "shared_expert_gate" in layer:
        gate_BxTx1 = jax.nn.sigmoid(dense(x_BxTxD, layer["shared_expert_gate"], kernel_axes=("embed", None)))
        out_BxTxD = out_BxTxD + gate_BxTx1 * gated_mlp(x_BxTxD, layer, cfg, adapters, "shared_expert.")
    elif cfg.shared_expert_size:  # Llama 4's: ungated, added first
        out_BxTxD = gated_mlp(x_BxTxD, layer, cfg, adapters, "shared_expert.") + out_BxTxD
    return out_BxTxD, routing


def tiled_mlp(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, adapters: Adapters, expert_hook=None,
              valid_BxT=None, tile: int = 0):
    """`mlp` over tiles of `tile` tokens a row (a device's share of them on a context axis), each recomputed in the
    backward, so no [B, T, F] activation exists whole (ALST's tiled MLP); the routing sums add up over the tiles.
    Tile i draws its dropout from the layer's key folded with i. tile 0, or rows no longer than a tile: `mlp`."""
    B, T, _ = x_BxTxD.shape
    if not tile or T // tile_count(T, 1)[0] <= tile:
        return mlp(x_BxTxD, layer, cfg, adapters, expert_hook, valid_BxT)
    valid_BxT = jnp.ones((B, T), bool) if valid_BxT is None else valid_BxT

    def one(_, args):
        x, valid, i = args
        tile_adapters = adapters if adapters.dropout_key is None else adapters.with_key(
            jax.random.fold_in(adapters.dropout_key, i))
        return None, mlp(x, layer, cfg, tile_adapters, expert_hook, valid)

    tiles = cut_tiles(x_BxTxD, tile)
    _, (out, routing) = jax.lax.scan(jax.checkpoint(one, prevent_cse=False), None,
                                     (tiles, cut_tiles(valid_BxT, tile), jnp.arange(tiles.shape[0])))
    return join_tiles(out, T), jax.tree.map(lambda r: jnp.sum(r, axis=0), routing)


def bottleneck(x_BxTxD: jax.Array, adapter: dict) -> jax.Array:
    """Houlsby adapter on a sub-layer's output: x + up(silu(down(x)))."""
    return x_BxTxD + dense(jax.nn.silu(dense(x_BxTxD, adapter["down"])), adapter["up"])


def decoder_layer(x_BxTxD: jax.Array, layer: dict, attend_fn, cfg: ModelConfig, adapters: Adapters,
                  expert_hook=None, valid_BxT=None, mlp_tile: int = 0):
    """One pre-norm layer, x + attn(norm(x)) then x + mlp(norm(x)), each with its bottleneck adapter if present.
    With `cfg.sandwich_norms` (Gemma) each sub-layer's output is normalised too: x + norm(attn(norm(x))) with
    input_layernorm and post_attention_layernorm, then x + norm(mlp(norm(x))) with pre_ and post_feedforward_layernorm;
    with `cfg.post_norms` (OLMo) only the outputs are: x + norm(attn(x)), then x + norm(mlp(x)). Gemma 4 adds
    the mixture beside the MLP (`experts_beside_mlp`), its per-layer input branch (the layer's `per_layer_input`
    [B, T, P], beside its weights) and the `layer_scalar` times the layer's output.

    attend_fn(h_BxTxD) -> (attention output [B, T, D], aux): the full forward's attention or the cached one, whose
    aux (the layer's new keys and values) is returned beside the new x, then a mixture's routing sums (or None;
    `mlp`, counting the tokens of valid_BxT). adapters, expert_hook: the method's (the MLP's). mlp_tile: `tiled_mlp`'s
    tile.
    """
    sandwich, post = cfg.sandwich_norms, cfg.post_norms
    with jax.named_scope("attention"):
        h, aux = attend_fn(x_BxTxD if post else norm(x_BxTxD, layer["input_layernorm"], cfg))
        h = norm(h, layer["post_attention_layernorm"], cfg) if sandwich or post else h
        x_BxTxD = x_BxTxD + (bottleneck(h, layer["attn_adapter"]) if "attn_adapter" in layer else h)
    with jax.named_scope("mlp"):
        h_in = x_BxTxD if post else norm(
            x_BxTxD, layer["pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"], cfg)
        if cfg.experts_beside_mlp:  # Gemma 4: the MLP and the mixture side by side, each normed, then summed
            h = norm(gated_mlp(h_in, layer, cfg, adapters), layer["post_feedforward_layernorm_1"], cfg)
            valid_BxT = jnp.ones(x_BxTxD.shape[:2], bool) if valid_BxT is None else valid_BxT
            experts_BxTxD, routing = routed_experts(norm(x_BxTxD, layer["pre_feedforward_layernorm_2"], cfg), layer,
                                                    cfg, valid_BxT, gated_activation(cfg), expert_hook, x_BxTxD)
            h = h + norm(experts_BxTxD, layer["post_feedforward_layernorm_2"], cfg)
        else:
            h, routing = tiled_mlp(h_in, layer, cfg, adapters, expert_hook, valid_BxT, mlp_tile)
        h = norm(h, layer["post_feedforward_layernorm"], cfg) if sandwich or post else h
        x_BxTxD = x_BxTxD + (bottleneck(h, layer["mlp_adapter"]) if "mlp_adapter" in layer else h)
    if "per_layer_input" in layer:  # Gemma 4's third branch: its input gates this layer's per-layer input
        with jax.named_scope("per_layer_input"):
            gate_BxTxP = dense(x_BxTxD, layer["per_layer_input_gate"], kernel_axes=("embed", None))
            h = jax.nn.gelu(gate_BxTxP.astype(wide(gate_BxTxP.dtype)), approximate=True).astype(gate_BxTxP.dtype)
            h = dense(h * layer["per_layer_input"].astype(h.dtype), layer["per_layer_projection"],
                      kernel_axes=(None, "embed"))
            x_BxTxD = x_BxTxD + norm(h, layer["post_per_layer_input_norm"], cfg)
    if "layer_scalar" in layer:  # a buffer in transformers: no gradient reaches it (`params.BUFFERS`)
        x_BxTxD = x_BxTxD * jax.lax.stop_gradient(layer["layer_scalar"]).astype(x_BxTxD.dtype)
    return x_BxTxD, aux, routing


def decoder(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig, **kwargs) -> jax.Array:
    """Final-norm hidden states [B, T, D] in the compute dtype (`decoder_and_routing` without the routing)."""
    return decoder_and_routing(params, tokens_BxT, cfg, **kwargs)[0]


def decoder_and_routing(
    params: dict,
    tokens_BxT: jax.Array,
    cfg: ModelConfig,
    *,
    positions_BxT: jax.Array | None = None,
    attention_mask_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    method: MethodConfig | None = None,
    options: ForwardOptions = ForwardOptions(),
    dropout_key: jax.Array | None = None,
    placed_embeddings: PlacedEmbeddings | None = None,
    span_ids_BxT: jax.Array | None = None,
    deepstack: DeepStack | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(final-norm hidden states [B, T, D] in the compute dtype, a mixture's load-balancing loss or None).

    positions_BxT: RoPE positions (default P..P+T-1 after P prefix tokens; pass them for left padding or packing), or
    M-RoPE's time, row and column streams [3, B, T] (Qwen2.5-VL's images; `cfg.mrope_section`, `rope.mrope_angles`).
    attention_mask_BxT: 1 for real tokens, 0 for padding (keys that nobody attends to).
    segment_ids_BxT: packed rows; a token attends only to earlier tokens of its own segment.
    method: the fine-tuning method whose leaves `params` carries (its LoRA scaling is static).
    dropout_key: training only, with a LoRA method whose `dropout` > 0: layer i draws its masks from
    `jax.random.split(dropout_key, L)[i]` (see `Adapters.of_module`). None (eval, generation): no dropout.
    placed_embeddings: an encoder's vectors (an image's soft tokens) over the embeddings (after Gemma's sqrt(D)
    scale) of the positions they mark (`models.multimodal`). span_ids_BxT: bidirectional spans (`multimodal.span_ids`),
    whose tokens also see their span's later tokens; the blockwise kernel computes them. deepstack: vectors added to
    those positions' hidden states after the first layers (`multimodal.DeepStack`, Qwen3-VL's). None of them: no cost.
    """
    dtype = jnp.dtype(options.compute_dtype)
    B, T = tokens_BxT.shape
    view = adapter_forward(method, cfg)
    layers = params["layers"] if view.prepare is None else view.prepare(params["layers"])
    prefix = params["layers"]["prefix"]["key"].shape[1] if "prefix" in params["layers"] else 0
    if positions_BxT is None:
        positions_BxT = jnp.broadcast_to(prefix + jnp.arange(T), (B, T))
    context = context_layout(T, cfg.sliding_windows, options.context_attention)
    if context is not None and (placed_embeddings is not None or span_ids_BxT is not None or deepstack is not None
                                or positions_BxT.ndim == 3):
        raise JaxtuneError("placed embeddings, bidirectional spans or M-RoPE positions (images) with a [mesh] "
                           "context axis are not supported; train on one device's length")
    if context is None:
        mask = training_mask(B, T, prefix, attention_mask_BxT, segment_ids_BxT, span_ids_BxT=span_ids_BxT)
        live_QxC = live_blocks(mask, T, prefix + T)  # once for all layers: which blocks any query sees
        K, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        shape = AttentionShape(B, T, prefix + T, K, G, cfg.head_dim, prefix, segment_ids_BxT is not None,
                               attention_mask_BxT is not None, cfg.attn_logit_softcap, dtype,
                               tuple(sorted(set(cfg.sliding_windows))), "sinks" in params["layers"],
                               span_ids_BxT is not None)
        fused = choose_kernel(options.attention, shape, platform_in_context())
    else:  # each row's tokens split over the context axis, in its layout's order (the prefix apart)
        tokens_BxT, positions_BxT, attention_mask_BxT, segment_ids_BxT, slots_T = spread_inputs(
            context, tokens_BxT, positions_BxT, attention_mask_BxT, segment_ids_BxT, prefix)
        mask = training_mask(B, slots_T.shape[0], 0, attention_mask_BxT, segment_ids_BxT, slots_T)
        live_QxC, fused = None, None
        context = with_ring_kernel(context, options.attention, B=B, T=T, K=cfg.num_kv_heads,
                              G=cfg.num_heads // cfg.num_kv_heads, head_dim=cfg.head_dim, prefix=prefix,
                              softcap=cfg.attn_logit_softcap, dtype=dtype, windows=cfg.sliding_windows)
    rope = rope_tables(positions_BxT, cfg, dtype, mask.q_slot_T)
    valid_BxT = (attention_mask_BxT > 0 if attention_mask_BxT is not None
                 else segment_ids_BxT > 0 if segment_ids_BxT is not None else jnp.ones(tokens_BxT.shape, bool))
    use_dropout = dropout_key is not None and view.dropout_rate > 0  # else no key enters the scan: no random work
    if cfg.linear_attention_layers and context is not None:
        raise JaxtuneError(f"{cfg.architecture}'s Gated DeltaNet layers carry a state along the row: a [mesh] context "
                           "axis, which splits rows over devices, is not supported; train on one device's length")
    if cfg.global_head_dim and context is not None:
        raise JaxtuneError(f"{cfg.architecture}'s layers of two head widths, some reading others' keys: a [mesh] "
                           "context axis is not supported; train on one device's length")
    stacks, layers = ({}, layers) if cfg.stacked_by_kind else unsliced_kernels(layers, dtype)
    padded_BxT = None if attention_mask_BxT is None and segment_ids_BxT is None else valid_BxT  # zeroed there

    if cfg.global_head_dim:  # Gemma 4's full layers: their own head width, RoPE tables and kernel choice
        global_cfg = cfg.global_view
        global_rope = rope_tables(positions_BxT, global_cfg, dtype, mask.q_slot_T)
        global_fused = None if context is not None else choose_kernel(  # `shape.spans`: the blockwise kernel
            options.attention, shape._replace(K=global_cfg.num_kv_heads, G=cfg.num_heads // global_cfg.num_kv_heads,
                                              head_dim=cfg.global_head_dim), platform_in_context())

    def layer_block(x_BxTxD, per_layer, shared, kind=LayerKind(), shared_kv=None):
        layer, window, index, layer_key = per_layer if use_dropout else (*per_layer, None)
        rope, mask, live_QxC, stacks, valid_BxT = shared
        layer_cfg, tables, layer_fused = (global_cfg, global_rope, global_fused) if kind.full else (cfg, rope, fused)
        rope_of_layer = layer_rope(tables, jnp.asarray(cfg.rope_table_of_layer, jnp.int32)[index], layer_cfg)
        layer = with_kernels_of_layer(layer, stacks, index)
        adapters = layer_adapters(view, layer_key)
        x_BxTxD = constrain(x_BxTxD, ("batch", "seq", None))  # rows over data x fsdp x expert, tokens over context
        if kind.linear:
            attend_fn = lambda h: (gated_deltanet_layer(h, layer, cfg, adapters, padded_BxT,
                                                        segment_ids_BxT=segment_ids_BxT)[0], None)
        else:
            attend_fn = lambda h: attention(h, layer, rope_of_layer, mask, window, live_QxC, layer_cfg, adapters,
                                            layer_fused, context, shared_kv)
        x_BxTxD, kv, routing = decoder_layer(x_BxTxD, layer, attend_fn, cfg, adapters, view.experts, valid_BxT,
                                             options.tiled_mlp)
        if deepstack is not None:
            x_BxTxD = add_deepstack(x_BxTxD, deepstack, index)
        return x_BxTxD, routing, kv

    rematted = remat_layer(lambda *args: layer_block(*args)[:2], options.remat, dtype)
    shared = (rope, mask, live_QxC, stacks, valid_BxT)
    block = lambda x, per_layer: rematted(x, per_layer, shared)  # noqa: E731
    x_BxTxD = embed(params, tokens_BxT, cfg, dtype)
    if placed_embeddings is not None:
        x_BxTxD = place_embeddings(x_BxTxD, placed_embeddings)
    x_BxTxD = constrain(x_BxTxD, ("batch", "seq", None))
    per_layer: tuple = (layers, jnp.asarray(cfg.sliding_windows, jnp.int32), jnp.arange(cfg.num_layers))
    if use_dropout:  # one key per layer, scanned like the weights, so every layer draws its own masks
        per_layer += (jax.random.split(dropout_key, cfg.num_layers),)
    routing: tuple[jax.Array, jax.Array] | None  # a mixture's (assigned [L, E], probability sums [L, E])
    if cfg.stacked_by_kind:
        every = tuple(range(cfg.num_layers))
        items = {name: (module, cfg.module_layers(name)) for name, module in layers.items()}
        items.update({f"per_layer.{i}": (a, every) for i, a in enumerate(per_layer[1:])})
        if cfg.per_layer_input_size:
            items["per_layer_input"] = (per_layer_inputs(params, tokens_BxT, x_BxTxD, cfg), every)
        no_routing = (jnp.zeros(cfg.num_experts, jnp.float32),) * 2  # a dense layer's, beside the mixtures'

        def mixed_block(x, rows, kind, kept_kv):
            layer = {hf_module_name(name): rows[name] for name in (*layers, "per_layer_input") if name in rows}
            one = (layer, *(rows[f"per_layer.{i}"] for i in range(len(per_layer) - 1)))
            x, routing, kv = layer_block(x, one, shared, kind, None if kept_kv is None else kept_kv.get(kind.full))
            return x, no_routing if routing is None and cfg.num_experts else routing, kv

        scan = scan_kv_sharing_layers if cfg.shared_kv_layers else scan_layers_by_kind
        x_BxTxD, routing = scan(mixed_block, x_BxTxD, items, cfg, lambda fn: remat_layer(fn, options.remat, dtype),
                                wrap_branch=options.remat.wrap)
        if cfg.dense_layers:  # the load-balancing loss counts the mixtures' layers
            routing = jax.tree.map(lambda a: a[jnp.asarray(cfg.mixture_layers)], routing)
    elif options.scan_layers:
        x_BxTxD, routing = jax.lax.scan(block, x_BxTxD, per_layer)
    else:
        outputs = []
        for i in range(cfg.num_layers):
            x_BxTxD, layer_routing = block(x_BxTxD, jax.tree.map(lambda a: a[i], per_layer))
            outputs.append(layer_routing)
        routing = jax.tree.map(lambda *a: jnp.stack(a), *outputs) if cfg.num_experts else None
    aux = None if routing is None else router_loss(*routing, jnp.sum(valid_BxT, dtype=jnp.float32))
    x_BxTxD = norm(x_BxTxD, params["norm"], cfg)
    return (x_BxTxD if context is None else gather_outputs(x_BxTxD, context, T)), aux


def unsliced_kernels(layers: dict, dtype) -> tuple[dict, dict]:
    """(frozen 16-bit kernel stacks the layer scan leaves whole, the layers it slices) on a mesh, or where the
    compute `dtype` is wider than the kernels; ({}, layers) otherwise.

    Scanned, a kernel stack [L, in, out] is sliced a layer at a time: a copy of the layer's shard. Left whole,
    each layer reads its kernels' pieces from the stack by index (`BitPattern.layer`) right where it gathers or
    widens them (`linear.gathered_piecewise_matmul`, `linear.derived_piecewise_matmul`), so a device holds a
    piece's shard, never a layer's (measured: the LoRA fsdp=8 step of a 607M bfloat16 model, 48.9 -> 39.4 MiB of
    temporaries a device; the same model's one-device LoRA step under float32 compute, the layer's 66 MiB of
    MLP kernel bits)."""
    if mesh_in_context() is None and jnp.dtype(dtype).itemsize <= 2:
        return {}, layers
    stacks = {name: m["kernel"] for name, m in layers.items()
              if isinstance(m, dict) and isinstance(m.get("kernel"), BitPattern)}
    sliced = {name: {k: v for k, v in m.items() if k != "kernel"} if name in stacks else m
              for name, m in layers.items()}
    return stacks, sliced


def with_kernels_of_layer(layer: dict, stacks: dict, index: jax.Array) -> dict:
    """One layer's modules with each unsliced kernel as layer `index` of its stack."""
    return {**layer, **{name: {**layer[name], "kernel": BitPattern(kernel.bits, kernel.dtype, index)}
                        for name, kernel in stacks.items()}}


def forward(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig, **kwargs) -> jax.Array:
    """Logits [B, T, V] float32 (float64 with compute_dtype float64). Keyword arguments as for `decoder`.

    Jit with `static_argnames=("cfg", "method", "options")`.
    """
    return head_logits(params, decoder(params, tokens_BxT, cfg, **kwargs), cfg.final_logit_softcap)
