"""Methods as pure transforms of the parameter tree (any unit of `methods/base.py`): add leaves, quantise the base.

    params = apply_method(base_params, cfg, MethodConfig(kind="lora", rank=8), key)
    mask = trainable_mask(params, method)                  # True at leaves the optimiser updates
    trainable, frozen = partition(params, mask)            # differentiate w.r.t. `trainable` only
    logits = forward(combine(trainable, frozen), tokens, cfg, method=method)

New leaves stack on the layer axis like the base weights, so the forward still scans one block (each unit's module
gives their shapes and init); `method_leaf_axes` gives their logical axes, `parameter_report` PEFT's counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.config.model import FUSED_MODULES, SEPARATE_MODULES, SHARED_EXPERT_MODULES
from jaxtune.methods.base import METHODS, adapter_keys, method_unit
from jaxtune.methods.targets import uniform_stacks
from jaxtune.models.quant import QuantizedArray, full_shape


def method_leaf_axes(keys: tuple[str, ...], base_axes: dict) -> tuple[str, ...] | None:
    """Logical axes of the method leaf at dict path `keys`, given the base model's `logical_axes`; None if no
    registered method adds such a leaf. A module's leaves take the (layers, in, out) axes of the kernel they adapt,
    so the sharding rules split them as that kernel is split."""
    module_axes = {leaf: axes for unit in METHODS.values() for leaf, axes in unit.module_axes.items()}
    if len(keys) == 3 and keys[0] == "layers" and keys[2] in module_axes:
        module = base_axes["layers"].get(keys[1])
        if isinstance(module, dict) and "kernel" in module:
            return module_axes[keys[2]](*module["kernel"])
    if len(keys) == 4 and keys[:2] == ("layers", "experts") and keys[3] in module_axes:  # each expert's own
        layers, experts, d_in, d_out = base_axes["layers"]["experts"][keys[2]]["kernel"]
        return (layers, experts, *module_axes[keys[3]](None, d_in, d_out)[1:])
    if keys == ("lm_head", "kernel"):  # a tied model's head, parted from the embedding (modules_to_save)
        return ("table_embed", "vocab")
    return next((unit.leaf_axes[keys] for unit in METHODS.values() if keys in unit.leaf_axes), None)


def quantize_base(params: dict, method: MethodConfig) -> dict:
    """The base tree as `method` holds it frozen: every linear kernel quantised for QLoRA, else as it is."""
    quantize = method_unit(method).quantize_base
    return params if quantize is None else quantize(params, method)


def add_method_leaves(params: dict, cfg: ModelConfig, method: MethodConfig, key: jax.Array) -> dict:
    """The (already quantised) base tree with `method`'s new leaves added. Reads the kernels' shapes, and their
    values only for DoRA's magnitude and a tied head parted from the embedding."""
    params = method_unit(method).add_leaves(params, cfg, method, key)
    if method.trained_whole and "lm_head" not in params:  # tied: the head and the embedding part ways, as in PEFT
        params = {**params, "lm_head": {"kernel": params["embed_tokens"].T}}
    return params


def apply_method(params: dict, cfg: ModelConfig, method: MethodConfig, key: jax.Array) -> dict:
    """The base tree with `method`'s leaves added (and, for QLoRA, every linear kernel quantised; an init from the
    weights, LoRA's PiSSA, OLoRA or LoftQ, changes the adapted kernels first: `Method.base_init`).

    Pure and traceable: `jax.eval_shape(apply_method, ...)` gives the transformed abstract tree. The spine's loader
    does the parts apart: the init and `quantize_base` tensor by tensor as it reads the checkpoint,
    `add_method_leaves` in the new leaves' shardings.
    """
    base_init = method_unit(method).base_init
    params, initial = (params, {}) if base_init is None else base_init.tree(params, cfg, method)
    return with_initial(add_method_leaves(quantize_base(params, method), cfg, method, key), initial)


