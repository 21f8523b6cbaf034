"""LoRA's PEFT format: `...{module}.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] per adapted layer (its first
r ranks), `lora_B.bias`, `lora_magnitude_vector`; an expert stack's `mlp.experts.lora_A.weight` [r E, in] and
`lora_B.weight` [out, r E] (PEFT's ParamWrapper). A QLoRA adapter records the quantised base it was trained on
(`QUANTIZED_BASE`), so it loads onto that base; PiSSA and OLoRA are written as PEFT converts them (`as_stored`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.lora.init import CONVERTED_INITS, LoRAOptions, as_plain_lora
from jaxtune.methods.lora.layout import lora_layout
from jaxtune.methods.lora.leaves import LORA_LEAVES
from jaxtune.methods.lora.options import LoRAConfig, QLoRAConfig
from jaxtune.methods.targets import peft_module, peft_names
from jaxtune.models.hf_families import peft_unloadable

QUANTIZED_BASE = "jaxtune_quantized_base"  # beside PEFT's fields: the frozen base a QLoRA adapter was trained on
PEFT_READ_FIELDS = (QUANTIZED_BASE, "r", "lora_alpha", "target_modules", "exclude_modules", "layers_to_transform",
                    "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias",
                    "modules_to_save", "target_parameters")


def _expert_prefix(module: str, layer: int, method: LoRAConfig) -> str:
    """Where PEFT keeps the LoRA of expert stack `module`: PEFT wraps the experts' parameters in the order the
    module registers them (gate_up_proj, then down_proj), so with both the first is the second's base layer."""
    inner = module == "gate_up_proj" and len(method.expert_modules) == 2
    return f"base_model.model.model.layers.{layer}.mlp.experts" + ".base_layer" * inner


def _peft_config(cfg: ModelConfig, method: LoRAConfig) -> dict:
    unloadable = [name for name in lora_layout(method, cfg.layer_stacks()) if name in peft_unloadable(cfg)]
    if unloadable:
        raise JaxtuneError(f"LoRA on {', '.join(unloadable)}: PEFT takes a {cfg.architecture} adapter's gate_proj, "
                           "up_proj and down_proj for its routed experts and would drop these; export the merged "
                           "model, or train without them (exclude_modules)")
    return {"peft_type": "LORA", "r": method.rank, "lora_alpha": method.alpha, "lora_dropout": method.dropout,
            "target_modules": peft_names(method.target_modules),
            "exclude_modules": peft_names(method.exclude_modules),
            "layers_to_transform": list(method.layers_to_transform) or None,
            "layers_pattern": list(method.layers_pattern) or None, "rank_pattern": dict(method.rank_pattern),
            "alpha_pattern": dict(method.alpha_pattern), "bias": "none", "lora_bias": method.lora_bias,
            "use_rslora": method.rslora, "use_dora": method.dora, "fan_in_fan_out": False,
            "init_lora_weights": "gaussian" if method.init == "gaussian" else True,  # others load as trained
            "target_parameters": list(method.target_parameters) or None}


def _peft_tensors(params: dict, cfg: ModelConfig, method: LoRAConfig) -> dict[str, np.ndarray]:
    layers, state = params["layers"], {}
    f32 = lambda x: np.asarray(x, np.float32)
    for name, lora in lora_layout(method, cfg.layer_stacks()).items():
        module = {k: f32(v) for k, v in layers[name].items() if k in LORA_LEAVES}
        for i, (layer, r) in enumerate(zip(lora.layers, lora.ranks)):
            if not r:
                continue
            prefix = peft_module(name, layer)
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(module["lora_a"][i][:, :r].T)
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(module["lora_b"][i][:r].T)
            if method.lora_bias:
                state[f"{prefix}.lora_B.bias"] = np.ascontiguousarray(module["lora_bias"][i])
            if method.dora:
                state[f"{prefix}.lora_magnitude_vector"] = np.ascontiguousarray(module["magnitude"][i])
    for name in method.expert_modules:
        a, b = (f32(layers["experts"][name][k]) for k in ("lora_a", "lora_b"))  # [L, E, in, r], [L, E, r, out]
        E, d_in, r = a.shape[1:]
        for row, i in enumerate(cfg.module_layers("experts")):
            prefix = _expert_prefix(name, i, method)
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[row].transpose(0, 2, 1).reshape(E * r, d_in))
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[row].transpose(2, 1, 0).reshape(-1, r * E))
    return state


