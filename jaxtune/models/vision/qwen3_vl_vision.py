"""Qwen3-VL's vision transformer as a pure function (`qwen3_vl_tower`) over images each padded to a static patch
count, built from Qwen2.5-VL's pieces (`qwen_vl_vision`: its linears, 2D rotary, attention, frame layout): patches
embedded (a Conv3d with bias, one matmul), plus learned position embeddings resampled bilinearly (corners aligned) to
each image's traced grid, then LayerNorm blocks (attention over each whole frame, no windows; a tanh-GELU MLP)
scanned over the stacked blocks, then the merger; DeepStack: after the `deepstack_visual_indexes` blocks, that
block's output through a merger of its own (norm after the 2 x 2 merge), added later to the text's first layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.models.attention import live_blocks
from jaxtune.models.vision.qwen_vl_config import QwenTowerShape
from jaxtune.models.vision.qwen_vl_vision import (
    frame_layout,
    linear_spec,
    rotary_angles,
    segment_mask,
    self_attention,
)
from jaxtune.models.vision.siglip import layer_norm
from jaxtune.models.vision.tower_linear import tower_linear

VISION_ACTIVATIONS = ("gelu_pytorch_tanh",)  # the blocks' MLP (the mergers' GELU is the erf form, always)
# our module's path -> its name under the tower in a checkpoint (`qwen_vl_weights.read_tower`); `deepstack` only in a
# tower with DeepStack (`tower_names`)
QWEN3_VL_NAMES: dict[tuple[str, ...], str] = {
    ("patch_embed",): "patch_embed.proj", ("pos_embed",): "pos_embed",
    **{("blocks", ours): f"blocks.{{i}}.{hf}" for ours, hf in {
        "norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.linear_fc1",
        "fc2": "mlp.linear_fc2"}.items()},
    **{(group, ours): f"{hf_group}.{hf}" for group, hf_group in (("merger", "merger"),
                                                                ("deepstack", "deepstack_merger_list.{i}"))
       for ours, hf in {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}.items()}}


@dataclass(frozen=True, kw_only=True)
class Qwen3VisionConfig(QwenTowerShape):
    """Qwen3-VL's vision transformer (`vision_config`; Qwen3.5's, without DeepStack). num_position_embeddings: a
    square grid of learned positions; deepstack_visual_indexes: the blocks whose outputs feed the text's first
    layers, in that order (none: Qwen3.5's)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # transformers' fixed epsilon of the blocks' and the mergers' LayerNorms

    def __post_init__(self):
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise JaxtuneError(f"vision hidden_act {self.hidden_act!r}: jaxtune knows {VISION_ACTIVATIONS}")
        self.check_heads()
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise JaxtuneError(f"vision num_position_embeddings {self.num_position_embeddings}: not a square grid")
        if not all(0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise JaxtuneError(f"vision deepstack_visual_indexes {list(self.deepstack_visual_indexes)}: blocks of "
                               f"the {self.depth}")


    @property
    def grid_side(self) -> int:
        """The learned positions' grid side: sqrt(num_position_embeddings)."""
        return math.isqrt(self.num_position_embeddings)


def tower_names(cfg: Qwen3VisionConfig) -> dict[tuple[str, ...], str]:
    """`QWEN3_VL_NAMES` of the modules `cfg`'s tower has (no DeepStack mergers without deepstack_visual_indexes)."""
    return {path: name for path, name in QWEN3_VL_NAMES.items()
            if path[0] != "deepstack" or cfg.deepstack_visual_indexes}


def _layer_norm_spec(shape: tuple[int, ...], dtype) -> dict:
    return {"weight": jax.ShapeDtypeStruct(shape, dtype), "bias": jax.ShapeDtypeStruct(shape, dtype)}


def abstract_qwen3_vl_params(cfg: Qwen3VisionConfig, dtype=jnp.float32) -> dict:
    """The tower's parameters as `ShapeDtypeStruct`s, kernels [in, out], blocks stacked on a leading [depth] axis and
    the DeepStack mergers on [K]: patch_embed [C * T * P * P, D] with bias; pos_embed [num_position_embeddings, D];
    blocks' LayerNorms norm1, norm2, qkv, proj, fc1 [D, F], fc2 [F, D]; merger's LayerNorm [D], fc1 [4D, 4D], fc2
    [4D, out]; deepstack's the same with the LayerNorm [4D] (none without deepstack_visual_indexes)."""
    D, F, L, wide = cfg.hidden_size, cfg.intermediate_size, (cfg.depth,), cfg.hidden_size * cfg.merge_unit
    K = (len(cfg.deepstack_visual_indexes),)
    tree = {
        "patch_embed": linear_spec(cfg.patch_dim, D, dtype),
        "pos_embed": jax.ShapeDtypeStruct((cfg.num_position_embeddings, D), dtype),
        "blocks": {"norm1": _layer_norm_spec((*L, D), dtype), "norm2": _layer_norm_spec((*L, D), dtype),
                   "qkv": linear_spec(D, 3 * D, dtype, layers=L), "proj": linear_spec(D, D, dtype, layers=L),
                   "fc1": linear_spec(D, F, dtype, layers=L), "fc2": linear_spec(F, D, dtype, layers=L)},
        "merger": {"norm": _layer_norm_spec((D,), dtype), "fc1": linear_spec(wide, wide, dtype),
                   "fc2": linear_spec(wide, cfg.out_hidden_size, dtype)},
        "deepstack": {"norm": _layer_norm_spec((*K, wide), dtype), "fc1": linear_spec(wide, wide, dtype, layers=K),
                      "fc2": linear_spec(wide, cfg.out_hidden_size, dtype, layers=K)},
    }
    return tree if cfg.deepstack_visual_indexes else {k: v for k, v in tree.items() if k != "deepstack"}


def position_embeddings(pos_embed_PxD: jax.Array, positions_IxNx2: jax.Array, grid_Ix3: jax.Array, side: int
                        ) -> jax.Array:
    """[I, N, D]: the learned side x side grid resampled bilinearly, corners aligned, to each image's (h, w) grid at
    each patch's (row, column) (transformers' `get_vision_interpolation_indices_and_weights`: 4 taps, summed)."""
    def taps(index_IxN, size_Ix1):
        source = index_IxN.astype(jnp.float32) * (side - 1) / jnp.maximum(size_Ix1 - 1, 1).astype(jnp.float32)
        floor = jnp.floor(source)
        weights = 1 - jnp.abs((source - floor)[..., None] - jnp.arange(2, dtype=jnp.float32))
        index = jnp.clip(floor.astype(jnp.int32)[..., None] + jnp.arange(2), 0, side - 1)
        return index, jnp.maximum(weights, 0)

    rows, row_weights = taps(positions_IxNx2[..., 0], grid_Ix3[:, 1, None])
    cols, col_weights = taps(positions_IxNx2[..., 1], grid_Ix3[:, 2, None])
    index_IxNx4 = (rows[..., :, None] * side + cols[..., None, :]).reshape(*rows.shape[:2], 4)
    weights_IxNx4 = (row_weights[..., :, None] * col_weights[..., None, :]).reshape(*rows.shape[:2], 4)
    return jnp.sum(pos_embed_PxD[index_IxNx4] * weights_IxNx4[..., None].astype(pos_embed_PxD.dtype), axis=2)


def _merge(x_IxNxD: jax.Array, merger: dict, cfg: Qwen3VisionConfig, norm_after: bool) -> jax.Array:
    """[I, N / merge², out]: LayerNorm (over each patch, or over the merged 4D when norm_after), merge² neighbouring
    patches concatenated, fc1, GELU (erf), fc2."""
    n_images, N, _ = x_IxNxD.shape
    merge = lambda x: x.reshape(n_images, N // cfg.merge_unit, -1)  # noqa: E731
    x = layer_norm(merge(x_IxNxD), merger["norm"], cfg.norm_eps) if norm_after else merge(
        layer_norm(x_IxNxD, merger["norm"], cfg.norm_eps))
    return tower_linear(jax.nn.gelu(tower_linear(x, merger["fc1"]), approximate=False), merger["fc2"])


def qwen3_vl_tower(params: dict, patches_IxNxP: jax.Array, grid_Ix3: jax.Array, cfg: Qwen3VisionConfig
                   ) -> tuple[jax.Array, jax.Array]:
    """(merged [I, N / merge², out_hidden_size], DeepStack features [K, I, N / merge², out_hidden_size], K = 0 without
    them) in params' dtype of I images each padded to N patches [N, C * T * P * P] (the processor's order, zeros
    past its t h w; `grid_Ix3` int32 traced): the first t h w / merge² rows of each, transformers'
    `get_image_features`."""
    dtype = params["patch_embed"]["kernel"].dtype
    n_images, N, _ = patches_IxNxP.shape
    positions_IxNx2, frames_IxN = frame_layout(grid_Ix3, N, cfg.spatial_merge_size)
    with jax.named_scope("patch_embed"):
        x_IxNxD = tower_linear(patches_IxNxP.astype(dtype), params["patch_embed"])
        x_IxNxD = x_IxNxD + position_embeddings(params["pos_embed"], positions_IxNx2, grid_Ix3, cfg.grid_side)
    rope = rotary_angles(positions_IxNx2.reshape(n_images * N, 2), cfg.head_dim, cfg.rope_theta)
    mask = segment_mask(frames_IxN)
    live = live_blocks(mask, N, N)
    K = len(cfg.deepstack_visual_indexes)
    deepstack_of_L: np.ndarray = np.full(cfg.depth, -1, np.int32)
    deepstack_of_L[list(cfg.deepstack_visual_indexes)] = np.arange(K)

    def step(carry, layer):
        x, features = carry
        block, k = layer
        with jax.named_scope("attention"):
            x = x + self_attention(layer_norm(x, block["norm1"], cfg.norm_eps), block, rope, mask, live, cfg.num_heads)
        with jax.named_scope("mlp"):
            h = tower_linear(layer_norm(x, block["norm2"], cfg.norm_eps), block["fc1"])
            x = x + tower_linear(jax.nn.gelu(h, approximate=True), block["fc2"])
        if K:
            merger = jax.tree.map(lambda a: a[jnp.maximum(k, 0)], params["deepstack"])
            features = jax.lax.cond(k >= 0, lambda: features.at[jnp.maximum(k, 0)].set(_merge(x, merger, cfg, True)),
                                    lambda: features)
        return (x, features), None

    features = jnp.zeros((K, n_images, N // cfg.merge_unit, cfg.out_hidden_size), dtype)
    (x_IxNxD, features), _ = jax.lax.scan(step, (x_IxNxD, features), (params["blocks"], jnp.asarray(deepstack_of_L)))
    with jax.named_scope("merger"):
        return _merge(x_IxNxD, params["merger"], cfg, False), features
