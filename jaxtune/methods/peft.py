"""Adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

Key names and layouts follow what PEFT itself saves (peft `save_pretrained`, `get_peft_model_state_dict`):

    LoRA   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
           base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]
    DoRA   base_model.model.model.layers.{i}.self_attn.q_proj.lora_magnitude_vector   [out]
    LoRA of an expert stack [E, in, out] (`target_parameters`, PEFT's ParamWrapper):
           base_model.model.model.layers.{i}.mlp.experts.lora_A.weight   [r E, in] (expert-major)
           base_model.model.model.layers.{i}.mlp.experts.lora_B.weight   [out, r E] (rank-major)
           with both stacks adapted, gate_up_proj's wrapper is inside down_proj's: its tensors are under
           ...mlp.experts.base_layer.lora_A.weight
    IA3    base_model.model.model.layers.{i}.self_attn.k_proj.ia3_l   [out, 1];  ...mlp.down_proj.ia3_l  [1, in]
    prefix prompt_embeddings   [P, L * 2 * K * hd], per virtual token: layer-major, key then value, head, dim

rsLoRA is LoRA with `use_rslora`; QLoRA adapters are LoRA adapters (the quantisation belongs to the base).
PEFT has no bottleneck adapters: jaxtune writes them in the same layout under its own `peft_type`
"JAXTUNE_BOTTLENECK" (`...layers.{i}.attn_adapter.down.weight` [m, D], ...), which only jaxtune reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.config.targets import ia3_modules, is_target, lora_layout, module_path
from jaxtune.errors import ConfigError, JaxtuneError, check_choice
from jaxtune.methods.lora import LORA_LEAVES
from jaxtune.methods.transform import apply_method
from jaxtune.models.hf_config import read_json
from jaxtune.models.safetensors_io import write_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
READABLE = ("LORA", "IA3", "PREFIX_TUNING", "JAXTUNE_BOTTLENECK")
BOTTLENECK_LEAVES = [(a, p, leaf) for a in ("attn_adapter", "mlp_adapter") for p in ("down", "up")
                     for leaf in ("kernel", "bias")]


def _prefix(module: str, layer: int) -> str:
    return f"base_model.model.{module_path(module, layer)}"


def _expert_prefix(module: str, layer: int, method: MethodConfig) -> str:
    """Where PEFT keeps the LoRA of expert stack `module`: PEFT wraps the experts' parameters in the order the
    module registers them (gate_up_proj, then down_proj), so with both the first is the second's base layer."""
    inner = module == "gate_up_proj" and len(method.expert_modules) == 2
    return f"base_model.model.model.layers.{layer}.mlp.experts" + ".base_layer" * inner


SAVED_TENSORS = {"lm_head": "base_model.model.lm_head.weight",
                 "embed_tokens": "base_model.model.model.embed_tokens.weight"}
QUANTIZED_BASE = "jaxtune_quantized_base"  # beside PEFT's fields: the frozen base a QLoRA adapter was trained on


def _peft_names(value):
    """A target/exclude field as PEFT writes it: a regex string, a list of names, or None."""
    return value if isinstance(value, str) else (list(value) or None)


