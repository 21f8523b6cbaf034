"""Qwen2.5-VL's multimodal RoPE (M-RoPE): three position streams (time, row, column) per token. `rope_index` gives
them, as transformers' `Qwen2_5_VLModel.get_rope_index` (numpy, on the host): text tokens count on in all three
streams; an image's tokens take (frame, row, column) in its merged grid offset by the position it starts at, and the
text after it resumes at that start plus the grid's longer side. The decoder turns them into cos and sin
(`jaxtune.models.rope.mrope_angles`: the rotary frequencies split by the config's `mrope_section` into chunks that
read the time, row and column streams in turn)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxtune.errors import JaxtuneError


def _image_positions(grid_thw: np.ndarray, merge: int, start: int) -> np.ndarray:
    """int64 [3, t * h/merge * w/merge]: an image's (frame, row, column) per merged token, plus `start`."""
    t, h, w = (int(v) for v in grid_thw)
    return np.indices((t, h // merge, w // merge), np.int64).reshape(3, -1) + start


def _row_positions(ids_T: np.ndarray, grids: Iterator[np.ndarray], image_token_id: int, merge: int) -> np.ndarray:
    """int64 [3, T] of one row's tokens, taking its images' grids from `grids` in order."""
    is_image = ids_T == image_token_id
    image_starts = np.flatnonzero(is_image)
    pieces, position, i = [], 0, 0
    while i < len(ids_T):
        if not is_image[i]:
            following = image_starts[image_starts > i]
            end = int(following[0]) if len(following) else len(ids_T)
            pieces.append(np.broadcast_to(np.arange(position, position + end - i), (3, end - i)))
            position, i = position + end - i, end
            continue
        grid = next(grids, None)
        if grid is None:
            raise JaxtuneError(f"image tokens at position {i} but no image_grid_thw row left for them")
        image = _image_positions(grid, merge, position)
        if i + image.shape[1] > len(ids_T) or not is_image[i:i + image.shape[1]].all():
            raise JaxtuneError(f"an image of grid {list(grid)} takes {image.shape[1]} image tokens; position {i} "
                               f"starts fewer")
        pieces.append(image)
        position, i = position + max(int(grid[1]), int(grid[2])) // merge, i + image.shape[1]
    return np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)


def rope_index(input_ids_BxT: np.ndarray, image_grid_thw: np.ndarray | None, *, image_token_id: int,
               spatial_merge_size: int, attention_mask_BxT: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64 [3, B, T], deltas int64 [B, 1]): each token's time, row and column position, and how far
    each row's next position (its largest + 1) runs ahead of its token count, which decoding adds to the plain
    positions that follow. image_grid_thw [images, 3]: the batch's images in order, each filling a run of
    t * h * w / merge² `image_token_id` tokens. Tokens where attention_mask_BxT is 0 are skipped and get 0."""
    input_ids_BxT = np.asarray(input_ids_BxT)
    valid_BxT = np.ones(input_ids_BxT.shape, bool) if attention_mask_BxT is None else np.asarray(attention_mask_BxT) > 0
    grids = iter(np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw))
    positions = np.zeros((3, *input_ids_BxT.shape), np.int64)
    deltas = np.zeros((input_ids_BxT.shape[0], 1), np.int64)
    for b, (ids_T, valid_T) in enumerate(zip(input_ids_BxT, valid_BxT)):
        row = _row_positions(ids_T[valid_T], grids, image_token_id, spatial_merge_size)
        positions[:, b, valid_T] = row
        deltas[b] = (row.max() + 1 if row.size else 0) - row.shape[1]
    if next(grids, None) is not None:
        raise JaxtuneError("image_grid_thw has more images than the input ids have runs of image tokens")
    return positions, deltas
