"""A model held for inference (eval, generate, export, a reward model, a reference), read by the spine's loader.

    cfg, params = load_model("path/to/model")                            # HF directory or GGUF file
    cfg, params, vision, vision_params = load_vision_language_model(model)   # + the image side (Gemma 3, Qwen2.5-VL)
    cfg, params, method = load_model_with_adapter(model, "run/adapter")   # + a PEFT adapter
    cfg, params, slots = load_adapters(model, {"a": "run-a/adapter", "b": "run-b/adapter"})   # stacked, one batch
    cfg, params = load_reward_model("run/reward_model")                   # + its `score` head

`abstract_model`: the tree as ShapeDtypeStructs in their shardings; `load.read_tree` reads into those, shard by shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxtune.config import MeshConfig, MethodConfig, ModelConfig, VisionLanguageConfig
from jaxtune.errors import JaxtuneError, check_choice
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.methods.base import method_unit
from jaxtune.methods.peft import CONFIG_FILE, adapter_method, load_peft_adapter
from jaxtune.methods.transform import quantize_base
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import check_tensors, checked_reader, expected_tensors
from jaxtune.models.params import abstract_params
from jaxtune.models.reward_model import reward_config
from jaxtune.models.vision.families import required_vision_family
from jaxtune.models.vision.qwen_vl_config import QwenVLConfig
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


def load_vision_language_model(model: str | Path, dtype=None, mesh: Mesh | None = None
                               ) -> tuple[ModelConfig, dict, VisionLanguageConfig | QwenVLConfig, dict]:
    """(text config, text params, image-side config, image-side params) of a vision-language directory: the text
    model as `load_model` reads it, the image side (Gemma 3's tower and projector, Qwen2.5-VL's tower) in its dtype;
    its family (`models.vision.families.vision_family`) gives the forward."""
    family = required_vision_family(model)
    cfg, params = load_model(model, dtype, mesh=mesh)
    vision = family.read_config(Path(model))
    return cfg, params, vision, family.read_params(Path(model), vision, params["embed_tokens"].dtype)


def load_model_with_adapter(model: str | Path, adapter: str | Path | None = None, dtype=None,
                            base: str = "as-trained", log=None, mesh: Mesh | None = None
                            ) -> tuple[ModelConfig, dict, MethodConfig | None]:
    """(config, params, method) of a model, with a PEFT adapter applied if given; the base read into its shardings
    over `mesh` (default one device).

    base: "as-trained" puts an adapter on its base held as in training (QLoRA's quantised base, recorded in its
    config, quantised as it is read; LoftQ's changed one); "float" uses the float weights (the unit's
    `on_float_base`). `log(text)` is told which base is used.
    """
    check_choice("base", base, ("as-trained", "float"))
    if adapter is None:
        return (*load_model(model, dtype, mesh=mesh), None)
    trained = adapter_method(adapter)
    method = _on_base(trained, base)
    cfg, params = load_model(model, dtype, method, mesh)
    method, params = load_peft_adapter(adapter, params, cfg, method)
    held = method_unit(trained).frozen_base(trained)
    if held is not None and log is not None:
        log(f"{adapter}: adapter on its base quantised as in training ({held}); --base float for the float weights"
            if method == trained else
            f"{adapter}: adapter trained on a quantised base ({held}), applied to the float weights")
    return cfg, params, method


def _on_base(method: MethodConfig, base: str) -> MethodConfig:
    """`method` as it runs on the base `base` chooses: as trained, or on the float weights."""
    on_float = method_unit(method).on_float_base
    return on_float(method) if base == "float" and on_float is not None else method


def load_adapters(model: str | Path, adapters: Mapping[str, str | Path], dtype=None, base: str = "as-trained",
                  log=None, mesh: Mesh | None = None) -> tuple[ModelConfig, dict, dict[str, int]]:
    """(config, params with the adapters stacked, name -> slot) for generating with several adapters in one batch
    (`Method.adapter_rows`: LoRA's; slot 0 is the base model). The base is read once.

    adapters: name -> PEFT adapter directory. base: as for `load_model_with_adapter`; adapters on a quantised base go
    on it only if all of them were trained on the same one. One-line JaxtuneErrors name the adapter that cannot mix
    (its method, DoRA, another base model or quantisation).
    """
    check_choice("base", base, ("as-trained", "float"))
    if not adapters:
        raise JaxtuneError("no adapters to load")
    methods, bases, models = {}, {}, {}
    for name, directory in adapters.items():
        try:
            trained = adapter_method(directory)
        except JaxtuneError as e:
            raise JaxtuneError(f"adapter {name}: {e}") from None
        rows = method_unit(trained).adapter_rows
        why = f"a {trained.kind} adapter cannot share a batch with other adapters" if rows is None else \
            rows.why_not(trained)
        if why is not None:
            raise JaxtuneError(f"adapter {name}: {why}; generate with it alone")
        methods[name] = _on_base(trained, base)
        bases[name] = method_unit(methods[name]).frozen_base(methods[name]) or "float"
        named = read_json(Path(directory, CONFIG_FILE)).get("base_model_name_or_path")
        if named:
            models[name] = Path(str(named).rstrip("/")).name
    for kinds, what in ((bases, "base weights (QLoRA bits; --base float puts all on the float weights)"),
                        (models, "base model (base_model_name_or_path)")):
        if len(set(kinds.values())) > 1:
            first = next(iter(kinds))
            other = next(name for name, kind in kinds.items() if kind != kinds[first])
            raise JaxtuneError(f"adapters {first} and {other} differ in their {what}: {kinds[first]} vs "
                               f"{kinds[other]}; adapters in one batch share their base")
    first_method = next(iter(methods.values()))
    cfg, params = load_model(model, dtype, first_method, mesh)
    weights = next(iter(bases.values()))
    if weights != "float" and log is not None:
        log(f"adapters on their base quantised as in training ({weights}); --base float for the float weights")
    loaded = {name: load_peft_adapter(directory, params, cfg, methods[name]) for name, directory in adapters.items()}
    rows = method_unit(first_method).adapter_rows
    assert rows is not None  # checked above, for every adapter
    return cfg, rows.stack(loaded, cfg), {name: i + 1 for i, name in enumerate(adapters)}


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
