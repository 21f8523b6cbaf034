"""The optimizer a run trains with (`[train] optimizer`), and a method's learning-rate multiples (LoRA+).

Each runs after the same global-norm clipping, on the same schedule, with decoupled weight decay (times the learning
rate, as torch's AdamW) off norms and biases (`state.weight_decay_mask`). Bytes of state a trainable parameter:
    adamw       optax.adamw: mu and nu in float32 (8 bytes; 4 with `[offload] moments_dtype = "bfloat16"`)
    adafactor   optax's factored second moment, update clipping 1.0 (transformers' optim="adafactor"): ~0 for matrices
    muon        Muon on each layer's and expert's matrix (4 bytes), AdamW for embeddings, head, norms, vectors
    adamw_8bit  AdamW with mu and nu stored as bitsandbytes' AdamW8bit stores them (block-wise 8-bit, ~2.03 bytes)
Every state is a pytree of arrays, so checkpoints save and restore it as they do Adam's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from jaxtune.config import TrainConfig
from jaxtune.parallel.offload import low_precision_moments
from jaxtune.spine.state import clip_by_global_norm, learning_rate_schedule, weight_decay_mask

STATE_LABELS = {  # what the planner's report calls each optimizer's state
    "adamw": "Adam mu and nu",
    "adafactor": "Adafactor's factored second moments",
    "muon": "Muon momentum (layer matrices) + Adam mu and nu (the rest)",
    "adamw_8bit": "Adam mu and nu in 8 bits (block-wise, 256)",
}
BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep float32 moments
MUON_MATRICES = ("kernel", "lora_a", "lora_b")  # a layer's linear maps: [L, (E,) in, out]


def _names(path) -> list[str]:
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]


def layer_stacked(path) -> bool:
    """Whether the leaf at `path` is stacked over the layers (its leading axis): each layer's slice is one tensor."""
    return "layers" in _names(path)


def make_optimizer(name: str, train: TrainConfig, total_steps: int, trainable: dict, moments_dtype: str = "float32",
                   rates: dict | None = None) -> optax.GradientTransformation:
    """Clipping to `train.max_grad_norm`, then optimizer `name` (see the module docstring) on the schedule, with
    `train.weight_decay` off norms and biases; `rates`, a tree like `trainable` (`Method.learning_rates`: LoRA+),
    scales each leaf's updates (None: off). moments_dtype "bfloat16": AdamW's moments rounded between steps, updated
    in float32."""
    schedule = learning_rate_schedule(train, total_steps)
    decay = weight_decay_mask(trainable)
    if name == "adamw":
        core = optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps,
                           weight_decay=train.weight_decay, mask=decay)
    elif name == "adafactor":
        core = optax.chain(optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0),
                           optax.add_decayed_weights(train.weight_decay, decay), optax.scale_by_learning_rate(schedule))
    elif name == "muon":
        core = muon(train, schedule, trainable)
    elif name == "adamw_8bit":
        core = optax.chain(scale_by_adam_8bit(train.adam_b1, train.adam_b2, train.adam_eps, train.max_grad_norm),
                           optax.add_decayed_weights(train.weight_decay, decay), optax.scale_by_learning_rate(schedule))
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    # 8-bit AdamW clips inside its layer-by-layer update (a clipped copy of the gradients would be written out whole)
    parts = [optax.identity() if name == "adamw_8bit" else clip_by_global_norm(train.max_grad_norm), core]
    if rates is not None:
        parts.append(scale_updates(rates))
    optimizer = optax.chain(*parts)
    return optimizer if moments_dtype == "float32" else low_precision_moments(optimizer, moments_dtype)


# --- Muon ---------------------------------------------------------------------------------------------------------

