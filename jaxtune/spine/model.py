"""A model held for inference (eval, generate, export, a reward model, a reference), read by the spine's loader.

    cfg, params = load_model("path/to/model")                            # HF directory or GGUF file
    cfg, params, method = load_model_with_adapter(model, "run/adapter")   # + a PEFT adapter
    cfg, params, slots = load_adapters(model, {"a": "run-a/adapter", "b": "run-b/adapter"})   # stacked, one batch
    cfg, params = load_reward_model("run/reward_model")                   # + its `score` head

`abstract_model` is the tree as ShapeDtypeStructs in their shardings (one device unless a mesh is given, a QLoRA
base quantised); `load.read_tree` reads the checkpoint into exactly those, a shard at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxtune.config import MeshConfig, MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError, check_choice
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.methods.adapter_rows import check_mixable, stack_adapters
from jaxtune.methods.peft import CONFIG_FILE, QUANTIZED_BASE, load_peft_adapter, method_from_peft_config, quantized_base
from jaxtune.methods.transform import quantize_base
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import check_tensors, checked_reader, expected_tensors
from jaxtune.models.params import abstract_params
from jaxtune.models.reward_model import reward_config
from jaxtune.parallel.mesh import make_mesh
from jaxtune.spine.load import read_tree
from jaxtune.spine.shardings import param_shardings


def abstract_model(cfg: ModelConfig, dtype, method: MethodConfig | None = None, mesh: Mesh | None = None) -> dict:
    """The base tree of `cfg` in `dtype` as ShapeDtypeStructs with shardings over `mesh` (default: one device),
    every linear kernel quantised where `method` holds its base quantised (QLoRA)."""
    mesh = mesh if mesh is not None else make_mesh(MeshConfig(), jax.devices()[:1])
    shapes = abstract_params(cfg, dtype)
    if method is not None:
        shapes = jax.eval_shape(lambda p: quantize_base(p, method), shapes)
    shardings = param_shardings(shapes, cfg, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def load_model(model: str | Path, dtype=None, method: MethodConfig | None = None, mesh: Mesh | None = None
               ) -> tuple[ModelConfig, dict]:
    """(config, params) of a Hugging Face directory or a GGUF file, each leaf read into its sharding.

    dtype: of the float leaves (default: the checkpoint's own); method: quantise the base as it is read (QLoRA), the
    kernels its LoRA init changes changed (LoftQ's base)."""
    cfg = load_config(model)
    with checked_reader(model, cfg) as reader:
        dtype = np.dtype(dtype if dtype is not None else reader.dtype("model.embed_tokens.weight"))
        return cfg, read_tree(reader, abstract_model(cfg, dtype, method, mesh), cfg, method)


def load_model_with_adapter(model: str | Path, adapter: str | Path | None = None, dtype=None,
                            base: str = "as-trained", log=None, mesh: Mesh | None = None
                            ) -> tuple[ModelConfig, dict, MethodConfig | None]:
    """(config, params, method) of a model, with a PEFT adapter applied if given; the base read into its shardings
    over `mesh` (default one device).

    base: "as-trained" puts a QLoRA adapter that records its quantised base (`jaxtune_quantized_base`) on that
    base, quantised as it is read; "float" uses the float weights. `log(text)` is told which base is used.
    """
    check_choice("base", base, ("as-trained", "float"))
    quantization = quantized_base(adapter) if adapter is not None and Path(adapter, CONFIG_FILE).is_file() else None
    use_quantized = quantization is not None and base == "as-trained"
    quantized = MethodConfig("qlora", bits=int(quantization.get("bits", 4)),
                             double_quant=bool(quantization.get("double_quant", True))) if use_quantized else None
    if use_quantized and quantization.get("init") == "loftq":  # LoftQ's base, from the adapter's modules and ranks
        where = Path(adapter, CONFIG_FILE)
        quantized = dataclasses.replace(method_from_peft_config(read_json(where), where), kind="qlora",
                                        bits=quantized.bits, double_quant=quantized.double_quant, init="loftq",
                                        loftq_iter=int(quantization.get("loftq_iter", 1)))
    cfg, params = load_model(model, dtype, quantized, mesh)
    if adapter is None:
        return cfg, params, None
    method, params = load_peft_adapter(adapter, params, cfg, kind="qlora" if use_quantized else None,
                                       quantization=quantization)
    if quantization is not None and log is not None:
        fmt = str(quantization.get("format", "nf4")).upper() + (", double quantisation" if quantization.get(
            "double_quant") else "")
        log(f"{adapter}: QLoRA adapter on its base quantised as in training ({fmt}); --base float for the float "
            "weights" if use_quantized else
            f"{adapter}: QLoRA adapter trained on a quantised base ({fmt}), applied to the float weights")
    return cfg, params, method


def load_adapters(model: str | Path, adapters: dict[str, str | Path], dtype=None, base: str = "as-trained", log=None,
                  mesh: Mesh | None = None) -> tuple[ModelConfig, dict, dict[str, int]]:
    """(config, params with the adapters stacked, name -> slot) for generating with several LoRA adapters in one
    batch (`methods/adapter_rows.py`; slot 0 is the base model). The base is read once.

    adapters: name -> PEFT adapter directory. base: as for `load_model_with_adapter`; QLoRA adapters go on their
    quantised base only if all of them were trained on the same one. One-line JaxtuneErrors name the adapter that
    cannot mix (not LoRA, DoRA, another base model or quantisation).
    """
    check_choice("base", base, ("as-trained", "float"))
    if not adapters:
        raise JaxtuneError("no adapters to load")
    quantizations, models = {}, {}
    for name, directory in adapters.items():
        where = Path(directory, CONFIG_FILE)
        if not where.is_file():
            raise JaxtuneError(f"adapter {name}: {where}: file not found (a PEFT adapter directory holds it)")
        config = read_json(where)
        check_mixable(method_from_peft_config(config, where), name)
        quantization = config.get(QUANTIZED_BASE)
        if quantization is not None and quantization.get("init") == "loftq":
            check_mixable(MethodConfig("qlora", init="loftq"), name)
        quantizations[name] = "float" if quantization is None or base == "float" else (
            f"{'nf4' if int(quantization.get('bits', 4)) == 4 else 'int8'}"
            f"{' double-quantised' if quantization.get('double_quant', True) else ''}")
        if config.get("base_model_name_or_path"):
            models[name] = Path(str(config["base_model_name_or_path"]).rstrip("/")).name
    for kinds, what in ((quantizations, "base weights (QLoRA bits; --base float puts all on the float weights)"),
                        (models, "base model (base_model_name_or_path)")):
        if len(set(kinds.values())) > 1:
            first = next(iter(kinds))
            other = next(name for name, kind in kinds.items() if kind != kinds[first])
            raise JaxtuneError(f"adapters {first} and {other} differ in their {what}: {kinds[first]} vs "
                               f"{kinds[other]}; adapters in one batch share their base")
    weights = next(iter(quantizations.values()))
    q = None if weights == "float" else {"bits": 4 if weights.startswith("nf4") else 8,
                                         "double_quant": weights.endswith("double-quantised")}
    quantized = None if q is None else MethodConfig("qlora", bits=q["bits"], double_quant=q["double_quant"])
    cfg, params = load_model(model, dtype, quantized, mesh)
    if quantized is not None and log is not None:
        log(f"adapters on their base quantised as in training ({weights}); --base float for the float weights")
    loaded = {name: load_peft_adapter(directory, params, cfg, kind="qlora" if q else None, quantization=q)
              for name, directory in adapters.items()}
    return cfg, stack_adapters(loaded, cfg), {name: i + 1 for i, name in enumerate(adapters)}


def load_reward_model(directory: str | Path, dtype=None) -> tuple[ModelConfig, dict]:
    """(config, params with `score`) of a directory `save_reward_model` (or transformers) wrote; the config is the
    causal architecture's with tied embeddings (a reward model has no LM head)."""
    directory, cfg = reward_config(directory)
    with CheckpointReader(directory) as reader:
        check_tensors(reader, directory, cfg, {**expected_tensors(cfg), "score.weight": (1, cfg.hidden_size)})
        dtype = np.dtype(dtype if dtype is not None else reader.dtype("model.embed_tokens.weight"))
        params = read_tree(reader, abstract_model(cfg, dtype), cfg)
        score = reader.read("score.weight")[0].astype(dtype)
    return cfg, {**params, "score": {"kernel": jnp.asarray(score)}}