def peft_config(cfg: ModelConfig, method: MethodConfig, base_model: str = "") -> dict:
    """The keys PEFT needs to rebuild `method` on a transformers model of `cfg`."""
    common = {"base_model_name_or_path": base_model, "task_type": "CAUSAL_LM", "inference_mode": True}
    saved = list(method.modules_to_save) or None
    if method.kind in ("lora", "qlora"):
        config = {**common, "peft_type": "LORA", "r": method.rank, "lora_alpha": method.alpha,
                  "lora_dropout": method.dropout, "target_modules": _peft_names(method.target_modules),
                  "exclude_modules": _peft_names(method.exclude_modules),
                  "layers_to_transform": list(method.layers_to_transform) or None,
                  "layers_pattern": list(method.layers_pattern) or None,
                  "rank_pattern": dict(method.rank_pattern), "alpha_pattern": dict(method.alpha_pattern),
                  "bias": "none", "lora_bias": method.lora_bias, "use_rslora": method.rslora, "use_dora": method.dora,
                  "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": saved,
                  "target_parameters": list(method.target_parameters) or None}
        if method.kind == "qlora":
            config[QUANTIZED_BASE] = {"bits": method.bits, "double_quant": method.double_quant,
                                      "format": "nf4" if method.bits == 4 else "int8"}
        return config
    if method.kind == "ia3":
        targets = ia3_modules(method, cfg.num_layers, cfg.linear_modules)
        # PEFT wants feedforward_modules within a list of target_modules: the names that pick a down_proj
        named = targets if isinstance(method.target_modules, str) else method.target_modules
        return {**common, "peft_type": "IA3", "target_modules": _peft_names(method.target_modules),
                "exclude_modules": _peft_names(method.exclude_modules),
                "feedforward_modules": [m for m in named if m.endswith("down_proj")],
                "fan_in_fan_out": False, "init_ia3_weights": True, "modules_to_save": saved}
    if method.kind == "prefix":
        return {**common, "peft_type": "PREFIX_TUNING", "num_virtual_tokens": method.num_virtual_tokens,
                "num_layers": cfg.num_layers, "num_attention_heads": cfg.num_kv_heads, "token_dim": cfg.kv_size,
                "encoder_hidden_size": cfg.kv_size, "num_transformer_submodules": 1, "prefix_projection": False}
    if method.kind == "adapter":
        return {**common, "peft_type": "JAXTUNE_BOTTLENECK", "adapter_size": method.adapter_size}
    raise JaxtuneError(f"method {method.kind!r} has no PEFT format (PEFT has LoRA, rsLoRA, DoRA, IA3 and prefix)")