def muon_dimensions(trainable: dict) -> dict:
    """Per leaf: MuonDimensionNumbers(reduction -2, output -1) for a layer's linear map ([L, in, out]; a mixture's
    [L, E, in, out]: every leading axis a batch axis, so each layer's and expert's matrix is orthogonalised on its
    own), None for the leaves AdamW trains (embeddings, the head, norms, vectors, prefixes)."""

    def dims(path, x):
        muon_leaf = layer_stacked(path) and _names(path)[-1] in MUON_MATRICES and x.ndim >= 3
        return MuonDimensionNumbers(-2, -1) if muon_leaf else None

    return jax.tree_util.tree_map_with_path(dims, trainable)


def muon(train: TrainConfig, schedule: optax.Schedule, trainable: dict) -> optax.GradientTransformation:
    """optax.contrib.muon's Muon half (Nesterov momentum `muon_momentum`, 5 Newton-Schulz steps, the step scaled by
    torch.optim.Muon's `adjust_lr_fn`: "match_rms_adamw" 0.2 sqrt(max(in, out)), so one learning rate serves both
    halves as in Moonlight, or "original" sqrt(max(1, out / in))) on the layers' matrices; `optax.adamw` as the
    "adamw" optimizer on the rest (optax's own Muon gives its Adam half Nesterov momentum and decays every leaf)."""
    dims = muon_dimensions(trainable)
    is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=is_dims)
    # the Muon half sees the tree with the Adam half's leaves masked out (optax.partition)
    muon_dims = jax.tree.map(lambda d: optax.MaskedNode() if d is None else d, dims, is_leaf=is_dims)
    return optax.partition({
        "muon": optax.chain(muon_by_layer(train.muon_momentum, train.muon_adjust_lr_fn, muon_dims),
                            optax.add_decayed_weights(train.weight_decay),  # matrices all decay
                            optax.scale_by_learning_rate(schedule)),
        "adam": optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps,
                            weight_decay=train.weight_decay, mask=weight_decay_mask),
    }, labels)


def muon_by_layer(beta: float, adjust_lr_fn: str, dims) -> optax.GradientTransformation:
    """optax.contrib's `scale_by_muon` (+ `scale_by_matrix_shape`) on layer-stacked matrices [L, (E,) in, out], one
    layer at a time (`by_layer`): the result of all layers at once, the Newton-Schulz temporaries one layer's. The
    state is scale_by_muon's (count, momentum [L, ...], coefficients)."""
    inner = optax.chain(scale_by_muon(beta=beta, weight_dimension_numbers=dims), scale_by_matrix_shape(adjust_lr_fn))

    def update(updates, state, params=None):
        del params
        muon_state, shape_state = state

        def layer(u, mu):
            out, (layer_state, _) = inner.update(u, (muon_state._replace(mu=mu), shape_state))
            return out, layer_state.mu

        out, mu = by_layer(layer, updates, muon_state.mu)
        return out, (muon_state._replace(count=optax.safe_increment(muon_state.count), mu=mu), shape_state)

    return optax.GradientTransformation(inner.init, update)


