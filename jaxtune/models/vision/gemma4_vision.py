"""Gemma 4's vision encoder as pure functions (`soft_tokens`): images padded to a static patch budget, each patch with
its (x, y) in the grid (-1: padding); patches embedded (one matmul of 2 (p - 0.5)) plus learned x and y embeddings;
pre/post-normed layers (RMSNorm, attention with query/key norms, unscaled value norm and 2D RoPE — x on the first
half of each head, y on the second —, a gated tanh-GELU MLP) stacked and scanned, attention the blockwise kernel over
the image's real patches; then k x k patches average-pooled, x sqrt(D), standardised if configured, RMS-normed and
projected to the text's width (`Gemma4MultimodalEmbedder`). Weights read from and written back to transformers'
names (`model.vision_tower.*`, `model.embed_vision.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.models.attention import blockwise_attention, live_blocks, training_mask
from jaxtune.models.hf_weights import canonical_name, host_array
from jaxtune.models.linear import wide

LINEARS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
           "down_proj": "mlp.down_proj"}  # ours -> transformers' module under encoder.layers.N
NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
         "pre_feedforward_layernorm": "pre_feedforward_layernorm",
         "post_feedforward_layernorm": "post_feedforward_layernorm", "q_norm": "self_attn.q_norm",
         "k_norm": "self_attn.k_norm"}
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # a clipped linear's buffers, in this order
TOWER, EMBEDDER = "vision_tower.", "model.embed_vision."  # canonical prefixes (`hf_weights.canonical_name`)


@dataclass(frozen=True, kw_only=True)
class Gemma4VisionConfig:
    """transformers' `Gemma4VisionConfig` (config.json's `vision_config`) and the text width it projects to.
    use_clipped_linears: each linear clamps its input and output to bounds stored beside its weight."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    text_hidden_size: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False
    standardize: bool = False

    def __post_init__(self):
        if self.head_dim % 4 or self.num_heads % self.num_kv_heads:
            raise JaxtuneError(f"Gemma 4 vision_config: head_dim {self.head_dim} must be a multiple of 4 (x and y "
                               f"rotate half each) and num_attention_heads {self.num_heads} a multiple of "
                               f"num_key_value_heads {self.num_kv_heads}")


def vision_config_from_hf(hf: dict, text_hidden_size: int, where: str = "config.json") -> Gemma4VisionConfig:
    """The `vision_config` of a Gemma4ForConditionalGeneration config.json; what jaxtune does not compute (another
    activation or RoPE, attention biases) is refused in one line."""
    v = hf.get("vision_config")
    if not v:
        raise JaxtuneError(f"{where}: Gemma4ForConditionalGeneration without a vision_config (no image side)")
    rope = v.get("rope_parameters") or {}
    for key, value, known in (
            ("hidden_activation", v.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
            ("rope_parameters.rope_type", rope.get("rope_type", "axial"), "axial"),
            ("attention_bias", bool(v.get("attention_bias")), False)):
        if value != known:
            raise JaxtuneError(f"{where}: vision_config {key} {value!r} (jaxtune computes {known!r})")
    names = dict(hidden_size="hidden_size", intermediate_size="intermediate_size", num_layers="num_hidden_layers",
                 num_heads="num_attention_heads", num_kv_heads="num_key_value_heads", head_dim="head_dim",
                 patch_size="patch_size", pooling_kernel_size="pooling_kernel_size",
                 position_embedding_size="position_embedding_size", rms_norm_eps="rms_norm_eps",
                 use_clipped_linears="use_clipped_linears", standardize="standardize")
    values = {ours: v[theirs] for ours, theirs in names.items() if v.get(theirs) is not None}
    values.setdefault("num_kv_heads", values.get("num_heads", 12))
    missing = [names[k] for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim")
               if k not in values]
    if missing:
        raise JaxtuneError(f"{where}: vision_config has no {', '.join(missing)}")
    return Gemma4VisionConfig(**values, rope_theta=float(rope.get("rope_theta", 100.0)),
                              text_hidden_size=text_hidden_size)


def abstract_params(cfg: Gemma4VisionConfig, dtype=jnp.float32) -> dict:
    """The image side's tree as `ShapeDtypeStruct`s, kernels [in, out], layers stacked on a leading [L] axis:
    input_proj [3 p², D], position_embedding_table [2, positions, D], layers' norms [L, D] (q_norm, k_norm [L, hd]),
    linears {"kernel", "clip" [L, 4] if clipped}, std_bias / std_scale [D] if standardised, embedding_projection
    [D, text D]."""
    D, F, L, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    sizes = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D), "gate_proj": (D, F),
             "up_proj": (D, F), "down_proj": (F, D)}
    layers: dict = {name: {"kernel": s(L, *io), **({"clip": s(L, 4)} if cfg.use_clipped_linears else {})}
                    for name, io in sizes.items()}
    layers.update({name: s(L, hd if name in ("q_norm", "k_norm") else D) for name in NORMS})
    tree = {"input_proj": s(3 * cfg.patch_size**2, D), "position_embedding_table": s(2, cfg.position_embedding_size, D),
            "layers": layers, "embedding_projection": s(D, cfg.text_hidden_size)}
    if cfg.standardize:
        tree.update(std_bias=s(D), std_scale=s(D))
    return tree


