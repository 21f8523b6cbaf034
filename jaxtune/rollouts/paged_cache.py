"""A paged key/value cache: a pool of fixed-size pages per layer, stacked on the layer axis as the layer scan reads it,
k and v [L, NP, ps, K, hd]; a row holds a page table (page ids; NP: none) instead of its own slots, its virtual
sequence the table's pages end to end ([M * ps] slots, which of them a query sees the engine's `seen_SxX`).
The free list is a device bitmap, `free_NP` [NP] bool (`take_pages`, `return_pages`: no host). Page id NP stands for
"no page": scatters drop it and gathers clamp it (its slots are never seen). `paged_decode_step` is
`kv_cache.extend`'s decode step with each row's pages gathered (`gather_rows`) for the dense cache's
`step_attention` in the pages' layout (`slots_first`), the new keys and values written after the layer scan in one
scatter. Plain attention layers only (`refuse_unpaged`). On a mesh the pool's heads are split over tensor and its pages
are whole on every other device (`pool_heads`; why: `rollouts.engine`), each device decoding its own rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.adapters import Adapters, adapter_forward
from jaxtune.models.head import head_logits
from jaxtune.models.kv_cache import step_attention
from jaxtune.models.llama import decoder_layer, embed, layer_sinks, norm, output_projection, project_qkv
from jaxtune.models.rope import layer_rope, rope_tables
from jaxtune.parallel.rules import constrain, gathered


def refuse_unpaged(cfg: ModelConfig) -> None:
    """A one-line JaxtuneError for a model whose cache is not one plain key/value stack of every layer: sliding
    windows and Llama 4's chunks (a page would have to leave the window), latent attention (DeepSeek), Gated
    DeltaNet state (Qwen3.5/Qwen3-Next), Gemma 4's own-width full layers and KV sharing, Llama 4's query temperature
    (by cache slot) and layers of several kinds; `generation.generate` decodes those."""
    reasons = [(any(cfg.sliding_windows), "sliding-window or chunked attention"),
               (bool(cfg.kv_lora_rank), "latent attention"),
               (bool(cfg.linear_attention_layers), "Gated DeltaNet layers"),
               (bool(cfg.global_head_dim or cfg.shared_kv_layers), "Gemma 4's full layers and KV sharing"),
               (bool(cfg.temperature_floor), "query temperature by cache slot"),
               (cfg.stacked_by_kind, "layers of several kinds")]
    why = next((reason for refused, reason in reasons if refused), None)
    if why is not None:
        raise JaxtuneError(f"the rollout engine's paged cache holds plain attention layers only, not {why}: use "
                           "jaxtune.generate for this model")


def empty_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Zero key and value pools [L, NP, ps, K, hd]."""
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def take_pages(free_NP: jax.Array, want_S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page_S, free_NP): each row that wants one gets a free page (the lowest free pages, in row order; NP where it
    wants none), marked taken. The caller makes sure enough are free (the engine reserves them at admission); a row
    left without one gets NP."""
    NP, S = free_NP.shape[0], want_S.shape[0]
    rank_S = jnp.cumsum(want_S) - 1
    (lowest_S,) = jnp.nonzero(free_NP, size=S, fill_value=NP)
    page_S = jnp.where(want_S, lowest_S[jnp.clip(rank_S, 0, S - 1)], NP)
    return page_S, free_NP.at[page_S].set(False, mode="drop")


def return_pages(free_NP: jax.Array, pages: jax.Array) -> jax.Array:
    """free_NP with `pages` (any shape; NP entries ignored) free again."""
    return free_NP.at[pages.reshape(-1)].set(True, mode="drop")


def write_prompts(k_pool: jax.Array, v_pool: jax.Array, k_LxGxKxWxh: jax.Array, v_LxGxKxWxh: jax.Array,
                  table_GxMp: jax.Array, length_G: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The pools with prompt g's keys and values (left-padded in the W slots of a dense cache row, as
    `kv_cache.prefill_packed` leaves them) in its pages `table_GxMp[g]`, token i at page i // ps, offset i % ps.
    A last partial page's other slots take any key: the engine never lets a query see them."""
    ps = k_pool.shape[2]
    W, Mp = k_LxGxKxWxh.shape[3], table_GxMp.shape[1]
    token_X = jnp.arange(Mp * ps)
    source_GxX = jnp.clip(W - length_G[:, None] + token_X, 0, W - 1)

    def write(pool, dense_LxGxKxWxh):
        L, G, K, _, hd = dense_LxGxKxWxh.shape
        tokens_LxGxXxKxh = jnp.take_along_axis(jnp.swapaxes(dense_LxGxKxWxh, 2, 3),
                                               source_GxX[None, :, :, None, None], axis=2)
        pages = pool_heads(tokens_LxGxXxKxh.reshape(L, G, Mp, ps, K, hd).astype(pool.dtype))
        return pool_heads(pool_heads(pool).at[:, table_GxMp].set(pages, mode="drop"))

    return write(k_pool, k_LxGxKxWxh), write(v_pool, v_LxGxKxWxh)


