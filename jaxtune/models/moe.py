"""A mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), as transformers computes it:
`routed_experts` (routing by `route`), and the router's load-balancing loss `router_loss`.

Each token goes to its `experts_per_token` most probable experts (float32 softmax of x W_r), weighted by their
probabilities (renormalised when `normalize_top_k`); the N x K assignments are sorted by expert and each expert's
gated MLP runs as one grouped matmul over its rows (no capacity, no token dropped). `grouped_kernel` picks it:
`jax.lax.ragged_dot` on GPU; where the compiler makes it a dense matmul per expert over every row, tiles on CPU
(`grouped_tiles`) and Pallas' megablox `gmm` per device under `shard_map` on TPU (`megablox_matmul`: experts split
over the expert axis, hidden units over tensor; experiments/tpu_compile_table.py). Loss: Switch Transformer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtune.config import ModelConfig
from jaxtune.config.method import ExpertHook
from jaxtune.models.grouped_tiles import tiled_grouped_matmul
from jaxtune.models.linear import dense, kernel_of, scaled, wide
from jaxtune.models.norms import unscaled_rms_norm
from jaxtune.models.params import EXPERT_AXES
from jaxtune.parallel.rules import gathered, mesh_axes_of, mesh_in_context, platform_in_context, to_spec

GMM_VMEM_BYTES = 14 * 2**20  # of the 16 MiB scoped VMEM a TPU kernel may take, what megablox's tiles may fill


def gmm_tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox's tiles for an [m, k] x [k, n] product (its backward's too): rows 512, 256 or 128 (m is padded to
    128), contraction and output 1,024 or the whole dimension where it is not a multiple of 128 (Mosaic's rule),
    the largest whose double-buffered bfloat16 inputs and float32 accumulator fit `GMM_VMEM_BYTES` (gpt-oss's
    whole contraction of 2,880 with 512 x 1,024 tiles asked 19 MiB of VMEM)."""
    tiles = [(tm, tk, tn) for tm in (512, 256, 128) if m % tm == 0 for tk in _tile_options(k)
             for tn in _tile_options(n)]
    return next((t for t in tiles if _tiles_fit(*t)), tiles[-1])


def _tile_options(x: int) -> list[int]:
    """Mosaic's tiles of a dimension x, largest first: x whole up to 1,024 or where it is no multiple of 128, else
    1,024 down to 128."""
    return [x] if x <= 1024 or x % 128 else [1024, 512, 256, 128]


def _tiles_fit(tm: int, tk: int, tn: int) -> bool:
    """Whether double-buffered bfloat16 tiles of x [tm, tk] and w [tk, tn] and a float32 [tm, tn] fit the VMEM."""
    return 2 * 2 * (tm * tk + tk * tn) + 4 * tm * tn <= GMM_VMEM_BYTES


def route(x_NxD: jax.Array, router: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probabilities [N, E] float32, the top-K weights [N, K] float32, their experts [N, K] int32). Sigmoid routers
    weight by the chosen experts' sigmoid scores (Llama 4: the top K logits'; DeepSeek-V3: chosen by score plus
    `e_score_correction_bias` among the best groups, renormalised, scaled), their probabilities, for the
    load-balancing loss, a softmax still. DeepSeek's router runs in float32, as transformers keeps it."""
    wide_dtype = jnp.promote_types(x_NxD.dtype, jnp.float32)
    if cfg.router_choice_bias:
        x_NxD = x_NxD.astype(wide_dtype)
    if "per_expert_scale" in router:  # Gemma 4's: its input normed and scaled, as transformers rounds each product
        x_NxD = unscaled_rms_norm(x_NxD, cfg.rms_norm_eps) * router["scale"].astype(x_NxD.dtype)
        x_NxD = scaled(x_NxD, cfg.hidden_size**-0.5)
    logits_NxE = dense(x_NxD, router, kernel_axes=("embed", None))
    probs_NxE = jax.nn.softmax(logits_NxE.astype(wide_dtype), axis=-1)
    if cfg.router_activation == "sigmoid":
        scores_NxE = jax.nn.sigmoid(logits_NxE.astype(wide_dtype))
        choice_NxE = logits_NxE  # the scores' order, without sigmoid's ties
        if cfg.router_choice_bias:
            choice_NxE = _group_limited(scores_NxE + router["e_score_correction_bias"].astype(wide_dtype), cfg)
        elif cfg.router_groups > 1:
            choice_NxE = _group_limited(scores_NxE, cfg)
        experts_NxK = jax.lax.top_k(choice_NxE, cfg.experts_per_token)[1]
        weights_NxK = jnp.take_along_axis(scores_NxE, experts_NxK, axis=-1)
        if cfg.normalize_top_k:
            weights_NxK = weights_NxK / (jnp.sum(weights_NxK, axis=-1, keepdims=True) + 1e-20)
        return probs_NxE, weights_NxK * cfg.routed_scaling_factor, experts_NxK
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, cfg.experts_per_token)
    if cfg.normalize_top_k:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    if "per_expert_scale" in router:
        weights_NxK = weights_NxK * router["per_expert_scale"].astype(wide_dtype)[experts_NxK]
    return probs_NxE, weights_NxK, experts_NxK


