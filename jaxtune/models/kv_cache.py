"""Incremental decoding with a key/value cache (`KVCache`): `prefill_packed` (or `prefill`) the prompts, then
`decode_step`, both one function, `extend`. The cache holds every layer's rotated keys and values stacked on the layer
axis, [L, B, K, S, hd], so a step still scans one `decoder_layer`. `extend` writes the new tokens' keys and values at
slots `length .. length+T-1` and lets their queries attend over the whole buffer: slot j is seen from slot i when it is
valid (`valid_BxS`: not padding, already written), j <= i, within the layer's sliding window and, packed, of i's
segment, as transformers indexes its cache. Row b's prompt sits left-padded in slots P .. P+W-1, RoPE positions from P
(`prefill_packed` computes the prompts packed several to a row, then moves their keys and values there); prefix tuning's
fill slots 0 .. P-1. Qwen3.5's Gated DeltaNet layers hold a `LinearState` each instead (one prompt a packed row: its
state the row's). DeepSeek's latent attention caches a slot's latent and rotated key as k (v empty; `latent_attention`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.config.model import hf_module_name
from jaxtune.errors import JaxtuneError
from jaxtune.models.adapter_rows import ROW_HOOK, rows_of
from jaxtune.models.adapters import Adapters, adapter_forward
from jaxtune.models.attention import cache_mask, live_blocks
from jaxtune.models.head import head_logits
from jaxtune.models.latent_attention import (
    absorbed_queries,
    expansion_kernel,
    latent_cache_entry,
    latent_keys_values,
    latent_queries,
    latent_values,
)
from jaxtune.models.layer_groups import scan_layer_groups
from jaxtune.models.linear import project, wide
from jaxtune.models.linear_attention import LinearState, empty_state, gated_deltanet_layer
from jaxtune.models.llama import (
    attend,
    decoder_layer,
    embed,
    layer_sinks,
    norm,
    output_projection,
    per_layer_inputs,
    project_qkv,
)
from jaxtune.models.multimodal import DeepStack, PlacedEmbeddings, add_deepstack, place_embeddings
from jaxtune.models.rope import layer_rope, rope_tables
from jaxtune.parallel.rules import constrain, context_ways


class KVCache(NamedTuple):
    """Decoding state, a pytree.

    k, v: [L, B, K, S, hd] rotated keys and values in the compute dtype (each head's slots contiguous, as a decode
    step's attention reads them).
    valid_BxS: which slots hold a key a later token may attend to (prefix and real tokens, not padding).
    length: [] int32, slots written so far (the next token goes to slot `length`).
    next_position_B: [B] int32, the RoPE position of each row's next token.
    linear: the Gated DeltaNet layers' states stacked on their own layer axis (k and v then the attention layers'
    only), or None.
    full_kv: Gemma 4's full layers' keys and values [Lf, B, Kg, S, ghd] (k and v then its sliding layers' only;
    `cached_layers`), or None.
    """

    k: jax.Array
    v: jax.Array
    valid_BxS: jax.Array
    length: jax.Array
    next_position_B: jax.Array
    linear: LinearState | None = None
    full_kv: tuple[jax.Array, jax.Array] | None = None

    @property
    def size(self) -> int:
        return self.k.shape[3]


def prefix_length(params: dict) -> int:
    """P, the number of prefix-tuning virtual tokens in `params` (0 without prefix tuning)."""
    return params["layers"]["prefix"]["key"].shape[1] if "prefix" in params["layers"] else 0


def cached_layers(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the layers whose keys and values `KVCache.k` and `v` hold, those `KVCache.full_kv` holds): every attention
    layer's, none; Gemma 4's own-width full layers apart, its KV-sharing layers in neither (they read their
    source's)."""
    if not cfg.global_head_dim:
        return cfg.attention_layers, ()
    own = [i for i in cfg.attention_layers if i not in cfg.kv_sharing_layers]
    return tuple(i for i in own if i not in cfg.global_layers), tuple(i for i in own if i in cfg.global_layers)