def pool_heads(a: jax.Array) -> jax.Array:
    """`a` [..., K, hd] with its heads split over tensor and whole on every other device of the mesh in context (the
    pool's layout, `rollouts.engine`; `rules.gathered` drops the fallback that would split K over fsdp, where the
    slots are split): a write into the pool gathers what it writes, never the pool."""
    return gathered(a, (None,) * (a.ndim - 2) + ("kv_heads", None))


def gather_rows(flat_pool: jax.Array, first_page: jax.Array, table_SxM: jax.Array) -> jax.Array:
    """One layer's pages of each row end to end, [S, M * ps, K, hd]: pages `first_page + table_SxM` of the pool
    flattened over its layers, [L * NP, ps, K, hd] (read in place: sliced by the layer scan, the step's time grew
    with the pool). A page NP reads the next layer's first (clamped at the end): never seen."""
    S, M = table_SxM.shape
    _, ps, K, hd = flat_pool.shape
    return jnp.take(flat_pool, first_page + table_SxM, axis=0, mode="clip").reshape(S, M * ps, K, hd)


def paged_decode_step(params: dict, token_S: jax.Array, position_S: jax.Array, table_SxM: jax.Array,
                      seen_SxX: jax.Array, page_S: jax.Array, offset_S: jax.Array, k_pool: jax.Array,
                      v_pool: jax.Array, cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Float32 logits [S, V] for the token after each row's `token_S`, and the pools with its key and value written.

    position_S: the token's RoPE position. table_SxM: each row's pages, X = M * ps virtual slots; seen_SxX: those
    its query attends to (besides its own new key). page_S, offset_S: where its key and value go (page NP: nowhere,
    an idle row). LoRA and the other dense-hook methods run unmerged, as `kv_cache.decode_step` runs them.
    """
    dtype = jnp.dtype(options.compute_dtype)
    S = token_S.shape[0]
    view = adapter_forward(method, cfg)
    layers = params["layers"] if view.prepare is None else view.prepare(params["layers"])
    adapters = Adapters(view.dense)
    rope = rope_tables(position_S[:, None], cfg, dtype)
    L, NP = k_pool.shape[:2]
    flat_k, flat_v = (a.reshape(L * NP, *a.shape[2:]) for a in (k_pool, v_pool))

    def block(x_Sx1xD, layer_rope_index):
        layer, rope_table, index = layer_rope_index
        x_Sx1xD = constrain(x_Sx1xD, ("batch", None, None))  # each device its own slots, as the padded decode

        def attention(h_Sx1xD):
            q_Sx1xKxGxh, k_new, v_new, gate_Sx1xQ = project_qkv(h_Sx1xD, layer, layer_rope(rope, rope_table, cfg), cfg,
                                                                 adapters)
            k_new, v_new = k_new[:, 0].astype(dtype), v_new[:, 0].astype(dtype)
            out_SxKxGxh = step_attention(q_Sx1xKxGxh[:, 0], k_new, v_new, gather_rows(flat_k, index * NP, table_SxM),
                                          gather_rows(flat_v, index * NP, table_SxM), seen_SxX, cfg,
                                          layer_sinks(layer, cfg), slots_first=True)
            return output_projection(out_SxKxGxh.reshape(S, 1, -1), gate_Sx1xQ, layer, adapters), (k_new, v_new)

        return decoder_layer(x_Sx1xD, layer, attention, cfg, adapters, view.experts)[:2]

    x_Sx1xD = embed(params, token_S[:, None], cfg, dtype)
    tables_L = jnp.asarray(cfg.rope_table_of_layer, jnp.int32)
    x_Sx1xD, (k_LxSxKxh, v_LxSxKxh) = jax.lax.scan(block, x_Sx1xD, (layers, tables_L, jnp.arange(L)))
    # on a mesh every data-parallel device holds the pool (its heads): the slots' new keys and values go to each copy,
    # pinned so that XLA gathers them (S x K x hd a layer), not the pool split by another axis around the scatter
    page_S, offset_S = constrain(page_S, (None,)), constrain(offset_S, (None,))
    k_pool = pool_heads(pool_heads(k_pool).at[:, page_S, offset_S].set(pool_heads(k_LxSxKxh), mode="drop"))
    v_pool = pool_heads(pool_heads(v_pool).at[:, page_S, offset_S].set(pool_heads(v_LxSxKxh), mode="drop"))
    hidden_Sx1xD = norm(x_Sx1xD, params["norm"], cfg)
    return head_logits(params, hidden_Sx1xD, cfg.final_logit_softcap, pieces=False)[:, 0], k_pool, v_pool