def _group_limited(choice_NxE: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The choice scores of experts in the `router_top_groups` groups whose two best scores sum highest; -inf
    elsewhere (every expert with one group)."""
    if cfg.router_groups == 1:
        return choice_NxE
    N, E = choice_NxE.shape
    by_group = choice_NxE.reshape(N, cfg.router_groups, E // cfg.router_groups)
    worth_NxG = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)
    best_NxG = jax.lax.top_k(worth_NxG, cfg.router_top_groups)[1]
    kept_NxG = jnp.zeros(worth_NxG.shape, bool).at[jnp.arange(N)[:, None], best_NxG].set(True)
    return jnp.where(kept_NxG[:, :, None], by_group, -jnp.inf).reshape(N, E)


def grouped_matmul(x_MxI: jax.Array, module: dict, group_sizes_E: jax.Array, axes: tuple[str, ...],
                   hook: ExpertHook | None = None, kernel: str = "ragged_dot") -> jax.Array:
    """Rows of x, sorted by expert (group_sizes_E rows each), times their expert's kernel [E, in, out]: [M, out];
    with the method's branch where the stack holds its leaves (`hook`, e.g. LoRA's two more grouped products);
    kernel: "ragged_dot" or "tiles" (`grouped_kernel`)."""
    if kernel == "tiles":
        product = lambda x, w: tiled_grouped_matmul(x, w.astype(x.dtype), group_sizes_E)  # noqa: E731
    else:
        product = lambda x, w: jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes_E)  # noqa: E731
    y_MxO = product(x_MxI, gathered(kernel_of(module, x_MxI.dtype), axes[1:]))
    return _with_hook(x_MxI, y_MxO, module, hook, product)


def _with_hook(x_MxI, y_MxO, module: dict, hook: ExpertHook | None, product) -> jax.Array:
    """y plus the hook's branch where the stack holds the hook's leaf."""
    return y_MxO if hook is None or hook.trigger not in module else hook.add(x_MxI, y_MxO, module, product)


def grouped_kernel(cfg: ModelConfig, platform: str, tensor: int) -> str:
    """The grouped matmul a mixture runs: "megablox" on TPU where the tensor axis divides each expert's hidden units
    into multiples of 128, as the hidden size is (and, with expert biases, does not split them); "tiles" on CPU
    (`grouped_tiles`: XLA:CPU makes ragged_dot a dense matmul per expert over every row; benchmarks/grouped_matmul.py);
    else "ragged_dot" (GPU, unmeasured; on TPU its compiler makes it dense per expert too). The planner asks the
    same."""
    if platform == "cpu":
        return "tiles"
    splits = tensor > 1 and cfg.expert_bias
    # Mosaic tiles a dimension by multiples of 128 or whole: gpt-oss's 2,880 x 2,880 down projection is neither
    # tileable nor, whole, within VMEM (16 MiB of bfloat16), so its products run as ragged_dot
    D, F = cfg.hidden_size, cfg.expert_size // max(tensor, 1)
    products = ((D, 2 * F), (F, D), (2 * F, D), (D, F))  # the forward's two and their input gradients'
    tileable = all(_tiles_fit(128, min(_tile_options(k)), min(_tile_options(n))) for k, n in products)
    return ("megablox" if platform == "tpu" and cfg.expert_size % tensor == 0 and tileable and not splits
            else "ragged_dot")


def expert_platform() -> tuple[str, bool]:
    """(the platform the step's experts are compiled for, whether megablox runs in Pallas' interpreter: never on
    the platform that chooses it; tests force it off TPU)."""
    return platform_in_context(), False


def routed_experts(x_BxTxD: jax.Array, layer: dict, cfg: ModelConfig, valid_BxT: jax.Array, gated,
                   hook: ExpertHook | None = None, router_x_BxTxD: jax.Array | None = None
                   ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(the experts' weighted sum [B, T, D], (assignments [E], probability sums [E] over the valid tokens)).

    gated(gate, up): the experts' activation (`llama.GATED`); hook: a method's part of the stacks' products;
    router_x_BxTxD: what the router reads where it is not the experts' input (Gemma 4: the residual); with it the
    weighted sum is taken in float32, as transformers' grouped experts do."""
    B, T, D = x_BxTxD.shape
    K, E = cfg.experts_per_token, cfg.num_experts
    routed_x = x_BxTxD if router_x_BxTxD is None else router_x_BxTxD
    probs_NxE, weights_NxK, experts_NxK = route(routed_x.reshape(B * T, D), layer["router"], cfg)
    platform, interpret = expert_platform()
    mesh = mesh_in_context()
    kernel = grouped_kernel(cfg, platform, 1 if mesh is None else mesh.shape["tensor"])
    if kernel == "megablox":
        out_BxTxD = _megablox_experts(x_BxTxD, weights_NxK.reshape(B, T, K), experts_NxK.reshape(B, T, K),
                                      layer["experts"], gated, hook, E, interpret, cfg.expert_input_scaled)
    else:
        experts = layer["experts"]
        matmul = lambda x, name, sizes_E: grouped_matmul(x, experts[name], sizes_E, EXPERT_AXES[name],  # noqa: E731
                                                         hook, kernel)
        out_BxTxD = _expert_rows(x_BxTxD.reshape(B * T, D), weights_NxK, experts_NxK, gated, E, matmul,
                                 None if router_x_BxTxD is None else wide(x_BxTxD.dtype),
                                 biases=expert_biases(experts), scale_inputs=cfg.expert_input_scaled
                                 ).reshape(B, T, D).astype(x_BxTxD.dtype)
    valid_N = valid_BxT.reshape(-1).astype(jnp.float32)
    assigned_E = jnp.zeros(E, jnp.float32).at[experts_NxK.reshape(-1)].add(jnp.repeat(valid_N, K))
    prob_sums_E = jnp.sum(probs_NxE.astype(jnp.float32) * valid_N[:, None], axis=0)
    return out_BxTxD, (assigned_E, prob_sums_E)


