"""Methods as pure transforms of the parameter tree: add adapter leaves, swap frozen kernels for quantised ones.

    params = apply_method(base_params, cfg, MethodConfig(kind="lora", rank=8), key)
    mask = trainable_mask(params, method)                  # True at leaves the optimiser updates
    trainable, frozen = partition(params, mask)            # differentiate w.r.t. `trainable` only
    logits = forward(combine(trainable, frozen), tokens, cfg, method=method)

New leaves stack on the layer axis like the base weights, so the forward still scans one block:
LoRA `lora_a` [L, in, r] (PEFT's kaiming-uniform init) and `lora_b` [L, r, out] (zeros), on a mixture's expert
stacks (`target_parameters`) `lora_a` [L, E, in, r] and `lora_b` [L, E, r, out]; DoRA `magnitude`
[L, out] (the column norms of the base weight); IA3 `ia3_in` [L, in] for down_proj and `ia3_out` [L, out] for
other modules (ones); prefix `prefix.key` / `prefix.value` [L, P, K, hd] (N(0, 1), as PEFT's embedding);
bottleneck adapters `attn_adapter` / `mlp_adapter` with `down` [L, D, m] (N(0, 0.02)) and `up` [L, m, D] (zeros).
Each starts as the identity on the base model except prefix tuning, which adds attended keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtune.config import LINEAR_MODULE_NAMES, MethodConfig, ModelConfig
from jaxtune.config.model import FUSED_MODULES, SEPARATE_MODULES, SHARED_EXPERT_MODULES
from jaxtune.config.targets import ModuleLoRA, ia3_modules, lora_layout
from jaxtune.errors import JaxtuneError
from jaxtune.models.quant import QuantizedArray, dequantize, full_shape, quantize_int8, quantize_nf4

ADAPTER_KEYS = ("lora_a", "lora_b", "magnitude", "lora_bias", "ia3_in", "ia3_out", "prefix", "attn_adapter",
                "mlp_adapter", "score")  # score: a reward model's head, trained with any method


# The logical axes of every leaf a method adds: a module's leaves from the (layers, in, out) axes of the kernel they
# adapt, so the sharding rules split them as that kernel is split; layer-level leaves by name. jaxtune.parallel
# reads this table and names no method.
MODULE_LEAF_AXES = {
    "lora_a": lambda layers, d_in, d_out: (layers, d_in, "lora_rank"),
    "lora_b": lambda layers, d_in, d_out: (layers, "lora_rank", d_out),
    "lora_bias": lambda layers, d_in, d_out: (layers, d_out),
    "magnitude": lambda layers, d_in, d_out: (layers, d_out),
    "ia3_in": lambda layers, d_in, d_out: (layers, d_in),
    "ia3_out": lambda layers, d_in, d_out: (layers, d_out),
}
LEAF_AXES = {
    ("layers", "prefix", "key"): ("layers", "prefix", "kv_heads", "head_dim"),
    ("layers", "prefix", "value"): ("layers", "prefix", "kv_heads", "head_dim"),
    **{("layers", a, "down", "kernel"): ("layers", "embed", "adapter") for a in ("attn_adapter", "mlp_adapter")},
    **{("layers", a, "down", "bias"): ("layers", "adapter") for a in ("attn_adapter", "mlp_adapter")},
    **{("layers", a, "up", "kernel"): ("layers", "adapter", "embed") for a in ("attn_adapter", "mlp_adapter")},
    **{("layers", a, "up", "bias"): ("layers", "embed") for a in ("attn_adapter", "mlp_adapter")},
    ("lm_head", "kernel"): ("table_embed", "vocab"),  # a tied model's head, parted from the embedding (modules_to_save)
}


def method_leaf_axes(keys: tuple[str, ...], base_axes: dict) -> tuple[str, ...] | None:
    """Logical axes of the method leaf at dict path `keys`, given the base model's `logical_axes`; None if no
    method adds such a leaf."""
    if len(keys) == 3 and keys[0] == "layers" and keys[2] in MODULE_LEAF_AXES:
        module = base_axes["layers"].get(keys[1])
        if isinstance(module, dict) and "kernel" in module:
            return MODULE_LEAF_AXES[keys[2]](*module["kernel"])
    if len(keys) == 4 and keys[:2] == ("layers", "experts") and keys[3] in ("lora_a", "lora_b"):
        layers, experts, d_in, d_out = base_axes["layers"]["experts"][keys[2]]["kernel"]
        return (layers, experts, *MODULE_LEAF_AXES[keys[3]](None, d_in, d_out)[1:])
    return LEAF_AXES.get(keys)


def _lora_leaves(kernel, lora: ModuleLoRA, method: MethodConfig, key) -> dict:
    """LoRA's leaves for one module, rank `lora.max_rank`; a layer of smaller rank holds zeros beyond its rank."""
    L, d_in, d_out = full_shape(kernel)
    R = lora.max_rank
    bound = 1 / math.sqrt(d_in)  # torch kaiming_uniform_(a=sqrt(5)) on lora_A.weight [r, in]
    lora_a = jax.random.uniform(key, (L, d_in, R), jnp.float32, -bound, bound)
    if min(lora.ranks) < R:
        lora_a = lora_a * (jnp.arange(R)[None, None, :] < jnp.asarray(lora.ranks)[:, None, None])
    leaves = {"lora_a": lora_a, "lora_b": jnp.zeros((L, R, d_out), jnp.float32)}
    if method.dora:
        base = dequantize(kernel) if isinstance(kernel, QuantizedArray) else kernel
        leaves["magnitude"] = jnp.linalg.norm(base.astype(jnp.float32), axis=1)
    if method.lora_bias:
        leaves["lora_bias"] = jnp.zeros((L, d_out), jnp.float32)
    return leaves


