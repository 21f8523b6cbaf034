"""Rotary position embeddings with Hugging Face's conventions (half-split rotation, float32 angles, the config's
rope scaling): `rope_tables` for a batch's positions, `layer_rope` a layer's pick of them, `apply_rope`; Qwen2.5-VL's
M-RoPE (`mrope_angles`) where the positions come as three streams [3, B, T]. The tables and the rotation are named in
the scope "rope"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError


def inverse_frequencies(cfg: ModelConfig, long: bool = False) -> np.ndarray:
    """[rotary_dim/2] float32 inverse frequencies, after `rope_scaling` (none, linear, llama3, yarn, proportional or
    longrope: its short factors, or its long ones with `long`)."""
    dim = cfg.rotary_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.kind == "longrope":
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        powers = (cfg.rope_theta ** exponents.astype(np.float64)).astype(np.float32)  # float32 steps, as torch's
        return np.float32(1.0) / (factors * powers)
    inv_freq = (1.0 / (cfg.rope_theta ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "proportional":  # the first fraction of the frequencies, the rest 0 (pairs left unrotated)
        rotated = int(scaling.rotated_fraction * dim // 2)
        return (np.where(np.arange(dim // 2) < rotated, inv_freq, 0) / np.float32(scaling.factor)).astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_frequencies(cfg.rope_theta, dim, scaling)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(theta: float, dim: int, scaling) -> np.ndarray:
    """YaRN's blend of the original (extrapolated) and `factor`-divided (interpolated) frequencies, in float32
    steps as transformers' `_compute_yarn_parameters`."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = (theta ** exponents.astype(np.float64)).astype(np.float32)  # torch's scalar ** tensor rounds once
    extrapolated, interpolated = np.float32(1.0) / powers, np.float32(1.0) / (np.float32(scaling.factor) * powers)
    original = scaling.original_max_position_embeddings

    def correction_dim(turns: float) -> float:  # the dimension whose wave turns `turns` times over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)
    return (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)


def rope_angles(positions_BxT: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin, each [B, T, rotary_dim], computed in float32 and cast to the compute dtype (as transformers
    does); for float64 compute, cos and sin of the same float32 angles in float64.

    longrope, as transformers' `longrope_frequency_update`: the long factors for the whole call when its largest
    position reaches past `original_max_position_embeddings`, else the short ones; cos and sin times its
    `attention_factor`. (A cache keeps keys rotated as they were written: a generation that crosses that length
    goes on with the long factors for the new tokens only, where transformers' Phi-3 recomputes the prompt.)"""
    inv_freq = jnp.asarray(inverse_frequencies(cfg))
    scaling, attention_factor = cfg.rope_scaling, 1.0
    if scaling is not None and scaling.kind == "longrope":
        long = jnp.max(positions_BxT) + 1 > scaling.original_max_position_embeddings
        inv_freq = jnp.where(long, jnp.asarray(inverse_frequencies(cfg, long=True)), inv_freq)
        attention_factor = scaling.attention_factor
    if scaling is not None and scaling.kind == "yarn":
        attention_factor = scaling.attention_factor
    freqs_BxTxH = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs_BxTxH, freqs_BxTxH], axis=-1).astype(jnp.promote_types(dtype, jnp.float32))
    if attention_factor != 1.0:
        return (jnp.cos(emb) * attention_factor).astype(dtype), (jnp.sin(emb) * attention_factor).astype(dtype)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def mrope_streams(mrope_section: Sequence[int], rotary_dim: int, interleaved: bool = False) -> np.ndarray:
    """int [rotary_dim]: the stream (0 time, 1 row, 2 column) each rotary dimension reads, on both halves. Chunked:
    chunk i of `mrope_section` (frequencies, summing to rotary_dim / 2) reads stream i % 3 (Qwen2.5-VL's).
    Interleaved: frequency j reads stream j % 3 while j < 3 x that stream's section, else time (transformers'
    Qwen3-VL `recomposition_frequencies`)."""
    if 2 * sum(mrope_section) != rotary_dim:
        raise JaxtuneError(f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, not half the rotary "
                         f"dimension {rotary_dim}")
    if interleaved:
        j = np.arange(rotary_dim // 2)
        half = np.where((j % 3 > 0) & (j < 3 * np.take(mrope_section, j % 3)), j % 3, 0)
    else:
        half = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)
    return np.concatenate([half, half])


