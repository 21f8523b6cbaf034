"""Qwen2.5-VL's vision tower read from a Hugging Face checkpoint without torch (`read_vision_params`): the tensors
under `visual.` (the hub's layout and what transformers 5 saves) or `model.visual.`, each shape checked against
`abstract_vision_params` before it is used; Linear weights [out, in] become kernels [in, out], the Conv3d's
[D, C, T, P, P] the patch embedding's [C * T * P * P, D], the blocks stacked on a leading axis; written back by
`vision_tensor_entries`."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.models.hf_weights import host_array
from jaxtune.models.vision.qwen_vl_config import QwenVisionConfig, vision_config_from_hf
from jaxtune.models.vision.qwen_vl_vision import abstract_vision_params

PREFIXES = ("model.visual.", "visual.")  # transformers 5's module path, the hub's (and transformers 5's saved) names
# our leaf -> its Hugging Face name under `blocks.{i}.` (`.weight` or `.bias` added), or under the tower
BLOCK_NAMES = {"norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj", "gate_proj": "mlp.gate_proj",
               "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
MERGER_NAMES = {"norm": "merger.ln_q", "fc1": "merger.mlp.0", "fc2": "merger.mlp.2"}


def _prefix(reader: CheckpointReader) -> str:
    for prefix in PREFIXES:
        if f"{prefix}patch_embed.proj.weight" in reader:
            return prefix
    raise JaxtuneError("no Qwen2.5-VL vision tower in the checkpoint (no visual.patch_embed.proj.weight)")


def _read(reader: CheckpointReader, name: str, spec: jax.ShapeDtypeStruct, dtype, kernel: bool) -> np.ndarray:
    """A tensor as our leaf (one block's, where `spec` is stacked): a Linear's weight transposed, the Conv3d's
    flattened first; its shape checked."""
    if name not in reader:
        raise JaxtuneError(f"the checkpoint has no {name}")
    array = reader.read(name)
    if kernel:
        array = array.reshape(array.shape[0], -1).T
    expected = spec.shape[-2:] if kernel else spec.shape[-1:]
    if array.shape != expected:
        raise JaxtuneError(f"{reader.stored_name(name)}: shape {reader.shape(name)}, expected one giving {expected}")
    return array.astype(dtype)


def read_vision_params(directory: str | Path, cfg: QwenVisionConfig | None = None, dtype=np.float32) -> dict:
    """The tower's parameter tree (`abstract_vision_params`' layout) as numpy arrays of `dtype`, from the checkpoint
    in `directory`; cfg: from its config.json unless given."""
    directory = Path(directory)
    cfg = vision_config_from_hf(read_json(directory / "config.json")) if cfg is None else cfg
    specs = abstract_vision_params(cfg)
    with CheckpointReader(directory) as reader:
        prefix = _prefix(reader)

        def module(name: str, spec, layer: int | None = None) -> dict | np.ndarray:
            at = f"{prefix}{name}" if layer is None else f"{prefix}blocks.{layer}.{name}"
            if not isinstance(spec, dict):  # a norm's weight
                return _read(reader, f"{at}.weight", spec, dtype, kernel=False)
            return {leaf: _read(reader, f"{at}.{'weight' if leaf == 'kernel' else 'bias'}", s, dtype,
                                kernel=leaf == "kernel") for leaf, s in spec.items()}

        layers = [{ours: module(hf, specs["blocks"][ours], layer=i) for ours, hf in BLOCK_NAMES.items()}
                  for i in range(cfg.depth)]
        return {"patch_embed": module("patch_embed.proj", specs["patch_embed"]),
                "blocks": jax.tree.map(lambda *a: np.stack(a), *layers),
                "merger": {ours: module(hf, specs["merger"][ours]) for ours, hf in MERGER_NAMES.items()}}


def vision_tensor_entries(params: dict, cfg: QwenVisionConfig, dtype=None) -> list[tuple]:
    """(name under `visual.`, torch shape, dtype, produce) of every tower tensor, for `io.safetensors.write_weights`
    (the inverse of `read_vision_params`): kernels back to [out, in], the patch embedding to the Conv3d's
    [D, C, T, P, P], the blocks one tensor a block, each gathered to the host as it is written."""
    conv = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    entries: list[tuple] = []

    def add(name: str, leaf, kind: str, layer: int | None = None, shape: tuple | None = None):
        out = np.dtype(dtype or leaf.dtype)
        one = leaf.shape[1:] if layer is not None else leaf.shape
        shape = shape or (tuple(one[::-1]) if kind == "kernel" else tuple(one))

        def produce(leaf=leaf, layer=layer, shape=shape, out=out, kernel=kind == "kernel"):
            value = host_array(leaf) if layer is None else host_array(leaf[layer])
            return np.ascontiguousarray((value.T if kernel else value).reshape(shape)).astype(out)

        entries.append((f"visual.{name}.{'weight' if kind in ('kernel', 'norm') else 'bias'}", shape, out, produce))

    add("patch_embed.proj", params["patch_embed"]["kernel"], "kernel", shape=conv)
    for i in range(cfg.depth):
        for ours, hf in BLOCK_NAMES.items():
            module = params["blocks"][ours]
            for kind, leaf in (module.items() if isinstance(module, dict) else [("norm", module)]):
                add(f"blocks.{i}.{hf}", leaf, kind, layer=i)
    for ours, hf in MERGER_NAMES.items():
        module = params["merger"][ours]
        for kind, leaf in (module.items() if isinstance(module, dict) else [("norm", module)]):
            add(hf, leaf, kind)
    return entries