def _method_of(config: dict, get, targets) -> LoRAConfig:
    """The options of a PEFT LoRA config; QLoRA's when it records the quantised base it was trained on."""
    fields = dict(
        rank=int(config["r"]), alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout") or 0.0), target_modules=targets,
        exclude_modules=get("exclude_modules", ()), layers_to_transform=get("layers_to_transform", ()),
        layers_pattern=get("layers_pattern", ()), rank_pattern=get("rank_pattern", {}),
        alpha_pattern=get("alpha_pattern", {}), rslora=bool(config.get("use_rslora")),
        dora=bool(config.get("use_dora")), lora_bias=bool(config.get("lora_bias")),
        modules_to_save=get("modules_to_save", ()), target_parameters=get("target_parameters", ()))
    base = config.get(QUANTIZED_BASE)
    if not base:
        return LoRAConfig(**fields)
    loftq = base.get("init") == "loftq"  # LoftQ's base, recomputed from the adapter's modules and ranks
    return QLoRAConfig(**fields, bits=int(base.get("bits", 4)), double_quant=bool(base.get("double_quant", True)),
                       init="loftq" if loftq else "default", loftq_iter=int(base.get("loftq_iter", 1)) if loftq else 1)


def _peft_load(state: dict, params: dict, cfg: ModelConfig, method: LoRAConfig) -> dict:
    """The loaded tensors in place of the freshly initialised leaves."""
    layers = dict(params["layers"])
    for name, lora in lora_layout(method, cfg.layer_stacks()).items():
        module = {k: np.array(v, np.float32) for k, v in layers[name].items() if k in LORA_LEAVES}
        module["lora_a"][:] = 0
        module["lora_b"][:] = 0
        for i, (layer, r) in enumerate(zip(lora.layers, lora.ranks)):
            if not r:
                continue
            prefix = peft_module(name, layer)
            module["lora_a"][i, :, :r] = state[f"{prefix}.lora_A.weight"].T
            module["lora_b"][i, :r] = state[f"{prefix}.lora_B.weight"].T
            if method.lora_bias:
                module["lora_bias"][i] = state[f"{prefix}.lora_B.bias"]
            if method.dora:
                module["magnitude"][i] = state[f"{prefix}.lora_magnitude_vector"]
        layers[name] = {**layers[name], **{k: jnp.asarray(v) for k, v in module.items()}}
    for name in method.expert_modules:
        module = layers["experts"][name]
        (_, E, d_in, r), d_out = module["lora_a"].shape, module["lora_b"].shape[-1]
        layers_e = cfg.module_layers("experts")
        a = np.stack([state[f"{_expert_prefix(name, i, method)}.lora_A.weight"].reshape(E, r, d_in)
                      for i in layers_e]).transpose(0, 1, 3, 2)
        b = np.stack([state[f"{_expert_prefix(name, i, method)}.lora_B.weight"].reshape(d_out, r, E)
                      for i in layers_e]).transpose(0, 3, 2, 1)
        layers["experts"] = {**layers["experts"], name: {**module, "lora_a": jnp.asarray(a), "lora_b": jnp.asarray(b)}}
    return {**params, "layers": layers}


def _qlora_peft_config(cfg: ModelConfig, method: QLoRAConfig) -> dict:
    config = {**_peft_config(cfg, method), QUANTIZED_BASE: {"bits": method.bits, "double_quant": method.double_quant,
                                                            "format": "nf4" if method.bits == 4 else "int8"}}
    if method.init == "loftq":  # the base is LoftQ's, recomputed from the original weights as it is read
        config[QUANTIZED_BASE].update(init="loftq", loftq_iter=method.loftq_iter)
    return config


def as_stored(params: dict, method: LoRAOptions, initial: dict | None, cfg: ModelConfig
              ) -> tuple[dict, LoRAOptions]:
    """A PiSSA or OLoRA adapter as PEFT stores it: the plain LoRA of rank 2r it is on the original weights, from its
    init's A and B `initial` (`spine.load.initial_leaves` recomputes them); other adapters as they are."""
    if method.init not in CONVERTED_INITS:
        return params, method
    if initial is None:
        raise JaxtuneError(f"a {method.init} adapter exports as a LoRA on the original weights: pass its init's "
                           "A and B as `initial` (spine.load.initial_leaves recomputes them)")
    return as_plain_lora(params, method, initial, cfg)
