"""Llama 4's image side (transformers' `Llama4VisionModel` and `Llama4MultiModalProjector`) as pure functions:
`tile_soft_tokens` (tiles [N, C, S, S] -> [N, K, D_text]): the unfold patch embedding (a reshape and one matmul), a
class embedding appended, learned positions, LayerNorm, encoder layers (2D rotary over the patch grid, the class token
unrotated; bidirectional attention through the decoder's blockwise kernel, each tile one span; exact-GELU MLP)
stacked and scanned, LayerNorm, the class token dropped, the pixel shuffle (2 x 2 patches into one), the adapter MLP
and the projector. The tree keeps transformers' module names under `vision_model.` (`param_specs`, `read_params`,
`tensor_entries`); its LayerNorms take torch's default epsilon, as transformers' `nn.LayerNorm`s do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.models.attention import blockwise_attention, live_blocks, training_mask
from jaxtune.models.hf_config import model_dir
from jaxtune.models.hf_weights import host_array
from jaxtune.models.params import ParamSpec
from jaxtune.models.vision.siglip import layer_norm, linear, patches

LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default: transformers' Llama 4 tower passes no eps
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.fc1", "mlp.fc2")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True, kw_only=True)
class Llama4VisionConfig:
    """`config.json`'s `vision_config` and image token ids of a `Llama4ForConditionalGeneration`: tiles of
    `image_size` pixels in `patch_size` patches, `pixel_shuffle_ratio` (0.5: 2 x 2 patches a soft token), the adapter
    MLP [intermediate_size -> projector_input_dim -> projector_output_dim], the projector to `text_hidden_size`;
    `image_token_id` the `<|patch|>` placeholder, `boi_token_id`/`eoi_token_id` `<|image_start|>`/`<|image_end|>`."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int
    rope_theta: float = 10_000.0
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tokens_per_tile(self) -> int:
        """Soft tokens a tile puts in the text: its patches over the shuffle's 1 / ratio² (transformers' processor)."""
        return self.patches_per_side**2 // round(1 / self.pixel_shuffle_ratio**2)


def vision_config_from_hf(hf: dict, where: str = "config.json") -> Llama4VisionConfig:
    """The image side of a `Llama4ForConditionalGeneration` config dict; errors name `where` and the key."""
    vision, text = hf.get("vision_config") or {}, hf.get("text_config") or {}
    try:
        rope = vision.get("rope_parameters") or {}
        cfg = Llama4VisionConfig(
            hidden_size=int(vision["hidden_size"]), num_layers=int(vision["num_hidden_layers"]),
            num_heads=int(vision["num_attention_heads"]), intermediate_size=int(vision["intermediate_size"]),
            image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
            num_channels=int(vision.get("num_channels", 3)),
            pixel_shuffle_ratio=float(vision.get("pixel_shuffle_ratio", 0.5)),
            projector_input_dim=int(vision["projector_input_dim"]),
            projector_output_dim=int(vision["projector_output_dim"]),
            vision_output_dim=int(vision["vision_output_dim"]),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10_000.0))),
            text_hidden_size=int(text["hidden_size"]),
            image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 200_092))),
            boi_token_id=int(hf.get("boi_token_index", 200_080)), eoi_token_id=int(hf.get("eoi_token_index", 200_081)))
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    shuffled = cfg.hidden_size * round(1 / cfg.pixel_shuffle_ratio**2)
    if shuffled != cfg.intermediate_size:
        raise JaxtuneError(f"{where}: vision_config intermediate_size {cfg.intermediate_size}: the pixel shuffle "
                           f"gives {shuffled} values a soft token (hidden_size / pixel_shuffle_ratio²)")
    return cfg


def read_config(directory: str | Path) -> Llama4VisionConfig:
    path = model_dir(directory) / "config.json"
    return vision_config_from_hf(read_json(path), str(path))