def with_initial(params: dict, initial: dict) -> dict:
    """`params` with the leaves of `initial` ({module: {leaf: value}}) in place of those it has."""
    layers = {**params["layers"], **{name: {**params["layers"][name], **leaves} for name, leaves in initial.items()}}
    return {**params, "layers": layers}


def _path_keys(path) -> list[str]:
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]


def trainable_mask(params: dict, method: MethodConfig, heads: tuple[str, ...] = ()) -> dict:
    """True at the leaves the optimiser updates: everything for a full fine-tune, else only the method's leaves, the
    modules it trains whole and `heads` (the top-level leaves an objective adds: a reward model's score)."""
    unit, adapters = method_unit(method), adapter_keys() + heads

    def trainable(path, leaf) -> bool:
        if unit.trains_base:
            return jnp.issubdtype(leaf.dtype, jnp.floating)
        keys = _path_keys(path)
        return keys[0] in method.trained_whole or any(k in adapters for k in keys)

    return jax.tree_util.tree_map_with_path(trainable, params)


def partition(params: dict, mask: dict) -> tuple[dict, dict]:
    """(trainable, frozen): the same tree twice, with None where the other one holds the leaf."""
    trainable = jax.tree.map(lambda p, m: p if m else None, params, mask)
    frozen = jax.tree.map(lambda p, m: None if m else p, params, mask)
    return trainable, frozen


def combine(trainable: dict, frozen: dict) -> dict:
    """Inverse of `partition`."""
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=lambda x: x is None)


@dataclass(frozen=True)
class ParameterReport:
    """Exact trainable and total parameter counts (quantised weights counted by their original elements)."""

    trainable: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / self.total

    def __str__(self) -> str:
        return f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {self.percent:.4f}"


def parameter_report(params: dict, method: MethodConfig, cfg: ModelConfig | None = None,
                     heads: tuple[str, ...] = ()) -> ParameterReport:
    """Counts as PEFT's `get_nb_trainable_parameters` gives them, for a tree of arrays or ShapeDtypeStructs; `heads`:
    top-level leaves an objective adds, counted with the adapter's.

    PEFT keeps the original of each of `modules_to_save` beside its trained copy, so both count in the total; on
    a model with tied embeddings (pass its `cfg`) one original is the tied matrix the tree already holds.
    """
    is_quantized = lambda x: isinstance(x, QuantizedArray)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized)
    unit, adapter_leaves = method_unit(method), adapter_keys() + heads
    if unit.trains_base:
        total = sum(math.prod(full_shape(leaf)) for _, leaf in leaves)
        return ParameterReport(total, total)
    counted = {}
    if unit.count is not None:  # PEFT counts these modules' parameters without jaxtune's padding
        if cfg is not None:
            stacks = cfg.layer_stacks()
        else:  # every layer holds every module
            L = full_shape(params["layers"]["o_proj"]["kernel"])[0]
            layout = FUSED_MODULES if "qkv_proj" in params["layers"] else SEPARATE_MODULES + SHARED_EXPERT_MODULES
            stacks = uniform_stacks(L, tuple(name for name in layout if name in params["layers"]))
        counted = unit.count(params, method, stacks)
    base = adapters = saved = 0
    for path, leaf in leaves:
        keys, size = _path_keys(path), math.prod(full_shape(leaf))
        if keys[0] == "layers" and keys[1] in counted and keys[2] in adapter_leaves:
            continue
        if any(k in adapter_leaves for k in keys):
            adapters += size
        elif keys[0] in method.trained_whole:
            saved += size
        else:
            base += size
    adapters += sum(counted.values())
    tied = cfg is not None and cfg.tie_word_embeddings and bool(method.trained_whole)
    originals = saved - (math.prod(params["embed_tokens"].shape) if tied else 0)
    return ParameterReport(adapters + saved, base + adapters + saved + originals)
