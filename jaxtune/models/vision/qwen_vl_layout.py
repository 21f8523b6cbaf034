"""Where each patch of a batch of images goes in Qwen2.5-VL's vision tower, computed on the host from `image_grid_thw`
alone (numpy, as transformers' `vision_utils`): the window order the blocks run in (windows of window_tokens² merged
tokens, edge windows smaller) and its inverse for the merged output, each patch's (row, column) for the 2D rotary
embedding, and the segment ids that keep attention within a window or within an image (a frame of a video). The
tower's jitted forward takes these arrays as inputs, so one program serves every batch with the same patch count."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.models.vision.qwen_vl_config import QwenVisionConfig

MAX_SEGMENTS = 2**16 - 1  # the attention mask's largest plain segment id


class VisionLayout(NamedTuple):
    """One batch's host-side indices, N patches and M = N / merge² merged tokens; a pytree of int32 arrays.

    patch_order_N: the patches in window order (indices into pixel_values' rows). merged_order_M: the merged
    tokens back in image order (the inverse of the window order, per merged token). positions_Nx2: each patch's
    (row, column) in its image, in window order. window_segment_N, image_segment_N: in window order, each patch's
    window and image frame, numbered from 1 across the batch."""

    patch_order_N: np.ndarray
    merged_order_M: np.ndarray
    positions_Nx2: np.ndarray
    window_segment_N: np.ndarray
    image_segment_N: np.ndarray


def _check(grid_thw: np.ndarray, cfg: QwenVisionConfig) -> np.ndarray:
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    m = cfg.spatial_merge_size
    if len(grid_thw) == 0 or (grid_thw <= 0).any() or (grid_thw[:, 1:] % m).any():
        raise JaxtuneError(f"image_grid_thw {grid_thw.tolist()}: positive sizes, h and w multiples of {m}")
    return grid_thw


def patch_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """int32 [N, 2]: each patch's (row, column) in its image, patches in `pixel_values`' order (merge x merge
    blocks consecutive, frames one after another), as `get_vision_position_ids`."""
    images = []
    for t, h, w in np.asarray(grid_thw).tolist():
        grid_2xHxW = np.indices((h, w)).reshape(2, h // merge, merge, w // merge, merge)
        in_blocks_2xN = grid_2xHxW.transpose(0, 1, 3, 2, 4).reshape(2, -1)
        images.append(np.tile(in_blocks_2xN.T, (t, 1)))
    return np.concatenate(images).astype(np.int32)


def window_index(grid_thw: np.ndarray, cfg: QwenVisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(window_index [M], window_of [M]): the merged tokens in window order, as transformers'
    `get_vision_window_index` (each frame tiled in windows of window_tokens x window_tokens merged tokens, row by row,
    tokens row by row within one), and the window (from 0, across the batch) each of them, in that order, is in."""
    side, m = cfg.window_tokens, cfg.spatial_merge_size
    order, window_of, offset, windows = [], [], 0, 0
    for t, h, w in np.asarray(grid_thw).tolist():
        gh, gw = h // m, w // m
        nh, nw = -(-gh // side), -(-gw // side)
        index = np.full((t, nh * side, nw * side), -1, np.int64)
        index[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
        tiles = index.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        window_ids = np.broadcast_to(np.arange(len(tiles))[:, None], tiles.shape)
        kept = tiles >= 0
        order.append(tiles[kept] + offset)
        window_of.append(window_ids[kept] + windows)
        offset, windows = offset + t * gh * gw, windows + len(tiles)
    return np.concatenate(order), np.concatenate(window_of)


def vision_layout(grid_thw: np.ndarray, cfg: QwenVisionConfig) -> VisionLayout:
    """The `VisionLayout` of images of `grid_thw` [images, 3] (t, h, w in patches)."""
    grid_thw = _check(grid_thw, cfg)
    unit = cfg.merge_unit
    merged_index, window_of = window_index(grid_thw, cfg)
    patch_order = (merged_index[:, None] * unit + np.arange(unit)).reshape(-1)
    frame_sizes: np.ndarray = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    frames: np.ndarray = np.repeat(np.arange(1, len(frame_sizes) + 1), frame_sizes)  # each patch's, from 1
    if window_of.max() + 1 > MAX_SEGMENTS or frames[-1] > MAX_SEGMENTS:
        raise JaxtuneError(f"{window_of.max() + 1} windows, {frames[-1]} frames: at most {MAX_SEGMENTS} in a batch")
    return VisionLayout(
        patch_order_N=patch_order.astype(np.int32),
        merged_order_M=np.argsort(merged_index).astype(np.int32),
        positions_Nx2=patch_positions(grid_thw, cfg.spatial_merge_size)[patch_order],
        window_segment_N=np.repeat(window_of + 1, unit).astype(np.int32),
        image_segment_N=frames[patch_order].astype(np.int32))
