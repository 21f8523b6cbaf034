"""The Qwen-VL vision towers read from a Hugging Face checkpoint without torch (`read_tower`), each by its table of
names (Qwen2.5-VL's `QWEN2_5_VL_NAMES`; Qwen3-VL's in qwen3_vl_vision.py): the tensors under `visual.` (the hub's
layout and what transformers 5 saves) or `model.visual.`, each shape checked against the tower's abstract tree before
it is used; Linear weights [out, in] become kernels [in, out], the Conv3d's [D, C, T, P, P] the patch embedding's
[C * T * P * P, D], a block list's modules stacked on a leading axis; written back by `tower_tensor_entries`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.models.hf_weights import host_array
from jaxtune.models.vision.qwen_vl_config import QwenVisionConfig, vision_config_from_hf
from jaxtune.models.vision.qwen_vl_vision import abstract_vision_params

PREFIXES = ("model.visual.", "visual.")  # transformers 5's module path, the hub's (and transformers 5's saved) names
# our module's path in the tree -> its Hugging Face name under the tower (`{i}`: the i-th of a stacked list); a module
# is an array (`.weight`: a norm's, an embedding's) or a dict of kernel (`.weight`, transposed), weight and bias
QWEN2_5_VL_NAMES: dict[tuple[str, ...], str] = {
    ("patch_embed",): "patch_embed.proj",
    **{("blocks", ours): f"blocks.{{i}}.{hf}" for ours, hf in {
        "norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj", "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}.items()},
    ("merger", "norm"): "merger.ln_q", ("merger", "fc1"): "merger.mlp.0", ("merger", "fc2"): "merger.mlp.2"}
SUFFIXES = {"kernel": "weight", "weight": "weight", "bias": "bias"}


def _prefix(reader: CheckpointReader) -> str:
    for prefix in PREFIXES:
        if f"{prefix}patch_embed.proj.weight" in reader:
            return prefix
    raise JaxtuneError("no Qwen-VL vision tower in the checkpoint (no visual.patch_embed.proj.weight)")


def _read(reader: CheckpointReader, name: str, shape: tuple[int, ...], dtype, kernel: bool) -> np.ndarray:
    """A tensor as our leaf of `shape`: a Linear's weight transposed, the Conv3d's flattened first; shape checked."""
    if name not in reader:
        raise JaxtuneError(f"the checkpoint has no {name}")
    array = reader.read(name)
    if kernel:
        array = array.reshape(array.shape[0], -1).T
    if array.shape != shape:
        raise JaxtuneError(f"{reader.stored_name(name)}: shape {reader.shape(name)}, expected one giving {shape}")
    return array.astype(dtype)


def _leaves(module) -> list[tuple[str, Any]]:
    """(leaf name, "" for a bare array; leaf) of a module."""
    return list(module.items()) if isinstance(module, dict) else [("", module)]


def read_tower(directory: str | Path, specs: dict, names: dict[tuple[str, ...], str], dtype=np.float32) -> dict:
    """A tower's tree (`specs`' layout, `ShapeDtypeStruct`s) as numpy arrays of `dtype`, each module read from the
    checkpoint in `directory` by its name in `names`."""
    tree: dict = {}
    with CheckpointReader(Path(directory)) as reader:
        prefix = _prefix(reader)

        def module(name: str, spec, stacked: bool):
            read = {leaf: _read(reader, f"{prefix}{name}.{SUFFIXES.get(leaf, 'weight')}",
                                s.shape[1:] if stacked else s.shape, dtype, kernel=leaf == "kernel")
                    for leaf, s in _leaves(spec)}
            return read if isinstance(spec, dict) else read[""]

        for path, name in names.items():
            spec = specs
            for key in path:
                spec = spec[key]
            if "{i}" in name:
                count = jax.tree.leaves(spec)[0].shape[0]
                value = jax.tree.map(lambda *a: np.stack(a), *[module(name.format(i=i), spec, True)
                                                                for i in range(count)])
            else:
                value = module(name, spec, False)
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
    return tree


def tower_tensor_entries(params: dict, names: dict[tuple[str, ...], str], shapes: dict[str, tuple[int, ...]],
                         dtype=None) -> list[tuple]:
    """(name under `visual.`, torch shape, dtype, produce) of every tower tensor, for `io.safetensors.write_weights`
    (the inverse of `read_tower`): kernels back to [out, in] (`shapes` by name where it is otherwise: the Conv3d's),
    a stacked list one tensor an entry, each gathered to the host as it is written."""
    entries: list[tuple] = []
    for path, template in names.items():
        module = params
        for key in path:
            module = module[key]
        stacked = "{i}" in template
        for i in range(jax.tree.leaves(module)[0].shape[0] if stacked else 1):
            for leaf, value in _leaves(module):
                name = f"visual.{template.format(i=i)}.{SUFFIXES.get(leaf, 'weight')}"
                out = np.dtype(dtype or value.dtype)
                one = value.shape[1:] if stacked else value.shape
                shape = shapes.get(name, tuple(one[::-1]) if leaf == "kernel" else tuple(one))

                def produce(value=value, layer=i if stacked else None, shape=shape, out=out, kernel=leaf == "kernel"):
                    array = host_array(value) if layer is None else host_array(value[layer])
                    return np.ascontiguousarray((array.T if kernel else array).reshape(shape)).astype(out)

                entries.append((name, shape, out, produce))
    return entries


def read_vision_params(directory: str | Path, cfg: QwenVisionConfig | None = None, dtype=np.float32) -> dict:
    """Qwen2.5-VL's tower (`abstract_vision_params`' layout) from the checkpoint in `directory`; cfg: from its
    config.json unless given."""
    cfg = vision_config_from_hf(read_json(Path(directory) / "config.json")) if cfg is None else cfg
    return read_tower(directory, abstract_vision_params(cfg), QWEN2_5_VL_NAMES, dtype)


def conv_shapes(hidden_size: int, in_channels: int, temporal_patch_size: int, patch_size: int
                ) -> dict[str, tuple[int, ...]]:
    """The patch embedding's torch shape, the Conv3d's [D, C, T, P, P]."""
    return {"visual.patch_embed.proj.weight": (hidden_size, in_channels, temporal_patch_size, patch_size, patch_size)}


def vision_tensor_entries(params: dict, cfg: QwenVisionConfig, dtype=None) -> list[tuple]:
    """Qwen2.5-VL's tower's `tower_tensor_entries`."""
    return tower_tensor_entries(params, QWEN2_5_VL_NAMES, conv_shapes(
        cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size), dtype)
