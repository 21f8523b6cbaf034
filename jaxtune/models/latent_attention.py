"""DeepSeek-V3's multi-head latent attention (DeepSeek-V2 report, section 2.1), as transformers computes it: queries
through a normed low-rank latent (`q_a_proj`, `q_a_layernorm`, `q_b_proj`; or `q_proj`), keys and values of every
head expanded by `kv_b_proj` from one normed latent c [kv_lora_rank] beside a rotated key all heads share
(`kv_a_proj_with_mqa`): a head's key is [its unrotated part | the shared rotated one], its query alike. Training
and prefill expand the latent (`latent_keys_values`); the decode cache holds [c | rotated key] a slot, and a step
attends in the latent's space (`absorbed_queries`, `latent_values`: q k^T = (q W_k^T) c^T, o = (p c) W_v), reading
the cache once with no per-head keys or values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.models.adapters import Adapters
from jaxtune.models.linear import kernel_of, project
from jaxtune.models.norms import rms_norm
from jaxtune.models.rope import LayerRope, apply_rope

LATENT_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which the latents' norms keep


def _rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, LATENT_EPS)


def latent_queries(x_BxTxD: jax.Array, layer: dict, rope: LayerRope, cfg: ModelConfig, adapters: Adapters
                   ) -> jax.Array:
    """Every head's query [B, T, H, hd], its last qk_rope_head_dim dimensions rotated."""
    B, T, _ = x_BxTxD.shape
    if "q_a_proj" in layer:
        q_BxTxQ = project(_rms_norm(project(x_BxTxD, layer, "q_a_proj", adapters), layer["q_a_layernorm"]),
                           layer, "q_b_proj", adapters)
    else:
        q_BxTxQ = project(x_BxTxD, layer, "q_proj", adapters)
    q_BxTxHxh = q_BxTxQ.reshape(B, T, cfg.num_heads, cfg.head_dim)
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    rotated = apply_rope(q_BxTxHxh[..., nope:], rope.cos, rope.sin, cfg.rope_interleaved)
    return jnp.concatenate([q_BxTxHxh[..., :nope], rotated], axis=-1)


def latent_cache_entry(x_BxTxD: jax.Array, layer: dict, rope: LayerRope, cfg: ModelConfig, adapters: Adapters
                       ) -> jax.Array:
    """What a token leaves for later ones to attend to: [B, T, kv_lora_rank + qk_rope_head_dim], its normed latent
    then its rotated shared key."""
    latent_BxTxC, key_BxTxR = jnp.split(project(x_BxTxD, layer, "kv_a_proj_with_mqa", adapters), [cfg.kv_lora_rank],
                                        axis=-1)
    rotated = apply_rope(key_BxTxR[:, :, None], rope.cos, rope.sin, cfg.rope_interleaved)[:, :, 0]
    return jnp.concatenate([_rms_norm(latent_BxTxC, layer["kv_a_layernorm"]), rotated], axis=-1)


def latent_keys_values(entries_BxSxE: jax.Array, layer: dict, cfg: ModelConfig, adapters: Adapters
                       ) -> tuple[jax.Array, jax.Array]:
    """Every head's keys [B, S, H, hd] and values [B, S, H, hd] of the cache entries (`latent_cache_entry`); values
    zero-padded from v_head_dim to hd, so every attention kernel takes them (`heads_output` drops the padding)."""
    B, S, _ = entries_BxSxE.shape
    H, hd, v, rope = cfg.num_heads, cfg.head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    expanded = project(entries_BxSxE[..., :cfg.kv_lora_rank], layer, "kv_b_proj", adapters)
    k_nope, v_BxSxHxv = jnp.split(expanded.reshape(B, S, H, hd - rope + v), [hd - rope], axis=-1)
    shared_BxSxHxR = jnp.broadcast_to(entries_BxSxE[:, :, None, cfg.kv_lora_rank:], (B, S, H, rope))
    k_BxSxHxh = jnp.concatenate([k_nope, shared_BxSxHxR.astype(k_nope.dtype)], axis=-1)
    return k_BxSxHxh, jnp.pad(v_BxSxHxv, ((0, 0), (0, 0), (0, 0), (0, hd - v)))


def heads_output(out_BxTxKxGxh: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The heads' outputs [B, T, K G v] for o_proj: v_head_dim of each head's hd (latent attention's padding off)."""
    B, T = out_BxTxKxGxh.shape[:2]
    if cfg.kv_lora_rank and cfg.v_head_dim < cfg.head_dim:
        out_BxTxKxGxh = out_BxTxKxGxh[..., :cfg.v_head_dim]
    return out_BxTxKxGxh.reshape(B, T, -1)


def expansion_kernel(layer: dict, cfg: ModelConfig, adapters: Adapters, rows: int, dtype) -> jax.Array:
    """kv_b_proj as one matrix [rows or 1, kv_lora_rank, H, hd - rope + v] with the method's hooks in it: the base
    kernel where no hook adapts it, else the module applied to the identity of each of `rows` rows (a row's
    adapter may differ, `adapter_rows`)."""
    module, C = layer["kv_b_proj"], cfg.kv_lora_rank
    shape = (C, cfg.num_heads, cfg.head_dim - cfg.qk_rope_head_dim + cfg.v_head_dim)
    if not adapters.hooks_of(module):
        return kernel_of(module, dtype).reshape(1, *shape)
    identity = jnp.broadcast_to(jnp.eye(C, dtype=dtype), (rows, C, C))
    return project(identity, layer, "kv_b_proj", adapters).reshape(rows, *shape)


def absorbed_queries(q_BxHxh: jax.Array, kernel_NxCxHxF: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Queries in the cache entries' space [B, H, kv_lora_rank + rope]: each head's unrotated part times its key
    expansion's transpose (so q . k = q' . entry), its rotated part as it is."""
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    absorbed = jnp.einsum("bhn,bchn->bhc", q_BxHxh[..., :nope], kernel_NxCxHxF[..., :nope].astype(q_BxHxh.dtype))
    return jnp.concatenate([absorbed, q_BxHxh[..., nope:]], axis=-1)


def latent_values(out_BxHxE: jax.Array, kernel_NxCxHxF: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The heads' outputs [B, H*v] from their attention-weighted cache entries [B, H, kv_lora_rank + rope]: the
    latent part times each head's value expansion."""
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    values = kernel_NxCxHxF[..., nope:].astype(out_BxHxE.dtype)
    out_BxHxv = jnp.einsum("bhc,bchv->bhv", out_BxHxE[..., :cfg.kv_lora_rank], values)
    return out_BxHxv.reshape(out_BxHxv.shape[0], -1)
