"""Adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

Key names and layouts follow what PEFT itself saves (peft `save_pretrained`, `get_peft_model_state_dict`):

    LoRA   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
           base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]
    DoRA   base_model.model.model.layers.{i}.self_attn.q_proj.lora_magnitude_vector   [out]
    IA3    base_model.model.model.layers.{i}.self_attn.k_proj.ia3_l   [out, 1];  ...mlp.down_proj.ia3_l  [1, in]
    prefix prompt_embeddings   [P, L * 2 * K * hd], per virtual token: layer-major, key then value, head, dim

rsLoRA is LoRA with `use_rslora`; QLoRA adapters are LoRA adapters (the quantisation belongs to the base).
PEFT has no bottleneck adapters: jaxtune writes them in the same layout under its own `peft_type`
"JAXTUNE_BOTTLENECK" (`...layers.{i}.attn_adapter.down.weight` [m, D], ...), which only jaxtune reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.transform import apply_method
from jaxtune.models.hf_config import read_json
from jaxtune.models.hf_weights import hf_module_path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
READABLE = ("LORA", "IA3", "PREFIX_TUNING", "JAXTUNE_BOTTLENECK")
BOTTLENECK_LEAVES = [(a, p, leaf) for a in ("attn_adapter", "mlp_adapter") for p in ("down", "up")
                     for leaf in ("kernel", "bias")]


def _prefix(module: str, layer: int) -> str:
    return f"base_model.model.model.layers.{layer}.{hf_module_path(module)}"


def peft_config(cfg: ModelConfig, method: MethodConfig, base_model: str = "") -> dict:
    """The keys PEFT needs to rebuild `method` on a transformers model of `cfg`."""
    common = {"base_model_name_or_path": base_model, "task_type": "CAUSAL_LM", "inference_mode": True}
    if method.kind in ("lora", "qlora"):
        return {**common, "peft_type": "LORA", "r": method.rank, "lora_alpha": method.alpha,
                "lora_dropout": method.dropout, "target_modules": list(method.target_modules), "bias": "none",
                "use_rslora": method.rslora, "use_dora": method.dora, "fan_in_fan_out": False,
                "init_lora_weights": True, "modules_to_save": None}
    if method.kind == "ia3":
        return {**common, "peft_type": "IA3", "target_modules": list(method.target_modules),
                "feedforward_modules": [m for m in method.target_modules if m == "down_proj"],
                "fan_in_fan_out": False, "init_ia3_weights": True, "modules_to_save": None}
    if method.kind == "prefix":
        return {**common, "peft_type": "PREFIX_TUNING", "num_virtual_tokens": method.num_virtual_tokens,
                "num_layers": cfg.num_layers, "num_attention_heads": cfg.num_kv_heads, "token_dim": cfg.kv_size,
                "encoder_hidden_size": cfg.kv_size, "num_transformer_submodules": 1, "prefix_projection": False}
    if method.kind == "adapter":
        return {**common, "peft_type": "JAXTUNE_BOTTLENECK", "adapter_size": method.adapter_size}
    raise JaxtuneError(f"method {method.kind!r} has no PEFT format (PEFT has LoRA, rsLoRA, DoRA, IA3 and prefix)")


def adapter_state_dict(params: dict, cfg: ModelConfig, method: MethodConfig) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 numpy array in torch's layout."""
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
    for name in method.target_modules:
        module = {k: f32(v) for k, v in layers[name].items() if k in ("lora_a", "lora_b", "magnitude", "ia3_in",
                                                                         "ia3_out")}
        for i in range(cfg.num_layers):
            prefix = _prefix(name, i)
            if method.kind == "ia3":
                ia3 = module["ia3_in"][i][None, :] if "ia3_in" in module else module["ia3_out"][i][:, None]
                state[f"{prefix}.ia3_l"] = np.ascontiguousarray(ia3)
                continue
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(module["lora_a"][i].T)
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(module["lora_b"][i].T)
            if method.dora:
                state[f"{prefix}.lora_magnitude_vector"] = np.ascontiguousarray(module["magnitude"][i])
    return state


def save_peft_adapter(directory: str | Path, params: dict, cfg: ModelConfig, method: MethodConfig,
                      base_model: str = "") -> Path:
    """Write `method`'s leaves of `params` as a PEFT adapter directory."""
    directory = Path(directory)
    config = peft_config(cfg, method, base_model)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(params, cfg, method), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _targets(config: dict, where: Path) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise JaxtuneError(f"{where}: target_modules {targets!r} must be a list of module names")
    return tuple(targets)