def _hf_name(keys: tuple[str, ...], layer: int | None) -> tuple[str, bool]:
    """(canonical name, stored as a kernel [out, in]) of a leaf at `keys` (layer i of a stacked one)."""
    if keys[0] == "layers":
        at = f"{TOWER}encoder.layers.{layer}."
        if keys[1] in NORMS:
            return f"{at}{NORMS[keys[1]]}.weight", False
        return f"{at}{LINEARS[keys[1]]}.linear.weight", True
    return {"input_proj": (f"{TOWER}patch_embedder.input_proj.weight", True),
            "position_embedding_table": (f"{TOWER}patch_embedder.position_embedding_table", False),
            "std_bias": (f"{TOWER}std_bias", False), "std_scale": (f"{TOWER}std_scale", False),
            "embedding_projection": (f"{EMBEDDER}embedding_projection.weight", True)}[keys[0]]


def read_params(directory: str | Path, cfg: Gemma4VisionConfig, dtype=None) -> dict:
    """The image side of a Gemma 4 checkpoint (`abstract_params`' tree, in the stored dtype or `dtype`), each
    tensor's name and shape checked against the config."""
    abstract = abstract_params(cfg)
    with CheckpointReader(directory, canonical_name) as reader:
        def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in reader:
                raise JaxtuneError(f"{directory}: no tensor {name} (the Gemma 4 vision side its config.json names)")
            if tuple(reader.shape(name)) != shape:
                raise JaxtuneError(f"{reader.file_of(name)}: tensor {reader.stored_name(name)} has shape "
                                   f"{tuple(reader.shape(name))}, expected {shape}")
            return reader.read(name)

        def one_layer(keys: tuple[str, ...], shape: tuple[int, ...], layer: int | None) -> np.ndarray:
            if keys[-1] == "clip":  # four scalar buffers beside the linear's weight
                weight = _hf_name(keys[:-1] + ("kernel",), layer)[0]
                return np.stack([tensor(weight.replace("linear.weight", bound), ()) for bound in CLIP_BOUNDS])
            name, kernel = _hf_name(keys, layer)
            return tensor(name, shape[::-1]).T if kernel else tensor(name, shape)

        def leaf(path, spec) -> jax.Array:
            keys = tuple(k.key for k in path)
            stacked = keys[0] == "layers"
            shape = spec.shape[1:] if stacked else spec.shape
            value = (np.stack([one_layer(keys, shape, i) for i in range(cfg.num_layers)]) if stacked
                     else one_layer(keys, shape, None))
            return jnp.asarray(value, dtype or value.dtype)

        return jax.tree_util.tree_map_with_path(leaf, abstract)


def tensor_entries(params: dict, cfg: Gemma4VisionConfig, dtype=None) -> list[tuple]:
    """(canonical name, torch shape, dtype, produce) of every image-side tensor for `io.safetensors.write_weights`
    (the inverse of `read_params`), each gathered to the host as it is written."""
    entries: list[tuple] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        out = np.dtype(dtype or leaf.dtype)
        for layer in range(cfg.num_layers) if keys[0] == "layers" else [None]:
            if keys[-1] == "clip":
                for b, bound in enumerate(CLIP_BOUNDS):
                    name = _hf_name(keys[:-1] + ("kernel",), layer)[0].replace("linear.weight", bound)
                    entries.append((name, (), out, lambda leaf=leaf, layer=layer, b=b, out=out: np.asarray(
                        host_array(leaf[layer, b]), out)))
                continue
            name, kernel = _hf_name(keys, layer)
            one = leaf.shape[1:] if layer is not None else leaf.shape
            shape = tuple(one[::-1]) if kernel else tuple(one)

            def produce(leaf=leaf, layer=layer, kernel=kernel, out=out):
                value = host_array(leaf) if layer is None else host_array(leaf[layer])
                return np.ascontiguousarray(value.T if kernel else value).astype(out)

            entries.append((name, shape, out, produce))
    return entries


def rms(x: jax.Array, eps: float, weight: jax.Array | None = None) -> jax.Array:
    """Gemma 4's RMSNorm: x (mean(x²) + eps)^-1/2 (x weight) in float32, then x's dtype."""
    x32 = x.astype(wide(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(y.dtype)).astype(x.dtype)


def linear(x: jax.Array, module: dict) -> jax.Array:
    """x @ kernel [in, out], input and output clamped to the module's `clip` bounds when it has them."""
    if "clip" in module:
        x = jnp.clip(x, module["clip"][0].astype(x.dtype), module["clip"][1].astype(x.dtype))
    y = x @ module["kernel"].astype(x.dtype)
    return jnp.clip(y, module["clip"][2].astype(y.dtype), module["clip"][3].astype(y.dtype)) if "clip" in module else y


def rotate(x_NxPxHxh: jax.Array, positions_NxPx2: jax.Array, theta: float) -> jax.Array:
    """2D RoPE: the first half of each head rotated by the patch's x, the second by its y (rotate-half pairs within
    each half; `apply_multidimensional_rope`), frequencies theta^(-4i/hd)."""
    hd = x_NxPxHxh.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd // 2, 2, dtype=jnp.float32) / (hd // 2))
    out = []
    for axis, part in enumerate(jnp.split(x_NxPxHxh, 2, axis=-1)):
        angles = positions_NxPx2[..., axis, None].astype(jnp.float32) * inv_freq  # [N, P, hd/4]
        cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, :, None].astype(part.dtype) for f in (jnp.cos, jnp.sin))
        first, second = jnp.split(part, 2, axis=-1)
        out.append(part * cos + jnp.concatenate([-second, first], -1) * sin)
    return jnp.concatenate(out, -1)


