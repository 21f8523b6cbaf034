"""Incremental decoding with a key/value cache (`KVCache`): `prefill` a batch of left-padded prompts, then
`decode_step`, both one function, `extend`.

The cache holds every layer's rotated keys and values stacked on the layer axis, [L, B, S, K, hd], so a step still
scans one `decoder_layer`. `extend` writes the new tokens' keys and values at slots `length .. length+T-1` and lets
their queries attend over the whole buffer: slot j is seen from slot i when it is valid (`valid_BxS`: not padding,
already written), j <= i and within the layer's sliding window, as transformers indexes its cache. RoPE positions
come from the attention mask (cumsum - 1), as `transformers.generate` computes them. Prefix tuning's keys and values
fill the first P slots (`init_cache`), as PEFT's `past_key_values` does; other methods live in the layers' modules.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.attention import cache_mask, live_blocks
from jaxtune.models.head import head_logits
from jaxtune.models.llama import attend, decoder_layer, embed, lora_scaled_layers, norm, project_qkv
from jaxtune.models.rope import layer_rope, rope_tables
from jaxtune.parallel.rules import context_ways


class KVCache(NamedTuple):
    """Decoding state, a pytree.

    k, v: [L, B, S, K, hd] rotated keys and values in the compute dtype.
    valid_BxS: which slots hold a key a later token may attend to (prefix and real tokens, not padding).
    length: [] int32, slots written so far (the next token goes to slot `length`).
    next_position_B: [B] int32, the RoPE position of each row's next token.
    """

    k: jax.Array
    v: jax.Array
    valid_BxS: jax.Array
    length: jax.Array
    next_position_B: jax.Array

    @property
    def size(self) -> int:
        return self.k.shape[2]


def prefix_length(params: dict) -> int:
    """P, the number of prefix-tuning virtual tokens in `params` (0 without prefix tuning)."""
    return params["layers"]["prefix"]["key"].shape[1] if "prefix" in params["layers"] else 0


def init_cache(params: dict, cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `size` slots per row, with any prefix-tuning keys and values in the first P."""
    P = prefix_length(params)
    shape = (cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim)
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if P:
        as_batch = lambda a: jnp.broadcast_to(a.astype(dtype)[:, None], (a.shape[0], batch) + a.shape[1:])
        k = k.at[:, :, :P].set(as_batch(params["layers"]["prefix"]["key"]))
        v = v.at[:, :, :P].set(as_batch(params["layers"]["prefix"]["value"]))
    valid_BxS = jnp.broadcast_to(jnp.arange(size) < P, (batch, size))
    return KVCache(k, v, valid_BxS, jnp.asarray(P, jnp.int32), jnp.full((batch,), P, jnp.int32))


def refuse_context_axis() -> None:
    """A JaxtuneError on a mesh with a context axis: a cache holds whole rows, and decoding does not split them."""
    if context_ways() > 1:
        raise JaxtuneError(f"generation does not split a row over [mesh] context = {context_ways()}: decode on a "
                           "mesh without a context axis")


