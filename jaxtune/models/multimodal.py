"""How another modality's encoder enters the shared decoder (`llama.decoder_and_routing`): its vectors placed over
the token embeddings of its placeholder tokens (`PlacedEmbeddings`, `place_embeddings`: transformers'
`masked_scatter`), and the bidirectional spans its tokens attend within (`span_ids`: Gemma 3's `token_type_ids` mask).
A forward given neither computes exactly as a text-only one."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.models.attention import SLIDING_SPANS


class PlacedEmbeddings(NamedTuple):
    """vectors_NxD: what replaces the token embeddings, in row-major order of the positions `at_BxT` (bool) marks;
    N must equal the number of marked positions (transformers checks it, a jitted forward cannot). Or [B, N, D]:
    each row its own vectors, in order of its marked positions, N at least as many (a training batch's rows, each
    with its images padded to the same count, the padding never placed)."""

    vectors_NxD: jax.Array
    at_BxT: jax.Array


def place_embeddings(x_BxTxD: jax.Array, placed: PlacedEmbeddings) -> jax.Array:
    """x [B, T, D] with the marked positions' rows replaced by the placed vectors (cast to x's dtype, unscaled)."""
    at_BxT, vectors = placed.at_BxT, placed.vectors_NxD.astype(x_BxTxD.dtype)
    if vectors.ndim == 3:  # each row its own: [B, N, D]
        index_BxT = jnp.clip(jnp.cumsum(at_BxT, axis=1) - 1, 0, vectors.shape[1] - 1)
        rows_BxTxD = jnp.take_along_axis(vectors, index_BxT[..., None], axis=1)
        return jnp.where(at_BxT[..., None], rows_BxTxD, x_BxTxD)
    index_BxT = jnp.cumsum(at_BxT.reshape(-1)).reshape(at_BxT.shape) - 1
    rows_BxTxD = vectors[jnp.clip(index_BxT, 0, vectors.shape[0] - 1)]
    return jnp.where(at_BxT[..., None], rows_BxTxD, x_BxTxD)


def span_ids(at_BxT: jax.Array, sliding_only: bool = False) -> jax.Array:
    """int32 [B, T]: each run of consecutive marked positions numbered 0, 1, ... along its row, -1 elsewhere (an
    image's placeholder tokens, one bidirectional span an image; transformers' `get_block_sequence_ids_for_mask`).
    sliding_only: numbered from `attention.SLIDING_SPANS`, bidirectional on sliding layers only (Gemma 4's mask)."""
    previous_BxT = jnp.pad(at_BxT, ((0, 0), (1, 0)))[:, :-1]
    starts_BxT = at_BxT & ~previous_BxT
    first = SLIDING_SPANS if sliding_only else 0
    return jnp.where(at_BxT, jnp.cumsum(starts_BxT, axis=1, dtype=jnp.int32) - 1 + first, -1)
