"""Hugging Face safetensors checkpoints <-> the stacked parameter tree, without torch: `save_model`, and the readers
the spine loads through (`checked_reader`, `read_layer`, `expert_rows`; `spine.model.load_model` is the loader).

Reading checks every tensor's name and shape against `param_specs` first (`check_tensors`), so a wrong checkpoint
fails with the tensor's name and both shapes rather than deep inside a matmul. A mixture's experts are read in the
hub's layout (one [out, in] matrix an expert and part; Mixtral's w1/w3/w2 as gate/up/down) or transformers 5's
stacks (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]). Writing gives what every version of
`AutoModelForCausalLM.from_pretrained` reads: `config.json` and `model.safetensors` (or shards with an index),
experts in the hub's layout.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

import jax
import ml_dtypes
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.config.model import ATTENTION_MODULES, LATENT_NORMS, PER_LAYER_INPUT_MODULES, hf_module_name
from jaxtune.errors import JaxtuneError, JaxtuneWarning
from jaxtune.io.fp8_blocks import BlockFP8Reader, fp8_block_size
from jaxtune.io.gguf import is_gguf
from jaxtune.io.safetensors import CheckpointReader, write_weights
from jaxtune.models import stacked_experts
from jaxtune.models.gguf import GGUFCheckpoint
from jaxtune.models.hf_config import config_to_hf, model_dir
from jaxtune.models.hf_families import FAMILIES
from jaxtune.models.params import QK_NORMS, ParamSpec, is_norm, param_specs
from jaxtune.models.quant import BitPattern

Reader: TypeAlias = CheckpointReader | GGUFCheckpoint | BlockFP8Reader  # what `checked_reader` opens; one interface

STORED_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}  # name -> numpy's


MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's hub names of an expert's parts
# a vision-language checkpoint's vision (and audio) towers (`models.vision` reads Gemma 3's), Qwen3.5's multi-token
# head: left by the text model
LEFT_PARTS = ("model.visual.", "visual.", "mtp.", "vision_tower.", "vision_model.", "multi_modal_projector.",
              "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# a vision-language checkpoint's prefixes, as transformers 4 and 5 and the hub's releases save them -> jaxtune's
VISION_LANGUAGE_PREFIXES = (
    ("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.visual.", "visual."))
TOP_LEVEL = {("embed_tokens",): "model.embed_tokens.weight", ("norm",): "model.norm.weight",
             ("lm_head", "kernel"): "lm_head.weight",
             ("embed_tokens_per_layer",): "model.embed_tokens_per_layer.weight",
             ("per_layer_model_projection", "kernel"): "model.per_layer_model_projection.weight",
             ("per_layer_projection_norm",): "model.per_layer_projection_norm.weight"}  # Gemma 4's per-layer inputs
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # hub parts of our modules


def hf_module_path(module: str) -> str:
    """Path of a per-layer module (or Qwen3's query/key norm) inside a Hugging Face decoder layer, e.g.
    'self_attn.q_proj'; a mixture's router is 'mlp.gate'; Gated DeltaNet's keep their `linear_attn.` path."""
    module = hf_module_name(module)
    if module.startswith("linear_attn.") or module in PER_LAYER_INPUT_MODULES:
        return module
    if module in ATTENTION_MODULES or module in QK_NORMS:
        return f"self_attn.{module}"
    return "mlp.gate" if module == "router" else f"mlp.{module}"


def canonical_name(stored: str) -> str:
    """A tensor's name as jaxtune reads it: Mixtral's hub names (`block_sparse_moe`, experts' w1/w3/w2) become the names
    transformers 5 gives them (`mlp`, gate_proj/up_proj/down_proj), gpt-oss's router (`mlp.router`) the other
    mixtures' (`mlp.gate`), Llama 4's `feed_forward` and DeepSeek's `shared_experts` Qwen2-MoE's names, a vision-
    language checkpoint's text model (`model.language_model.`, `language_model.model.`) a text model's (`model.`),
    its vision tower `vision_tower.*` (Qwen2.5-VL's `visual.*`) and projector `multi_modal_projector.*`; other names
    are kept."""
    stored = stored.replace(".feed_forward.", ".mlp.")  # Llama 4's
    stored = stored.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's
    stored = re.sub(r"(\.layers\.\d+)\.(router\.proj|router|experts)\.",  # Gemma 4's, beside the MLP
                    lambda m: f"{m[1]}.mlp.{'experts' if m[2] == 'experts' else 'gate'}.", stored)
    old, new = next(((old, new) for old, new in VISION_LANGUAGE_PREFIXES if stored.startswith(old)), ("", ""))
    stored = new + stored[len(old):]
    if ".mlp.router." in stored:
        return stored.replace(".mlp.router.", ".mlp.gate.")
    if ".block_sparse_moe." not in stored:
        return stored
    name = stored.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m[1]}.{MIXTRAL_PARTS[m[2]]}.", name)


def stored_name(name: str, cfg: ModelConfig) -> str:
    """The name a hub checkpoint of `cfg` stores tensor `name` under (inverse of `canonical_name`)."""
    if cfg.architecture == "GptOssForCausalLM":
        return name.replace(".mlp.gate.", ".mlp.router.")
    if cfg.architecture == "DeepseekV3ForCausalLM":
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    if cfg.architecture == "Gemma4ForCausalLM":
        return re.sub(r"\.mlp\.(gate|experts)\.(weight)?", lambda m: ".router.proj.weight" if m[2] else
                      f".{'router' if m[1] == 'gate' else 'experts'}.", name)
    if cfg.architecture == "Llama4ForCausalLM":
        return name.replace(".mlp.gate.", ".mlp.router.").replace(".mlp.", ".feed_forward.")
    if cfg.architecture != "MixtralForCausalLM" or not re.search(r"\.mlp\.(gate|experts)\.", name):
        return name
    parts = {v: k for k, v in MIXTRAL_PARTS.items()}
    name = re.sub(r"\.experts\.(\d+)\.(\w+)\.", lambda m: f".experts.{m[1]}.{parts[m[2]]}.", name)
    return name.replace(".mlp.", ".block_sparse_moe.")


def expert_tensor_names(module: str, layer: int, expert: int) -> list[str]:
    """The hub tensors of expert `expert`'s `module` in `layer` (gate_up_proj: gate's then up's)."""
    return [f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight" for part in EXPERT_PARTS[module]]


def fused_expert_name(module: str, layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts.{module}"


def has_fused_experts(reader: Reader) -> bool:
    return any(name.endswith(".mlp.experts.gate_up_proj") for name in reader.names())


def _is_expert(path: tuple[str, ...]) -> bool:
    return len(path) > 2 and path[:2] == ("layers", "experts")


def hf_tensor_name(path: tuple[str, ...], layer: int | None) -> str:
    """The Hugging Face tensor name of leaf `path` of our tree (for stacked leaves, of one `layer`)."""
    if path in TOP_LEVEL:
        return TOP_LEVEL[path]
    module, *leaf = path[1:]
    if module == "sinks":  # gpt-oss's, a bare parameter of self_attn
        return f"model.layers.{layer}.self_attn.sinks"
    if module == "layer_scalar":  # Gemma 4's, a buffer of the layer
        return f"model.layers.{layer}.layer_scalar"
    if module.startswith("linear_attn.") and not leaf:  # Gated DeltaNet's dt_bias, A_log
        return f"model.layers.{layer}.{module}"
    if _is_expert(path):
        raise ValueError(f"{path}: expert stacks are many tensors (expert_tensor_names)")
    if module in LATENT_NORMS:
        return f"model.layers.{layer}.self_attn.{module}.weight"
    if is_norm(module) and hf_module_name(module) not in QK_NORMS:
        return f"model.layers.{layer}.{module}.weight"
    part = leaf[0] if leaf in (["bias"], ["e_score_correction_bias"], ["scale"], ["per_expert_scale"]) else "weight"
    return f"model.layers.{layer}.{hf_module_path(module)}.{part}"


def _leaf_paths(tree) -> list[tuple[tuple[str, ...], ParamSpec]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    return [(tuple(k.key for k in path), leaf) for path, leaf in flat]


def expected_tensors(cfg: ModelConfig, fused_experts: bool = False, mxfp4: bool = False
                     ) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape in torch's layout ([out, in] for kernels), for every parameter; a
    mixture's experts in the hub's layout, or with `fused_experts` in transformers 5's; gpt-oss's in its own
    (`stacked_experts`; `mxfp4`: gpt-oss as released)."""
    expected: dict[str, tuple[int, ...]] = {}
    stacked = cfg.architecture in stacked_experts.INTERLEAVED
    if stacked:
        expected.update(stacked_experts.expected(cfg.module_layers("experts"), cfg.num_experts, cfg.hidden_size,
                                                 cfg.expert_size, mxfp4, cfg.expert_bias))
    for path, spec in _leaf_paths(param_specs(cfg)):
        if _is_expert(path) and stacked:
            continue
        if _is_expert(path):
            E, d_in, d_out = spec.shape[1:]
            for i in cfg.module_layers("experts"):
                if fused_experts:
                    expected[fused_expert_name(path[2], i)] = (E, d_out, d_in)
                    continue
                expected.update({name: (d_out // len(EXPERT_PARTS[path[2]]), d_in) for e in range(E)
                                 for name in expert_tensor_names(path[2], i, e)})
            continue
        shape = spec.shape[::-1] if path[-1] == "kernel" else spec.shape
        if path[0] != "layers":
            expected[hf_tensor_name(path, None)] = shape
        else:
            per_layer = spec.shape[1:][::-1] if path[-1] == "kernel" else spec.shape[1:]
            expected.update({hf_tensor_name(path, i): per_layer for i in cfg.module_layers(path[1])})
    return expected


def check_tensors(reader: Reader, directory: Path, cfg: ModelConfig,
                  expected: dict[str, tuple[int, ...]] | None = None) -> None:
    """From the headers alone: the checkpoint holds exactly the tensors `cfg` needs (`expected`, by default
    `expected_tensors(cfg)`), with the right shapes; else an error naming the tensor (and file)."""
    fused = has_fused_experts(reader)
    expected = expected_tensors(cfg, fused, stacked_experts.is_quantized(reader.names())) if expected is None \
        else expected
    names = set(reader.names())
    for name, shape in expected.items():
        if name not in names:
            raise JaxtuneError(f"{directory}: tensor {name if fused else stored_name(name, cfg)} is missing from "
                               "the checkpoint")
        if reader.shape(name) != shape:
            raise JaxtuneError(f"{reader.file_of(name)}: tensor {reader.stored_name(name)} has shape "
                               f"{reader.shape(name)}, expected {shape}")
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    ignorable |= {f"model.layers.{i}.self_attn.{m}.weight" for i in cfg.kv_sharing_layers  # transformers ignores them
                  for m in ("k_proj", "v_proj", "k_norm", "v_norm")}
    family = FAMILIES.get(cfg.architecture)
    prediction_heads = {n for n in names if family is not None and family.prediction_layers
                        and (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m[1]) >= cfg.num_layers}
    if prediction_heads:
        warnings.warn(f"{directory}: layers {cfg.num_layers}+ ({len(prediction_heads)} tensors) are DeepSeek's "
                      "multi-token prediction; read past, not trained or exported", JaxtuneWarning, stacklevel=3)
    unused = sorted(reader.stored_name(n) for n in names - set(expected) - ignorable - prediction_heads
                    if "rotary_emb" not in n and not n.startswith(LEFT_PARTS))
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise JaxtuneError(f"{directory}: unexpected tensors {', '.join(unused[:3])}{more} for {cfg.architecture}")


@contextmanager
def checked_reader(directory: str | Path, cfg: ModelConfig) -> Iterator[Reader]:
    """A `CheckpointReader` of `directory`'s weights (a `GGUFCheckpoint` of a GGUF file; block-scaled FP8 weights
    decoded as they are read, `io.fp8_blocks`), after `check_tensors`."""
    directory = Path(directory) if is_gguf(directory) else model_dir(directory)
    with (GGUFCheckpoint if is_gguf(directory) else CheckpointReader)(directory, canonical_name) as opened:
        block = None if is_gguf(directory) else fp8_block_size(directory)
        reader: Reader = opened if block is None else BlockFP8Reader(opened, block)
        check_tensors(reader, directory, cfg)
        yield reader


def stored_dtype(directory: str | Path) -> str:
    """The dtype the checkpoint stores its embedding in ("bfloat16", "float32", ...): the weights' "as stored"."""
    opened = GGUFCheckpoint(directory) if is_gguf(directory) else CheckpointReader(model_dir(directory), canonical_name)
    with opened as reader:
        if "model.embed_tokens.weight" not in reader.names():
            raise JaxtuneError(f"{directory}: tensor model.embed_tokens.weight is missing from the checkpoint")
        return str(reader.dtype("model.embed_tokens.weight"))


def _read(reader: Reader, name: str, index: tuple[slice, ...], kernel: bool) -> np.ndarray:
    """tensor[index] in our layout: kernels are stored [out, in], ours are [in, out]."""
    return reader.read(name, (index[1], index[0])).T if kernel else reader.read(name, index)


def expert_rows(reader: Reader, module: str, layer: int, expert: int, rows: slice, cols: slice,
                size: int) -> np.ndarray:
    """Rows `rows` (and columns `cols`) of one expert's `module` matrix in torch's layout [out, in], from either
    layout; gate_up_proj's rows are gate's `size` then up's."""
    fused = fused_expert_name(module, layer)
    if fused in reader:
        return reader.read(fused, (slice(expert, expert + 1), rows, cols))[0]
    names = expert_tensor_names(module, layer, expert)
    a, b, _ = rows.indices(size * len(names))
    parts = [reader.read(name, (slice(max(a - j * size, 0), min(b - j * size, size)), cols))
             for j, name in enumerate(names) if a < (j + 1) * size and b > j * size]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def read_layer(reader: Reader, path: tuple[str, ...], layer: int | None, index: tuple[slice, ...],
               cfg: ModelConfig) -> np.ndarray:
    """Leaf `path`'s `layer` (None: an unstacked leaf) restricted to `index` (slices of its per-layer dims), in
    our layout."""
    kernel = path[-1] == "kernel"
    if not _is_expert(path):
        return _read(reader, hf_tensor_name(path, layer), index, kernel)
    assert layer is not None  # an expert stack is a layer's
    if cfg.architecture in stacked_experts.INTERLEAVED:
        return stacked_experts.read(reader, layer, path[2], path[3], index,
                                    stacked_experts.INTERLEAVED[cfg.architecture])
    experts, cols, rows = index
    size = cfg.expert_size if path[2] == "gate_up_proj" else cfg.hidden_size
    return np.stack([expert_rows(reader, path[2], layer, e, rows, cols, size).T
                     for e in range(*experts.indices(cfg.num_experts))])


def tensor_entries(params: dict, cfg: ModelConfig, dtype=None, skip: tuple[str, ...] = (), tensor=None,
                   fused: bool = False) -> list[tuple]:
    """(Hugging Face name, shape, dtype, produce) of every tensor of `params` (torch's layout), for
    `write_weights`: each `produce()` gathers just that tensor (one layer of a stacked leaf) to the host; with
    `fused`, a mixture's experts as transformers 5's stacks a layer (as a family that stores only those).

    tensor(path, layer): if given and not None for a stacked leaf's layer, what to write instead of `leaf[layer]`
    (a merged export computes each merged layer there). Leaves a method adds (LoRA, ...) are not model tensors and
    are left out: `tensor` merges them where they change one."""
    entries: list[tuple] = []
    model_paths = {path for path, _ in _leaf_paths(param_specs(cfg))} | {("lm_head", "kernel")}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, BitPattern))[0]:
        path = tuple(k.key for k in path)
        if path[0] in skip or path not in model_paths:  # a method's leaves are no model tensors
            continue
        kernel = path[-1] == "kernel"
        out_dtype = np.dtype(dtype or leaf.dtype)
        layout = lambda x, kernel=kernel: x.T if kernel else x
        full = leaf.bits.shape if isinstance(leaf, BitPattern) else leaf.shape
        if path[0] != "layers":
            shape = tuple(full[::-1] if kernel else full)
            entries.append((hf_tensor_name(path, None), shape, out_dtype,
                            lambda leaf=leaf, layout=layout, d=out_dtype: layout(host_array(leaf)).astype(d)))
            continue
        if _is_expert(path):
            entries += _expert_entries(leaf, path, cfg, out_dtype, tensor, fused)
            continue
        shape = tuple(full[1:][::-1] if kernel else full[1:])
        for row, i in enumerate(cfg.module_layers(path[1])):
            def produce(leaf=leaf, path=path, row=row, layout=layout, d=out_dtype):
                value = None if tensor is None else tensor(path, row)
                return layout(host_array(jax.tree.map(lambda a: a[row], leaf) if value is None else value)).astype(d)

            entries.append((stored_name(hf_tensor_name(path, i), cfg), shape, out_dtype, produce))
    return entries


def _expert_entries(leaf, path: tuple[str, ...], cfg: ModelConfig, out_dtype, tensor, fused: bool) -> list[tuple]:
    """The hub tensors of an expert stack [L, E, in, out] (or a merged layer from `tensor`; its rows the mixture's
    layers): each expert's parts, [out, in]; a layer is gathered once for all its experts' tensors."""
    entries: list[tuple] = []
    held: dict[int, Any] = {}
    full = (leaf.bits.shape if isinstance(leaf, BitPattern) else leaf.shape)[1:]

    def row_of(row):
        if row not in held:
            held.clear()
            value = None if tensor is None else tensor(path, row)
            held[row] = host_array(jax.tree.map(lambda a: a[row], leaf) if value is None else value)
        return held[row]

    layers = enumerate(cfg.module_layers("experts"))
    if cfg.architecture in stacked_experts.INTERLEAVED:  # one tensor a layer and leaf, [E, in, out] or [E, out]
        part, interleaved = "_bias" if path[3] == "bias" else "", stacked_experts.INTERLEAVED[cfg.architecture]
        return [(stored_name(stacked_experts.tensor_name(i, path[2], part), cfg), full, out_dtype,
                 lambda row=row: stacked_experts.as_stored(path[2], row_of(row), interleaved).astype(out_dtype))
                for row, i in layers]
    E, d_in, d_out = full
    family = FAMILIES.get(cfg.architecture)
    if fused or (family is not None and family.fused_experts):  # transformers' stack a layer, [E, out, in]
        return [(stored_name(fused_expert_name(path[2], i), cfg), (E, d_out, d_in), out_dtype,
                 lambda row=row: np.swapaxes(row_of(row), 1, 2).astype(out_dtype)) for row, i in layers]
    for row, i in layers:
        for e in range(E):
            names = expert_tensor_names(path[2], i, e)
            width = d_out // len(names)
            for j, name in enumerate(names):
                produce = lambda row=row, e=e, j=j, w=width: row_of(row)[e][:, j * w:(j + 1) * w].T.astype(out_dtype)
                entries.append((stored_name(name, cfg), (width, d_in), out_dtype, produce))
    return entries


def host_array(x) -> np.ndarray:
    """`x` on the host; split across processes, it is all-gathered first (every process must call this). A
    BitPattern comes back as its float values."""
    if isinstance(x, BitPattern):
        return host_array(x.bits).view(x.dtype)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_model(
    directory: str | Path,
    cfg: ModelConfig,
    params: dict,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
    tensor=None,
) -> Path:
    """Write `params` as a Hugging Face model directory: config.json and the weights (the tokenizer beside them is
    `data.tokenizer.copy_tokenizer`'s to write).

    Tensor by tensor: each is gathered to the host (one layer of a stacked leaf at a time) as it is written, so the
    export never holds a second copy of the model. A tied `cfg` whose params hold their own `lm_head` (trained
    apart, PEFT's modules_to_save) is written untied."""
    if cfg.tie_word_embeddings and "lm_head" in params:
        cfg = cfg.replace(tie_word_embeddings=False)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = tensor_entries(params, cfg, STORED_DTYPES[dtype] if dtype else None, tensor=tensor)
    dtype_name = dtype or str(entries[0][2])
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype_name), indent=2) + "\n")
    write_weights(directory, entries, max_shard_bytes)
    return directory
