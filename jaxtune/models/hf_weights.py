"""Hugging Face safetensors checkpoints <-> the stacked parameter tree, without torch.

Reading checks every tensor's name and shape against `param_specs` before it is used, so a wrong checkpoint
fails with the tensor's name and both shapes rather than deep inside a matmul. Writing produces what
`transformers.AutoModelForCausalLM.from_pretrained` reads: `config.json` and `model.safetensors`, or shards
with a `model.safetensors.index.json` when the weights are large.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.hf_config import config_to_hf, load_config, model_dir, read_json
from jaxtune.models.params import ATTENTION_MODULES, ParamSpec, param_specs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def hf_module_path(module: str) -> str:
    """Path of a per-layer linear module inside a Hugging Face decoder layer, e.g. 'self_attn.q_proj'."""
    return f"self_attn.{module}" if module in ATTENTION_MODULES else f"mlp.{module}"


def hf_tensor_name(path: tuple[str, ...], layer: int | None) -> str:
    """The Hugging Face tensor name of leaf `path` of our tree (for stacked leaves, of one `layer`)."""
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight"
    if path == ("norm",):
        return "model.norm.weight"
    if path == ("lm_head", "kernel"):
        return "lm_head.weight"
    module, *leaf = path[1:]
    if module.endswith("layernorm"):
        return f"model.layers.{layer}.{module}.weight"
    return f"model.layers.{layer}.{hf_module_path(module)}.{'weight' if leaf == ['kernel'] else 'bias'}"


def _leaf_paths(tree) -> list[tuple[tuple[str, ...], ParamSpec]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    return [(tuple(k.key for k in path), leaf) for path, leaf in flat]


def open_checkpoint(directory: Path) -> dict[str, tuple]:
    """tensor name -> (open safetensors handle, file path)."""
    if (directory / INDEX_FILE).is_file():
        index = read_json(directory / INDEX_FILE)
        if "weight_map" not in index:
            raise JaxtuneError(f"{directory / INDEX_FILE}: no 'weight_map' key")
        files = sorted(set(index["weight_map"].values()))
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
        raise JaxtuneError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (found: {found})")
    tensors = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise JaxtuneError(f"{path}: file not found (listed in {INDEX_FILE})")
        try:
            handle = safe_open(str(path), framework="numpy")
        except (SafetensorError, OSError) as e:
            raise JaxtuneError(f"{path}: not a readable safetensors file ({e})") from None
        for key in handle.keys():
            tensors[key] = (handle, path)
    return tensors


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape in torch's layout ([out, in] for kernels), for every parameter."""
    expected = {}
    for path, spec in _leaf_paths(param_specs(cfg)):
        shape = spec.shape[::-1] if path[-1] == "kernel" else spec.shape
        if path[0] != "layers":
            expected[hf_tensor_name(path, None)] = shape
        else:
            per_layer = spec.shape[1:][::-1] if path[-1] == "kernel" else spec.shape[1:]
            expected.update({hf_tensor_name(path, i): per_layer for i in range(cfg.num_layers)})
    return expected


def check_checkpoint(directory: str | Path, cfg: ModelConfig) -> dict[str, tuple]:
    """Open a checkpoint and check, from the file headers alone, that it holds exactly the tensors `cfg` needs
    with the right shapes. Returns tensor name -> (handle, file path)."""
    directory = model_dir(directory)
    tensors = open_checkpoint(directory)
    for name, shape in expected_tensors(cfg).items():
        if name not in tensors:
            raise JaxtuneError(f"{directory}: tensor {name} is missing from the checkpoint")
        handle, path = tensors[name]
        found = tuple(handle.get_slice(name).get_shape())
        if found != shape:
            raise JaxtuneError(f"{path}: tensor {name} has shape {found}, expected {shape}")
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unused = sorted(n for n in set(tensors) - set(expected_tensors(cfg)) - ignorable if "rotary_emb" not in n)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise JaxtuneError(f"{directory}: unexpected tensors {', '.join(unused[:3])}{more} for {cfg.architecture}")
    return tensors


def read_hf_weights(directory: str | Path, cfg: ModelConfig, dtype=None) -> dict:
    """The parameter tree as host numpy arrays, read from the safetensors files of `directory`.

    dtype: the parameter dtype (default: the checkpoint's own, taken from its embedding matrix).
    """
    tensors = check_checkpoint(directory, cfg)

    def read(name: str) -> np.ndarray:
        return tensors[name][0].get_tensor(name)

    dtype = np.dtype(dtype if dtype is not None else read("model.embed_tokens.weight").dtype)

    def load_leaf(path: tuple[str, ...], spec: ParamSpec) -> np.ndarray:
        transpose = path[-1] == "kernel"
        if path[0] != "layers":
            value = read(hf_tensor_name(path, None))
            return (value.T if transpose else value).astype(dtype)
        stacked = np.empty(spec.shape, dtype)
        for i in range(cfg.num_layers):
            value = read(hf_tensor_name(path, i))
            stacked[i] = value.T if transpose else value
        return stacked

    leaves = [load_leaf(path, spec) for path, spec in _leaf_paths(param_specs(cfg))]
    treedef = jax.tree.structure(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    return jax.tree.unflatten(treedef, leaves)


def load_model(directory: str | Path, dtype=None) -> tuple[ModelConfig, dict]:
    """(config, params) of a Hugging Face Llama/Mistral/Qwen2 directory, params as device arrays."""
    cfg = load_config(directory)
    return cfg, jax.tree.map(jnp.asarray, read_hf_weights(directory, cfg, dtype))


def hf_state_dict(params: dict, cfg: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
    """Hugging Face tensor name -> numpy array in torch's [out, in] layout."""
    state = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(k.key for k in path)
        value = np.asarray(leaf) if dtype is None else np.asarray(leaf).astype(dtype)
        is_kernel = path[-1] == "kernel"
        if path[0] != "layers":
            state[hf_tensor_name(path, None)] = np.ascontiguousarray(value.T if is_kernel else value)
            continue
        for i in range(cfg.num_layers):
            state[hf_tensor_name(path, i)] = np.ascontiguousarray(value[i].T if is_kernel else value[i])
    return state


def save_model(
    directory: str | Path,
    cfg: ModelConfig,
    params: dict,
    dtype: str | None = None,
    tokenizer_from: str | Path | None = None,
    max_shard_bytes: int = 2 * 2**30,
) -> Path:
    """Write `params` as a Hugging Face model directory; copies tokenizer files from `tokenizer_from` if given.

    A tied `cfg` whose params hold their own `lm_head` (trained apart, PEFT's modules_to_save) is written untied."""
    if cfg.tie_word_embeddings and "lm_head" in params:
        cfg = cfg.replace(tie_word_embeddings=False)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = DTYPES[dtype] if dtype else None
    state = hf_state_dict(params, cfg, np_dtype)
    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    dtype_name = dtype or str(next(iter(state.values())).dtype)
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype_name), indent=2) + "\n")

    shards, current, size = [], {}, 0
    for name, value in state.items():
        if current and size + value.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copyfile(Path(tokenizer_from) / name, directory / name)
    return directory