def method_from_peft_config(config: dict, where: Path) -> MethodConfig:
    """The `MethodConfig` of a PEFT adapter config; refuses what jaxtune would compute differently."""
    kind = config.get("peft_type")
    if kind not in READABLE:
        raise JaxtuneError(f"{where}: PEFT adapter type {kind!r} is not supported (readable: {', '.join(READABLE)})")
    for key in ("modules_to_save", "layers_to_transform", "alpha_pattern", "rank_pattern"):
        if config.get(key):
            raise JaxtuneError(f"{where}: {key}={config[key]!r} is not supported")
    try:
        if kind == "LORA":
            if config.get("bias", "none") != "none" or config.get("lora_bias"):
                raise JaxtuneError(f"{where}: LoRA bias={config.get('bias')!r} is not supported (only 'none')")
            return MethodConfig(kind="lora", rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                                dropout=float(config.get("lora_dropout", 0.0)), target_modules=_targets(config, where),
                                rslora=bool(config.get("use_rslora")), dora=bool(config.get("use_dora")))
        if kind == "IA3":
            targets = _targets(config, where)
            feedforward = set(config.get("feedforward_modules") or [])
            if feedforward != {"down_proj"} & set(targets):
                raise JaxtuneError(f"{where}: IA3 feedforward_modules {sorted(feedforward)} are not supported "
                                   "(jaxtune scales the input of down_proj and the output of other modules)")
            return MethodConfig(kind="ia3", target_modules=targets)
        if kind == "JAXTUNE_BOTTLENECK":
            return MethodConfig(kind="adapter", adapter_size=int(config["adapter_size"]))
        if config.get("prefix_projection"):
            raise JaxtuneError(f"{where}: prefix tuning with prefix_projection=true is not supported")
        return MethodConfig(kind="prefix", num_virtual_tokens=int(config["num_virtual_tokens"]))
    except KeyError as e:
        raise JaxtuneError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise JaxtuneError(f"{where}: {e}") from None


def load_peft_adapter(directory: str | Path, params: dict, cfg: ModelConfig,
                      kind: str | None = None) -> tuple[MethodConfig, dict]:
    """(method, params with the adapter's leaves) for a PEFT adapter directory and base `params`.

    kind="qlora" puts a LoRA adapter on a quantised copy of the base (bits and double_quant at their defaults).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise JaxtuneError(f"{directory}: adapter directory not found")
    method = method_from_peft_config(read_json(directory / CONFIG_FILE), directory / CONFIG_FILE)
    if kind == "qlora":
        method = MethodConfig(**{**method.__dict__, "kind": "qlora"})
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise JaxtuneError(f"{path}: file not found")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises its own error type, or OSError, for damaged files
        raise JaxtuneError(f"{path}: not a readable safetensors file ({e})") from None
    params = apply_method(params, cfg, method, jax.random.key(0))
    expected = adapter_state_dict(params, cfg, method)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise JaxtuneError(f"{path}: tensor {name} is {'missing' if missing else 'unexpected'} "
                           f"({len(missing)} missing, {len(unexpected)} unexpected)")
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
            layers[adapter] = {**layers[adapter], proj: {**layers[adapter][proj],
                                                          leaf: jnp.asarray(np.swapaxes(value, 1, 2) if leaf == "kernel" else value)}}
        return {**params, "layers": layers}
    for name in method.target_modules:
        module = dict(layers[name])
        per_layer = lambda suffix, f: jnp.asarray(np.stack([f(state[f"{_prefix(name, i)}.{suffix}"]) for i in range(L)]))
        if method.kind == "ia3":
            leaf = "ia3_in" if "ia3_in" in module else "ia3_out"
            module[leaf] = per_layer("ia3_l", np.ravel)
        else:
            module["lora_a"] = per_layer("lora_A.weight", np.transpose)
            module["lora_b"] = per_layer("lora_B.weight", np.transpose)
            if method.dora:
                module["magnitude"] = per_layer("lora_magnitude_vector", np.asarray)
        layers[name] = module
    return {**params, "layers": layers}


def load_model_with_adapter(model: str | Path, adapter: str | Path | None = None,
                            dtype=None) -> tuple[ModelConfig, dict, MethodConfig | None]:
    """(config, params, method) of a Hugging Face model directory, with a PEFT adapter applied if given."""
    from jaxtune.models.hf_weights import load_model

    cfg, params = load_model(model, dtype)
    if adapter is None:
        return cfg, params, None
    method, params = load_peft_adapter(adapter, params, cfg)
    return cfg, params, method


def export_merged(model: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """Merge a PEFT LoRA/DoRA adapter into its base and write a Hugging Face model directory (with the tokenizer)."""
    from jaxtune.methods.lora import merge
    from jaxtune.models.hf_weights import save_model

    cfg, params, method = load_model_with_adapter(model, adapter)
    if method.kind not in ("lora", "qlora"):
        raise JaxtuneError(f"{adapter}: only LoRA and DoRA adapters merge into the weights, not {method.kind}")
    dtype = str(np.dtype(params["embed_tokens"].dtype))
    return save_model(out, cfg, merge(params, method), dtype=dtype, tokenizer_from=model)


def adapter_summary(model: str | Path, adapter: str | Path) -> dict:
    """An adapter's method and exact parameter counts on its base, from the configs alone (nothing allocated)."""
    from jaxtune.methods.transform import parameter_report
    from jaxtune.models.hf_config import load_config
    from jaxtune.models.params import abstract_params

    cfg = load_config(model)
    method = method_from_peft_config(read_json(Path(adapter) / CONFIG_FILE), Path(adapter) / CONFIG_FILE)
    shapes = jax.eval_shape(lambda p, key: apply_method(p, cfg, method, key), abstract_params(cfg), jax.random.key(0))
    report = parameter_report(shapes, method)
    return {"method": method.kind + (" (DoRA)" if method.dora else ""), "trainable": report.trainable,
            "total": report.total, "percent": report.percent}