def expert_biases(experts: dict) -> dict:
    """{stack name: its bias [E, out]} of the stacks that have one (gpt-oss)."""
    return {name: m["bias"] for name, m in experts.items() if "bias" in m}


def _expert_rows(x_NxD, weights_NxK, experts_NxK, gated, E: int, matmul, accumulate=None,
                 biases: dict | None = None, scale_inputs: bool = False) -> jax.Array:
    """Every token's K experts' gated MLPs, weighted and summed: [N, D] (in `accumulate`'s dtype if given).
    matmul(x_MxI, "gate_up_proj" or "down_proj", group_sizes_E): that stack's grouped matmul over rows sorted by
    expert; biases: {stack name: [E, out]}, each row's expert's added to its product; scale_inputs (Llama 4): the
    weights multiply each expert's input, in its dtype, and the outputs are summed as they are."""
    N, K = experts_NxK.shape
    expert_M = experts_NxK.reshape(-1)  # M = N K assignments, token-major
    order_M = jnp.argsort(expert_M, stable=True)
    sizes_E = jnp.bincount(expert_M, length=E).astype(jnp.int32)
    x_MxD = x_NxD[order_M // K]
    if scale_inputs:
        x_MxD = x_MxD * weights_NxK.reshape(-1)[order_M][:, None].astype(x_MxD.dtype)
        weights_NxK = jnp.ones_like(weights_NxK)
    biases = biases or {}

    def product(x_MxI, name):
        y_MxO = matmul(x_MxI, name, sizes_E)
        return y_MxO if name not in biases else y_MxO + biases[name][expert_M[order_M]].astype(y_MxO.dtype)

    hidden_MxF = gated(*jnp.split(product(x_MxD, "gate_up_proj"), 2, axis=-1))
    y_MxD = product(hidden_MxF, "down_proj")
    y_NxKxD = y_MxD[jnp.argsort(order_M)].reshape(N, K, y_MxD.shape[-1])
    return _weighted_sum(y_NxKxD, weights_NxK, accumulate or y_NxKxD.dtype)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _weighted_sum(y_NxKxD: jax.Array, weights_NxK: jax.Array, dtype) -> jax.Array:
    """sum_k w_k y_k [N, D] in `dtype`, one fused reduction as transformers adds each expert's weighted output. The
    backward keeps y as it is and widens it inside its own reductions: a widened [N, K, D] copy, which an einsum
    kept for the weights' gradient, was 14 GiB of float32 a chip in DeepSeek-V3's LoRA step on v5p-512."""
    return jnp.sum(y_NxKxD.astype(dtype) * weights_NxK.astype(dtype)[:, :, None], axis=1)


def _megablox_experts(x_BxTxD, weights_BxTxK, experts_BxTxK, experts: dict, gated, hook: ExpertHook | None,
                      E: int, interpret: bool, scale_inputs: bool = False) -> jax.Array:
    """The mixture's output [B, T, D] by megablox on every device's rows: with an expert axis that splits the
    experts, rows gathered over it, each device's own experts computed, partial sums reduce-scattered back; with a
    tensor axis, each device its share of every expert's hidden units (gate and up side by side, as [E, in, 2, F]
    split on F), the down projection's partial sums added over it."""
    dtype = x_BxTxD.dtype
    mesh = mesh_in_context()
    expert_axes, (row_axes, seq_axes), tensor_axes = ((), ((), ()), ()) if mesh is None else (
        mesh_axes_of(("experts",), (E,), mesh.shape)[0], mesh_axes_of(("batch", "seq"), x_BxTxD.shape[:2], mesh.shape),
        ("tensor",) if mesh.shape["tensor"] > 1 else ())
    gather_rows = bool(expert_axes) and set(expert_axes) <= set(row_axes)
    stacks: dict[str, dict] = {}  # each leaf gathered over fsdp, split over the expert axis and (on F) tensor
    specs: dict[str, dict] = {}
    hook_dims = {} if hook is None else dict(hook.leaf_dims)
    for name, module in experts.items():
        follows = {"kernel": ("in", "out"), **(hook_dims if hook is not None and hook.trigger in module else {}),
                   **({"bias": ("in", "out")} if "bias" in module else {})}
        for leaf, (rows_dim, columns_dim) in follows.items():
            value = kernel_of(module, dtype) if leaf == "kernel" else module[leaf]
            if value.ndim < 3:  # a leaf of no expert dimensions (a scale) or an expert bias [E, out]: replicated
                specs.setdefault(name, {})[leaf] = to_spec([()] * value.ndim)
                stacks.setdefault(name, {})[leaf] = value
                continue
            dims = [expert_axes] + [()] * (value.ndim - 1)
            if name == "gate_up_proj" and columns_dim == "out":  # [E, in, 2F] -> [E, in, 2, F]
                value = value.reshape(*value.shape[:-1], 2, value.shape[-1] // 2)
                dims = [expert_axes, (), (), tensor_axes]
            elif name == "down_proj" and rows_dim == "in":  # [E, F, out]
                dims[1] = tensor_axes
            specs.setdefault(name, {})[leaf] = to_spec(dims)
            stacks.setdefault(name, {})[leaf] = (value if mesh is None
                                                 else jax.lax.with_sharding_constraint(value, to_spec(dims)))

    def rows(x, weights, chosen, stacks):  # per device: [b, t, D], [b, t, K] x 2, the local experts' stacks
        b, T, D = x.shape
        x_NxD, weights_NxK, experts_NxK = x.reshape(b * T, D), weights.reshape(b * T, -1), chosen.reshape(b * T, -1)
        if gather_rows:
            x_NxD, weights_NxK, experts_NxK = (jax.lax.all_gather(a, expert_axes, tiled=True)
                                               for a in (x_NxD, weights_NxK, experts_NxK))
        local = stacks["down_proj"]["kernel"].shape[0]
        offset = jax.lax.axis_index(expert_axes) * local if expert_axes else 0
        unpaired = {name: {leaf: v.reshape(*v.shape[:-2], -1) if v.ndim == 4 else v for leaf, v in module.items()}
                    for name, module in stacks.items()}  # gate_up: [E, in, 2, F'] -> [E, in, 2 F'], [gate' | up']
        matmul = lambda x, name, sizes_E: megablox_matmul(  # noqa: E731
            x, unpaired[name], sizes_E, jnp.asarray(offset, jnp.int32), hook, interpret)
        out_NxD = _expert_rows(x_NxD, weights_NxK, experts_NxK, gated, E, matmul,
                               accumulate=jnp.promote_types(dtype, jnp.float32), biases=expert_biases(stacks),
                               scale_inputs=scale_inputs)
        if tensor_axes:  # each device's hidden units' share of every expert output
            out_NxD = jax.lax.psum(out_NxD, tensor_axes)
        if gather_rows:
            out_NxD = jax.lax.psum_scatter(out_NxD, expert_axes, scatter_dimension=0, tiled=True)
        elif expert_axes:
            out_NxD = jax.lax.psum(out_NxD, expert_axes)
        return out_NxD.astype(dtype).reshape(b, T, D)

    if mesh is None:
        return rows(x_BxTxD, weights_BxTxK, experts_BxTxK, stacks)
    rows_spec = to_spec([row_axes, seq_axes, ()])  # each device its rows' tokens (its share of them on context)
    return jax.shard_map(rows, mesh=mesh, in_specs=(rows_spec, rows_spec, rows_spec, specs),
                         out_specs=rows_spec, check_vma=False)(x_BxTxD, weights_BxTxK, experts_BxTxK, stacks)


def megablox_matmul(x_MxI: jax.Array, module: dict, group_sizes_E: jax.Array, offset: jax.Array,
                    hook: ExpertHook | None, interpret: bool) -> jax.Array:
    """Rows sorted by expert times the local experts' kernels [E_local, in, out] (experts offset.. offset +
    E_local of group_sizes_E; other rows come out zero), the method's branch added as in `grouped_matmul`; rows
    padded to megablox's tile."""
    M = x_MxI.shape[0]
    padded = -(-M // 128) * 128
    x_MxI = jnp.pad(x_MxI, ((0, padded - M), (0, 0)))

    def gmm(x, kernel):
        from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

        return megablox.gmm(x, kernel.astype(x.dtype), group_sizes_E, x.dtype, gmm_tiles, offset, None, False,
                            interpret)

    y = _with_hook(x_MxI, gmm(x_MxI, module["kernel"]), module, hook, gmm)
    return y[:M]


def router_loss(assigned_LxE: jax.Array, prob_sums_LxE: jax.Array, tokens: jax.Array) -> jax.Array:
    """Switch Transformer's load-balancing loss (Fedus et al.) E * sum_e f_e P_e over all layers' routing: f_e the
    share of assignments that went to expert e, P_e its mean probability, each over (layers x valid tokens); tokens:
    valid tokens per layer."""
    rows = assigned_LxE.shape[0] * jnp.maximum(tokens, 1.0)
    f_E, p_E = jnp.sum(assigned_LxE, axis=0) / rows, jnp.sum(prob_sums_LxE, axis=0) / rows
    return assigned_LxE.shape[-1] * jnp.sum(f_E * p_E)
