"""Qwen2.5-VL's vision transformer as a pure function (`vision_forward`): patches embedded (its Conv3d, whose stride
is its kernel, is one matmul), put in window order (`qwen_vl_layout`), rotated by 2D RoPE (rows on the first half of
each rotary half, columns on the second), then blocks of RMSNorm, attention and a gated SiLU MLP, scanned over the
stacked blocks: attention within windows, or over the whole image in `fullatt_blocks`, never across images; then the
merger (RMSNorm, merge² neighbouring patches concatenated, a GELU MLP) and the merged tokens back in image order.
Attention is jaxtune's blockwise kernel with segment ids, so nothing grows with the square of the patch count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.models.attention import AttentionMask, blockwise_attention, live_blocks
from jaxtune.models.norms import rms_norm
from jaxtune.models.vision.qwen_vl_config import QwenVisionConfig
from jaxtune.models.vision.qwen_vl_layout import VisionLayout


def _linear(d_in: int, d_out: int, dtype, bias: bool = True, layers: tuple[int, ...] = ()) -> dict:
    module = {"kernel": jax.ShapeDtypeStruct((*layers, d_in, d_out), dtype)}
    if bias:
        module["bias"] = jax.ShapeDtypeStruct((*layers, d_out), dtype)
    return module


def abstract_vision_params(cfg: QwenVisionConfig, dtype=jnp.float32) -> dict:
    """The tower's parameters as `ShapeDtypeStruct`s, kernels [in, out], blocks stacked on a leading [depth] axis:
    patch_embed.kernel [C * T * P * P, D]; blocks' norm1, norm2 [L, D], qkv (queries, keys, values side by side),
    proj, gate_proj, up_proj, down_proj with biases; merger's norm [D], fc1 [4D, 4D], fc2 [4D, out]."""
    D, F, L, wide = cfg.hidden_size, cfg.intermediate_size, (cfg.depth,), cfg.hidden_size * cfg.merge_unit
    return {
        "patch_embed": _linear(cfg.patch_dim, D, dtype, bias=False),
        "blocks": {"norm1": jax.ShapeDtypeStruct((*L, D), dtype), "norm2": jax.ShapeDtypeStruct((*L, D), dtype),
                   "qkv": _linear(D, 3 * D, dtype, layers=L), "proj": _linear(D, D, dtype, layers=L),
                   "gate_proj": _linear(D, F, dtype, layers=L), "up_proj": _linear(D, F, dtype, layers=L),
                   "down_proj": _linear(F, D, dtype, layers=L)},
        "merger": {"norm": jax.ShapeDtypeStruct((D,), dtype), "fc1": _linear(wide, wide, dtype),
                   "fc2": _linear(wide, cfg.out_hidden_size, dtype)},
    }


def _dense(x: jax.Array, module: dict) -> jax.Array:
    y = x @ module["kernel"]
    return y + module["bias"] if "bias" in module else y


def rotary_angles(positions_Nx2: jax.Array, cfg: QwenVisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin, float32 [N, head_dim]: frequencies theta^(-4i / head_dim) (i < head_dim / 4) at the row, then
    at the column, that half repeated (transformers' axial `Qwen2_5_VLVisionRotaryEmbedding`)."""
    quarter = cfg.head_dim // 2
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))).astype(np.float32)
    freqs_Nx2xQ = positions_Nx2.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    half_NxH = freqs_Nx2xQ.reshape(freqs_Nx2xQ.shape[0], -1)
    angles_NxR = jnp.concatenate([half_NxH, half_NxH], axis=-1)
    return jnp.cos(angles_NxR), jnp.sin(angles_NxR)