def _expert_lora_leaves(kernel, method: MethodConfig, key) -> dict:
    """LoRA's leaves for an expert stack [L, E, in, out]: each expert's A (PEFT's ParamWrapper draws its lora_A
    [r E, in] kaiming-uniform, bound 1 / sqrt(in)) and B (zeros)."""
    L, E, d_in, d_out = full_shape(kernel)
    bound = 1 / math.sqrt(d_in)
    return {"lora_a": jax.random.uniform(key, (L, E, d_in, method.rank), jnp.float32, -bound, bound),
            "lora_b": jnp.zeros((L, E, method.rank, d_out), jnp.float32)}


def _adapter(L: int, D: int, size: int, key) -> dict:
    return {
        "down": {"kernel": 0.02 * jax.random.normal(key, (L, D, size), jnp.float32), "bias": jnp.zeros((L, size))},
        "up": {"kernel": jnp.zeros((L, size, D), jnp.float32), "bias": jnp.zeros((L, D), jnp.float32)},
    }


def quantize_base(params: dict, method: MethodConfig) -> dict:
    """The base tree with every linear kernel quantised for QLoRA (NF4 or int8), a mixture's experts too (each
    expert's matrix as one weight; the router stays in float); the tree itself otherwise."""
    if method.kind != "qlora":
        return params
    quantize = (lambda w: quantize_nf4(w, method.double_quant)) if method.bits == 4 else quantize_int8
    quantized = lambda m: {**m, "kernel": quantize(m["kernel"])}
    layers = {**params["layers"], **{name: quantized(params["layers"][name])
                                     for name in LINEAR_MODULE_NAMES + SHARED_EXPERT_MODULES
                                     if name in params["layers"]}}
    if "experts" in layers:
        layers["experts"] = {name: quantized(m) for name, m in layers["experts"].items()}
    return {**params, "layers": layers}


def add_method_leaves(params: dict, cfg: ModelConfig, method: MethodConfig, key: jax.Array) -> dict:
    """The (already quantised) base tree with `method`'s new leaves added. Reads the kernels' shapes, and their
    values only for DoRA's magnitude and a tied head parted from the embedding."""
    layers = dict(params["layers"])
    L = cfg.num_layers
    keys = dict(zip(SEPARATE_MODULES + ("prefix", "attn", "mlp"), jax.random.split(key, 10)))
    keys.update({name: jax.random.fold_in(key, i)
                 for i, name in enumerate(("qkv_proj", "gate_up_proj") + SHARED_EXPERT_MODULES)})
    if method.kind in ("lora", "qlora"):
        for name, lora in lora_layout(method, L, cfg.linear_modules).items():
            layers[name] = {**layers[name], **_lora_leaves(layers[name]["kernel"], lora, method, keys[name])}
        if method.target_parameters and not cfg.num_experts:
            raise JaxtuneError(f"target_parameters {list(method.target_parameters)}: a {cfg.architecture} has no "
                               "experts")
        for i, name in enumerate(method.expert_modules):
            experts = layers["experts"]
            kernel = experts[name]["kernel"]
            leaves = _expert_lora_leaves(kernel, method, jax.random.fold_in(key, 100 + i))
            layers["experts"] = {**experts, name: {**experts[name], **leaves}}
    elif method.kind == "ia3":
        for name in ia3_modules(method, L, cfg.linear_modules):
            d_in, d_out = full_shape(layers[name]["kernel"])[1:]
            feedforward = name.endswith("down_proj")  # a shared expert's too
            leaf = {"ia3_in": jnp.ones((L, d_in))} if feedforward else {"ia3_out": jnp.ones((L, d_out))}
            layers[name] = {**layers[name], **leaf}
    elif method.kind == "prefix":
        shape = (L, method.num_virtual_tokens, cfg.num_kv_heads, cfg.head_dim)
        k_key, v_key = jax.random.split(keys["prefix"])
        layers["prefix"] = {"key": jax.random.normal(k_key, shape), "value": jax.random.normal(v_key, shape)}
    elif method.kind == "adapter":
        layers["attn_adapter"] = _adapter(L, cfg.hidden_size, method.adapter_size, keys["attn"])
        layers["mlp_adapter"] = _adapter(L, cfg.hidden_size, method.adapter_size, keys["mlp"])
    params = {**params, "layers": layers}
    if method.modules_to_save and "lm_head" not in params:  # tied: the head and the embedding part ways, as in PEFT
        params["lm_head"] = {"kernel": params["embed_tokens"].T}
    return params


