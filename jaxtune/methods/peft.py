"""Adapters in Hugging Face PEFT's format, `adapter_config.json` + `adapter_model.safetensors`: `save_peft_adapter`,
`load_peft_adapter`, `load_model_with_adapter`, and the exports built on them (`export_merged`, `export_gguf`,
`export_gguf_lora`; `adapter_summary` for `jaxtune info`).

Key names and layouts follow what PEFT itself saves (`save_pretrained`, `get_peft_model_state_dict`); each method
unit declares its own (`methods.base.PeftFormat`: LoRA's `...q_proj.lora_A.weight` [r, in], IA3's `ia3_l`, prefix
tuning's `prompt_embeddings`, ...; a QLoRA adapter records the quantised base it was trained on, so it loads onto
that base), and a unit without one has no PEFT format. `modules_to_save` are PEFT's whole tensors beside them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.io.json import read_json
from jaxtune.io.safetensors import write_safetensors
from jaxtune.methods.base import METHODS, method_unit
from jaxtune.methods.targets import Targeted
from jaxtune.methods.transform import add_method_leaves, apply_method, parameter_report, quantize_base
from jaxtune.methods.vision import image_side_reached, peft_vision, trained_parts
from jaxtune.models.hf_config import load_config
from jaxtune.models.params import abstract_params
from jaxtune.models.quant import QuantizedArray

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SAVED_TENSORS = {"lm_head": "base_model.model.lm_head.weight",
                 "embed_tokens": "base_model.model.model.embed_tokens.weight"}


def _format(method: MethodConfig):
    """The PEFT format of `method`'s unit, or an error naming the method."""
    unit = method_unit(method)
    if unit.peft is None:
        raise JaxtuneError(f"method {method.kind!r} has no PEFT format (PEFT has LoRA, rsLoRA, DoRA, IA3 and prefix)")
    return unit.peft


def peft_config(cfg: ModelConfig, method: MethodConfig, base_model: str = "") -> dict:
    """The keys PEFT needs to rebuild `method` on a transformers model of `cfg`."""
    config = {"base_model_name_or_path": base_model, "task_type": "CAUSAL_LM", "inference_mode": True,
              **_format(method).config(cfg, method)}
    if isinstance(method, Targeted):  # PEFT's field of the configs that target modules
        config["modules_to_save"] = list(method.modules_to_save) or None
    return config


