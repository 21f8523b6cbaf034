"""The output head, a chunk of tokens at a time: no [B, T, V] float32 logits buffer exists in a training step.

A loss over the vocabulary is computed per token from the final hidden states: `per_token(fn, ...)` cuts the
sequence into chunks of `chunk_length` tokens, computes each chunk's logits [B, c, V] with `head_logits`, reduces them
to one value a token with `fn`, and keeps nothing of the chunk for the backward pass, which computes the chunk's
logits again (one more head matmul) for its gradient. So the head's memory is O(B x c x V) with c x B x V about
`CHUNK_ELEMENTS`, whatever T is, for SFT and eval, and for the log-probabilities of DPO, the reward model's
policy, GRPO and distillation (whose teacher logits are chunked alongside the student's).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtune.models.linear import derived_piecewise_matmul, matmul, pieces_of, wide
from jaxtune.models.quant import BitPattern, dequantize
from jaxtune.models.tiles import over_tiles, tile_count
from jaxtune.parallel.rules import constrain, head_rows

CHUNK_ELEMENTS = 1 << 24  # logits elements a chunk holds (64 MiB in float32)


def token_logps(logits_BxTxV: jax.Array, labels_BxT: jax.Array) -> jax.Array:
    """log p(label) per position [B, T], in the logits' dtype."""
    label_logit = jnp.take_along_axis(logits_BxTxV, labels_BxT[..., None], axis=-1)[..., 0]
    return label_logit - jax.nn.logsumexp(logits_BxTxV, axis=-1)


def head_logits(params: dict, hidden_BxTxD: jax.Array, softcap: float | None = None, pieces: bool = True
                ) -> jax.Array:
    """Float32 (float64 in float64 runs) logits [B, T, V] of final hidden states [B, T, D] under the head: the
    `lm_head` kernel [D, V], else (tied) the embedding table [V, D], multiplied as stored, never transposed. The
    kernel is cast to the hidden states' dtype inside the matmul, so a float32 master weight's gradient sums the
    chunks in float32. A tied model holds an `lm_head` leaf only when a method trains the head or the embedding
    apart from the other (PEFT's modules_to_save), which unties them.

    On a mesh the head is vocabulary-parallel: the kernel and the logits are split by vocabulary over tensor and
    fsdp, the rows only over data, so no device gathers the head (a reduction over V, the log-sum-exp, is summed
    across devices by XLA); the hidden states, far smaller, are gathered instead. A vocabulary fsdp cannot divide
    is gathered, and each device computes its own rows. softcap: the logits become softcap * tanh(logits /
    softcap) (Gemma 2's `final_logit_softcapping`; the model config's `final_logit_softcap`).

    A frozen head narrower than the hidden states (16 bits under float32 compute; the spine holds it as its bits,
    `quant.as_bit_patterns`) is converted a piece of the vocabulary at a time as it is multiplied
    (`linear.derived_piecewise_matmul`; each device its own shard's pieces), never whole. `pieces=False` uses it
    whole: decoding, a token a step, converts it once for the whole generation (XLA hoists it out of the loop)
    where pieces would convert it every step."""
    tied = "lm_head" not in params
    kernel = params["embed_tokens"] if tied else params["lm_head"]["kernel"]
    axes = (None, "vocab")  # the logical axes of the head's (in, out): D, V
    kernel = _constrained(kernel, axes[::-1] if tied else axes)
    rows = head_rows(vocab_size(params))
    hidden_BxTxD = constrain(hidden_BxTxD, (rows, "seq", None))
    layout = pieces_of(kernel, hidden_BxTxD.dtype, axes, transposed=tied) if pieces else None
    if layout is None:
        kernel = dequantize(kernel) if isinstance(kernel, BitPattern) else kernel
        logits = matmul(hidden_BxTxD, kernel, wide(hidden_BxTxD.dtype), transposed=tied)
    else:
        logits = derived_piecewise_matmul(hidden_BxTxD, kernel, layout, wide(hidden_BxTxD.dtype))
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    return constrain(logits, (rows, "seq", "vocab"))


def _constrained(kernel, axes):
    """The head's kernel (or its bits) split as the rules split a leaf of logical `axes`."""
    if isinstance(kernel, BitPattern):
        return BitPattern(constrain(kernel.bits, axes), kernel.dtype)
    return constrain(kernel, axes)


def vocab_size(params: dict) -> int:
    """V, the head's output width."""
    kernel = params["lm_head"]["kernel"] if "lm_head" in params else params["embed_tokens"]
    shape = kernel.bits.shape if isinstance(kernel, BitPattern) else kernel.shape
    return shape[1] if "lm_head" in params else shape[0]


def chunk_length(B: int, T: int, V: int) -> int:
    """Tokens a row per chunk: the largest power of two with B x c x V <= CHUNK_ELEMENTS, at least 1, at most T."""
    c = 1 << max(0, (CHUNK_ELEMENTS // max(B * V, 1)).bit_length() - 1)
    return min(c, T)


@jax.named_scope("head")
def per_token(fn: Callable, *arrays_BxT: jax.Array, vocab: int):
    """fn applied to chunks of tokens: [B, T] (or a tuple of them) from arrays [B, T, ...] that fn maps chunk by
    chunk ([B, c, ...] to [B, c] or a tuple of them); fn computes the chunk's logits itself (`head_logits`), so its
    memory is the chunk's. `vocab`: V, which sets the chunk length. Rows stay whole, so a batch split over devices
    stays split; so do a row's tokens split over a context axis (`tiles.over_tiles`)."""
    B, T = arrays_BxT[0].shape[:2]
    ways = tile_count(T, 1)[0]
    return over_tiles(fn, *arrays_BxT, tile=chunk_length(B, T // ways, vocab))


def label_logps(params: dict, hidden_BxTxD: jax.Array, labels_BxT: jax.Array, softcap: float | None = None,
                temperature: float = 1.0) -> jax.Array:
    """log p(label) [B, T] float32 (float64 in float64 runs) under the head (soft-capped by `softcap`, as for
    `head_logits`; divided by a sampling `temperature`), a chunk of tokens at a time."""
    def chunk(hidden_BxCxD, labels_BxC):
        logits = head_logits(params, hidden_BxCxD, softcap)
        return token_logps(logits if temperature == 1.0 else logits / temperature, labels_BxC)

    return per_token(chunk, hidden_BxTxD, labels_BxT, vocab=vocab_size(params))