def encoder_layer(x_NxPxD: jax.Array, layer: dict, positions_NxPx2: jax.Array, mask, live_QxC: jax.Array,
                  cfg: Gemma4VisionConfig) -> jax.Array:
    """x + post_norm(attention(norm(x))), then + post_norm(mlp(norm(x))): Gemma4VisionEncoderLayer."""
    N, P, _ = x_NxPxD.shape
    H, K, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    h = rms(x_NxPxD, eps, layer["input_layernorm"])
    q = rotate(rms(linear(h, layer["q_proj"]).reshape(N, P, H, hd), eps, layer["q_norm"]), positions_NxPx2,
               cfg.rope_theta)
    k = rotate(rms(linear(h, layer["k_proj"]).reshape(N, P, K, hd), eps, layer["k_norm"]), positions_NxPx2,
               cfg.rope_theta)
    v = rms(linear(h, layer["v_proj"]).reshape(N, P, K, hd), eps)
    q_NxKxGxPxh = jnp.transpose(q.reshape(N, P, K, H // K, hd), (0, 2, 3, 1, 4))
    attended = blockwise_attention(q_NxKxGxPxh, jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3)), mask,
                                   0, live_QxC, scale=1.0)
    attended_NxPxHh = jnp.transpose(attended, (0, 3, 1, 2, 4)).reshape(N, P, H * hd)
    x_NxPxD = x_NxPxD + rms(linear(attended_NxPxHh, layer["o_proj"]), eps, layer["post_attention_layernorm"])
    h = rms(x_NxPxD, eps, layer["pre_feedforward_layernorm"])
    gate = linear(h, layer["gate_proj"])
    h = jax.nn.gelu(gate.astype(wide(gate.dtype)), approximate=True).astype(gate.dtype) * linear(h, layer["up_proj"])
    return x_NxPxD + rms(linear(h, layer["down_proj"]), eps, layer["post_feedforward_layernorm"])


def soft_tokens(params: dict, pixels_NxPxK: jax.Array, cfg: Gemma4VisionConfig, dtype=jnp.float32) -> jax.Array:
    """The text-width soft tokens [N, P / k², text D] of N images, each [P, 2 + 3 p²]: its patches' (x, y) in columns
    0, 1 (-1 for padding) then their values in [0, 1]. An image of n real patches has its n / k² tokens first (pool
    windows in row order), then padding's."""
    positions_NxPx2 = jnp.round(pixels_NxPxK[..., :2]).astype(jnp.int32)
    padding_NxP = jnp.all(positions_NxPx2 == -1, axis=-1)
    N, P, _ = pixels_NxPxK.shape
    x = (2 * (pixels_NxPxK[..., 2:] - 0.5)).astype(dtype) @ params["input_proj"].astype(dtype)
    at = jnp.maximum(positions_NxPx2, 0)
    table = params["position_embedding_table"].astype(dtype)
    x_NxPxD = x + jnp.where(padding_NxP[..., None], 0, table[0][at[..., 0]] + table[1][at[..., 1]])
    mask = training_mask(N, P, 0, ~padding_NxP, None, span_ids_BxT=jnp.zeros((N, P), jnp.int32))  # real keys, all
    live_QxC = live_blocks(mask, P, P)
    x_NxPxD, _ = jax.lax.scan(lambda x, layer: (encoder_layer(x, layer, positions_NxPx2, mask, live_QxC, cfg), None),
                              x_NxPxD, params["layers"])
    k = cfg.pooling_kernel_size
    width = jnp.max(at[..., 0], axis=1, keepdims=True) + 1  # each image's patches a row
    window_NxP = at[..., 0] // k + width // k * (at[..., 1] // k)
    hidden = jnp.where(padding_NxP[..., None], 0, x_NxPxD).astype(jnp.float32)
    weights_NxPxS = jax.nn.one_hot(window_NxP, P // k**2, dtype=jnp.float32) / k**2
    pooled_NxSxD = jnp.einsum("nps,npd->nsd", weights_NxPxS, hidden) * cfg.hidden_size**0.5
    if cfg.standardize:
        pooled_NxSxD = (pooled_NxSxD - params["std_bias"].astype(jnp.float32)) * params["std_scale"].astype(
            jnp.float32)
    embedded = rms(pooled_NxSxD.astype(dtype), cfg.rms_norm_eps)
    return embedded @ params["embedding_projection"].astype(dtype)