def extend(params: dict, tokens_BxT: jax.Array, positions_BxT: jax.Array, mask_BxT: jax.Array, cache: KVCache,
           cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions) -> tuple[jax.Array, KVCache]:
    """Run T new tokens against the cache: final-norm hidden states [B, T, D] and the cache with them written."""
    refuse_context_axis()
    dtype = jnp.dtype(options.compute_dtype)
    B, T = tokens_BxT.shape
    layers, lora_scale = lora_scaled_layers(params["layers"], method, cfg)
    start = cache.length
    valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, mask_BxT > 0, (0, start))
    mask = cache_mask(start, T, valid_BxS)
    live_QxC = live_blocks(mask, T, cache.size)
    rope = rope_tables(positions_BxT, cfg, dtype)

    def block(x_BxTxD, layer_window_kv):
        layer, window, k_BxSxKxh, v_BxSxKxh = layer_window_kv
        cos, sin = layer_rope(rope, window)

        def cached_attention(h_BxTxD):
            q_BxTxKxGxh, k_new, v_new = project_qkv(h_BxTxD, layer, cos, sin, cfg, lora_scale)
            k_all = jax.lax.dynamic_update_slice(k_BxSxKxh, k_new.astype(dtype), (0, start, 0, 0))
            v_all = jax.lax.dynamic_update_slice(v_BxSxKxh, v_new.astype(dtype), (0, start, 0, 0))
            return attend(q_BxTxKxGxh, k_all, v_all, mask, window, live_QxC, layer, cfg, lora_scale), (k_new, v_new)

        return decoder_layer(x_BxTxD, layer, cached_attention, cfg, lora_scale)[:2]

    x_BxTxD = embed(params, tokens_BxT, cfg, dtype)
    windows_L = jnp.asarray(cfg.sliding_windows, jnp.int32)
    x_BxTxD, (k_LxBxTxKxh, v_LxBxTxKxh) = jax.lax.scan(block, x_BxTxD, (layers, windows_L, cache.k, cache.v))
    # One in-place write of all layers' new keys and values (the scan read the old buffer, plus its own update).
    k = jax.lax.dynamic_update_slice(cache.k, k_LxBxTxKxh.astype(dtype), (0, 0, start, 0, 0))
    v = jax.lax.dynamic_update_slice(cache.v, v_LxBxTxKxh.astype(dtype), (0, 0, start, 0, 0))
    next_position_B = cache.next_position_B + jnp.sum(mask_BxT > 0, axis=1, dtype=jnp.int32)
    cache = KVCache(k, v, valid_BxS, start + T, next_position_B)
    return norm(x_BxTxD, params["norm"], cfg), cache


def prefill(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig, attention_mask_BxT: jax.Array | None = None, *,
            cache_size: int | None = None, method: MethodConfig | None = None,
            options: ForwardOptions = ForwardOptions()) -> tuple[jax.Array, KVCache]:
    """Float32 logits [B, V] for the token after each left-padded prompt, and the cache holding the prompts.

    tokens_BxT: prompts padded on the left; attention_mask_BxT: 1 for real tokens, 0 for padding (default all 1).
    cache_size: slots per row, at least P + T (the default); decoding n more tokens needs P + T + n.
    Jit with `static_argnames=("cfg", "cache_size", "method", "options")`.
    """
    B, T = tokens_BxT.shape
    P = prefix_length(params)
    size = P + T if cache_size is None else cache_size
    if P + T > size:
        raise JaxtuneError(f"prompt length {T} (+ {P} prefix tokens) does not fit the cache of {size} slots")
    if attention_mask_BxT is None:
        attention_mask_BxT = jnp.ones((B, T), jnp.int32)
    cache = init_cache(params, cfg, B, size, jnp.dtype(options.compute_dtype))
    positions_BxT = P + jnp.maximum(jnp.cumsum(attention_mask_BxT > 0, axis=1) - 1, 0)
    hidden_BxTxD, cache = extend(params, tokens_BxT, positions_BxT, attention_mask_BxT, cache, cfg, method, options)
    return head_logits(params, hidden_BxTxD[:, -1:], cfg.final_logit_softcap, pieces=False)[:, 0], cache


def decode_step(params: dict, token_B: jax.Array, cache: KVCache, cfg: ModelConfig, *,
                method: MethodConfig | None = None,
                options: ForwardOptions = ForwardOptions()) -> tuple[jax.Array, KVCache]:
    """Float32 logits [B, V] for the token after `token_B`, and the cache with `token_B` appended.

    The cache must have a free slot (`length < size`): past the end, XLA clamps the write and the output is wrong.
    Jit with `static_argnames=("cfg", "method", "options")` and donate the cache.
    """
    positions_Bx1 = cache.next_position_B[:, None]
    mask_Bx1 = jnp.ones_like(positions_Bx1)
    hidden_Bx1xD, cache = extend(params, token_B[:, None], positions_Bx1, mask_Bx1, cache, cfg, method, options)
    return head_logits(params, hidden_Bx1xD, cfg.final_logit_softcap, pieces=False)[:, 0], cache