def scale_by_matrix_shape(adjust_lr_fn: str) -> optax.GradientTransformation:
    """Each [..., in, out] update times torch.optim.Muon's `adjust_lr_fn` ratio, as optax.contrib's scale_by_shape
    computes it: "original" sqrt(max(1, out / in)) (Keller Jordan's), "match_rms_adamw" 0.2 sqrt(max(in, out))
    (its `consistent_rms`: the update's RMS near AdamW's, Liu et al. 2025). No state."""

    def scale(u):
        fan_in, fan_out = u.shape[-2], u.shape[-1]
        if adjust_lr_fn == "match_rms_adamw":
            return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * 0.2 * u
        return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * u

    def update(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


# --- 8-bit AdamW (bitsandbytes' block-wise dynamic quantisation) ---------------------------------------------------

def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)` (Dettmers 2016): 256 sorted
    float32 values in [-1, 1], dense near 0: for each exponent 10^-6 .. 10^0, the midpoints of an even split of
    [0.1, 1] (2^i of them signed, with their negatives; 2^(i+1) unsigned), then 0 and 1."""
    values = [0.0, 1.0]
    for i in range(7):
        bounds = np.linspace(0.1, 1.0, (2**i if signed else 2 ** (i + 1)) + 1)
        means = 10.0 ** (i - 6) * (bounds[:-1] + bounds[1:]) / 2
        values += list(means) + (list(-means) if signed else [])
    return np.sort(np.asarray(values)).astype(np.float32)


SIGNED_MAP, UNSIGNED_MAP = dynamic_map(True), dynamic_map(False)


class QuantizedMoment(NamedTuple):
    """A moment stored in 8 bits: codes uint8 (the parameter's shape, so sharded as it is), indices into the dynamic
    map; absmax float32 [L, blocks] for a layer-stacked leaf (each layer's tensor flattened into blocks of 256, the
    last one partial, as bitsandbytes blocks a tensor), else [blocks]."""

    codes: jax.Array
    absmax: jax.Array


def _blocks(x: jax.Array, lead: int) -> jax.Array:
    """x [*lead axes, ...] -> [*lead axes, blocks, 256]: each lead slice flattened, zero-padded to whole blocks."""
    flat = x.reshape(*x.shape[:lead], -1)
    pad = -flat.shape[-1] % BLOCK
    return jnp.pad(flat, [(0, 0)] * lead + [(0, pad)]).reshape(*x.shape[:lead], -1, BLOCK)


def _unblock(blocks: jax.Array, shape: tuple, lead: int) -> jax.Array:
    n = int(np.prod(shape[lead:]))
    return blocks.reshape(*shape[:lead], -1)[..., :n].reshape(shape)


def quantize_blockwise(x: jax.Array, code: np.ndarray, lead: int) -> QuantizedMoment:
    """x float32 -> codes of the value of `code` nearest to x / its block's absmax (ties: the lower), as
    bitsandbytes' `quantize_blockwise` (an all-zero block's absmax is stored as 1). lead: 1 for a layer stack.

    The index is counted against the 255 midpoints between neighbouring codes, one comparison each: elementwise, so
    XLA fuses it into one pass (a searchsorted's gathers made XLA:CPU write each step out: 6x the moments' bytes)."""
    blocks = _blocks(x, lead)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    absmax = jnp.where(absmax == 0, 1.0, absmax)
    scaled = blocks / absmax[..., None]
    index = jnp.zeros(scaled.shape, jnp.int32)
    for midpoint in (code[1:] + code[:-1]) / 2:
        index = index + (scaled > midpoint)
    return QuantizedMoment(_unblock(index.astype(jnp.uint8), x.shape, lead), absmax)


def dequantize_blockwise(q: QuantizedMoment, code: np.ndarray) -> jax.Array:
    """code[codes] x the block's absmax, float32 in the codes' shape."""
    lead = q.absmax.ndim - 1
    values = _blocks(jnp.asarray(code)[q.codes.astype(jnp.int32)], lead)
    return _unblock(values * q.absmax[..., None], q.codes.shape, lead)


class ScaleByAdam8bitState(NamedTuple):
    count: jax.Array  # int32 []
    mu: dict  # per leaf a QuantizedMoment (signed map), or float32 below MIN_8BIT_SIZE elements a tensor
    nu: dict  # likewise (unsigned map)


def scale_by_adam_8bit(b1: float, b2: float, eps: float, max_norm: float | None = None
                       ) -> optax.GradientTransformation:
    """optax.scale_by_adam with mu and nu stored between steps as bitsandbytes' 8-bit block-wise optimizers store
    them (signed and unsigned dynamic maps); a step dequantises them, updates in float32 with the gradient, takes
    Adam's direction from those float32 moments and quantises them again. A tensor under MIN_8BIT_SIZE elements
    (per layer, for a layer stack) keeps float32 moments, as bitsandbytes' min_8bit_size does. max_norm: the
    gradients clipped to this global norm first (`state.clip_by_global_norm`'s factor, applied a layer at a time)."""

    def init(params):
        def zeros(path, p, code):
            lead = 1 if layer_stacked(path) else 0
            if p.size // (p.shape[0] if lead else 1) < MIN_8BIT_SIZE:
                return jnp.zeros(p.shape, jnp.float32)
            return quantize_blockwise(jnp.zeros(p.shape, jnp.float32), code, lead)

        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32),
                                    jax.tree_util.tree_map_with_path(lambda k, p: zeros(k, p, SIGNED_MAP), params),
                                    jax.tree_util.tree_map_with_path(lambda k, p: zeros(k, p, UNSIGNED_MAP), params))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        norm = optax.tree.norm(updates)
        factor = 1.0 if max_norm is None else jnp.where(norm < max_norm, 1.0, max_norm / norm)

        def moments(g, m, v):
            g = g * factor.astype(g.dtype) if max_norm is not None else g
            quantized = isinstance(m, QuantizedMoment)
            m32 = dequantize_blockwise(m, SIGNED_MAP) if quantized else m
            v32 = dequantize_blockwise(v, UNSIGNED_MAP) if quantized else v
            m32 = optax.tree.update_moment(g, m32, b1, 1)
            v32 = optax.tree.update_moment_per_elem_norm(g, v32, b2, 2)
            step = (optax.tree.bias_correction(m32, b1, count)
                    / (jnp.sqrt(optax.tree.bias_correction(v32, b2, count)) + eps))
            if quantized:
                lead = m.absmax.ndim - 1
                m32, v32 = quantize_blockwise(m32, SIGNED_MAP, lead), quantize_blockwise(v32, UNSIGNED_MAP, lead)
            return step, m32, v32

        def leaf(g, m, v):
            if not isinstance(m, QuantizedMoment):
                return moments(g, m, v)
            if m.absmax.ndim == 2:
                return by_layer(moments, g, m, v)
            n = row_chunks(g.size)  # a leaf outside the stacks (the embedding, the head): whole blocks a chunk
            as_chunks = lambda x: x.reshape(n, -1)  # noqa: E731
            step, m, v = by_layer(moments, as_chunks(g), *jax.tree.map(as_chunks, (m, v)))
            back = lambda x, like: x.reshape(like.shape)  # noqa: E731
            return back(step, g), QuantizedMoment(back(m.codes, g), m.absmax.reshape(-1)), \
                QuantizedMoment(back(v.codes, g), v.absmax.reshape(-1))

        out = jax.tree.map(leaf, updates, state.mu, state.nu)
        part = lambda i: jax.tree.map(lambda _, o: o[i], updates, out)  # noqa: E731
        return part(0), ScaleByAdam8bitState(count, part(1), part(2))

    return optax.GradientTransformation(init, update)


def row_chunks(size: int) -> int:
    """How many equal pieces of whole 256-blocks (at most 16) a tensor of `size` elements is updated in."""
    return next((n for n in (16, 8, 4, 2) if size % (n * BLOCK) == 0), 1)


def by_layer(update, g, *state):
    """`update(g, *state) -> (step, *new state)` on layer stacks (trees of [L, ...] arrays), one layer at a time: the
    state's stacks updated in place and the step written a layer at a time, so the update's temporaries are one
    layer's. On whole stacks XLA:CPU kept several float32 copies of them at once (8-bit AdamW 3.9: the moments
    dequantised, their squares, the step; Muon's Newton-Schulz 3.1: the matrix, its Gram matrix, their products)."""
    take = lambda i: lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)  # noqa: E731
    put = lambda i: lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part, i, 0)  # noqa: E731

    def layer(i, carry):
        return jax.tree.map(put(i), carry, update(*jax.tree.map(take(i), (g, *carry[1:]))))

    return jax.lax.fori_loop(0, jax.tree.leaves(g)[0].shape[0], layer, (jax.tree.map(jnp.zeros_like, g), *state))


# --- learning-rate multiples ----------------------------------------------------------------------------------------

def scale_updates(rates: dict) -> optax.GradientTransformation:
    """Each leaf's final update times its multiple in `rates`, i.e. its learning rate (and with it its decoupled
    weight decay) lr x the multiple, as param groups give torch's optimizers. No state."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, r: u if r == 1.0 else u * r, updates, rates), state

    return optax.GradientTransformation(optax.init_empty_state, update)
