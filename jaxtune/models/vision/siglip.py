"""The SigLIP vision tower (Zhai et al. 2023; transformers' `SiglipVisionModel` without its pooling head) as pure
functions over `hf.vision_param_specs`' tree: `siglip_tower` (pixels [N, C, H, W] -> patch features [N, P, Dv]). The
patch convolution is a reshape and one matmul (its stride is its kernel); the encoder's layers are stacked and
scanned (each rematerialised in a trained tower's backward); attention is the decoder's blockwise kernel with each
image one bidirectional span, so no [P, P] scores are held. Numerics as transformers': LayerNorm statistics and the
softmax in float32, the rest in the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import SiglipConfig
from jaxtune.models.attention import AttentionMask, blockwise_attention, live_blocks, training_mask
from jaxtune.models.linear import wide
from jaxtune.models.vision.tower_linear import tower_linear as linear


def layer_norm(x: jax.Array, norm: dict, eps: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, in float32 (float64) then x's dtype."""
    x32 = x.astype(wide(x.dtype))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * norm["weight"].astype(y.dtype) + norm["bias"].astype(y.dtype)).astype(x.dtype)


def patches(pixels_NxCxHxW: jax.Array, patch: int) -> jax.Array:
    """[N, (H/p)(W/p), C p p]: the patches in row-major order, each flattened as a conv kernel [C, p, p] is."""
    N, C, H, W = pixels_NxCxHxW.shape
    grid = pixels_NxCxHxW.reshape(N, C, H // patch, patch, W // patch, patch)
    return jnp.transpose(grid, (0, 2, 4, 1, 3, 5)).reshape(N, (H // patch) * (W // patch), C * patch * patch)


def encoder_layer(x_NxPxD: jax.Array, layer: dict, mask: AttentionMask, live_QxC: jax.Array,
                  cfg: SiglipConfig) -> jax.Array:
    """x + attn(LN(x)), then + fc2(gelu_tanh(fc1(LN(x)))): multi-head attention over all of an image's patches
    (`mask`: each image one span, `siglip_tower`'s)."""
    N, P, D = x_NxPxD.shape
    H, hd = cfg.num_heads, cfg.head_dim
    h = layer_norm(x_NxPxD, layer["layer_norm1"], cfg.layer_norm_eps)
    q, k, v = (jnp.transpose(linear(h, layer[f"self_attn.{n}_proj"]).reshape(N, P, H, hd), (0, 2, 1, 3))
               for n in "qkv")
    attended_NxHx1xPxh = blockwise_attention(q[:, :, None], k, v, mask, 0, live_QxC, scale=hd**-0.5)
    attended = jnp.transpose(attended_NxHx1xPxh[:, :, 0], (0, 2, 1, 3)).reshape(N, P, D)
    x_NxPxD = x_NxPxD + linear(attended, layer["self_attn.out_proj"])
    h = layer_norm(x_NxPxD, layer["layer_norm2"], cfg.layer_norm_eps)
    h = linear(h, layer["mlp.fc1"])
    h = jax.nn.gelu(h.astype(wide(h.dtype)), approximate=True).astype(h.dtype)
    return x_NxPxD + linear(h, layer["mlp.fc2"])


def siglip_tower(tower: dict, pixels_NxCxHxW: jax.Array, cfg: SiglipConfig, dtype=jnp.float32) -> jax.Array:
    """Post-LayerNorm patch features [N, P, Dv] in `dtype` of N images [N, C, image_size, image_size]."""
    x_NxPxK = patches(pixels_NxCxHxW.astype(dtype), cfg.patch_size)
    x_NxPxD = linear(x_NxPxK, tower["patch_embedding"]) + tower["position_embedding"].astype(dtype)
    N, P, _ = x_NxPxD.shape
    mask = training_mask(N, P, 0, None, None, span_ids_BxT=jnp.zeros((N, P), jnp.int32))  # every patch sees all
    live_QxC = live_blocks(mask, P, P)
    # each layer rematerialised in a trained tower's backward: only the layers' inputs [N, P, D] are kept
    layer_step = jax.checkpoint(lambda x, layer: (encoder_layer(x, layer, mask, live_QxC, cfg), None))
    x_NxPxD, _ = jax.lax.scan(layer_step, x_NxPxD, tower["layers"])
    return layer_norm(x_NxPxD, tower["post_layernorm"], cfg.layer_norm_eps)
