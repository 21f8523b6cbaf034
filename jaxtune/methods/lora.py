"""LoRA (rsLoRA, DoRA, a LoRA bias, expert stacks) and QLoRA, LoRA on a frozen NF4 or int8 base: the units.

Leaves: a module's `lora_a` [L, in, R] (PEFT's kaiming-uniform init) and `lora_b` [L, R, out] (zeros), R its largest
rank (`targets.lora_layout`); DoRA's `magnitude` [L, out]; `lora_bias` [L, out]; an expert stack's `lora_a`
[L, E, in, r] and `lora_b` [L, E, r, out]. The forward adds s B A dropout(x) (DoRA rescales), `merge` folds it into
the kernels (dequantising QLoRA's: a plain float model, as PEFT's `merge_and_unload`), `unmerge` takes plain LoRA out.
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import LINEAR_MODULE_NAMES, MethodConfig, ModelConfig
from jaxtune.config.method import CLAIMED_FIELDS, MethodFields
from jaxtune.config.model import EXPERT_MODULES, SHARED_EXPERT_MODULES
from jaxtune.errors import ConfigError, JaxtuneError, check_choice, check_range
from jaxtune.methods.base import Method, PeftFormat, PlannerCosts, module_keys
from jaxtune.methods.lora_init import BASE_INITS, INITS
from jaxtune.methods.targets import ModuleLoRA, layer_scales, lora_layout, peft_module, peft_names
from jaxtune.models.adapters import AdapterForward, Branch, DenseHook
from jaxtune.models.linear import dropout, kernel_of, wide
from jaxtune.models.quant import BitPattern, QuantizedArray, dequantize, full_shape, quantize_int8, quantize_nf4
from jaxtune.parallel.rules import context_ways, gathered

LORA_LEAVES = ("lora_a", "lora_b", "magnitude", "lora_bias")


def dora_scale(kernel_IxO: jax.Array, lora_a: jax.Array, lora_b: jax.Array, magnitude_O: jax.Array,
               lora_scale: float) -> jax.Array:
    """DoRA's magnitude / ||W + s B A|| per output unit, the norm treated as a constant (DoRA paper, section 4.3)."""
    dtype = wide(kernel_IxO.dtype)
    merged = kernel_IxO.astype(dtype) + lora_scale * (lora_a.astype(dtype) @ lora_b.astype(dtype))
    norm_O = jax.lax.stop_gradient(jnp.linalg.norm(merged, axis=-2))
    return magnitude_O.astype(dtype) / norm_O