def param_specs(cfg: Llama4VisionConfig) -> dict:
    """The image side's tree as `ParamSpec`s, replicated, by transformers' names: kernels [in, out], the encoder's
    layers stacked [L, ...], the unfold's linear [C p p, Dv]."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size

    def spec(*shape, init: str = "normal") -> ParamSpec:
        return ParamSpec(shape, (None,) * len(shape), init)

    def dense(d_in: int, d_out: int, *layers: int) -> dict:
        return {"kernel": spec(*layers, d_in, d_out), "bias": spec(*layers, d_out, init="zeros")}

    norm = lambda *layers: {"weight": spec(*layers, D, init="ones"), "bias": spec(*layers, D, init="zeros")}  # noqa
    sizes = {"mlp.fc1": (D, F), "mlp.fc2": (F, D)}
    layers = {name: dense(*sizes.get(name, (D, D)), L) for name in LAYER_LINEARS} | {n: norm(L) for n in LAYER_NORMS}
    return {"patch_embedding.linear": {"kernel": spec(cfg.num_channels * cfg.patch_size**2, D)},
            "class_embedding": spec(D), "positional_embedding_vlm": spec(cfg.patches_per_side**2 + 1, D),
            "layernorm_pre": norm(), "layernorm_post": norm(), "layers": layers,
            "vision_adapter.mlp.fc1": {"kernel": spec(F, cfg.projector_input_dim)},
            "vision_adapter.mlp.fc2": {"kernel": spec(cfg.projector_output_dim, cfg.projector_output_dim)},
            "multi_modal_projector.linear_1": {"kernel": spec(cfg.vision_output_dim, cfg.text_hidden_size)}}


def tensor_name(keys: tuple[str, ...], layer: int | None) -> str:
    """The checkpoint name of leaf `keys` (of a stacked leaf, of one `layer`)."""
    part = {"kernel": "weight", "weight": "weight", "bias": "bias"}
    module, leaf = (keys[:-1], part[keys[-1]]) if keys[-1] in part else (keys, "")
    if module[0] == "layers":
        module = (f"model.layers.{layer}", *module[1:])
    name = ".".join((*module, leaf)) if leaf else ".".join(module)
    return name if name.startswith("multi_modal_projector.") else f"vision_model.{name}"


def read_params(directory: str | Path, cfg: Llama4VisionConfig, dtype) -> dict:
    """The image side's weights (`param_specs`' tree) in `dtype`, each tensor's name and shape checked."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    with CheckpointReader(model_dir(directory)) as reader:
        def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in reader:
                raise JaxtuneError(f"{directory}: tensor {name} is missing from the checkpoint")
            if reader.shape(name) != shape:
                raise JaxtuneError(f"{reader.file_of(name)}: tensor {name} has shape {reader.shape(name)}, "
                                   f"expected {shape}")
            return reader.read(name)

        def leaf(path, spec: ParamSpec) -> jax.Array:
            keys = tuple(k.key for k in path)
            kernel, stacked = keys[-1] == "kernel", keys[0] == "layers"
            shape = spec.shape[1:] if stacked else spec.shape
            layout = (lambda a: a.T) if kernel else (lambda a: a)
            read = lambda i: layout(tensor(tensor_name(keys, i), shape[::-1] if kernel else shape))  # noqa: E731
            value = np.stack([read(i) for i in range(cfg.num_layers)]) if stacked else read(None)
            return jnp.asarray(value, dtype)

        return jax.tree.unflatten(treedef, [leaf(path, spec) for path, spec in flat])


def tensor_entries(params: dict, cfg: Llama4VisionConfig, dtype=None) -> list[tuple]:
    """(checkpoint name, torch shape, dtype, produce) of every image-side tensor, for `io.safetensors.write_weights`
    (the inverse of `read_params`)."""
    entries: list[tuple] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        kernel, stacked = keys[-1] == "kernel", keys[0] == "layers"
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        shape = shape[::-1] if kernel else shape
        out = np.dtype(dtype or leaf.dtype)
        for layer in range(cfg.num_layers) if stacked else [None]:
            def produce(leaf=leaf, layer=layer, kernel=kernel, out=out):
                value = host_array(leaf) if layer is None else host_array(leaf[layer])
                return np.ascontiguousarray(value.T if kernel else value).astype(out)

            entries.append((tensor_name(keys, layer), shape, out, produce))
    return entries


