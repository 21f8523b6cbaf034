"""Qwen2.5-VL's vision transformer as a pure function (`padded_vision_forward`) over images each padded to a static
patch count: patches embedded (its Conv3d, whose stride is its kernel, is one matmul), rotated by 2D RoPE (rows on
the first half of each rotary half, columns on the second), then blocks of RMSNorm, attention and a gated SiLU MLP,
scanned over the stacked blocks: attention within windows, or over the whole frame in `fullatt_blocks` (segment ids
from the traced grids, `padded_layout`: no reordering), each image its own batch row; then the merger (RMSNorm,
merge² neighbouring patches concatenated, a GELU MLP). Attention is jaxtune's blockwise kernel, so nothing grows
with the square of the patch count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.models.attention import AttentionMask, blockwise_attention, live_blocks
from jaxtune.models.norms import rms_norm
from jaxtune.models.vision.qwen_vl_config import QwenVisionConfig
from jaxtune.models.vision.tower_linear import tower_linear

PAD_SEGMENT = 2**16 - 1  # the mask's largest plain segment id: padding patches attend among themselves (never read)


def linear_spec(d_in: int, d_out: int, dtype, bias: bool = True, layers: tuple[int, ...] = ()) -> dict:
    """A linear's kernel [*layers, in, out] (and bias [*layers, out]) as `ShapeDtypeStruct`s."""
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
        "patch_embed": linear_spec(cfg.patch_dim, D, dtype, bias=False),
        "blocks": {"norm1": jax.ShapeDtypeStruct((*L, D), dtype), "norm2": jax.ShapeDtypeStruct((*L, D), dtype),
                   "qkv": linear_spec(D, 3 * D, dtype, layers=L), "proj": linear_spec(D, D, dtype, layers=L),
                   "gate_proj": linear_spec(D, F, dtype, layers=L), "up_proj": linear_spec(D, F, dtype, layers=L),
                   "down_proj": linear_spec(F, D, dtype, layers=L)},
        "merger": {"norm": jax.ShapeDtypeStruct((D,), dtype), "fc1": linear_spec(wide, wide, dtype),
                   "fc2": linear_spec(wide, cfg.out_hidden_size, dtype)},
    }


def rotary_angles(positions_Nx2: jax.Array, head_dim: int, rope_theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin, float32 [N, head_dim]: frequencies theta^(-4i / head_dim) (i < head_dim / 4) at the row, then
    at the column, that half repeated (transformers' axial `Qwen2_5_VLVisionRotaryEmbedding`, Qwen3-VL's)."""
    quarter = head_dim // 2
    inv_freq = (1.0 / (rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))).astype(np.float32)
    freqs_Nx2xQ = positions_Nx2.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    half_NxH = freqs_Nx2xQ.reshape(freqs_Nx2xQ.shape[0], -1)
    angles_NxR = jnp.concatenate([half_NxH, half_NxH], axis=-1)
    return jnp.cos(angles_NxR), jnp.sin(angles_NxR)


def rotate(x_NxHxd: jax.Array, cos_Nxd: jax.Array, sin_Nxd: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin in float32, cast back (transformers' `apply_rotary_pos_emb_vision`)."""
    x = x_NxHxd.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos_Nxd[:, None] + rotated * sin_Nxd[:, None]).astype(x_NxHxd.dtype)


def segment_mask(segment_IxN: jax.Array) -> AttentionMask:
    """Bidirectional attention among the patches of one segment (a window, or an image's frame), each of I
    sequences [I, N] its own."""
    N = segment_IxN.shape[-1]
    return AttentionMask(q_slot_T=jnp.full((N,), N, jnp.int32), k_valid_BxS=jnp.ones(segment_IxN.shape, bool),
                         q_segment_BxT=segment_IxN, k_segment_BxS=segment_IxN, k_slot_S=jnp.arange(N, dtype=jnp.int32))


def self_attention(h_IxNxD: jax.Array, block: dict, rope: tuple[jax.Array, jax.Array], mask: AttentionMask,
                   live: jax.Array, num_heads: int) -> jax.Array:
    """[I, N, D]: the blocks' attention over normed h (`qkv`, 2D rotary on queries and keys, bidirectional within
    the mask's segments, `proj`), before the residual."""
    n_images, N = h_IxNxD.shape[:2]
    qkv = tower_linear(h_IxNxD, block["qkv"]).reshape(n_images * N, 3, num_heads, -1)
    q, k = (rotate(qkv[:, i], *rope).reshape(n_images, N, num_heads, -1) for i in (0, 1))
    heads = lambda a: jnp.transpose(a, (0, 2, 1, 3))  # [I, H, N, d]
    v = qkv[:, 2].reshape(n_images, N, num_heads, -1)
    out_IxHxNxd = blockwise_attention(heads(q)[:, :, None], heads(k), heads(v), mask, live_QxC=live)[:, :, 0]
    return tower_linear(jnp.transpose(out_IxHxNxd, (0, 2, 1, 3)).reshape(n_images, N, -1), block["proj"])


