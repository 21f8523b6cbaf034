"""A mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), as transformers computes it.

Each token's router logits x W_r [E] (in the compute dtype) go through a float32 softmax; the token goes to its
`experts_per_token` most probable experts, weighted by their probabilities (renormalised to sum to 1 when
`normalize_top_k`). The N x K (token, expert) assignments are sorted by expert and every expert's gated MLP runs
as one grouped matmul over its contiguous rows (`jax.lax.ragged_dot`: no loop over experts, no capacity, no token
dropped), then each token sums its K weighted outputs.

The router's load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4-6, as transformers'
`load_balancing_loss_func`) needs two sums per layer over the real tokens: how many of their K assignments went
to each expert, and their summed probabilities. `routed_experts` returns them; `router_loss` combines every layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.models.linear import dense, kernel_of
from jaxtune.models.params import EXPERT_AXES
from jaxtune.parallel.rules import gathered


def route(x_NxD: jax.Array, router: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probabilities [N, E] float32, the top-K weights [N, K] float32, their experts [N, K] int32)."""
    logits_NxE = dense(x_NxD, router, kernel_axes=("embed", None))
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.promote_types(x_NxD.dtype, jnp.float32)), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, cfg.experts_per_token)
    if cfg.normalize_top_k:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return probs_NxE, weights_NxK, experts_NxK


def grouped_matmul(x_MxI: jax.Array, module: dict, group_sizes_E: jax.Array, axes: tuple[str, ...],
                   lora_scale: float = 1.0) -> jax.Array:
    """Rows of x, sorted by expert (group_sizes_E rows each), times their expert's kernel [E, in, out]: [M, out];
    with the module's LoRA (A [E, in, r], B [E, r, out]) added as two more grouped matmuls, s (x A_e) B_e."""
    kernel_ExIxO = gathered(kernel_of(module, x_MxI.dtype), axes[1:])
    y_MxO = jax.lax.ragged_dot(x_MxI, kernel_ExIxO, group_sizes_E)
    if "lora_a" not in module:
        return y_MxO
    xa_MxR = jax.lax.ragged_dot(x_MxI, module["lora_a"].astype(x_MxI.dtype), group_sizes_E)
    return y_MxO + lora_scale * jax.lax.ragged_dot(xa_MxR, module["lora_b"].astype(x_MxI.dtype), group_sizes_E)


def routed_experts(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, valid_BxT: jax.Array, gated,
                   lora_scale: float = 1.0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(the experts' weighted sum [B, T, D], (assignments [E], probability sums [E] over the valid tokens)).

    gated(gate, up): the experts' activation (`llama.GATED`); lora_scale: of LoRA on the expert stacks."""
    B, T, D = x_BxTxD.shape
    K, E = cfg.experts_per_token, cfg.num_experts
    x_NxD = x_BxTxD.reshape(B * T, D)
    probs_NxE, weights_NxK, experts_NxK = route(x_NxD, layer["router"], cfg)
    expert_M = experts_NxK.reshape(-1)  # M = N K assignments, token-major
    order_M = jnp.argsort(expert_M, stable=True)
    sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)
    x_MxD = x_NxD[order_M // K]
    experts = layer["experts"]
    gate_up_Mx2F = grouped_matmul(x_MxD, experts["gate_up_proj"], sizes_E, EXPERT_AXES["gate_up_proj"], lora_scale)
    hidden_MxF = gated(*jnp.split(gate_up_Mx2F, 2, axis=-1))
    y_MxD = grouped_matmul(hidden_MxF, experts["down_proj"], sizes_E, EXPERT_AXES["down_proj"], lora_scale)
    y_NxKxD = y_MxD[jnp.argsort(order_M)].reshape(B * T, K, D)
    out_NxD = jnp.einsum("nkd,nk->nd", y_NxKxD, weights_NxK.astype(y_NxKxD.dtype))
    valid_N = valid_BxT.reshape(-1).astype(jnp.float32)
    assigned_E = jnp.zeros(E, jnp.float32).at[expert_M].add(jnp.repeat(valid_N, K))
    prob_sums_E = jnp.sum(probs_NxE.astype(jnp.float32) * valid_N[:, None], axis=0)
    return out_NxD.reshape(B, T, D), (assigned_E, prob_sums_E)


def router_loss(assigned_LxE: jax.Array, prob_sums_LxE: jax.Array, tokens: jax.Array) -> jax.Array:
    """The load-balancing loss E * sum_e f_e P_e over all layers' routing: f_e the share of assignments that went
    to expert e, P_e its mean probability, each over (layers x valid tokens); tokens: valid tokens per layer."""
    rows = assigned_LxE.shape[0] * jnp.maximum(tokens, 1.0)
    f_E, p_E = jnp.sum(assigned_LxE, axis=0) / rows, jnp.sum(prob_sums_LxE, axis=0) / rows
    return assigned_LxE.shape[-1] * jnp.sum(f_E * p_E)