def apply_method(params: dict, cfg: ModelConfig, method: MethodConfig, key: jax.Array) -> dict:
    """The base tree with `method`'s leaves added (and, for QLoRA, every linear kernel quantised).

    Pure and traceable: `jax.eval_shape(apply_method, ...)` gives the transformed abstract tree. The spine's loader
    does the two halves apart: `quantize_base` tensor by tensor as it reads the checkpoint, `add_method_leaves` in
    the new leaves' shardings.
    """
    return add_method_leaves(quantize_base(params, method), cfg, method, key)


def _path_keys(path) -> list[str]:
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]


def trainable_mask(params: dict, method: MethodConfig) -> dict:
    """True at the leaves the optimiser updates: everything for a full fine-tune, else only the method's leaves."""

    def trainable(path, leaf) -> bool:
        if method.kind == "full":
            return jnp.issubdtype(leaf.dtype, jnp.floating)
        keys = _path_keys(path)
        return keys[0] in method.modules_to_save or any(k in ADAPTER_KEYS for k in keys)

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


def _lora_count(module: dict, lora: ModuleLoRA, method: MethodConfig) -> int:
    """Parameters PEFT creates for one module's LoRA: per adapted layer r (in + out), + out for DoRA's magnitude and
    for lora_bias (the zero padding of smaller ranks is not a parameter)."""
    d_in, d_out = module["lora_a"].shape[1], module["lora_b"].shape[2]
    return sum(r * (d_in + d_out) + d_out * (method.dora + method.lora_bias) for r in lora.ranks if r)


def parameter_report(params: dict, method: MethodConfig, cfg: ModelConfig | None = None) -> ParameterReport:
    """Counts as PEFT's `get_nb_trainable_parameters` gives them, for a tree of arrays or ShapeDtypeStructs.

    PEFT keeps the original of each of `modules_to_save` beside its trained copy, so both count in the total; on
    a model with tied embeddings (pass its `cfg`) one original is the tied matrix the tree already holds.
    """
    is_quantized = lambda x: isinstance(x, QuantizedArray)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized)
    if method.kind == "full":
        total = sum(math.prod(full_shape(leaf)) for _, leaf in leaves)
        return ParameterReport(total, total)
    lora = {}
    if method.kind in ("lora", "qlora"):
        L = full_shape(params["layers"]["o_proj"]["kernel"])[0]
        layout = FUSED_MODULES if "qkv_proj" in params["layers"] else SEPARATE_MODULES + SHARED_EXPERT_MODULES
        modules = tuple(name for name in layout if name in params["layers"])
        lora = {name: _lora_count(params["layers"][name], m, method)
                for name, m in lora_layout(method, L, modules).items()}
    base = adapters = saved = 0
    for path, leaf in leaves:
        keys, size = _path_keys(path), math.prod(full_shape(leaf))
        if keys[0] == "layers" and keys[1] in lora and keys[2] in ADAPTER_KEYS:
            continue
        if any(k in ADAPTER_KEYS for k in keys):
            adapters += size
        elif keys[0] in method.modules_to_save:
            saved += size
        else:
            base += size
    adapters += sum(lora.values())
    tied = cfg is not None and cfg.tie_word_embeddings and bool(method.modules_to_save)
    originals = saved - (math.prod(params["embed_tokens"].shape) if tied else 0)
    return ParameterReport(adapters + saved, base + adapters + saved + originals)
