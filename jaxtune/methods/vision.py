"""Training a vision-language model's image side (`[method] vision_modules`), for any vision family: the parts it
names (`VisionPart`s of the family unit) train, the rest stays frozen (the default: none named). With LoRA a part's
linear modules get `lora_a` [..., in, r] / `lora_b` [..., r, out] beside their kernels (PEFT's init and rank and
alpha patterns on their transformers paths) and a part without linear modules (a projector) trains whole, as PEFT's
`modules_to_save`; `kind = "full"` trains every leaf of the parts. The towers run them through
`models.vision.tower_linear`. `peft_vision` gives the adapter's tensors and PEFT config keys, so
`PeftModel.from_pretrained` on transformers' model reads it (jaxtune does not read such an adapter back yet)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import MethodConfig
from jaxtune.errors import ConfigError
from jaxtune.methods.lora.layout import pattern_value
from jaxtune.methods.lora.options import LoRAConfig
from jaxtune.models.vision.families import FAMILIES
from jaxtune.models.vision.family import VisionFamily, VisionPart

LORA_LEAVES = ("lora_a", "lora_b")


def trained_parts(method: MethodConfig | None, family: VisionFamily) -> tuple[VisionPart, ...]:
    """The parts of `family`'s image side `method` trains; a name that reaches none is a one-line ConfigError."""
    names = getattr(method, "vision_modules", ())
    if names and not family.parts:
        raise ConfigError("vision_modules", names[0], f"{family.architectures[0]}'s image side does not train yet: "
                          "leave vision_modules empty (the tower and projector frozen)")
    for name in names:
        if name not in family.parts:
            raise ConfigError("vision_modules", name, f"reaches nothing in {family.architectures[0]}: its image "
                              f"side's parts are {', '.join(family.parts)}")
    return tuple(family.parts[name] for name in names)


def _adapted(method: MethodConfig | None, family: VisionFamily) -> list[tuple[tuple[str, ...], str]]:
    """(dict path, transformers path) of every linear module LoRA adapts, in the parts' order."""
    if not isinstance(method, LoRAConfig):
        return []
    return [(path, hf) for part in trained_parts(method, family) for path, hf in part.linears.items()]


