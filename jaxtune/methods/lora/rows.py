"""Several LoRA adapters of one base model stacked in one tree, for batches whose rows each name their adapter
(`models/adapter_rows.py` runs them; `spine.model.load_adapters` reads PEFT directories into it):
    params = stack_adapters({"a": (method_a, params_a), "b": (method_b, params_b)}, cfg)
    generate_text(params, cfg, tokenizer, prompts, adapter_of_row=[1, 2, 0])   # adapter a, adapter b, the base

A module some adapter targets gets `stack_a` [L, N+1, in, R] and `stack_b` [L, N+1, R, out]: slot 0 zeros (the
base), slot i adapter i's A and its B times its per-layer scale (alpha / r; rsLoRA alpha / sqrt(r)), R the largest
rank there (smaller ranks and skipped modules: zeros); the forward's scale is 1. Only plain low-rank sums on one base
mix: DoRA, lora_bias, modules_to_save, expert LoRA, a changed base (PiSSA, OLoRA, LoftQ), other methods are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.lora.init import BASE_INITS
from jaxtune.methods.lora.layout import lora_layout
from jaxtune.methods.lora.leaves import LORA_LEAVES
from jaxtune.methods.lora.options import LoRAConfig
from jaxtune.models.adapter_rows import STACK_LEAVES
from jaxtune.models.quant import full_shape


def why_not_mixed(method: LoRAConfig) -> str | None:
    """What keeps an adapter of `method` out of a batch with other adapters, or None (`Method.mixes`)."""
    refused = {"DoRA (use_dora)": method.dora, "a LoRA bias (lora_bias)": method.lora_bias,
               f"modules_to_save {list(method.modules_to_save)}": method.modules_to_save,
               "LoRA on expert stacks (target_parameters)": method.target_parameters,
               f"init {method.init} (it changes the base weights)": method.init in BASE_INITS}
    what = next((what for what, present in refused.items() if present), None)
    return None if what is None else f"{what} cannot share a batch with other adapters (only plain LoRA mixes)"


def base_of(params: dict) -> dict:
    """`params` without LoRA's leaves (nor adapter stacks): the frozen base they were added to."""
    drop = LORA_LEAVES + STACK_LEAVES
    layers = {name: {k: v for k, v in m.items() if k not in drop} if isinstance(m, dict) else m
              for name, m in params["layers"].items()}
    return {**params, "layers": layers}


def _signature(params: dict):
    return jax.tree.structure(params), [(x.shape, x.dtype) for x in jax.tree.leaves(params)]


def stack_adapters(adapters: dict[str, tuple[LoRAConfig, dict]], cfg: ModelConfig) -> dict:
    """The base tree of the adapters' params with their LoRA stacked: adapter i (in `adapters`' order) is slot i + 1.

    adapters: name -> (method, params with that method's LoRA leaves), all on the same base tree (same model, same
    quantisation), each one that mixes (`why_not_mixed`). Raises a one-line JaxtuneError naming an adapter whose
    base differs.
    """
    if not adapters:
        raise JaxtuneError("no adapters to stack")
    first, (_, first_params) = next(iter(adapters.items()))
    base = base_of(first_params)
    for name, (method, params) in adapters.items():
        if _signature(base_of(params)) != _signature(base):
            raise JaxtuneError(f"adapter {name}: its base differs from adapter {first}'s (another model, or another "
                               "quantisation: QLoRA bits): adapters in one batch share their base")
    layouts = [lora_layout(method, cfg.layer_stacks()) for method, _ in adapters.values()]
    layers = dict(base["layers"])
    for module in cfg.linear_modules:
        adapted = [(layout[module], params["layers"][module]) for layout, (_, params) in zip(layouts, adapters.values())
                   if module in layout]
        if not adapted:
            continue
        R = max(lora.max_rank for lora, _ in adapted)
        L, d_in, d_out = full_shape(layers[module]["kernel"])  # the module's layers (`module_layers`)
        slots_a, slots_b = [jnp.zeros((L, d_in, R), jnp.float32)], [jnp.zeros((L, R, d_out), jnp.float32)]
        for layout, (_, params) in zip(layouts, adapters.values()):
            if module not in layout:
                slots_a.append(slots_a[0])
                slots_b.append(slots_b[0])
                continue
            leaves, scale_L = params["layers"][module], jnp.asarray(layout[module].scales, jnp.float32)
            pad = R - leaves["lora_a"].shape[-1]
            slots_a.append(jnp.pad(leaves["lora_a"].astype(jnp.float32), ((0, 0), (0, 0), (0, pad))))
            b = scale_L[:, None, None] * leaves["lora_b"].astype(jnp.float32)
            slots_b.append(jnp.pad(b, ((0, 0), (0, pad), (0, 0))))
        stacks = {"stack_a": jnp.stack(slots_a, axis=1), "stack_b": jnp.stack(slots_b, axis=1)}
        layers[module] = {**layers[module], **stacks}
    return {**base, "layers": layers}