def _rotate(x_NxHxd: jax.Array, cos_Nxd: jax.Array, sin_Nxd: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin in float32, cast back (transformers' `apply_rotary_pos_emb_vision`)."""
    x = x_NxHxd.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos_Nxd[:, None] + rotated * sin_Nxd[:, None]).astype(x_NxHxd.dtype)


def _segment_mask(segment_N: jax.Array) -> AttentionMask:
    """Bidirectional attention among the patches of one segment (a window, or an image's frame)."""
    N = segment_N.shape[0]
    return AttentionMask(q_slot_T=jnp.full((N,), N, jnp.int32), k_valid_BxS=jnp.ones((1, N), bool),
                         q_segment_BxT=segment_N[None], k_segment_BxS=segment_N[None],
                         k_slot_S=jnp.arange(N, dtype=jnp.int32))


def _block(x_NxD: jax.Array, block: dict, rope: tuple[jax.Array, jax.Array], mask: AttentionMask,
           live: jax.Array, cfg: QwenVisionConfig) -> jax.Array:
    N, H = x_NxD.shape[0], cfg.num_heads
    with jax.named_scope("attention"):
        qkv_Nx3xHxd = _dense(rms_norm(x_NxD, block["norm1"], cfg.norm_eps), block["qkv"]).reshape(N, 3, H, -1)
        q, k = (_rotate(qkv_Nx3xHxd[:, i], *rope) for i in (0, 1))
        heads = lambda a: jnp.transpose(a, (1, 0, 2))[None]  # [1, H, N, d]
        out_HxNxd = blockwise_attention(heads(q)[:, :, None], heads(k), heads(qkv_Nx3xHxd[:, 2]), mask,
                                        live_QxC=live)[0, :, 0]
        x_NxD = x_NxD + _dense(jnp.transpose(out_HxNxd, (1, 0, 2)).reshape(N, -1), block["proj"])
    with jax.named_scope("mlp"):
        h = rms_norm(x_NxD, block["norm2"], cfg.norm_eps)
        gated = jax.nn.silu(_dense(h, block["gate_proj"])) * _dense(h, block["up_proj"])
        return x_NxD + _dense(gated, block["down_proj"])


def vision_forward(params: dict, pixel_values_NxP: jax.Array, layout: VisionLayout, cfg: QwenVisionConfig
                   ) -> jax.Array:
    """Image embeddings [N / merge², out_hidden_size] in params' dtype, in image order (what
    `Qwen2_5_VLModel.get_image_features` gives, concatenated): pixel_values [N, C * T * P * P] as the processor
    gives them (`image_patches`), layout = `vision_layout(image_grid_thw, cfg)`. Jit with `cfg` static."""
    dtype = params["patch_embed"]["kernel"].dtype
    N = pixel_values_NxP.shape[0]
    with jax.named_scope("patch_embed"):
        x_NxD = (pixel_values_NxP.astype(dtype) @ params["patch_embed"]["kernel"])[layout.patch_order_N]
    rope = rotary_angles(jnp.asarray(layout.positions_Nx2), cfg)
    window_mask = _segment_mask(jnp.asarray(layout.window_segment_N))
    image_mask = _segment_mask(jnp.asarray(layout.image_segment_N))
    window_live, image_live = live_blocks(window_mask, N, N), live_blocks(image_mask, N, N)
    full_L = jnp.asarray(np.isin(np.arange(cfg.depth), cfg.fullatt_blocks))

    def step(x, layer):
        block, full = layer
        mask = jax.tree.map(lambda a, b: jnp.where(full, a, b), image_mask, window_mask)
        return _block(x, block, rope, mask, jnp.where(full, image_live, window_live), cfg), None

    x_NxD, _ = jax.lax.scan(step, x_NxD, (params["blocks"], full_L))
    with jax.named_scope("merger"):
        merger = params["merger"]
        merged = rms_norm(x_NxD, merger["norm"], cfg.norm_eps).reshape(N // cfg.merge_unit, -1)
        merged = _dense(jax.nn.gelu(_dense(merged, merger["fc1"]), approximate=False), merger["fc2"])
    return merged[layout.merged_order_M]
