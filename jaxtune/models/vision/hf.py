"""A Gemma 3 checkpoint's image side: `config.json`'s `vision_config` and image tokens -> `VisionLanguageConfig`
(`vision_config_from_hf`, `load_vision_config`), its tree declared (`vision_param_specs`) and read from the
safetensors (`read_vision_params`; names as `hf_weights.canonical_name` gives them: `vision_tower.*`,
`multi_modal_projector.*`, whichever layout transformers saved), and written back (`vision_tensor_entries`). Kernels
are [in, out]; the convolution's [Dv, C, p, p] is a matmul's [C p p, Dv]. The tower is small: read whole, replicated."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import SiglipConfig, VisionLanguageConfig
from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.models.hf_config import COMPOSITE_TEXT_DEFAULTS, model_dir
from jaxtune.models.hf_weights import canonical_name, host_array
from jaxtune.models.params import ParamSpec

VISION_LANGUAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
LAYER_NORMS = ("layer_norm1", "layer_norm2")
# transformers' `SiglipVisionConfig` defaults, on which a released `vision_config` may rely
SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, layer_norm_eps=1e-6)


def vision_config_from_hf(hf: dict, where: str = "config.json") -> VisionLanguageConfig:
    """The image side of a Gemma 3 vision-language config dict; `where` names the file in errors."""
    archs = hf.get("architectures") or []
    if not set(archs) & set(VISION_LANGUAGE_ARCHITECTURES):
        raise JaxtuneError(f"{where}: no vision tower jaxtune computes (architectures {', '.join(archs) or 'none'}; "
                           f"supported: {', '.join(VISION_LANGUAGE_ARCHITECTURES)})")
    arch = next(a for a in archs if a in VISION_LANGUAGE_ARCHITECTURES)
    vision = {**SIGLIP_DEFAULTS, **(hf.get("vision_config") or {})}  # a pooling head, if any, is left: Gemma 3's
    text = {**COMPOSITE_TEXT_DEFAULTS[arch], **(hf.get("text_config") or {})}  # projector reads the patches
    try:
        tower = SiglipConfig(
            hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
            image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
            num_channels=int(vision["num_channels"]), layer_norm_eps=float(vision["layer_norm_eps"]))
        return VisionLanguageConfig(
            tower=tower, text_hidden_size=int(text["hidden_size"]),
            tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
            image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262_144))),
            boi_token_id=hf.get("boi_token_index", 255_999), eoi_token_id=hf.get("eoi_token_index", 256_000))
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise JaxtuneError(f"{where}: {e}") from None


def load_vision_config(path: str | Path) -> VisionLanguageConfig:
    """`VisionLanguageConfig` of the Hugging Face model directory `path`."""
    path = model_dir(path) / "config.json"
    return vision_config_from_hf(read_json(path), str(path))


def vision_param_specs(cfg: VisionLanguageConfig) -> dict:
    """The image side's tree as `ParamSpec`s: `vision_tower` (`patch_embedding`, `position_embedding` [P, Dv],
    `layers` stacked [L, ...] by transformers' module names, `post_layernorm`) and `multi_modal_projector`
    (`mm_soft_emb_norm` [Dv], `mm_input_projection` [Dv, D])."""
    t = cfg.tower
    L, D, F, K = t.num_layers, t.hidden_size, t.intermediate_size, t.num_channels * t.patch_size**2

    def linear(d_in: int, d_out: int, layers: tuple[int, ...] = ()) -> dict:
        axes = (None,) * len(layers)
        return {"kernel": ParamSpec((*layers, d_in, d_out), (*axes, None, None)),
                "bias": ParamSpec((*layers, d_out), (*axes, None), "zeros")}

    def norm(layers: tuple[int, ...] = ()) -> dict:
        axes = (None,) * (len(layers) + 1)
        return {"weight": ParamSpec((*layers, D), axes, "ones"), "bias": ParamSpec((*layers, D), axes, "zeros")}

    sizes = {"mlp.fc1": (D, F), "mlp.fc2": (F, D)}
    layers = {name: linear(*sizes.get(name, (D, D)), (L,)) for name in LAYER_LINEARS}
    layers.update({name: norm((L,)) for name in LAYER_NORMS})
    tower = {"patch_embedding": linear(K, D), "position_embedding": ParamSpec((t.patches_per_side**2, D), (None, None)),
             "layers": layers, "post_layernorm": norm()}
    projector = {"mm_soft_emb_norm": ParamSpec((D,), (None,), "zeros"),
                 "mm_input_projection": ParamSpec((D, cfg.text_hidden_size), (None, None))}
    return {"vision_tower": tower, "multi_modal_projector": projector}


def vision_tensor_name(path: tuple[str, ...], layer: int | None) -> str:
    """The canonical checkpoint name of leaf `path` (of a stacked leaf, of one `layer`)."""
    if path == ("multi_modal_projector", "mm_input_projection"):
        return "multi_modal_projector.mm_input_projection_weight"
    if path == ("multi_modal_projector", "mm_soft_emb_norm"):
        return "multi_modal_projector.mm_soft_emb_norm.weight"
    part = "weight" if path[-1] == "kernel" else path[-1]
    if path[1] == "layers":
        return f"vision_tower.encoder.layers.{layer}.{path[2]}.{part}"
    if path[1] == "post_layernorm":
        return f"vision_tower.post_layernorm.{part}"
    return f"vision_tower.embeddings.{path[1]}.{'weight' if path[1] == 'position_embedding' else part}"


def _stored_layout(spec: ParamSpec, path: tuple[str, ...], stacked: bool) -> tuple[int, ...]:
    """The shape a leaf's tensor has in the checkpoint (one layer's, for a stacked leaf)."""
    shape = spec.shape[1:] if stacked else spec.shape
    if path[-1] != "kernel":
        return shape
    return shape[::-1]


def read_vision_params(directory: str | Path, cfg: VisionLanguageConfig, dtype=jnp.float32) -> dict:
    """The image side's weights of `directory` in `dtype` (on the default device), every tensor's name and shape
    checked first."""
    specs = vision_param_specs(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    t = cfg.tower
    with CheckpointReader(model_dir(directory), canonical_name) as reader:
        def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in reader:
                raise JaxtuneError(f"{directory}: tensor {name} is missing from the checkpoint")
            stored = reader.shape(name)
            if name.endswith("patch_embedding.weight"):  # the convolution's [Dv, C, p, p]
                shape = (t.hidden_size, t.num_channels, t.patch_size, t.patch_size)
            if stored != shape:
                raise JaxtuneError(f"{reader.file_of(name)}: tensor {reader.stored_name(name)} has shape {stored}, "
                                   f"expected {shape}")
            value = reader.read(name)
            return value.reshape(value.shape[0], -1).T if value.ndim == 4 else value

        def leaf(path, spec: ParamSpec) -> jax.Array:
            keys = tuple(k.key for k in path)
            stacked = keys[1] == "layers"
            shape = _stored_layout(spec, keys, stacked)
            kernel = keys[-1] == "kernel" and keys[1] != "patch_embedding"
            read = lambda i: tensor(vision_tensor_name(keys, i), shape)  # noqa: E731
            layout = lambda a: a.T if kernel else a  # noqa: E731
            value = (np.stack([layout(read(i)) for i in range(t.num_layers)]) if stacked else layout(read(None)))
            return jnp.asarray(value, dtype)

        return jax.tree.unflatten(treedef, [leaf(path, spec) for path, spec in flat])


def vision_tensor_entries(vision_params: dict, cfg: VisionLanguageConfig, dtype=None) -> list[tuple]:
    """(canonical name, torch shape, dtype, produce) of every image-side tensor, for `io.safetensors.write_weights`:
    kernels [in, out] back to [out, in], the patch embedding's [C p p, Dv] back to the convolution's [Dv, C, p, p],
    a stacked leaf one tensor a layer, each gathered to the host as it is written."""
    t = cfg.tower
    conv = (t.hidden_size, t.num_channels, t.patch_size, t.patch_size)
    entries: list[tuple] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(vision_params)[0]:
        keys = tuple(k.key for k in path)
        out = np.dtype(dtype or leaf.dtype)
        stacked = keys[1] == "layers"
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        if keys[-1] == "kernel":
            shape = conv if keys[1] == "patch_embedding" else shape[::-1]
        for layer in range(leaf.shape[0]) if stacked else [None]:
            def produce(leaf=leaf, layer=layer, shape=shape, kernel=keys[-1] == "kernel", out=out):
                value = host_array(leaf) if layer is None else host_array(leaf[layer])
                return np.ascontiguousarray((value.T if kernel else value).reshape(shape)).astype(out)

            entries.append((vision_tensor_name(keys, layer), shape, out, produce))
    return entries
