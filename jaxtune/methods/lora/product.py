"""LoRA in the forward: the branch s B A dropout(x) beside a module's base product (`LORA_HOOK`: added, or folded
into the base GEMM as `lora_product` where `linear.folds_branch` says), DoRA's rescaling, the experts' branch
(`EXPERT_HOOK`), and `lora_forward`: what the forward runs of a LoRA method, its scales put in the layers.

Each adapted module (and expert stack) carries `lora_scale` [L] beside its leaves while the forward runs (alpha / r,
rsLoRA alpha / sqrt(r), per `lora.layout`; 0 in a layer the adapter skips), sliced by the layer scan with the rest.
The branches' own ops are named in the scope "lora" (a folded branch's rows of the base product are the projection's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxtune.config.method import AdapterForward, Branch, DenseHook, ExpertHook
from jaxtune.config.model import ModelConfig
from jaxtune.methods.lora.layout import lora_layout
from jaxtune.models.linear import dropout, product_dtype, wide
from jaxtune.parallel.rules import context_ways, gathered

if TYPE_CHECKING:
    from jaxtune.methods.lora.options import LoRAConfig


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
    with jax.named_scope("lora"):  # the branch's own work; the product is the projection's
        xa_NxR = jnp.einsum("ni,ir->nr", x_lora.reshape(x_NxI.shape), a, preferred_element_type=accumulate)
        xa_NxR = (xa_NxR * scale).astype(x.dtype)
        xs_NxJ, kernel_JxO = jnp.concatenate([x_NxI, xa_NxR], axis=-1), jnp.concatenate([kernel, b], axis=0)
    y_NxO = jnp.einsum("ni,io->no", xs_NxJ, kernel_JxO, preferred_element_type=product_dtype(x.dtype, accumulate))
    return y_NxO.reshape(*x.shape[:-1], kernel.shape[-1]).astype(x.dtype), (x, x_lora, kernel, a, b, xa_NxR, scale)


def _lora_product_bwd(residuals, g):
    x, x_lora, kernel, a, b, xa_NxR, scale = residuals
    accumulate = _accumulation(x.dtype)
    g_NxO = g.astype(x.dtype).reshape(-1, g.shape[-1])
    x_NxI = x.reshape(-1, x.shape[-1])
    dx_NxI = jnp.einsum("no,io->ni", g_NxO, kernel, preferred_element_type=product_dtype(x.dtype, accumulate))
    with jax.named_scope("lora"):
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


@jax.named_scope("lora")
def _branch(x: jax.Array, y: jax.Array, module: dict, kernel: jax.Array | None, branch: Branch) -> jax.Array:
    """y + s (B A dropout(x) + b); DoRA: (y + s B A x) m / ||W + s B A|| (with dropout, PEFT's form). s: the
    module's `lora_scale` of this layer (0 where the layer is not adapted)."""
    x_lora = _dropped(x, branch)
    lora_a, lora_b = module["lora_a"], module["lora_b"]
    if branch.kernel_axes is not None and context_ways() > 1:  # gathered over ZeRO's axes as their kernel is
        lora_a = gathered(lora_a, (branch.kernel_axes[0], "lora_rank"))
        lora_b = gathered(lora_b, ("lora_rank", branch.kernel_axes[1]))
    lora_y = lora_branch(x_lora, lora_a.astype(x.dtype), lora_b.astype(x.dtype))
    if "lora_bias" in module:
        lora_y = lora_y + module["lora_bias"].astype(x.dtype)
    scale_ = module["lora_scale"]
    lora_y = lora_y * scale_.astype(x.dtype)
    if "magnitude" not in module:
        return y + lora_y
    scale = dora_scale(kernel, module["lora_a"], module["lora_b"], module["magnitude"], scale_)
    scale = jnp.where(scale_ > 0, scale, 1.0)  # a layer DoRA does not adapt (scale 0) keeps its weights as they are
    scale = scale.astype(x.dtype)
    if branch.dropout_key is None:
        return (y + lora_y) * scale
    # PEFT's DoRA with dropout: x W + (m/||.|| - 1) dropout(x) W + m/||.|| s B A dropout(x)
    return y + (scale - 1) * (x_lora @ kernel) + scale * lora_y


def _product(x: jax.Array, kernel: jax.Array, module: dict, branch: Branch) -> jax.Array:
    """x W + s B A dropout(x) as one product (`lora_product`): `linear.dense`'s fused form of `_branch`."""
    a, b = module["lora_a"].astype(x.dtype), module["lora_b"].astype(x.dtype)
    return lora_product(x, _dropped(x, branch), kernel, a, b, module["lora_scale"])


LORA_HOOK = DenseHook("lora_a", add=_branch, needs_kernel=lambda module: "magnitude" in module, dropout=True,
                      product=_product, fuses=lambda module: not {"magnitude", "lora_bias"} & set(module))


@jax.named_scope("lora")
def _expert_branch(x_MxI: jax.Array, y_MxO: jax.Array, module: dict, product) -> jax.Array:
    """y + s (x A_e) B_e: each row's expert's LoRA, as two more grouped products (`moe.grouped_matmul`)."""
    xa_MxR = product(x_MxI, module["lora_a"])
    return y_MxO + module["lora_scale"].astype(y_MxO.dtype) * product(xa_MxR, module["lora_b"])


EXPERT_HOOK = ExpertHook("lora_a", add=_expert_branch, leaf_dims={"lora_a": ("in", None), "lora_b": (None, "out"),
                                                                "lora_scale": (None, None)})


def lora_forward(method: LoRAConfig, cfg: ModelConfig) -> AdapterForward:
    """What the forward runs of `method` on a model of `cfg`: the hooks, the dropout rate, and its per-layer scales
    put beside each adapted module's (and expert stack's) leaves."""
    scales = {name: m.scales for name, m in lora_layout(method, cfg.layer_stacks()).items()}

    def prepare(layers: dict) -> dict:
        with_scale = lambda module, scale_L: {**module, "lora_scale": jnp.asarray(scale_L)}  # noqa: E731
        layers = {**layers, **{name: with_scale(layers[name], s) for name, s in scales.items()}}
        if method.expert_modules:
            experts = layers["experts"]
            rows = cfg.module_layers("experts")
            layers["experts"] = {**experts, **{
                name: with_scale(experts[name], jnp.full((len(rows),), method.expert_lora(name, rows)[1]))
                for name in method.expert_modules}}
        return layers

    return AdapterForward(dense=(LORA_HOOK,), experts=EXPERT_HOOK, dropout_rate=method.dropout, prepare=prepare)