def adapter_state_dict(params: dict, cfg: ModelConfig, method: MethodConfig) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 numpy array in torch's layout. A LoRA layer of rank r < the module's largest
    gives its first r ranks (the rest is zero padding); layers the adapter skips give nothing."""
    layers = params["layers"]
    f32 = lambda x: np.asarray(x, np.float32)
    state = {}
    if method.kind == "prefix":
        key, value = f32(layers["prefix"]["key"]), f32(layers["prefix"]["value"])  # [L, P, K, hd]
        stacked = np.stack([key, value], axis=1)  # [L, 2, P, K, hd]
        state["prompt_embeddings"] = np.ascontiguousarray(
            stacked.transpose(2, 0, 1, 3, 4).reshape(method.num_virtual_tokens, -1))
        return state
    if method.kind == "adapter":
        for adapter, proj, leaf in BOTTLENECK_LEAVES:
            value = f32(layers[adapter][proj][leaf])
            for i in range(cfg.num_layers):
                name = f"base_model.model.model.layers.{i}.{adapter}.{proj}.{'weight' if leaf == 'kernel' else 'bias'}"
                state[name] = np.ascontiguousarray(value[i].T if leaf == "kernel" else value[i])
        return state
    for name in method.modules_to_save:
        state[SAVED_TENSORS[name]] = np.ascontiguousarray(
            f32(params["lm_head"]["kernel"]).T if name == "lm_head" else f32(params["embed_tokens"]))
    if method.kind == "ia3":
        for name in ia3_modules(method, cfg.num_layers, cfg.linear_modules):
            module = layers[name]
            for i in range(cfg.num_layers):
                ia3 = f32(module["ia3_in"][i])[None, :] if "ia3_in" in module else f32(module["ia3_out"][i])[:, None]
                state[f"{_prefix(name, i)}.ia3_l"] = np.ascontiguousarray(ia3)
        return state
    for name, lora in lora_layout(method, cfg.num_layers, cfg.linear_modules).items():
        module = {k: f32(v) for k, v in layers[name].items() if k in LORA_LEAVES}
        for i, r in enumerate(lora.ranks):
            if not r:
                continue
            prefix = _prefix(name, i)
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(module["lora_a"][i][:, :r].T)
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(module["lora_b"][i][:r].T)
            if method.lora_bias:
                state[f"{prefix}.lora_B.bias"] = np.ascontiguousarray(module["lora_bias"][i])
            if method.dora:
                state[f"{prefix}.lora_magnitude_vector"] = np.ascontiguousarray(module["magnitude"][i])
    for name in method.expert_modules:
        a, b = (f32(layers["experts"][name][k]) for k in ("lora_a", "lora_b"))  # [L, E, in, r], [L, E, r, out]
        L, E, d_in, r = a.shape
        for i in range(L):
            prefix = _expert_prefix(name, i, method)
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].transpose(0, 2, 1).reshape(E * r, d_in))
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].transpose(2, 1, 0).reshape(-1, r * E))
    return state


def save_peft_adapter(directory: str | Path, params: dict, cfg: ModelConfig, method: MethodConfig,
                      base_model: str = "") -> Path:
    """Write `method`'s leaves of `params` as a PEFT adapter directory; `base_model` is recorded as its
    `base_model_name_or_path` (a local path made absolute)."""
    directory = Path(directory)
    if base_model and Path(base_model).exists():  # absolute, so PEFT finds the base from any working directory
        base_model = str(Path(base_model).resolve())
    config = peft_config(cfg, method, base_model)
    directory.mkdir(parents=True, exist_ok=True)
    # our writer, not safetensors' `save_file`: that one creates its file mode 0600, whatever the umask
    entries = [(name, v.shape, v.dtype, lambda v=v: v) for name, v in adapter_state_dict(params, cfg, method).items()]
    write_safetensors(directory / WEIGHTS_FILE, entries, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


# Fields PEFT writes that change nothing jaxtune computes from the saved tensors (metadata, initialisation).
IGNORED_FIELDS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                  "inference_mode", "init_lora_weights", "init_ia3_weights", "init_weights", "loftq_config",
                  "eva_config", "corda_config", "lora_ga_config", "runtime_config", "megatron_core", "lora_dropout",
                  "num_layers", "num_attention_heads", "token_dim", "encoder_hidden_size",
                  "num_transformer_submodules", "adapter_size", "qalora_group_size", QUANTIZED_BASE}
READ_FIELDS = {
    "LORA": {"r", "lora_alpha", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
             "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias", "modules_to_save",
             "target_parameters"},
    "IA3": {"target_modules", "exclude_modules", "feedforward_modules", "modules_to_save"},
    "PREFIX_TUNING": {"num_virtual_tokens"},
    "JAXTUNE_BOTTLENECK": set(),
}


def _is_unset(value) -> bool:
    return value in (None, False, "", "none", [], {}) or value == "megatron.core"


def method_from_peft_config(config: dict, where: Path) -> MethodConfig:
    """The `MethodConfig` of a PEFT adapter config. A field jaxtune does not compute (set to anything but its
    default), or a value it cannot represent, is refused naming the field: nothing is silently dropped."""
    kind = config.get("peft_type")
    if kind not in READABLE:
        raise JaxtuneError(f"{where}: PEFT adapter type {kind!r} is not supported (readable: {', '.join(READABLE)})")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise JaxtuneError(f"{where}: task_type {config['task_type']!r} is not supported (jaxtune adapts causal "
                           "language models: CAUSAL_LM)")
    for field, value in config.items():
        if field not in IGNORED_FIELDS and field not in READ_FIELDS[kind] and not _is_unset(value):
            raise JaxtuneError(f"{where}: field {field} = {json.dumps(value)} is not supported by jaxtune "
                               f"({kind} adapters are read with {', '.join(sorted(READ_FIELDS[kind])) or 'no fields'})")
    get = lambda key, default: default if config.get(key) is None else config[key]
    try:
        if kind == "LORA":
            return MethodConfig(
                kind="lora", rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                dropout=float(config.get("lora_dropout") or 0.0), target_modules=_targets(config, where),
                exclude_modules=get("exclude_modules", ()), layers_to_transform=get("layers_to_transform", ()),
                layers_pattern=get("layers_pattern", ()), rank_pattern=get("rank_pattern", {}),
                alpha_pattern=get("alpha_pattern", {}), rslora=bool(config.get("use_rslora")),
                dora=bool(config.get("use_dora")), lora_bias=bool(config.get("lora_bias")),
                modules_to_save=get("modules_to_save", ()), target_parameters=get("target_parameters", ()))
        if kind == "IA3":
            method = MethodConfig(kind="ia3", target_modules=_targets(config, where),
                                  exclude_modules=get("exclude_modules", ()),
                                  modules_to_save=get("modules_to_save", ()))
            feedforward = get("feedforward_modules", [])
            feedforward = {feedforward} if isinstance(feedforward, str) else set(feedforward)
            scales_down = any(is_target(method, module_path(m, i)) for i in range(256)
                              for m in ("down_proj", "shared_expert.down_proj"))
            if {f.rsplit(".", 1)[-1] for f in feedforward} != ({"down_proj"} if scales_down else set()):
                raise JaxtuneError(f"{where}: IA3 feedforward_modules {sorted(feedforward)} are not supported "
                                   "(jaxtune scales the input of down_proj and the output of other modules)")
            return method
        if kind == "JAXTUNE_BOTTLENECK":
            return MethodConfig(kind="adapter", adapter_size=int(config["adapter_size"]))
        if config.get("prefix_projection"):
            raise JaxtuneError(f"{where}: prefix tuning with prefix_projection=true is not supported")
        return MethodConfig(kind="prefix", num_virtual_tokens=int(config["num_virtual_tokens"]))
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    except ConfigError as e:
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


def quantized_base(directory: str | Path) -> dict | None:
    """The frozen base a jaxtune QLoRA adapter was trained on, {"bits", "double_quant", "format"}, or None."""
    return read_json(Path(directory) / CONFIG_FILE).get(QUANTIZED_BASE)


def load_peft_adapter(directory: str | Path, params: dict, cfg: ModelConfig,
                      kind: str | None = None, quantization: dict | None = None) -> tuple[MethodConfig, dict]:
    """(method, params with the adapter's leaves) for a PEFT adapter directory and base `params`.

    kind="qlora" puts a LoRA adapter on a quantised copy of the base, with `quantization` {"bits",
    "double_quant"} (default NF4 with double quantisation).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise JaxtuneError(f"{directory}: adapter directory not found")
    method = method_from_peft_config(read_json(directory / CONFIG_FILE), directory / CONFIG_FILE)
    if kind == "qlora":
        if method.kind != "lora":
            raise JaxtuneError(f"{directory}: a quantised base takes a LoRA adapter, not {method.kind}")
        q = quantization or {}
        method = dataclasses.replace(method, kind="qlora", bits=int(q.get("bits", 4)),
                                     double_quant=bool(q.get("double_quant", True)))
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise JaxtuneError(f"{path}: file not found")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises its own error type, or OSError, for damaged files
        raise JaxtuneError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        params = apply_method(params, cfg, method, jax.random.key(0))
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
    return method, _insert(params, cfg, method, {k: v.astype(np.float32) for k, v in state.items()})


def _insert(params: dict, cfg: ModelConfig, method: MethodConfig, state: dict[str, np.ndarray]) -> dict:
    """Inverse of `adapter_state_dict`: the loaded tensors in place of the freshly initialised leaves."""
    layers = dict(params["layers"])
    L = cfg.num_layers
    if method.kind == "prefix":
        emb = state["prompt_embeddings"].reshape(method.num_virtual_tokens, L, 2, cfg.num_kv_heads, cfg.head_dim)
        stacked = emb.transpose(1, 2, 0, 3, 4)  # [L, 2, P, K, hd]
        layers["prefix"] = {"key": jnp.asarray(stacked[:, 0]), "value": jnp.asarray(stacked[:, 1])}
        return {**params, "layers": layers}
    if method.kind == "adapter":
        for adapter, proj, leaf in BOTTLENECK_LEAVES:
            suffix = "weight" if leaf == "kernel" else "bias"
            value = np.stack([state[f"base_model.model.model.layers.{i}.{adapter}.{proj}.{suffix}"] for i in range(L)])
            stored = np.swapaxes(value, 1, 2) if leaf == "kernel" else value
            layers[adapter] = {**layers[adapter], proj: {**layers[adapter][proj], leaf: jnp.asarray(stored)}}
        return {**params, "layers": layers}
    params = dict(params)
    if "lm_head" in method.modules_to_save:
        params["lm_head"] = {"kernel": jnp.asarray(state[SAVED_TENSORS["lm_head"]].T)}
    if "embed_tokens" in method.modules_to_save:
        params["embed_tokens"] = jnp.asarray(state[SAVED_TENSORS["embed_tokens"]])
    if method.kind == "ia3":
        for name in ia3_modules(method, L, cfg.linear_modules):
            leaf = "ia3_in" if "ia3_in" in layers[name] else "ia3_out"
            value = np.stack([np.ravel(state[f"{_prefix(name, i)}.ia3_l"]) for i in range(L)])
            layers[name] = {**layers[name], leaf: jnp.asarray(value)}
        return {**params, "layers": layers}
    for name, lora in lora_layout(method, L, cfg.linear_modules).items():
        module = {k: np.array(v, np.float32) for k, v in layers[name].items() if k in LORA_LEAVES}
        module["lora_a"][:] = 0
        module["lora_b"][:] = 0
        for i, r in enumerate(lora.ranks):
            if not r:
                continue
            prefix = _prefix(name, i)
            module["lora_a"][i, :, :r] = state[f"{prefix}.lora_A.weight"].T
            module["lora_b"][i, :r] = state[f"{prefix}.lora_B.weight"].T
            if method.lora_bias:
                module["lora_bias"][i] = state[f"{prefix}.lora_B.bias"]
            if method.dora:
                module["magnitude"][i] = state[f"{prefix}.lora_magnitude_vector"]
        layers[name] = {**layers[name], **{k: jnp.asarray(v) for k, v in module.items()}}
    for name in method.expert_modules:
        module = layers["experts"][name]
        (L, E, d_in, r), d_out = module["lora_a"].shape, module["lora_b"].shape[-1]
        a = np.stack([state[f"{_expert_prefix(name, i, method)}.lora_A.weight"].reshape(E, r, d_in)
                      for i in range(L)]).transpose(0, 1, 3, 2)
        b = np.stack([state[f"{_expert_prefix(name, i, method)}.lora_B.weight"].reshape(d_out, r, E)
                      for i in range(L)]).transpose(0, 3, 2, 1)
        layers["experts"] = {**layers["experts"], name: {**module, "lora_a": jnp.asarray(a), "lora_b": jnp.asarray(b)}}
    return {**params, "layers": layers}


def load_model_with_adapter(model: str | Path, adapter: str | Path | None = None, dtype=None,
                            base: str = "as-trained", log=None) -> tuple[ModelConfig, dict, MethodConfig | None]:
    """(config, params, method) of a Hugging Face model directory, with a PEFT adapter applied if given.

    base: "as-trained" puts a QLoRA adapter that records its quantised base (`jaxtune_quantized_base`) on that
    base, quantised as in training; "float" uses the float weights. `log(text)` is told which base is used.
    """
    from jaxtune.models.hf_weights import load_model

    check_choice("base", base, ("as-trained", "float"))
    cfg, params = load_model(model, dtype)
    if adapter is None:
        return cfg, params, None
    quantization = quantized_base(adapter) if Path(adapter, CONFIG_FILE).is_file() else None
    use_quantized = quantization is not None and base == "as-trained"
    method, params = load_peft_adapter(adapter, params, cfg, kind="qlora" if use_quantized else None,
                                       quantization=quantization)
    if quantization is not None and log is not None:
        fmt = str(quantization.get("format", "nf4")).upper() + (", double quantisation" if quantization.get(
            "double_quant") else "")
        log(f"{adapter}: QLoRA adapter on its base quantised as in training ({fmt}); --base float for the float "
            "weights" if use_quantized else
            f"{adapter}: QLoRA adapter trained on a quantised base ({fmt}), applied to the float weights")
    return cfg, params, method


def export_merged(model: str | Path, adapter: str | Path | None, out: str | Path, log=None) -> Path:
    """Merge a PEFT LoRA/DoRA adapter into its base and write a Hugging Face model directory (with the tokenizer).

    A QLoRA adapter merges into the float weights (as PEFT merges into a dequantised base: a plain float model).
    Without an adapter the model is written as it loads: a GGUF file becomes the directory transformers makes of
    it (blocks dequantised to float32, the tokenizer and chat template from its metadata).
    """
    from jaxtune.methods.lora import merged_layer
    from jaxtune.models.hf_weights import save_model

    cfg, params, method = load_model_with_adapter(model, adapter, base="float", log=log)
    if adapter is not None and method.kind not in ("lora", "qlora"):
        raise JaxtuneError(f"{adapter}: only LoRA and DoRA adapters merge into the weights, not {method.kind}")
    dtype = str(np.dtype(params["embed_tokens"].dtype))
    tensor = merged_layer(params, method) if adapter is not None else None
    return save_model(out, cfg, params, dtype=dtype, tokenizer_from=model, tensor=tensor)


def export_gguf(model: str | Path, adapter: str | Path | None, out: str | Path, kind: str = "f16", log=None) -> Path:
    """A model, with a PEFT LoRA/DoRA adapter merged in when given (a full fine-tune's model directory needs none),
    written as a GGUF file of `kind` (f32, f16, bf16, q8_0) with its tokenizer and chat template."""
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.methods.gguf_export import save_gguf
    from jaxtune.methods.lora import merged_layer

    cfg, params, method = load_model_with_adapter(model, adapter, base="float", log=log)
    if adapter is not None and method.kind not in ("lora", "qlora"):
        raise JaxtuneError(f"{adapter}: only LoRA and DoRA adapters merge into the weights, not {method.kind}")
    tensor = merged_layer(params, method) if adapter is not None else None
    return save_gguf(out, cfg, params, load_tokenizer(model), kind, tensor=tensor, name=Path(str(model)).stem)


def export_gguf_lora(model: str | Path, adapter: str | Path, out: str | Path, log=None) -> Path:
    """A PEFT LoRA adapter as llama.cpp's GGUF LoRA, for `model` written by `export_gguf` (or any GGUF of it)."""
    from jaxtune.methods.gguf_export import save_gguf_lora

    cfg, params, method = load_model_with_adapter(model, adapter, log=log)
    return save_gguf_lora(out, cfg, params, method, name=Path(str(adapter)).name)


def adapter_summary(model: str | Path, adapter: str | Path) -> dict:
    """An adapter's method and exact parameter counts on its base, from the configs alone (nothing allocated)."""
    from jaxtune.methods.transform import parameter_report
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.params import abstract_params

    cfg = load_config(model)
    method = method_from_peft_config(read_json(Path(adapter) / CONFIG_FILE), Path(adapter) / CONFIG_FILE)
    shapes = jax.eval_shape(lambda p, key: apply_method(p, cfg, method, key), abstract_params(cfg), jax.random.key(0))
    report = parameter_report(shapes, method, cfg)
    return {"method": method.kind + (" (DoRA)" if method.dora else ""), "trainable": report.trainable,
            "total": report.total, "percent": report.percent}