def _block(x_IxNxD: jax.Array, block: dict, rope: tuple[jax.Array, jax.Array], mask: AttentionMask,
           live: jax.Array, cfg: QwenVisionConfig) -> jax.Array:
    with jax.named_scope("attention"):
        h = rms_norm(x_IxNxD, block["norm1"], cfg.norm_eps)
        x_IxNxD = x_IxNxD + self_attention(h, block, rope, mask, live, cfg.num_heads)
    with jax.named_scope("mlp"):
        h = rms_norm(x_IxNxD, block["norm2"], cfg.norm_eps)
        gated = jax.nn.silu(tower_linear(h, block["gate_proj"])) * tower_linear(h, block["up_proj"])
        return x_IxNxD + tower_linear(gated, block["down_proj"])


def _tower(params: dict, x_IxNxD: jax.Array, positions_IxNx2: jax.Array, window_IxN: jax.Array, image_IxN: jax.Array,
           cfg: QwenVisionConfig) -> jax.Array:
    """The blocks and the merger over I sequences of N embedded patches (merge units consecutive): [I, N / merge²,
    out_hidden_size], attention within each sequence's windows (or its images, in `fullatt_blocks`)."""
    n_images, N, _ = x_IxNxD.shape
    cos, sin = rotary_angles(positions_IxNx2.reshape(n_images * N, 2), cfg.head_dim, cfg.rope_theta)
    window_mask, image_mask = segment_mask(window_IxN), segment_mask(image_IxN)
    window_live, image_live = live_blocks(window_mask, N, N), live_blocks(image_mask, N, N)
    full_L = jnp.asarray(np.isin(np.arange(cfg.depth), cfg.fullatt_blocks))

    def step(x, layer):
        block, full = layer
        mask = jax.tree.map(lambda a, b: jnp.where(full, a, b), image_mask, window_mask)
        return _block(x, block, (cos, sin), mask, jnp.where(full, image_live, window_live), cfg), None

    # each block rematerialised in a trained tower's backward: only the blocks' inputs [I, N, D] are kept
    x_IxNxD, _ = jax.lax.scan(jax.checkpoint(step), x_IxNxD, (params["blocks"], full_L))
    with jax.named_scope("merger"):
        merger = params["merger"]
        merged = rms_norm(x_IxNxD, merger["norm"], cfg.norm_eps).reshape(n_images, N // cfg.merge_unit, -1)
        return tower_linear(jax.nn.gelu(tower_linear(merged, merger["fc1"]), approximate=False), merger["fc2"])


def frame_layout(grid_Ix3: jax.Array, N: int, merge: int) -> tuple[jax.Array, jax.Array]:
    """(positions (row, column) [I, N, 2], frame segments [I, N]) of I images of traced grids (t, h, w) each held in N
    patch slots in the processor's order (merge blocks row by row, frames one after another); slots past t h w are
    padding, a segment of their own (`PAD_SEGMENT`), frames numbered from 1."""
    t, h, w = (grid_Ix3[:, i, None] for i in range(3))
    gh, gw = jnp.maximum(h // merge, 1), jnp.maximum(w // merge, 1)
    slot = jnp.arange(N)[None]
    block, within = slot // merge**2, slot % merge**2
    frame, in_frame = block // (gh * gw), block % (gh * gw)
    positions = jnp.stack([in_frame // gw * merge + within // merge, in_frame % gw * merge + within % merge], -1)
    return positions.astype(jnp.int32), jnp.where(slot < t * h * w, frame + 1, PAD_SEGMENT).astype(jnp.int32)


def padded_layout(grid_Ix3: jax.Array, N: int, cfg: QwenVisionConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(positions [I, N, 2], window segments [I, N], image segments [I, N]): `frame_layout`'s, and windows as
    transformers' `get_vision_window_index` tiles them: window_size // merge // patch merged tokens a side, row by
    row, edge windows smaller (padding slots `PAD_SEGMENT` in both)."""
    m, side = cfg.spatial_merge_size, cfg.window_tokens
    positions, frames = frame_layout(grid_Ix3, N, m)
    h, w = grid_Ix3[:, 1, None], grid_Ix3[:, 2, None]
    gh, gw = jnp.maximum(h // m, 1), jnp.maximum(w // m, 1)
    block_row, block_col = positions[..., 0] // m, positions[..., 1] // m
    window = ((frames - 1) * -(-gh // side) + block_row // side) * -(-gw // side) + block_col // side
    return positions, jnp.where(frames == PAD_SEGMENT, PAD_SEGMENT, window + 1).astype(jnp.int32), frames


def padded_vision_forward(params: dict, patches_IxNxP: jax.Array, grid_Ix3: jax.Array, cfg: QwenVisionConfig
                          ) -> jax.Array:
    """[I, N / merge², out_hidden_size] in params' dtype: I images each padded to N patches [N, C * T * P * P] (the
    processor's order, zeros past its t h w, `grid_Ix3` int32 traced), the first t h w / merge² rows of each its
    `get_image_features` (windows are masks here, never a reordering: the same sums, in another order)."""
    dtype = params["patch_embed"]["kernel"].dtype
    with jax.named_scope("patch_embed"):
        x_IxNxD = patches_IxNxP.astype(dtype) @ params["patch_embed"]["kernel"]
    return _tower(params, x_IxNxD, *padded_layout(grid_Ix3, patches_IxNxP.shape[1], cfg), cfg)