def mrope_angles(positions_3xBxT: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, rotary_dim] of M-RoPE: `rope_angles` of each stream (time, row, column), each dimension
    taken from its `mrope_streams` stream of `cfg.mrope_section` (transformers' `Qwen2_5_VLRotaryEmbedding`, or
    Qwen3-VL's interleaved)."""
    _, B, T = positions_3xBxT.shape
    streams_R = jnp.asarray(mrope_streams(cfg.mrope_section, cfg.rotary_dim, cfg.mrope_interleaved))
    tables = rope_angles(jnp.reshape(positions_3xBxT, (3 * B, T)), cfg, dtype)
    cos_3xBxTxR, sin_3xBxTxR = (jnp.reshape(a, (3, B, T, -1)) for a in tables)
    pick = lambda a: jnp.where(streams_R == 0, a[0], jnp.where(streams_R == 1, a[1], a[2]))  # noqa: E731
    return pick(cos_3xBxTxR), pick(sin_3xBxTxR)


def position_angles(positions: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, rotary_dim]: `rope_angles` of positions [B, T], `mrope_angles` of streams [3, B, T]."""
    if positions.ndim == 2:
        return rope_angles(positions, cfg, dtype)
    if not cfg.mrope_section:
        raise JaxtuneError(f"positions of shape {positions.shape}: three streams need the config's mrope_section")
    return mrope_angles(positions, cfg, dtype)


@jax.named_scope("rope")
def apply_rope(x_BxTxNxH: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array, interleaved: bool = False
               ) -> jax.Array:
    """Rotate the first R dimensions of each head's vector, x * cos + rotate_half(x) * sin, and pass the rest
    (R < hd: Phi-3's partial rotary factor); `interleaved` (Llama 4): rotate adjacent pairs (x[2i], x[2i+1]) by
    angle i, as a complex product. Computed in float32 (float64) and rounded once: XLA:CPU rounds a bfloat16
    product or sum at each operation, converting there and back around each."""
    R = cos_BxTxR.shape[-1]
    wide = jnp.promote_types(x_BxTxNxH.dtype, jnp.float32)
    x_rot, x_pass = x_BxTxNxH[..., :R].astype(wide), x_BxTxNxH[..., R:]
    half = R // 2
    cos, sin = cos_BxTxR[:, :, None, :], sin_BxTxR[:, :, None, :]
    if interleaved:
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
        cos, sin = cos[..., :half], sin[..., :half]
        out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x_rot.shape)
    else:
        rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
        out = x_rot * cos + rotated * sin
    out = out.astype(x_BxTxNxH.dtype)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


class LayerRope(NamedTuple):
    """One layer's pick of `rope_tables`: cos and sin [B, T, R]; rotates, a bool scalar (False on NoPE layers) or
    None where every layer rotates; q_scale_T, Llama 4's NoPE-layer query temperature (1 on other layers) [T], or a
    cache's [B, T] (by position), or None."""

    cos: jax.Array
    sin: jax.Array
    rotates: jax.Array | None
    q_scale_T: jax.Array | None


@jax.named_scope("rope")
def rope_tables(positions_BxT: jax.Array, cfg: ModelConfig, dtype, slots_T: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """cos and sin [R, B, T, hd] (`position_angles` of positions [B, T], or M-RoPE's streams [3, B, T]), the tables
    of `cfg.rope_table_of_layer`: the full layers', then the sliding layers' own when they have their own base
    (`local_rope_theta`: Gemma 3, OLMo 3; unscaled), then the identity (cos 1, sin 0) when some layers are NoPE
    (`nope_layers`); and with `temperature_floor`, each table's query scale [R, T] by the tokens' cache slots
    `slots_T` (else None), or [R, B, T] by a cache's per-row positions [B, T] in their place."""
    tables = [position_angles(positions_BxT, cfg, dtype)]
    if cfg.local_rope_theta is not None:
        local = cfg.replace(rope_theta=cfg.local_rope_theta, rope_scaling=None)
        tables.append(position_angles(positions_BxT, local, dtype))
    if cfg.nope_layers:
        tables.append((jnp.ones_like(tables[0][0]), jnp.zeros_like(tables[0][1])))
    cos, sin = (jnp.stack(parts) for parts in zip(*tables))
    if not cfg.temperature_floor:
        return cos, sin, None
    assert slots_T is not None, "a model with attention temperature needs the tokens' slots"
    floor = jnp.floor((slots_T.astype(jnp.float32) + 1.0) / cfg.temperature_floor)
    temperature_T = jnp.log1p(floor) * cfg.temperature_scale + 1.0  # float32, as transformers computes it
    scales = jnp.ones((len(tables), *slots_T.shape), jnp.float32)
    return cos, sin, scales.at[-1].set(temperature_T)  # the NoPE layers' table is the last


def layer_rope(tables: tuple[jax.Array, jax.Array, jax.Array | None], table: jax.Array, cfg: ModelConfig
               ) -> LayerRope:
    """A layer's `LayerRope`: table `table` (its entry of `cfg.rope_table_of_layer`) of `rope_tables`."""
    cos_RxBxTxH, sin_RxBxTxH, scale_RxT = tables
    rotates = table != cos_RxBxTxH.shape[0] - 1 if cfg.nope_layers else None
    if cos_RxBxTxH.shape[0] == 1:
        return LayerRope(cos_RxBxTxH[0], sin_RxBxTxH[0], rotates, None)
    return LayerRope(cos_RxBxTxH[table], sin_RxBxTxH[table], rotates,
                     None if scale_RxT is None else scale_RxT[table])