def init_cache(params: dict, cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `size` slots per row, with any prefix-tuning keys and values in the first P."""
    P = prefix_length(params)
    layers, full_layers = cached_layers(cfg)
    shape = (len(layers), batch, cfg.num_kv_heads, size, cfg.head_dim)
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if cfg.kv_lora_rank:  # a slot's latent and shared rotated key; prefix tuning is refused for latent attention
        k = jnp.zeros((shape[0], batch, 1, size, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype)
        v = jnp.zeros((shape[0], batch, 1, size, 0), dtype)
    elif P:  # prefix [L, P, K, hd] -> [L, B, K, P, hd]
        as_batch = lambda a: jnp.broadcast_to(jnp.swapaxes(a.astype(dtype), 1, 2)[:, None],  # noqa: E731
                                              shape[:3] + (P,) + shape[4:])
        k = k.at[:, :, :, :P].set(as_batch(params["layers"]["prefix"]["key"]))
        v = v.at[:, :, :, :P].set(as_batch(params["layers"]["prefix"]["value"]))
    valid_BxS = jnp.broadcast_to(jnp.arange(size) < P, (batch, size))
    linear = None
    if cfg.linear_attention_layers:
        linear = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(cfg.linear_attention_layers), *a.shape)),
                              empty_state(cfg, batch, dtype))
    full_kv = None
    if full_layers:
        g = cfg.global_view
        full_kv = (jnp.zeros((len(full_layers), batch, g.num_kv_heads, size, g.head_dim), dtype),) * 2
    return KVCache(k, v, valid_BxS, jnp.asarray(P, jnp.int32), jnp.full((batch,), P, jnp.int32), linear, full_kv)


def split_cache_rows(cache: KVCache) -> KVCache:
    """`cache` with its rows split over the batch axes of the mesh in context and its heads over tensor
    (`rules.constrain`; itself without a mesh): each device decodes its own rows, as a training step splits them."""
    heads = lambda a: constrain(a, (None, "batch", "kv_heads", None, None))  # noqa: E731  [L, B, K, S, hd]
    rows = lambda a: constrain(a, (None, "batch") + (None,) * (a.ndim - 2))  # noqa: E731  [L, B, ...]
    return cache._replace(
        k=heads(cache.k), v=heads(cache.v), valid_BxS=constrain(cache.valid_BxS, ("batch", None)),
        next_position_B=constrain(cache.next_position_B, ("batch",)),
        linear=None if cache.linear is None else jax.tree.map(rows, cache.linear),
        full_kv=None if cache.full_kv is None else (heads(cache.full_kv[0]), heads(cache.full_kv[1])))


def refuse_context_axis() -> None:
    """A JaxtuneError on a mesh with a context axis: a cache holds whole rows, and decoding does not split them."""
    if context_ways() > 1:
        raise JaxtuneError(f"generation does not split a row over [mesh] context = {context_ways()}: decode on a "
                           "mesh without a context axis")


def step_attention(q_BxKxGxh: jax.Array, k_new_BxKxh: jax.Array, v_new_BxKxh: jax.Array, k_BxKxSxh: jax.Array,
                   v_BxKxSxh: jax.Array, seen_BxS: jax.Array, cfg: ModelConfig,
                   sinks_KxG: jax.Array | None = None, slots_first: bool = False) -> jax.Array:
    """One new query per row over the cache's `seen_BxS` slots and its own new key: softmax(q k^T scale) v [B, K, G,
    hd] in q's dtype (float32 scores), with the model's scale and soft cap and the layer's attention sinks [K, G]
    (None: none), as `attention.blockwise_attention`.

    Dense over the S slots: a step's scores are [B, K, G, S], and the cache is read in place (no padded blocks, no
    copy with the new key written in). slots_first: keys and values [B, S, K, hd] (a paged cache's gathered
    pages, `rollouts.paged_cache`), read in that layout."""
    f32 = wide(q_BxKxGxh.dtype)
    scale = cfg.attention_scale
    keys = "bskh" if slots_first else "bksh"
    old_BxKxGxS = jnp.einsum(f"bkgh,{keys}->bkgs", q_BxKxGxh, k_BxKxSxh, preferred_element_type=f32) * scale
    new_BxKxGx1 = jnp.einsum("bkgh,bkh->bkg", q_BxKxGxh, k_new_BxKxh, preferred_element_type=f32)[..., None] * scale
    if cfg.attn_logit_softcap:
        cap = cfg.attn_logit_softcap
        old_BxKxGxS, new_BxKxGx1 = cap * jnp.tanh(old_BxKxGxS / cap), cap * jnp.tanh(new_BxKxGx1 / cap)
    old_BxKxGxS = jnp.where(seen_BxS[:, None, None], old_BxKxGxS, -jnp.inf)
    max_BxKxGx1 = jnp.maximum(jnp.max(old_BxKxGxS, axis=-1, keepdims=True), new_BxKxGx1)  # finite: the new key
    if sinks_KxG is not None:
        sink_KxGx1 = sinks_KxG.astype(f32)[:, :, None]
        max_BxKxGx1 = jnp.maximum(max_BxKxGx1, sink_KxGx1)
    p_old, p_new = jnp.exp(old_BxKxGxS - max_BxKxGx1), jnp.exp(new_BxKxGx1 - max_BxKxGx1)
    out = (jnp.einsum(f"bkgs,{keys}->bkgh", p_old, v_BxKxSxh.astype(f32))
           + p_new * v_new_BxKxh[:, :, None].astype(f32))
    denominator_BxKxGx1 = jnp.sum(p_old, axis=-1, keepdims=True) + p_new
    if sinks_KxG is not None:  # the sink's probability joins the denominator; its value is 0
        denominator_BxKxGx1 = denominator_BxKxGx1 + jnp.exp(sink_KxGx1 - max_BxKxGx1)
    return (out / denominator_BxKxGx1).astype(q_BxKxGxh.dtype)


def key_positions(cache: KVCache, P: int, positions_BxT: jax.Array) -> jax.Array:
    """[B, S] int32: the RoPE position of each slot once T new tokens at positions_BxT are written at slot `length`:
    the prefix's slots 0..P-1 their own, a later written slot its slot less the row's offset (a row's slots and
    positions advance together after its left padding: offset = length - next_position), the new tokens theirs."""
    slot_S = jnp.arange(cache.size, dtype=jnp.int32)
    offset_B = cache.length - cache.next_position_B
    written_BxS = jnp.where(slot_S < P, slot_S, slot_S - offset_B[:, None])
    return jax.lax.dynamic_update_slice(written_BxS, positions_BxT.astype(jnp.int32), (0, cache.length))


def extend(params: dict, tokens_BxT: jax.Array, positions_BxT: jax.Array, mask_BxT: jax.Array, cache: KVCache,
           cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions, adapter_B: jax.Array | None = None,
           segment_ids_BxT: jax.Array | None = None, placed_embeddings: PlacedEmbeddings | None = None,
           span_ids_BxT: jax.Array | None = None, deepstack: DeepStack | None = None) -> tuple[jax.Array, KVCache]:
    """Run T new tokens against the cache: final-norm hidden states [B, T, D] and the cache with them written.

    adapter_B: [B] int32, each row's slot of the adapter stacks `params` carries (`models/adapter_rows.py`).
    segment_ids_BxT: packed rows written into an empty cache; a token sees the prefix and its own segment only.
    placed_embeddings, span_ids_BxT: an image's soft tokens and their bidirectional spans among the new tokens (as
    `llama.decoder_and_routing`'s; the slots before them in no span); deepstack: Qwen3-VL's, after the first layers."""
    refuse_context_axis()
    dtype = jnp.dtype(options.compute_dtype)
    B, T = tokens_BxT.shape
    view = adapter_forward(method, cfg)
    layers = params["layers"] if view.prepare is None else view.prepare(params["layers"])
    adapters = Adapters(view.dense + ((ROW_HOOK,) if adapter_B is not None else ()))
    start = cache.length
    valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, mask_BxT > 0, (0, start))
    mask = cache_mask(start, T, valid_BxS)
    if segment_ids_BxT is not None:  # slots outside the new tokens (the prefix): segment -1, seen by every segment
        segment_BxT = segment_ids_BxT.astype(jnp.int32)
        k_segment_BxS = jax.lax.dynamic_update_slice(jnp.full(valid_BxS.shape, -1, jnp.int32), segment_BxT, (0, start))
        mask = mask._replace(q_segment_BxT=segment_BxT, k_segment_BxS=k_segment_BxS)
    if span_ids_BxT is not None:
        span_BxT = span_ids_BxT.astype(jnp.int32)
        k_span_BxS = jax.lax.dynamic_update_slice(jnp.full(valid_BxS.shape, -1, jnp.int32), span_BxT, (0, start))
        mask = mask._replace(q_span_BxT=span_BxT, k_span_BxS=k_span_BxS)
    if any(w < 0 for w in cfg.sliding_windows):  # Llama 4's chunks: by position, as transformers cuts them
        mask = mask._replace(q_position_BxT=positions_BxT,
                             k_position_BxS=key_positions(cache, prefix_length(params), positions_BxT))
    live_QxC = live_blocks(mask, T, cache.size) if T > 1 else None
    # Llama 4's temperature by position, as transformers computes it for a prompt alone (not by padded slot)
    temperature_at = positions_BxT if cfg.temperature_floor else mask.q_slot_T
    rope = rope_tables(positions_BxT, cfg, dtype, temperature_at)
    global_rope = rope_tables(positions_BxT, cfg.global_view, dtype, temperature_at) if cfg.global_head_dim else None
    slot_S = jnp.arange(cache.size)

    def block(x_BxTxD, layer_window_kv, full=False, source_new=None):
        """One layer; full: Gemma 4's own-width full attention; source_new: a KV-sharing layer's source's new keys
        and values (its cache slices are in layer_window_kv), the layer writing none."""
        layer, window, table, k_BxKxSxh, v_BxKxSxh = layer_window_kv
        layer = rows_of(layer, adapter_B)
        x_BxTxD = constrain(x_BxTxD, ("batch", None, None))  # each device its own rows, as training splits them
        layer_cfg = cfg.global_view if full else cfg
        rope_of_layer = layer_rope(global_rope if full else rope, table, layer_cfg)

        def cached_latent_attention(h_BxTxD):
            q_BxTxHxh = latent_queries(h_BxTxD, layer, rope_of_layer, cfg, adapters)
            entry_BxTx1xE = latent_cache_entry(h_BxTxD, layer, rope_of_layer, cfg, adapters).astype(dtype)[:, :, None]
            written = (entry_BxTx1xE, jnp.zeros((B, T, 1, 0), dtype))
            if T == 1:  # in the latent's space: the cache read once, no per-head keys or values
                kernel = expansion_kernel(layer, cfg, adapters, B, dtype)
                q_Bx1xHxE = absorbed_queries(q_BxTxHxh[:, 0], kernel, cfg)[:, None]
                out_Bx1xHxE = step_attention(q_Bx1xHxE, entry_BxTx1xE[:, 0], entry_BxTx1xE[:, 0], k_BxKxSxh,
                                             k_BxKxSxh, cache.valid_BxS, cfg)
                return project(latent_values(out_Bx1xHxE[:, 0], kernel, cfg)[:, None], layer, "o_proj",
                               adapters), written
            entries_Bx1xSxE = jax.lax.dynamic_update_slice(k_BxKxSxh, jnp.swapaxes(entry_BxTx1xE, 1, 2),
                                                           (0, 0, start, 0))
            k_all, v_all = latent_keys_values(entries_Bx1xSxE[:, 0], layer, cfg, adapters)
            return attend(q_BxTxHxh[:, :, :, None], k_all, v_all, mask, window, live_QxC, layer, cfg,
                          adapters), written

        def cached_attention(h_BxTxD):
            q_BxTxKxGxh, k_new, v_new, gate_BxTxQ = project_qkv(h_BxTxD, layer, rope_of_layer, layer_cfg, adapters)
            written = source_new is None
            k_new, v_new = (k_new, v_new) if written else source_new
            k_new, v_new = k_new.astype(dtype), v_new.astype(dtype)
            if T == 1:  # a decode step: the old slots as they are, the new key beside them (no copy of the cache)
                chunk = jnp.maximum(-window, 1)  # window < 0: Llama 4's chunks
                same_chunk_BxS = (positions_BxT[:, :1] // chunk == mask.k_position_BxS // chunk
                                  if mask.k_position_BxS is not None else (start // chunk == slot_S // chunk)[None])
                seen_BxS = cache.valid_BxS & ((window == 0) | ((window > 0) & (start - slot_S < window))
                                              | ((window < 0) & same_chunk_BxS))
                out_BxKxGxh = step_attention(q_BxTxKxGxh[:, 0], k_new[:, 0], v_new[:, 0], k_BxKxSxh, v_BxKxSxh,
                                             seen_BxS, cfg, layer_sinks(layer, cfg))
                return (output_projection(out_BxKxGxh.reshape(B, 1, -1), gate_BxTxQ, layer, adapters),
                        (k_new, v_new) if written else None)
            k_all, v_all = (jax.lax.dynamic_update_slice(a, jnp.swapaxes(new, 1, 2), (0, 0, start, 0))
                            for a, new in ((k_BxKxSxh, k_new), (v_BxKxSxh, v_new)))
            k_all, v_all = jnp.swapaxes(k_all, 1, 2), jnp.swapaxes(v_all, 1, 2)  # attend's [B, S, K, hd]
            return (attend(q_BxTxKxGxh, k_all, v_all, mask, window, live_QxC, layer, layer_cfg, adapters,
                           gate_BxTxQ=gate_BxTxQ), (k_new, v_new) if written else None)

        return decoder_layer(x_BxTxD, layer, cached_latent_attention if cfg.kv_lora_rank else cached_attention, cfg,
                             adapters, view.experts)[:2]

    def linear_block(x_BxTxD, layer, state: LinearState):
        layer = rows_of(layer, adapter_B)
        x_BxTxD = constrain(x_BxTxD, ("batch", None, None))
        mixer = lambda h: gated_deltanet_layer(h, layer, cfg, adapters, mask_BxT > 0, state)  # noqa: E731
        return decoder_layer(x_BxTxD, layer, mixer, cfg, adapters, view.experts)[:2]

    x_BxTxD = embed(params, tokens_BxT, cfg, dtype)
    if placed_embeddings is not None:
        x_BxTxD = place_embeddings(x_BxTxD, placed_embeddings)
    windows_L = jnp.asarray(cfg.sliding_windows, jnp.int32)
    tables_L = jnp.asarray(cfg.rope_table_of_layer, jnp.int32)
    linear, new_full = cache.linear, None
    if not cfg.stacked_by_kind and deepstack is None:
        x_BxTxD, (k_LxBxTxKxh, v_LxBxTxKxh) = jax.lax.scan(block, x_BxTxD, (layers, windows_L, tables_L, cache.k,
                                                                             cache.v))
    elif not cfg.stacked_by_kind:
        def deepstack_block(x_BxTxD, layer_window_kv_index):
            x_BxTxD, kv = block(x_BxTxD, layer_window_kv_index[:-1])
            return add_deepstack(x_BxTxD, deepstack, layer_window_kv_index[-1]), kv

        x_BxTxD, (k_LxBxTxKxh, v_LxBxTxKxh) = jax.lax.scan(deepstack_block, x_BxTxD, (
            layers, windows_L, tables_L, cache.k, cache.v, jnp.arange(cfg.num_layers)))
    else:  # layers of several kinds (Qwen3.5's linear attention, Maverick's dense MLPs): one scan over their periods
        every = tuple(range(cfg.num_layers))
        layers_k, layers_full = cached_layers(cfg)
        items = {name: (module, cfg.module_layers(name)) for name, module in layers.items()}
        items.update({"per_layer.window": (windows_L, every), "per_layer.table": (tables_L, every),
                      "per_layer.kv": ((cache.k, cache.v), layers_k)})
        if linear is not None:
            items["per_layer.state"] = (linear, cfg.linear_attention_layers)
        if cache.full_kv is not None:
            items["per_layer.full_kv"] = (cache.full_kv, layers_full)
        if cfg.per_layer_input_size:
            items["per_layer_input"] = (per_layer_inputs(params, tokens_BxT, x_BxTxD, cfg), every)

        def rows_layer(rows):
            return {hf_module_name(name): rows[name] for name in (*layers, "per_layer_input") if name in rows}

        if deepstack is not None:
            items["per_layer.index"] = (jnp.arange(cfg.num_layers), every)

        def mixed_block(x, rows, kind):
            if kind.linear:
                x, out = linear_block(x, rows_layer(rows), rows["per_layer.state"])
            else:
                kv = rows["per_layer.full_kv" if kind.full else "per_layer.kv"]
                x, out = block(x, (rows_layer(rows), rows["per_layer.window"], rows["per_layer.table"], *kv), kind.full)
            return (x, out) if deepstack is None else (add_deepstack(x, deepstack, rows["per_layer.index"]), out)

        first = cfg.num_layers - cfg.shared_kv_layers
        group = (lambda kind: kind.full) if cfg.global_head_dim else (lambda kind: kind.linear)  # of the outputs
        x_BxTxD, by_kind = scan_layer_groups(mixed_block, x_BxTxD, items, cfg, (0, first), group)
        if cfg.global_head_dim:
            (k_LxBxTxKxh, v_LxBxTxKxh), new_full = by_kind[False], by_kind.get(True)
        else:
            (k_LxBxTxKxh, v_LxBxTxKxh), linear = by_kind[False], by_kind.get(True)
        if cfg.shared_kv_layers:  # Gemma 4: the last layers attend over their sources' caches and new entries
            stacks: dict[bool, Any] = {  # by kind (full?): (its cache, its new entries, the layers they hold)
                False: ((cache.k, cache.v), (k_LxBxTxKxh, v_LxBxTxKxh), layers_k),
                True: (cache.full_kv, new_full, layers_full)}
            source = {}
            for i in cfg.kv_sharing_layers:
                old, new, held = stacks[bool(i in cfg.global_layers)]
                row = held.index(cfg.kv_source(i))
                source[i in cfg.global_layers] = (old[0][row], old[1][row], new[0][row], new[1][row])

            def sharing_block(x, rows, kind):
                k_old, v_old, k_new, v_new = source[kind.full]
                return block(x, (rows_layer(rows), rows["per_layer.window"], rows["per_layer.table"], k_old, v_old),
                             kind.full, (k_new, v_new))

            x_BxTxD, _ = scan_layer_groups(sharing_block, x_BxTxD, items, cfg, (first, cfg.num_layers))
    # One in-place write of all layers' new keys and values (the scan read the old buffer, plus its own update).
    k, v = (jax.lax.dynamic_update_slice(a, jnp.swapaxes(new, 2, 3), (0, 0, 0, start, 0))
            for a, new in ((cache.k, k_LxBxTxKxh), (cache.v, v_LxBxTxKxh)))
    full_kv = cache.full_kv
    if full_kv is not None and new_full is not None:
        full_kv = tuple(jax.lax.dynamic_update_slice(a, jnp.swapaxes(new, 2, 3), (0, 0, 0, start, 0))
                        for a, new in zip(full_kv, new_full))
    next_position_B = cache.next_position_B + jnp.sum(mask_BxT > 0, axis=1, dtype=jnp.int32)
    cache = KVCache(k, v, valid_BxS, start + T, next_position_B, linear, full_kv)
    return norm(x_BxTxD, params["norm"], cfg), cache


def prefill(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig, attention_mask_BxT: jax.Array | None = None, *,
            cache_size: int | None = None, method: MethodConfig | None = None,
            options: ForwardOptions = ForwardOptions(), adapter_B: jax.Array | None = None,
            placed_embeddings: PlacedEmbeddings | None = None, span_ids_BxT: jax.Array | None = None,
            positions_BxT: jax.Array | None = None, deepstack: DeepStack | None = None) -> tuple[jax.Array, KVCache]:
    """Float32 logits [B, V] for the token after each left-padded prompt, and the cache holding the prompts.

    tokens_BxT: prompts padded on the left; attention_mask_BxT: 1 for real tokens, 0 for padding (default all 1).
    cache_size: slots per row, at least P + T (the default); decoding n more tokens needs P + T + n.
    placed_embeddings, span_ids_BxT, deepstack: the prompts' images (`extend`). positions_BxT: RoPE positions in place
    of the default (P + each real token's index), e.g. M-RoPE's [3, B, T]; `decode_step` goes on from `next_position_B`.
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
    if positions_BxT is None:
        positions_BxT = P + jnp.maximum(jnp.cumsum(attention_mask_BxT > 0, axis=1) - 1, 0)
    hidden_BxTxD, cache = extend(params, tokens_BxT, positions_BxT, attention_mask_BxT, cache, cfg, method, options,
                                 adapter_B, placed_embeddings=placed_embeddings, span_ids_BxT=span_ids_BxT,
                                 deepstack=deepstack)
    return head_logits(params, hidden_BxTxD[:, -1:], cfg.final_logit_softcap, pieces=False)[:, 0], cache


class PackedPrompts(NamedTuple):
    """B prompts packed into R rows of T tokens for one prefill, and where each goes in the cache; a pytree.

    tokens_RxT, positions_RxT, segments_RxT: int32 packed rows, each prompt a segment (1, 2, ...; 0 pads) whose RoPE
    positions run from P. source_BxW: int32, for cache row b's prompt left-padded to W slots, the flat index into
    R*T of each slot's token (-1: padding). last_B: int32, the flat index of each prompt's last token. adapter_R:
    int32 [R], each packed row's adapter slot (all of a row's prompts share it), or None.
    """

    tokens_RxT: jax.Array
    positions_RxT: jax.Array
    segments_RxT: jax.Array
    source_BxW: jax.Array
    last_B: jax.Array
    adapter_R: jax.Array | None = None


def prefill_packed(params: dict, packed: PackedPrompts, cfg: ModelConfig, *, cache_size: int,
                   method: MethodConfig | None = None, options: ForwardOptions = ForwardOptions()
                   ) -> tuple[jax.Array, KVCache]:
    """Float32 logits [B, V] for the token after each prompt, and the cache of B rows holding them left-padded.

    One forward over the packed rows (compute ~ R x T, the prompts' tokens bucketed, not B x the longest), whose keys
    and values are then gathered into slots P .. P+W-1 of each cache row. cache_size: slots per row, >= P + W.
    Jit with `static_argnames=("cfg", "cache_size", "method", "options")`.
    """
    R, T = packed.tokens_RxT.shape
    B, W = packed.source_BxW.shape
    P = prefix_length(params)
    if P + W > cache_size:
        raise JaxtuneError(f"prompt length {W} (+ {P} prefix tokens) does not fit the cache of {cache_size} slots")
    dtype = jnp.dtype(options.compute_dtype)
    rows = init_cache(params, cfg, R, P + T, dtype)
    hidden_RxTxD, rows = extend(params, packed.tokens_RxT, packed.positions_RxT, packed.segments_RxT, rows, cfg,
                                method, options, packed.adapter_R, segment_ids_BxT=packed.segments_RxT)
    last_Bx1xD = hidden_RxTxD.reshape(R * T, -1)[packed.last_B][:, None]
    logits_BxV = head_logits(params, last_Bx1xD, cfg.final_logit_softcap, pieces=False)[:, 0]
    is_token_BxW = packed.source_BxW >= 0
    source_BxW = jnp.maximum(packed.source_BxW, 0)  # padding slots take any key: they are never valid

    def gathered(a_LxRxKxSxh):  # -> [L, B, K, W, hd]
        L, _, K, _, hd = a_LxRxKxSxh.shape
        tokens_LxRTxKxh = jnp.swapaxes(a_LxRxKxSxh[:, :, :, P:], 2, 3).reshape(L, R * T, K, hd)
        return jnp.swapaxes(tokens_LxRTxKxh[:, source_BxW], 2, 3)

    cache = init_cache(params, cfg, B, cache_size, dtype)
    k = jax.lax.dynamic_update_slice(cache.k, gathered(rows.k), (0, 0, 0, P, 0))
    v = jax.lax.dynamic_update_slice(cache.v, gathered(rows.v), (0, 0, 0, P, 0))
    full_kv = None if cache.full_kv is None or rows.full_kv is None else tuple(
        jax.lax.dynamic_update_slice(a, gathered(r), (0, 0, 0, P, 0)) for a, r in zip(cache.full_kv, rows.full_kv))
    valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, is_token_BxW, (0, P))
    next_position_B = P + jnp.sum(is_token_BxW, axis=1, dtype=jnp.int32)
    # a linear layer's state is its packed row's at the row's end: one prompt a row, right-aligned (`pack_prompts`)
    linear = None if rows.linear is None else jax.tree.map(lambda a: a[:, packed.last_B // T], rows.linear)
    return logits_BxV, KVCache(k, v, valid_BxS, jnp.asarray(P + W, jnp.int32), next_position_B, linear, full_kv)


def decode_step(params: dict, token_B: jax.Array, cache: KVCache, cfg: ModelConfig, *,
                method: MethodConfig | None = None,
                options: ForwardOptions = ForwardOptions(), adapter_B: jax.Array | None = None
                ) -> tuple[jax.Array, KVCache]:
    """Float32 logits [B, V] for the token after `token_B`, and the cache with `token_B` appended.

    The cache must have a free slot (`length < size`): past the end, XLA clamps the write and the output is wrong.
    Jit with `static_argnames=("cfg", "method", "options")` and donate the cache.
    """
    positions_Bx1 = cache.next_position_B[:, None]
    mask_Bx1 = jnp.ones_like(positions_Bx1)
    hidden_Bx1xD, cache = extend(params, token_B[:, None], positions_Bx1, mask_Bx1, cache, cfg, method, options,
                                 adapter_B)
    return head_logits(params, hidden_Bx1xD, cfg.final_logit_softcap, pieces=False)[:, 0], cache