def _get(tree: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def _with(tree: dict, path: tuple[str, ...], module: dict) -> dict:
    """`tree` with the module at `path` replaced (a new dict along the path; the rest shared)."""
    if not path:
        return module
    return {**tree, path[0]: _with(tree[path[0]], path[1:], module)}


def lora_of(method: LoRAConfig, hf_path: str, layers: int) -> tuple[int, float]:
    """(rank, scale) of the module at `hf_path` (`{i}` its layer, of `layers`): rank_pattern and alpha_pattern as
    PEFT matches them, which must give every layer the same (the layers are one stacked leaf)."""
    values = {(int(pattern_value(method.rank_pattern, hf_path.format(i=i), method.rank)),
               float(pattern_value(method.alpha_pattern, hf_path.format(i=i), method.alpha))) for i in range(layers)}
    if len(values) > 1:
        raise ConfigError("rank_pattern", dict(method.rank_pattern), f"gives {hf_path} different ranks or alphas in "
                          "different layers (the image side's LoRA has one rank and alpha a module)")
    rank, alpha = values.pop()
    return rank, alpha / (math.sqrt(rank) if method.rslora else rank)


def _layers(module: dict) -> int:
    return math.prod(module["kernel"].shape[:-2])


def add_vision_leaves(vision: dict, method: MethodConfig | None, family: VisionFamily, key: jax.Array) -> dict:
    """The image-side tree with LoRA's leaves on the linear modules of the parts `method` adapts: `lora_a`
    [..., in, r] kaiming-uniform (bound 1 / sqrt(in), PEFT's), `lora_b` [..., r, out] zeros, float32. Traceable."""
    for n, (path, hf) in enumerate(_adapted(method, family)):
        assert isinstance(method, LoRAConfig)  # `_adapted` holds modules of LoRA methods alone
        module = _get(vision, path)
        *lead, d_in, d_out = module["kernel"].shape
        rank, _ = lora_of(method, hf, _layers(module))
        bound = 1 / math.sqrt(d_in)
        lora_a = jax.random.uniform(jax.random.fold_in(key, n), (*lead, d_in, rank), jnp.float32, -bound, bound)
        vision = _with(vision, path, {**module, "lora_a": lora_a, "lora_b": jnp.zeros((*lead, rank, d_out))})
    return vision


def vision_mask(vision: dict, method: MethodConfig | None, family: VisionFamily) -> dict:
    """True at the image side's leaves the optimiser updates: every float leaf of a trained part under
    `kind = "full"`; with LoRA, the adapted parts' LoRA leaves and every leaf of a part without linear modules."""
    parts = trained_parts(method, family)
    lora = isinstance(method, LoRAConfig)

    def trainable(path, leaf) -> bool:
        keys = tuple(k.key for k in path)
        part = next((p for p in parts if keys[0] in p.keys), None)
        if part is None or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return False
        return keys[-1] in LORA_LEAVES if lora and part.linears else True

    return jax.tree_util.tree_map_with_path(trainable, vision)


def with_lora_scales(vision: dict, method: MethodConfig | None, family: VisionFamily) -> dict:
    """The image-side tree with each adapted module's `lora_scale` (float32, one a layer) beside its leaves, as the
    towers' `tower_linear` reads it."""
    for path, hf in _adapted(method, family):
        assert isinstance(method, LoRAConfig)
        module = _get(vision, path)
        _, scale = lora_of(method, hf, _layers(module))
        vision = _with(vision, path, {**module, "lora_scale": jnp.full(module["kernel"].shape[:-2], scale)})
    return vision


def without_lora(vision: dict) -> dict:
    """The image-side tree less LoRA's leaves (the base weights and the parts trained whole)."""
    if not isinstance(vision, dict):
        return vision
    return {k: without_lora(v) for k, v in vision.items() if k not in LORA_LEAVES}


def peft_vision(vision: dict, method: MethodConfig, family: VisionFamily, config) -> tuple[dict, str | None, list]:
    """What a PEFT adapter holds of the image side: ({PEFT tensor name: float32 array in torch's layout}, a regex
    matching the adapted linear modules' paths (None: none), the `modules_to_save` of the parts trained whole)."""
    tensors: dict[str, np.ndarray] = {}
    paths = []
    for path, hf in _adapted(method, family):
        module = _get(vision, path)
        lora_a, lora_b = (np.asarray(module[k], np.float32) for k in LORA_LEAVES)
        layers = [(hf.format(i=i), lora_a.reshape(-1, *lora_a.shape[-2:])[i], lora_b.reshape(-1, *lora_b.shape[-2:])[i])
                  for i in range(_layers(module))]
        for name, a, b in layers:
            tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a.T)
            tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b.T)
        paths.append(re.escape(hf).replace(re.escape("{i}"), r"\d+"))
    whole = [part.saved for part in trained_parts(method, family) if not part.linears]
    if whole:
        plain = without_lora(vision)
        for name, _, _, produce in family.tensor_entries(plain, config, np.float32):
            if any(name.startswith(saved + ".") for saved in whole):
                tensors[f"base_model.model.model.{name}"] = np.asarray(produce(), np.float32)
    return tensors, "|".join(paths) or None, whole


def image_side_reached(config: dict, tensors=()) -> str | None:
    """The first part of a registered family's image side a PEFT adapter trains (a projector its config's
    `modules_to_save` names, or one of `tensors`' names under a tower), or None."""
    saved = config.get("modules_to_save") or []
    whole = [part.saved for family in FAMILIES for part in family.parts.values() if part.saved and part.saved in saved]
    tower = [name for name in tensors if any(re.fullmatch(family.outside_text, name) for family in FAMILIES)]
    return next(iter(whole + tower), None)
