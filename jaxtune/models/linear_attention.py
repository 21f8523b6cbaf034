"""Qwen3.5's (and Qwen3-Next's) linear-attention layer, Gated DeltaNet as transformers runs it: `in_proj_qkv` through
a causal depthwise convolution (silu), split into L2-normed queries and keys and values; the gated delta rule
(`gated_deltanet.py`) with beta = sigmoid(in_proj_b x) and log decay g = -exp(A_log) softplus(in_proj_a x + dt_bias);
each head's output RMS-normed, scaled by `norm.weight` and by silu(in_proj_z x), then `out_proj`. Qwen3-Next's
fused `in_proj_qkvz` and `in_proj_ba` hold the same columns grouped by key head (`_projections`).

`gated_deltanet_layer` runs T tokens from a `LinearState` (the convolution's last inputs and the rule's state: what a
decode carries from step to step) and returns the state after them; None starts from zeros (training).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.models.adapters import Adapters
from jaxtune.models.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from jaxtune.models.linear import project, wide


class LinearState(NamedTuple):
    """One layer's decoding state: conv_BxKxC, the convolution's last K - 1 inputs (K taps, C = 2 keys + values
    channels) in the compute dtype; recurrent_BxNxKxV, the delta rule's state [B, value heads, dk, dv] float32."""

    conv_BxKxC: jax.Array
    recurrent_BxNxKxV: jax.Array


def empty_state(cfg: ModelConfig, batch: int, dtype) -> LinearState:
    """A state of zeros: no token seen."""
    C = 2 * cfg.linear_key_size + cfg.linear_value_size
    return LinearState(jnp.zeros((batch, cfg.linear_conv_kernel - 1, C), dtype),
                       jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim), wide(dtype)))


def _project(x, layer: dict, name: str, adapters: Adapters):
    return project(x, layer, f"linear_attn.{name}", adapters)


def _projections(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, adapters: Adapters) -> tuple[jax.Array, ...]:
    """(qkv [B, T, 2 keys + values] as the convolution reads it, z [B, T, values], b and a [B, T, value heads]);
    from Qwen3-Next's fused projections, whose columns run key head by key head: its query, its key, its value
    heads' values, their gates (b then a in `in_proj_ba`)."""
    if not cfg.linear_attention_fused:
        return tuple(_project(x_BxTxD, layer, name, adapters) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                             "in_proj_a"))
    B, T, _ = x_BxTxD.shape
    Hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // Hk
    qkvz = _project(x_BxTxD, layer, "in_proj_qkvz", adapters).reshape(B, T, Hk, 2 * dk + 2 * r * dv)
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    b, a = jnp.split(_project(x_BxTxD, layer, "in_proj_ba", adapters).reshape(B, T, Hk, 2 * r), 2, axis=-1)
    qkv = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
    return qkv, z.reshape(B, T, -1), b.reshape(B, T, -1), a.reshape(B, T, -1)


def causal_conv(x_BxTxC: jax.Array, weight_Cx1xK: jax.Array, history_BxKxC: jax.Array,
                segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(silu of the depthwise causal convolution [B, T, C] in x's dtype, summed in float32 and rounded once; the last
    K - 1 inputs, the next call's history), the first outputs reading `history_BxKxC` (K - 1 earlier inputs).
    segment_ids_BxT: packed rows, a tap reading only its own segment's inputs (the history none)."""
    K = weight_Cx1xK.shape[-1]
    padded = jnp.concatenate([history_BxKxC.astype(x_BxTxC.dtype), x_BxTxC], axis=1)
    f32, T = wide(x_BxTxC.dtype), x_BxTxC.shape[1]
    w_KxC = weight_Cx1xK[:, 0].T.astype(f32)
    taps = [padded[:, k:k + T].astype(f32) * w_KxC[k] for k in range(K)]
    if segment_ids_BxT is not None:
        segments = jnp.pad(segment_ids_BxT, ((0, 0), (K - 1, 0)), constant_values=-1)
        taps = [jnp.where((segments[:, k:k + T] == segment_ids_BxT)[..., None], tap, 0) for k, tap in enumerate(taps)]
    out = sum(taps)
    return jax.nn.silu(out).astype(x_BxTxC.dtype), padded[:, T:]


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis (float32 statistics, cast back), times `weight`, times silu(gate) in float32, cast
    back: transformers' `Qwen3NextRMSNormGated`."""
    x32 = x.astype(wide(x.dtype))
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return ((weight.astype(x.dtype) * normed).astype(x32.dtype)
            * jax.nn.silu(gate.astype(x32.dtype))).astype(x.dtype)


def gated_deltanet_layer(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, adapters: Adapters,
                         valid_BxT: jax.Array | None = None, state: LinearState | None = None,
                         segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, LinearState]:
    """(the layer's output [B, T, D], the state after the T tokens). valid_BxT: padding's inputs are zeroed first
    (as transformers does), so left padding leaves the state at zero. segment_ids_BxT: packed rows, each segment
    from a zero state (the convolution and the rule restart at its first token). One token from a state steps the
    recurrence; more run the chunked form."""
    B, T, _ = x_BxTxD.shape
    Hk, Nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if valid_BxT is not None:
        x_BxTxD = x_BxTxD * valid_BxT[..., None].astype(x_BxTxD.dtype)
    state = empty_state(cfg, B, x_BxTxD.dtype) if state is None else state
    qkv_BxTxC, z_BxTxV, b_BxTxN, a_BxTxN = _projections(x_BxTxD, layer, cfg, adapters)
    qkv_BxTxC, conv_BxKxC = causal_conv(qkv_BxTxC, layer["linear_attn.conv1d"]["weight"], state.conv_BxKxC,
                                        segment_ids_BxT)
    q, k, v = jnp.split(qkv_BxTxC, [Hk * dk, 2 * Hk * dk], axis=-1)
    q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Nv, dv)
    f32 = wide(x_BxTxD.dtype)
    beta_BxTxN = jax.nn.sigmoid(b_BxTxN)
    g_BxTxN = -jnp.exp(layer["linear_attn.A_log"].astype(f32)) * jax.nn.softplus(
        a_BxTxN.astype(f32) + layer["linear_attn.dt_bias"].astype(f32))
    if T == 1:
        out_BxTxNxV, recurrent = recurrent_gated_delta_rule(q, k, v, g_BxTxN, beta_BxTxN,
                                                            state_BxNxKxV=state.recurrent_BxNxKxV)
    else:
        reset_BxT = None if segment_ids_BxT is None else segment_ids_BxT != jnp.pad(
            segment_ids_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        out_BxTxNxV, recurrent = chunk_gated_delta_rule(q, k, v, g_BxTxN, beta_BxTxN, reset_BxT=reset_BxT,
                                                        state_BxNxKxV=state.recurrent_BxNxKxV)
    z_BxTxNxV = z_BxTxV.reshape(B, T, Nv, dv)
    normed = gated_rms_norm(out_BxTxNxV, z_BxTxNxV, layer["linear_attn.norm"]["weight"], cfg.rms_norm_eps)
    out_BxTxD = _project(normed.reshape(B, T, Nv * dv), layer, "out_proj", adapters)
    return out_BxTxD, LinearState(conv_BxKxC.astype(state.conv_BxKxC.dtype), recurrent.astype(f32))