def rotary_angles(cfg: Llama4VisionConfig) -> jax.Array:
    """[P + 1, head_dim / 2] the angle of each rotated pair (2i, 2i + 1) of each token (`Llama4VisionRotaryEmbedding`):
    the first half of the pairs turn with the patch's column + 1, the second with its row + 1, the class token
    (last) not at all."""
    side, hd = cfg.patches_per_side, cfg.head_dim
    freq_dim = hd // 2
    inverse = 1.0 / (cfg.rope_theta ** (np.arange(0, freq_dim, 2)[:freq_dim // 2].astype(np.float32) / freq_dim))
    index = np.arange(side**2)
    angles = np.concatenate([(index % side + 1).astype(np.float32)[:, None] * inverse,
                             (index // side + 1).astype(np.float32)[:, None] * inverse], -1)
    return jnp.asarray(np.concatenate([angles, np.zeros((1, angles.shape[1]), np.float32)]))


def rotate_pairs(x_NxPxHxh: jax.Array, angles_Pxh: jax.Array) -> jax.Array:
    """Each adjacent pair (x[2i], x[2i+1]) turned by its angle (a complex product), in float32."""
    x = x_NxPxHxh.astype(jnp.float32).reshape(*x_NxPxHxh.shape[:-1], -1, 2)
    cos, sin = jnp.cos(angles_Pxh)[:, None], jnp.sin(angles_Pxh)[:, None]
    turned = jnp.stack([x[..., 0] * cos - x[..., 1] * sin, x[..., 0] * sin + x[..., 1] * cos], -1)
    return turned.reshape(x_NxPxHxh.shape).astype(x_NxPxHxh.dtype)


def encoder_layer(x_NxPxD: jax.Array, layer: dict, angles_Pxh: jax.Array, mask, live_QxC, cfg: Llama4VisionConfig
                  ) -> jax.Array:
    """x + o(attn(rotary(q, k), v)) of LN(x), then + fc2(gelu(fc1(LN(x)))): each tile's tokens see each other."""
    N, P, D = x_NxPxD.shape
    H, hd = cfg.num_heads, cfg.head_dim
    h = layer_norm(x_NxPxD, layer["input_layernorm"], LAYER_NORM_EPS)
    q, k, v = (linear(h, layer[f"self_attn.{n}_proj"]).reshape(N, P, H, hd) for n in "qkv")
    q, k = rotate_pairs(q, angles_Pxh), rotate_pairs(k, angles_Pxh)
    q, k, v = (jnp.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))
    attended_NxHx1xPxh = blockwise_attention(q[:, :, None], k, v, mask, 0, live_QxC, scale=hd**-0.5)
    attended = jnp.transpose(attended_NxHx1xPxh[:, :, 0], (0, 2, 1, 3)).reshape(N, P, D)
    x_NxPxD = x_NxPxD + linear(attended, layer["self_attn.o_proj"])
    h = jax.nn.gelu(linear(layer_norm(x_NxPxD, layer["post_attention_layernorm"], LAYER_NORM_EPS), layer["mlp.fc1"]),
                    approximate=False)
    return x_NxPxD + linear(h, layer["mlp.fc2"])


def pixel_shuffle(x_NxPxD: jax.Array, ratio: float) -> jax.Array:
    """[N, P ratio², D / ratio²]: transformers' `pixel_shuffle`, neighbouring columns then rows folded into the
    channels (its views and permutes, in its order)."""
    N, P, D = x_NxPxD.shape
    side = int(round(P**0.5))
    x = x_NxPxD.reshape(N, side, int(side * ratio), int(D / ratio))
    x = jnp.transpose(x, (0, 2, 1, 3)).reshape(N, int(side * ratio), int(side * ratio), int(D / ratio**2))
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(N, -1, x.shape[-1])


def tile_soft_tokens(vision_params: dict, tiles_NxCxSxS: jax.Array, cfg: Llama4VisionConfig, dtype=jnp.float32
                     ) -> jax.Array:
    """[N, tokens_per_tile, D_text] in `dtype`: what N preprocessed tiles put in the text."""
    x_NxPxK = patches(tiles_NxCxSxS.astype(dtype), cfg.patch_size)
    x_NxPxD = x_NxPxK @ vision_params["patch_embedding.linear"]["kernel"].astype(dtype)
    N, P, D = x_NxPxD.shape
    cls = jnp.broadcast_to(vision_params["class_embedding"].astype(dtype), (N, 1, D))
    x_NxPxD = jnp.concatenate([x_NxPxD, cls], 1) + vision_params["positional_embedding_vlm"].astype(dtype)
    x_NxPxD = layer_norm(x_NxPxD, vision_params["layernorm_pre"], LAYER_NORM_EPS)
    mask = training_mask(N, P + 1, 0, None, None, span_ids_BxT=jnp.zeros((N, P + 1), jnp.int32))  # all see all
    live_QxC, angles = live_blocks(mask, P + 1, P + 1), rotary_angles(cfg)
    x_NxPxD, _ = jax.lax.scan(lambda x, layer: (encoder_layer(x, layer, angles, mask, live_QxC, cfg), None), x_NxPxD,
                              vision_params["layers"])
    x_NxPxD = layer_norm(x_NxPxD, vision_params["layernorm_post"], LAYER_NORM_EPS)[:, :-1]  # the class token dropped
    h = pixel_shuffle(x_NxPxD, cfg.pixel_shuffle_ratio)
    h = jax.nn.gelu(h @ vision_params["vision_adapter.mlp.fc1"]["kernel"].astype(dtype), approximate=False)
    h = jax.nn.gelu(h @ vision_params["vision_adapter.mlp.fc2"]["kernel"].astype(dtype), approximate=False)
    return h @ vision_params["multi_modal_projector.linear_1"]["kernel"].astype(dtype)