def adapter_state_dict(params: dict, cfg: ModelConfig, method: MethodConfig, text_prefix: str = "model."
                       ) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 numpy array in torch's layout: `modules_to_save`'s whole tensors, then the
    method's own (a LoRA layer of rank r < the module's largest gives its first r ranks; skipped layers nothing).
    text_prefix: where the text model's modules sit in the transformers model PEFT wraps ("model.language_model."
    in a vision-language model)."""
    f32 = lambda x: np.asarray(x, np.float32)
    state = {SAVED_TENSORS[name]: np.ascontiguousarray(
        f32(params["lm_head"]["kernel"]).T if name == "lm_head" else f32(params["embed_tokens"]))
        for name in method.trained_whole}
    state = {**state, **{_as_peft_names(name, cfg): value
                         for name, value in _format(method).tensors(params, cfg, method).items()}}
    inner = "base_model.model.model."
    return {f"base_model.model.{text_prefix}{k[len(inner):]}" if k.startswith(inner) else k: v
            for k, v in state.items()}


def _as_peft_names(name: str, cfg: ModelConfig, back: bool = False) -> str:
    """Llama 4's MLP modules are its `feed_forward` (jaxtune's names, as transformers 5's, say `mlp`); `back`:
    PEFT's name to jaxtune's."""
    if cfg.architecture != "Llama4ForCausalLM":
        return name
    return name.replace(".feed_forward.", ".mlp.") if back else name.replace(".mlp.", ".feed_forward.")


def excluding(exclude, outside: str):
    """PEFT's `exclude_modules` (None, names, or a regex) that also excludes every module the regex `outside`
    matches: as one regex, a name list as PEFT matches it (the path, or its suffix after a dot)."""
    if not exclude:
        return outside
    own = exclude if isinstance(exclude, str) else rf"(?:.*\.)?(?:{'|'.join(map(re.escape, exclude))})"
    return f"(?:{own})|(?:{outside})"


def within(selection, prefix: str) -> str:
    """PEFT's target_modules / exclude_modules (names, or a regex) as one regex that matches only under `prefix`
    (a name list as PEFT matches it: the path, or its suffix after a dot)."""
    own = selection if isinstance(selection, str) else rf"(?:.*\.)?(?:{'|'.join(map(re.escape, selection))})"
    return rf"(?={re.escape(prefix)})(?:{own})"


def save_peft_adapter(directory: str | Path, params: dict, cfg: ModelConfig, method: MethodConfig,
                      base_model: str = "", initial: dict | None = None, text_prefix: str = "model.",
                      outside: str | None = None, image_side: tuple | None = None) -> Path:
    """Write `method`'s leaves of `params` as a PEFT adapter directory; `base_model` is recorded as its
    `base_model_name_or_path` (a local path made absolute). A PiSSA or OLoRA adapter (whose base was changed) is
    written as PEFT converts it, a plain LoRA of rank 2r on the original base, from its init's A and B: `initial`
    {module: {"lora_a", "lora_b"}} (`spine.load.initial_leaves`; `PeftFormat.as_stored`). text_prefix, outside: of
    a vision-language model, where its text model's modules are and a regex of the modules PEFT must leave alone
    (its vision tower, whose modules share the text model's names). image_side: (vision family, its config) of a
    run that trains parts of it (`methods.vision.peft_vision`): their tensors, targets and modules_to_save added."""
    directory = Path(directory)
    as_stored = _format(method).as_stored
    if as_stored is not None:
        params, method = as_stored(params, method, initial, cfg)
    if base_model and Path(base_model).exists():  # absolute, so PEFT finds the base from any working directory
        base_model = str(Path(base_model).resolve())
    config = peft_config(cfg, method, base_model)
    if outside is not None and "target_modules" in config:  # a vision-language model: PEFT adapts its text alone
        config["exclude_modules"] = excluding(config.get("exclude_modules"), outside)
    directory.mkdir(parents=True, exist_ok=True)
    # our writer, not safetensors' `save_file`: that one creates its file mode 0600, whatever the umask
    state = adapter_state_dict(params, cfg, method, text_prefix)
    if image_side is not None and trained_parts(method, image_side[0]):
        tensors, adapted, whole = peft_vision(params["vision"], method, *image_side)
        state.update(tensors)
        if adapted:  # one regex: the text model's targets, then the tower's linear modules
            assert isinstance(method, Targeted)  # a LoRA method: `_adapted`'s
            config["target_modules"] = f"(?:{within(method.target_modules, text_prefix)})|(?:{adapted})"
            own = method.exclude_modules
            config["exclude_modules"] = within(own, text_prefix) if own else None
        if whole:
            config["modules_to_save"] = [*(config.get("modules_to_save") or []), *whole]
    entries = [(name, v.shape, v.dtype, lambda v=v: v) for name, v in state.items()]
    write_safetensors(directory / WEIGHTS_FILE, entries, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


# Fields PEFT writes that change nothing jaxtune computes from the saved tensors (metadata, initialisation).
IGNORED_FIELDS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                  "inference_mode", "init_lora_weights", "init_ia3_weights", "init_weights", "loftq_config",
                  "eva_config", "corda_config", "lora_ga_config", "runtime_config", "megatron_core", "lora_dropout",
                  "num_layers", "num_attention_heads", "token_dim", "encoder_hidden_size",
                  "num_transformer_submodules", "adapter_size", "qalora_group_size"}


def _is_unset(value) -> bool:
    return value in (None, False, "", "none", [], {}) or value == "megatron.core"


def method_from_peft_config(config: dict, where: Path) -> MethodConfig:
    """The method options of a PEFT adapter config, as trained (a QLoRA adapter's on its quantised base). A field
    jaxtune does not compute (set to anything but its default), or a value it cannot represent, is refused naming
    the field: nothing is silently dropped."""
    kind = config.get("peft_type")
    formats = {t: unit.peft for unit in METHODS.values() if unit.peft is not None for t in unit.peft.peft_types}
    if kind not in formats:
        raise JaxtuneError(f"{where}: PEFT adapter type {kind!r} is not supported (readable: {', '.join(formats)})")
    reached = image_side_reached(config)
    if reached:
        raise JaxtuneError(f"{where}: it trains the image side ({reached}; vision_modules): jaxtune does not read "
                           "such an adapter back yet (PEFT's merge_and_unload merges it)")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise JaxtuneError(f"{where}: task_type {config['task_type']!r} is not supported (jaxtune adapts causal "
                           "language models: CAUSAL_LM)")
    read = formats[kind].read_fields
    for field, value in config.items():
        if field not in IGNORED_FIELDS and field not in read and not _is_unset(value):
            raise JaxtuneError(f"{where}: field {field} = {json.dumps(value)} is not supported by jaxtune "
                               f"({kind} adapters are read with {', '.join(sorted(read)) or 'no fields'})")
    get = lambda key, default: default if config.get(key) is None else config[key]
    method_of = formats[kind].method_of
    assert method_of is not None  # a format that reads a peft_type has its reader
    try:
        return method_of(config, get, _targets(config, where) if "target_modules" in read else ())
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    except ConfigError as e:
        raise JaxtuneError(f"{where}: {e}") from None
    except JaxtuneError as e:
        raise JaxtuneError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise JaxtuneError(f"{where}: {e}") from None


def _targets(config: dict, where: Path):
    targets = config.get("target_modules")
    if not targets and config.get("target_parameters"):  # LoRA on a mixture's experts alone
        return ()
    if not isinstance(targets, (list, str)) or not targets:
        raise JaxtuneError(f"{where}: target_modules {targets!r} must be a regular expression or a list of modules")
    return targets


def adapter_method(directory: str | Path) -> MethodConfig:
    """The method options an adapter directory was trained with (`method_from_peft_config` of its config)."""
    if not Path(directory).is_dir():
        raise JaxtuneError(f"{directory}: adapter directory not found")
    where = Path(directory) / CONFIG_FILE
    if not where.is_file():
        raise JaxtuneError(f"{where}: file not found (a PEFT adapter directory holds it)")
    return method_from_peft_config(read_json(where), where)


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def load_peft_adapter(directory: str | Path, params: dict, cfg: ModelConfig, method: MethodConfig | None = None
                      ) -> tuple[MethodConfig, dict]:
    """(method, params with the adapter's leaves) for a PEFT adapter directory and base `params`.

    method: the options to apply it as (default: as trained, on the base as given: an adapter trained on a
    quantised base goes on float `params` as its unit's `on_float_base` says, and quantises nothing). A method
    that holds its base quantised quantises float `params` (`quantize_base`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise JaxtuneError(f"{directory}: adapter directory not found")
    if method is None:
        method = method_from_peft_config(read_json(directory / CONFIG_FILE), directory / CONFIG_FILE)
        on_float = method_unit(method).on_float_base
        if on_float is not None and not any(_is_quantized(x) for x in jax.tree.leaves(params, is_leaf=_is_quantized)):
            method = on_float(method)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise JaxtuneError(f"{path}: file not found")
    try:  # an adapter trained on a vision-language model's text model: its modules under model.language_model
        state = {k.replace(".model.language_model.", ".model."): v for k, v in load_file(str(path)).items()}
    except Exception as e:  # safetensors raises its own error type, or OSError, for damaged files
        raise JaxtuneError(f"{path}: not a readable safetensors file ({e})") from None
    reached = image_side_reached({}, state)
    if reached:
        raise JaxtuneError(f"{path}: it trains the image side ({reached}; vision_modules): jaxtune does not read "
                           "such an adapter back yet (PEFT's merge_and_unload merges it)")
    try:
        quantized = any(_is_quantized(leaf) for leaf in jax.tree.leaves(params, is_leaf=_is_quantized))
        base = params if quantized else quantize_base(params, method)  # a base may come quantised as it was read
        params = add_method_leaves(base, cfg, method, jax.random.key(0))
    except JaxtuneError as e:
        raise JaxtuneError(f"{directory / CONFIG_FILE}: {e}") from None
    expected = adapter_state_dict(params, cfg, method)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    foreign = [n for n in unexpected if any(f".{m}." in n for m in ("lm_head", "embed_tokens")) and
               not n.endswith(tuple(SAVED_TENSORS.values()))]
    if foreign:
        module = "lm_head" if ".lm_head." in foreign[0] else "embed_tokens"
        raise JaxtuneError(f"{path}: tensor {foreign[0]} adapts {module}, which jaxtune's LoRA does not (it adapts the "
                           "linear modules of decoder layers; lm_head and embed_tokens train whole, modules_to_save)")
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise JaxtuneError(f"{path}: tensor {name} is {'missing' if missing else 'unexpected'} "
                           f"({len(missing)} missing, {len(unexpected)} unexpected; is the adapter for this model?)")
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise JaxtuneError(f"{path}: tensor {name} has shape {value.shape}, expected {expected[name].shape}")
    return method, _insert(params, cfg, method, {_as_peft_names(k, cfg, back=True): v.astype(np.float32)
                                                 for k, v in state.items()})


def _insert(params: dict, cfg: ModelConfig, method: MethodConfig, state: dict[str, np.ndarray]) -> dict:
    """Inverse of `adapter_state_dict`: the loaded tensors in place of the freshly initialised leaves."""
    params = dict(params)
    if "lm_head" in method.trained_whole:
        params["lm_head"] = {"kernel": jnp.asarray(state[SAVED_TENSORS["lm_head"]].T)}
    if "embed_tokens" in method.trained_whole:
        params["embed_tokens"] = jnp.asarray(state[SAVED_TENSORS["embed_tokens"]])
    load = _format(method).load
    if load is None:
        raise JaxtuneError(f"method {method.kind!r} writes PEFT adapters but does not read them back")
    return load(state, params, cfg, method)


def adapter_summary(model: str | Path, adapter: str | Path) -> dict:
    """An adapter's method and exact parameter counts on its base, from the configs alone (nothing allocated)."""
    cfg = load_config(model)
    method = method_from_peft_config(read_json(Path(adapter) / CONFIG_FILE), Path(adapter) / CONFIG_FILE)
    shapes = jax.eval_shape(lambda p, key: apply_method(p, cfg, method, key), abstract_params(cfg), jax.random.key(0))
    report = parameter_report(shapes, method, cfg)
    return {"method": method_unit(method).summary(method), "trainable": report.trainable, "total": report.total,
            "percent": report.percent}