@jax.custom_vjp
def lora_branch(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """(x [..., in] @ a [in, r]) @ b [r, out], all in x's dtype, with a hand-written backward.

    The gradients a rank-r branch needs contract over tokens; autodiff's forms put the wide operand (x, or the
    output's gradient) on the left of those contractions, and XLA:CPU then writes it transposed, [in, tokens], a
    strided pass over the largest arrays of the layer (with the MLP's elementwise backward fused into it, 40% of
    all-linear LoRA's step on the benchmark shape). Here the narrow [tokens, r] operand goes first and the small
    [r, in] result is transposed instead.
    """
    return (x @ a) @ b


def _lora_branch_fwd(x, a, b):
    xa = x @ a
    return xa @ b, (x, a, b, xa)


def _lora_branch_bwd(residuals, g):
    x, a, b, xa = residuals
    g = g.astype(x.dtype)
    db = jnp.einsum("...r,...o->ro", xa, g)
    dxa = g @ b.T
    return dxa @ a.T, _a_gradient(x, dxa), db


lora_branch.defvjp(_lora_branch_fwd, _lora_branch_bwd)


def _a_gradient(x: jax.Array, dxa: jax.Array, accumulate=None) -> jax.Array:
    """A's gradient x^T dxa [in, r] (x [..., in], dxa [..., r]), taken as (dxa^T x)^T: the narrow operand first, its
    small [r, in] result transposed. The barrier keeps XLA from folding that transpose back into the product, which
    XLA:CPU then multiplies as x^T dxa, transposing x ([tokens, in]) first (several times slower)."""
    da_RxI = jnp.einsum("...r,...i->ri", dxa, x, preferred_element_type=accumulate)
    return jnp.swapaxes(jax.lax.optimization_barrier(da_RxI), 0, 1)


@jax.custom_vjp
def lora_product(x: jax.Array, x_lora: jax.Array, kernel: jax.Array, a: jax.Array, b: jax.Array,
                 scale: float | jax.Array) -> jax.Array:
    """x @ kernel + scale (x_lora @ a) @ b [..., out] in x's dtype, as one product [x | scale x_lora a] @
    [kernel ; b] (x, x_lora [..., in], kernel [in, out], a [in, r], b [r, out]; x_lora is x, or x after dropout).

    `linear.dense` uses it on CPU (`LORA_HOOK.product`), where XLA:CPU spends more on a separate [tokens, r] x [r,
    out] product and the add over [tokens, out] than on the r extra rows of the kernel's GEMM. Below float32 the
    products accumulate in float32 and round once, as `linear.matmul`'s. The backward takes the kernel's products
    apart (x's gradient g kernel^T, dxa = scale g b^T, a's and b's gradients as `lora_branch`'s)."""
    return _lora_product_fwd(x, x_lora, kernel, a, b, scale)[0]


def _accumulation(dtype) -> jnp.dtype:
    return jnp.dtype(dtype) if dtype in (jnp.float32, jnp.float64) else jnp.dtype(jnp.float32)


def _lora_product_fwd(x, x_lora, kernel, a, b, scale):
    accumulate = _accumulation(x.dtype)
    scale = jnp.asarray(scale, accumulate)
    x_NxI = x.reshape(-1, x.shape[-1])
    xa_NxR = jnp.einsum("ni,ir->nr", x_lora.reshape(x_NxI.shape), a, preferred_element_type=accumulate)
    xa_NxR = (xa_NxR * scale).astype(x.dtype)
    y_NxO = jnp.einsum("ni,io->no", jnp.concatenate([x_NxI, xa_NxR], axis=-1), jnp.concatenate([kernel, b], axis=0),
                       preferred_element_type=accumulate)
    return y_NxO.reshape(*x.shape[:-1], kernel.shape[-1]).astype(x.dtype), (x, x_lora, kernel, a, b, xa_NxR, scale)


def _lora_product_bwd(residuals, g):
    x, x_lora, kernel, a, b, xa_NxR, scale = residuals
    accumulate = _accumulation(x.dtype)
    g_NxO = g.astype(x.dtype).reshape(-1, g.shape[-1])
    x_NxI = x.reshape(-1, x.shape[-1])
    dx_NxI = jnp.einsum("no,io->ni", g_NxO, kernel, preferred_element_type=accumulate)
    dxa_NxR = (jnp.einsum("no,ro->nr", g_NxO, b, preferred_element_type=accumulate) * scale).astype(x.dtype)
    dx_lora_NxI = jnp.einsum("nr,ir->ni", dxa_NxR, a, preferred_element_type=accumulate)
    da = _a_gradient(x_lora.reshape(x_NxI.shape), dxa_NxR, accumulate)
    db = jnp.einsum("nr,no->ro", xa_NxR, g_NxO, preferred_element_type=accumulate)
    dkernel = jnp.einsum("ni,no->io", x_NxI, g_NxO, preferred_element_type=accumulate)
    as_x = lambda d: d.reshape(x.shape).astype(x.dtype)  # noqa: E731
    return (as_x(dx_NxI), as_x(dx_lora_NxI), dkernel.astype(kernel.dtype), da.astype(a.dtype), db.astype(b.dtype),
            None)


lora_product.defvjp(_lora_product_fwd, _lora_product_bwd)


def _dropped(x: jax.Array, branch: Branch) -> jax.Array:
    """The branch's input: x, or x after the branch's dropout."""
    return x if branch.dropout_key is None else dropout(x, branch.dropout_key, branch.dropout_rate)


def _branch(x: jax.Array, y: jax.Array, module: dict, kernel: jax.Array | None, branch: Branch) -> jax.Array:
    """y + s (B A dropout(x) + b); DoRA: (y + s B A x) m / ||W + s B A|| (with dropout, PEFT's form)."""
    x_lora = _dropped(x, branch)
    lora_a, lora_b = module["lora_a"], module["lora_b"]
    if branch.kernel_axes is not None and context_ways() > 1:  # gathered over ZeRO's axes as their kernel is
        lora_a = gathered(lora_a, (branch.kernel_axes[0], "lora_rank"))
        lora_b = gathered(lora_b, ("lora_rank", branch.kernel_axes[1]))
    lora_y = lora_branch(x_lora, lora_a.astype(x.dtype), lora_b.astype(x.dtype))
    if "lora_bias" in module:
        lora_y = lora_y + module["lora_bias"].astype(x.dtype)
    scale_ = branch.scale
    lora_y = lora_y * (scale_ if isinstance(scale_, float) else scale_.astype(x.dtype))
    if "magnitude" not in module:
        return y + lora_y
    scale = dora_scale(kernel, module["lora_a"], module["lora_b"], module["magnitude"], scale_)
    if not isinstance(scale_, float):  # a layer DoRA does not adapt (scale 0) keeps its weights as they are
        scale = jnp.where(scale_ > 0, scale, 1.0)
    scale = scale.astype(x.dtype)
    if branch.dropout_key is None:
        return (y + lora_y) * scale
    # PEFT's DoRA with dropout: x W + (m/||.|| - 1) dropout(x) W + m/||.|| s B A dropout(x)
    return y + (scale - 1) * (x_lora @ kernel) + scale * lora_y


def _product(x: jax.Array, kernel: jax.Array, module: dict, branch: Branch) -> jax.Array:
    """x W + s B A dropout(x) as one product (`lora_product`): `linear.dense`'s fused form of `_branch`."""
    a, b = module["lora_a"].astype(x.dtype), module["lora_b"].astype(x.dtype)
    return lora_product(x, _dropped(x, branch), kernel, a, b, branch.scale)


LORA_HOOK = DenseHook("lora_a", add=_branch, needs_kernel=lambda module: "magnitude" in module, dropout=True,
                      product=_product, fuses=lambda module: not {"magnitude", "lora_bias"} & set(module))


def _lora_leaves(kernel, lora: ModuleLoRA, method: MethodConfig, key) -> dict:
    """LoRA's leaves for one module, rank `lora.max_rank`; a layer of smaller rank holds zeros beyond its rank."""
    L, d_in, d_out = full_shape(kernel)
    R = lora.max_rank
    if method.init == "gaussian":  # PEFT's "gaussian": normal_(std=1 / r) on lora_A.weight, r the layer's rank
        std_L = 1 / np.maximum(np.asarray(lora.ranks, np.float32), 1)
        lora_a = jax.random.normal(key, (L, d_in, R), jnp.float32) * std_L[:, None, None]
    else:  # torch kaiming_uniform_(a=sqrt(5)) on lora_A.weight [r, in]; BASE_INITS' values come from `lora_init`
        bound = 1 / math.sqrt(d_in)
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


def add_lora(params: dict, cfg: ModelConfig, method: MethodConfig, key: jax.Array) -> dict:
    """`params` with LoRA's leaves on every module (and expert stack) `method` adapts."""
    layers = dict(params["layers"])
    keys = module_keys(key)
    for name, lora in lora_layout(method, cfg.num_layers, cfg.linear_modules).items():
        layers[name] = {**layers[name], **_lora_leaves(layers[name]["kernel"], lora, method, keys[name])}
    if method.target_parameters and not cfg.num_experts:
        raise JaxtuneError(f"target_parameters {list(method.target_parameters)}: a {cfg.architecture} has no experts")
    for i, name in enumerate(method.expert_modules):
        experts = layers["experts"]
        leaves = _expert_lora_leaves(experts[name]["kernel"], method, jax.random.fold_in(key, 100 + i))
        layers["experts"] = {**experts, name: {**experts[name], **leaves}}
    return {**params, "layers": layers}


def quantize_base(params: dict, method: MethodConfig) -> dict:
    """The base tree with every linear kernel quantised for QLoRA (NF4 or int8), a mixture's experts too (each
    expert's matrix as one weight; the router stays in float)."""
    quantize = (lambda w: quantize_nf4(w, method.double_quant)) if method.bits == 4 else quantize_int8
    quantized = lambda m: m if isinstance(m["kernel"], QuantizedArray) else {**m, "kernel": quantize(m["kernel"])}
    layers = {**params["layers"], **{name: quantized(params["layers"][name])
                                     for name in LINEAR_MODULE_NAMES + SHARED_EXPERT_MODULES
                                     if name in params["layers"]}}
    if "experts" in layers:
        layers["experts"] = {name: quantized(m) for name, m in layers["experts"].items()}
    return {**params, "layers": layers}


def _check(method: MethodConfig) -> None:
    """LoRA's own values: a positive rank and alpha; expert stacks alone as PEFT's parameter LoRA takes them."""
    if method.rank <= 0:
        raise ConfigError("rank", method.rank, "LoRA's rank is a positive integer")
    check_range("alpha", method.alpha, 0, low_open=True)
    for name in method.target_parameters:
        parts = str(name).split(".")
        if parts[-1] not in EXPERT_MODULES or (len(parts) > 1 and parts[-2] != "experts"):
            raise ConfigError("target_parameters", name, "jaxtune adapts a mixture's expert stacks: "
                              "mlp.experts.gate_up_proj and mlp.experts.down_proj")
    if method.target_parameters:
        unsupported = {"dropout": method.dropout, "dora": method.dora, "lora_bias": method.lora_bias,
                       "rank_pattern": method.rank_pattern, "alpha_pattern": method.alpha_pattern,
                       "layers_to_transform": method.layers_to_transform}
        for name, value in unsupported.items():
            if value:
                raise ConfigError(name, value, "does not go with target_parameters (PEFT's LoRA of a parameter has "
                                  "no dropout, DoRA or LoRA bias; jaxtune gives experts one rank and alpha in every "
                                  "layer)")
    if method.dora and method.lora_bias:
        raise ConfigError("lora_bias", True, "DoRA has no LoRA bias (PEFT refuses use_dora with lora_bias too)")
    check_choice("init", method.init, INITS)
    if method.init in BASE_INITS and (method.dora or method.target_parameters):
        raise ConfigError("init", method.init, "initialises plain LoRA on linear modules: not with dora nor "
                          "target_parameters (expert stacks)")
    if method.init == "loftq" and method.kind != "qlora":
        raise ConfigError("init", method.init, "LoftQ initialises LoRA for a quantised base: use kind = qlora")
    if isinstance(method.loftq_iter, bool) or not isinstance(method.loftq_iter, int) or method.loftq_iter < 1:
        raise ConfigError("loftq_iter", method.loftq_iter, "LoftQ's iterations are an integer >= 1")
    if method.loftq_iter != 1 and method.init != "loftq":
        raise ConfigError("loftq_iter", method.loftq_iter, "is for init = loftq")


def _check_qlora(method: MethodConfig) -> None:
    _check(method)
    check_choice("bits", method.bits, (4, 8))


def _count(params: dict, method: MethodConfig, adapted: dict) -> dict[str, int]:
    """{module: parameters PEFT creates for its LoRA}: per adapted layer r (in + out), + out for DoRA's magnitude
    and for lora_bias (the zero padding of smaller ranks is not a parameter)."""
    L = full_shape(params["layers"]["o_proj"]["kernel"])[0]
    counts = {}
    for name, lora in lora_layout(method, L, tuple(adapted)).items():
        module = params["layers"][name]
        d_in, d_out = module["lora_a"].shape[1], module["lora_b"].shape[2]
        counts[name] = sum(r * (d_in + d_out) + d_out * (method.dora + method.lora_bias) for r in lora.ranks if r)
    return counts


def _label(method: MethodConfig) -> str:
    return method.kind + f" r={method.rank}" + (f" {method.bits}-bit" if method.kind == "qlora" else "")


def module_scales(method: MethodConfig, name: str, num_layers: int) -> jnp.ndarray:
    """[L]: module `name`'s LoRA scale per layer (0 where the layer is not adapted), float32 (float64 with x64)."""
    return jnp.asarray(lora_layout(method, num_layers, (name,))[name].scales)


def _delta(module: dict, scale_L) -> jnp.ndarray:
    """s A B per layer, [L, in, out] float32."""
    ab = jnp.einsum("lir,lro->lio", module["lora_a"].astype(jnp.float32), module["lora_b"].astype(jnp.float32))
    return scale_L[:, None, None] * ab


def _merged(module: dict, scale_L: jnp.ndarray, name: str, dtype=None) -> dict:
    """One module's leaves with its LoRA/DoRA folded in, for any number of stacked layers L (scale_L [L])."""
    base = kernel_of(module, jnp.float32)
    merged = base + _delta(module, scale_L)
    if "magnitude" in module:
        scale = dora_scale(base, module["lora_a"], module["lora_b"], module["magnitude"], scale_L[:, None, None])
        merged = merged * jnp.where(scale_L[:, None] > 0, scale, 1.0)[:, None, :]
    out = {k: v for k, v in module.items() if k not in LORA_LEAVES} | {"kernel": merged.astype(dtype or
                                                                                           module["kernel"].dtype)}
    if "lora_bias" in module:
        if "bias" not in module:
            raise JaxtuneError(f"{name}: a LoRA bias (lora_bias) cannot be merged into a module without a bias")
        bias = module["bias"].astype(jnp.float32) + scale_L[:, None] * module["lora_bias"].astype(jnp.float32)
        out["bias"] = bias.astype(module["bias"].dtype)
    return out


def _merged_experts(module: dict, scale: float, dtype=None) -> dict:
    """An expert stack [..., E, in, out] with each expert's LoRA folded in: W_e + s A_e B_e."""
    base = kernel_of(module, jnp.float32)
    if "lora_a" in module:
        base = base + scale * jnp.einsum("...ir,...ro->...io", module["lora_a"].astype(jnp.float32),
                                         module["lora_b"].astype(jnp.float32))
    return {"kernel": base.astype(dtype or module["kernel"].dtype)}


def merge(params: dict, method: MethodConfig, dtype=None) -> dict:
    """The tree with every LoRA/DoRA module folded into its kernel and the adapter leaves removed (and every
    quantised kernel dequantised, every kernel held as a bit pattern bitcast back).

    dtype: of the merged kernels (default: the base kernel's dtype, the original dtype for quantised ones).
    A LoRA bias (`lora_bias`) folds into the module's bias, s b; a module without a bias cannot take it (PEFT
    refuses that merge too). For writing a merged model, `merged_layer` does the same one layer at a time.
    """
    layers = dict(params["layers"])
    for name, module in params["layers"].items():
        if name == "experts":
            layers[name] = {m: _merged_experts(e, method.lora_scale, dtype) for m, e in module.items()}
        elif isinstance(module, dict) and "lora_a" in module:
            layers[name] = _merged(module, module_scales(method, name, module["lora_a"].shape[0]), name, dtype)
        elif isinstance(module, dict) and isinstance(module.get("kernel"), QuantizedArray | BitPattern):  # not adapted
            layers[name] = {**module, "kernel": kernel_of(module, dtype or module["kernel"].dtype)}
    return {**params, "layers": layers}


def merged_layer(params: dict, method: MethodConfig):
    """`tensor(path, layer)` for `save_model`: layer `layer` of leaf `path` of `merge(params, method)`, computed
    alone (a merged export then never holds the merged model beside the adapted one); None for leaves merging
    leaves as they are."""
    merge_one = jax.jit(_merged, static_argnums=(2,))
    merge_experts = jax.jit(_merged_experts, static_argnums=(1,))

    def tensor(path: tuple[str, ...], layer: int):
        if path[:2] == ("layers", "experts"):
            module = params["layers"]["experts"][path[2]]
            if "lora_a" not in module:
                return None
            return merge_experts(jax.tree.map(lambda x: x[layer], module), method.lora_scale)["kernel"]
        module = params["layers"].get(path[1]) if path[0] == "layers" and len(path) == 3 else None
        if not isinstance(module, dict) or "lora_a" not in module:
            return None
        scale = module_scales(method, path[1], module["lora_a"].shape[0])[layer:layer + 1]
        one = jax.tree.map(lambda x: x[layer:layer + 1], module)
        return merge_one(one, scale, path[1])[path[2]][0]

    return tensor


def unmerge(merged: dict, adapters: dict, method: MethodConfig) -> dict:
    """Inverse of `merge` for LoRA: kernels W' - s A B, with `adapters`' LoRA leaves put back.

    `adapters` is any tree holding the LoRA leaves (e.g. the trainable half of `partition`). DoRA cannot be
    unmerged from the merged weights alone (the norm ||W + s A B|| is lost), so it is refused.
    """
    if method.dora:
        raise ValueError("DoRA cannot be unmerged from merged weights: the column norms of W + sAB are not kept")
    if method.lora_bias:
        raise ValueError("a LoRA bias cannot be unmerged from merged weights: the base bias is not kept")
    layers = dict(merged["layers"])
    for name, module in adapters["layers"].items():
        if not isinstance(module, dict) or module.get("lora_a") is None:
            continue
        lora = {k: module[k] for k in ("lora_a", "lora_b")}
        kernel = layers[name]["kernel"]
        restored = kernel.astype(jnp.float32) - _delta(lora, module_scales(method, name, lora["lora_a"].shape[0]))
        layers[name] = {**layers[name], **lora, "kernel": restored.astype(kernel.dtype)}
    return {**merged, "layers": layers}


def _expert_prefix(module: str, layer: int, method: MethodConfig) -> str:
    """Where PEFT keeps the LoRA of expert stack `module`: PEFT wraps the experts' parameters in the order the
    module registers them (gate_up_proj, then down_proj), so with both the first is the second's base layer."""
    inner = module == "gate_up_proj" and len(method.expert_modules) == 2
    return f"base_model.model.model.layers.{layer}.mlp.experts" + ".base_layer" * inner


def _peft_config(cfg: ModelConfig, method: MethodConfig) -> dict:
    return {"peft_type": "LORA", "r": method.rank, "lora_alpha": method.alpha, "lora_dropout": method.dropout,
            "target_modules": peft_names(method.target_modules),
            "exclude_modules": peft_names(method.exclude_modules),
            "layers_to_transform": list(method.layers_to_transform) or None,
            "layers_pattern": list(method.layers_pattern) or None, "rank_pattern": dict(method.rank_pattern),
            "alpha_pattern": dict(method.alpha_pattern), "bias": "none", "lora_bias": method.lora_bias,
            "use_rslora": method.rslora, "use_dora": method.dora, "fan_in_fan_out": False,
            "init_lora_weights": "gaussian" if method.init == "gaussian" else True,  # others load as trained
            "target_parameters": list(method.target_parameters) or None}


def _peft_tensors(params: dict, cfg: ModelConfig, method: MethodConfig) -> dict[str, np.ndarray]:
    layers, state = params["layers"], {}
    f32 = lambda x: np.asarray(x, np.float32)
    for name, lora in lora_layout(method, cfg.num_layers, cfg.linear_modules).items():
        module = {k: f32(v) for k, v in layers[name].items() if k in LORA_LEAVES}
        for i, r in enumerate(lora.ranks):
            if not r:
                continue
            prefix = peft_module(name, i)
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


def _method_of(config: dict, get, targets) -> MethodConfig:
    return MethodConfig(
        kind="lora", rank=int(config["r"]), alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout") or 0.0), target_modules=targets,
        exclude_modules=get("exclude_modules", ()), layers_to_transform=get("layers_to_transform", ()),
        layers_pattern=get("layers_pattern", ()), rank_pattern=get("rank_pattern", {}),
        alpha_pattern=get("alpha_pattern", {}), rslora=bool(config.get("use_rslora")),
        dora=bool(config.get("use_dora")), lora_bias=bool(config.get("lora_bias")),
        modules_to_save=get("modules_to_save", ()), target_parameters=get("target_parameters", ()))


def _peft_load(state: dict, params: dict, cfg: ModelConfig, method: MethodConfig) -> dict:
    """The loaded tensors in place of the freshly initialised leaves."""
    layers, L = dict(params["layers"]), cfg.num_layers
    for name, lora in lora_layout(method, L, cfg.linear_modules).items():
        module = {k: np.array(v, np.float32) for k, v in layers[name].items() if k in LORA_LEAVES}
        module["lora_a"][:] = 0
        module["lora_b"][:] = 0
        for i, r in enumerate(lora.ranks):
            if not r:
                continue
            prefix = peft_module(name, i)
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


PEFT_READ_FIELDS = ("r", "lora_alpha", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
                    "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias", "modules_to_save",
                    "target_parameters")
LORA_AXES = {
    "lora_a": lambda layers, d_in, d_out: (layers, d_in, "lora_rank"),
    "lora_b": lambda layers, d_in, d_out: (layers, "lora_rank", d_out),
    "lora_bias": lambda layers, d_in, d_out: (layers, d_out),
    "magnitude": lambda layers, d_in, d_out: (layers, d_out),
}

LORA = Method(
    kind="lora",
    fields=MethodFields(CLAIMED_FIELDS, default_targets=("q_proj", "v_proj"), check=_check),
    add_leaves=add_lora,
    leaves=LORA_LEAVES,
    module_axes=LORA_AXES,
    dense=(LORA_HOOK,),
    forward=AdapterForward(dropout_rate=lambda method: method.dropout,
                           scales=lambda method, cfg: layer_scales(method, cfg.num_layers, cfg.linear_modules)),
    adapted=lambda method, num_layers, modules: {name: m.max_rank
                                                 for name, m in lora_layout(method, num_layers, modules).items()},
    count=_count,
    merge=merge,
    merged_layer=merged_layer,
    peft=PeftFormat(("LORA",), PEFT_READ_FIELDS, _peft_config, _peft_tensors, _method_of, _peft_load),
    gguf_lora=True,
    costs=PlannerCosts(trains_input=lambda method, module, adapted: module in adapted, low_rank=True),
    label=_label,
)
QLORA = replace(LORA, kind="qlora", fields=replace(LORA.fields, check=_check_qlora), quantize_base=quantize_base)
