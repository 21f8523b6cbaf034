"""The one linear layer every projection goes through (`dense`), whatever method has transformed its leaves.

A module is a dict of one layer's leaves: `kernel` [in, out] (a float array, a quantised leaf or a `BitPattern`),
optional `bias` [out], and the leaves methods add (LoRA's `lora_a` [in, r] and `lora_b` [r, out], DoRA's
`magnitude`, IA3's `ia3_in` / `ia3_out`, ...). A method enters through the hooks it hands the forward
(`models/adapters.py`), each run where a module holds its leaf: nothing here names a method. A frozen kernel in
another dtype is derived a piece at a time where it is used (`derived_piecewise_matmul`; over fsdp in its stored
bits: `gathered_piecewise_matmul`) and again in the backward, never kept.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxtune.config.forward import MATMUL_OUTPUT
from jaxtune.config.method import Branch, DenseHook
from jaxtune.host_cpu import fast_bf16_dots
from jaxtune.models.adapters import Adapters
from jaxtune.models.params import LINEAR_AXES
from jaxtune.models.quant import (
    BitPattern,
    NF4Array,
    QuantizedArray,
    absmax_of,
    column_multiple,
    dequantize,
    dequantize_columns,
    full_shape,
)
from jaxtune.parallel.rules import (
    ZERO_AXES,
    context_ways,
    gathered,
    mesh_axes_of,
    mesh_in_context,
    platform_in_context,
    zero_only_dim,
)


def wide(dtype) -> jnp.dtype:
    """The dtype of statistics and accumulations for values of `dtype`: float32, or float64 for float64."""
    return jnp.promote_types(dtype, jnp.float32)


def scaled(x: jax.Array, c: float) -> jax.Array:
    """x times a constant, computed in float32 (float64) and rounded once: torch's product of a tensor and a Python
    float."""
    return (x.astype(wide(x.dtype)) * c).astype(x.dtype)


def kernel_of(module: dict, dtype) -> jax.Array:
    """The module's base weight [in, out] in `dtype`, dequantised inside the jitted computation if quantised (or
    bitcast back from a frozen kernel's bit pattern)."""
    kernel = module["kernel"]
    if isinstance(kernel, QuantizedArray | BitPattern):
        kernel = dequantize(kernel)
    return kernel.astype(dtype)


def matmul(x: jax.Array, w: jax.Array, out_dtype=None, transposed: bool = False) -> jax.Array:
    """x [..., in] @ w [in, out] as `out_dtype` (default x's), w cast to x's dtype; `transposed`: w is [out, in] (a
    tied head's embedding table), multiplied as stored. Below float32 (bfloat16 compute) the products are
    accumulated in float32, forward and backward, and rounded once, as torch's autocast rounds them (which dot does
    that fastest: `product_dtype`); a float32 w (a master weight) gets its gradient in float32, never rounded to x's
    dtype.

    The products with w, x w and the backward's g w^T, are taken as [tokens, in]: inside a loop (the chunked head,
    a layer's pieces), XLA:CPU gave a [B, T, in] product that contracts w's last axis a transposed copy of w,
    hoisted out of the loop (the whole head, in bfloat16; tests/test_head.py), where a [tokens, in] one reads w as
    stored. dw = x^T g keeps x's own shape: taken as [tokens, ...] it held more memory in full fine-tunes."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    accumulate = x.dtype if x.dtype in (jnp.float32, jnp.float64) else jnp.dtype(jnp.float32)
    return checkpoint_name(_matmul(x, w, out_dtype, transposed, accumulate), MATMUL_OUTPUT)


def product_dtype(out_dtype, accumulate) -> jnp.dtype:
    """The dtype a dot returns for a product accumulated in `accumulate` and rounded to `out_dtype`: `accumulate`,
    but bfloat16 itself on a CPU without fast bfloat16 dots (`host_cpu.fast_bf16_dots`: no AMX). XLA:CPU computes a
    bfloat16-output dot as a float32 GEMM of the widened operands (the same float32 sums, rounded once), which there
    runs faster than its bfloat16 kernel (float32 output): the bfloat16 LoRA step 1.18x with AVX512_BF16, 1.15x
    capped at AVX2. With AMX that kernel is the fast one (benchmarks/README.md, issue 54). A product with a wide
    output (the head's logits) keeps its input's gradient wide too: XLA:CPU widened the head's weight for a bfloat16
    one."""
    out_dtype, accumulate = jnp.dtype(out_dtype), jnp.dtype(accumulate)
    if out_dtype != jnp.bfloat16 or accumulate == out_dtype or platform_in_context() != "cpu" or fast_bf16_dots():
        return accumulate
    return out_dtype


# einsum specs of y = x w, dx = g w^T and dw = x^T g, for w [in, out] and, transposed, w [out, in]
_SPECS = {False: ("ti,io->to", "to,io->ti", "...i,...o->io"),
          True: ("ti,oi->to", "to,oi->ti", "...o,...i->oi")}


def _tokens(a: jax.Array) -> jax.Array:
    return a.reshape(-1, a.shape[-1])


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(x, w, out_dtype, transposed, accumulate):
    y = jnp.einsum(_SPECS[transposed][0], _tokens(x), w.astype(x.dtype),
                   preferred_element_type=product_dtype(out_dtype, accumulate))
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype)


def _matmul_fwd(x, w, out_dtype, transposed, accumulate):
    return _matmul(x, w, out_dtype, transposed, accumulate), (x, w)


def _matmul_bwd(out_dtype, transposed, accumulate, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    _, dx_spec, dw_spec = _SPECS[transposed]
    product = product_dtype(out_dtype, accumulate)
    dx = jnp.einsum(dx_spec, _tokens(g), w.astype(x.dtype), preferred_element_type=product)
    x_, g_ = (x, g) if product == accumulate else (x.astype(accumulate), g.astype(accumulate))  # as y's and dx's GEMMs
    dw = jnp.einsum(dw_spec, *((g_, x_) if transposed else (x_, g_)), preferred_element_type=accumulate)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# The most of a frozen kernel one device gathers at once under fsdp, by backend: on CPU 4 MiB (its devices often
# share one host's memory, and a piece costs little there); elsewhere 64 MiB, a whole kernel up to ~8B models, so
# NCCL's and ICI's all-gathers stay few and bandwidth-bound (a 70B MLP kernel, 470 MB, goes in 8 pieces).
GATHERED_PIECE_BYTES = {"cpu": 1 << 22, "other": 1 << 26}


def gathered_piece_bytes(backend: str) -> int:
    """`GATHERED_PIECE_BYTES` for a backend ("cpu", "gpu", "tpu", ...)."""
    return GATHERED_PIECE_BYTES.get(backend, GATHERED_PIECE_BYTES["other"])


def gathered_piecewise_matmul(x: jax.Array, kernel: BitPattern, axes: tuple[str | None, str | None], split: int
                              ) -> jax.Array:
    """x [..., in] @ W [in, out] for a frozen 16-bit kernel that fsdp alone splits, along dimension `split`, gathering
    W a piece at a time (about `gathered_piece_bytes`) in a loop, so a device never holds the whole gathered
    kernel: pieces of output columns when fsdp splits the input rows (y is their concatenation), pieces of input
    rows when it splits the output columns (y is their sum, in float32). The backward gathers each piece again.
    A kernel that is one layer of a stack (`BitPattern.layer`) has each piece read from the stack directly.

    ZeRO-3 all-gathers a layer's weights where they are used; whole, a gathered MLP kernel of a 1B model is
    22 MiB a device, plus XLA:CPU's copy of it from its stored bits."""
    bits = kernel.bits
    shape = bits.shape[-2:]  # one layer's [in, out]
    cut = 1 - split  # the dimension cut into pieces: the one fsdp leaves whole
    nbytes = math.prod(shape) * bits.dtype.itemsize
    pieces = _piece_count(shape[cut], nbytes, gathered_piece_bytes(platform_in_context()))
    width = shape[cut] // pieces

    def piece(p):
        if kernel.layer is None:
            w = jax.lax.dynamic_slice_in_dim(bits, p * width, width, axis=cut)
        else:
            start = (kernel.layer, 0, p * width) if cut == 1 else (kernel.layer, p * width, 0)
            size = (1, shape[0], width) if cut == 1 else (1, width, shape[1])
            w = jax.lax.dynamic_slice(bits, start, size)[0]
        return gathered(jax.lax.bitcast_convert_type(w, kernel.dtype), axes)  # `matmul` casts it to x's dtype

    if cut == 1:  # output columns: y[..., p] = x @ W[:, p]
        def columns(_, p):
            return None, matmul(x, piece(p))
        _, y_Px = jax.lax.scan(jax.checkpoint(columns, prevent_cse=False), None, jnp.arange(pieces))
        return jnp.moveaxis(y_Px, 0, -2).reshape(*x.shape[:-1], shape[1])

    def rows(acc, p):  # input rows: y = sum_p x[..., p] @ W[p, :]
        x_p = jax.lax.dynamic_slice_in_dim(x, p * width, width, axis=-1)
        return acc + matmul(x_p, piece(p), wide(x.dtype)), None
    acc = jnp.zeros((*x.shape[:-1], shape[1]), wide(x.dtype))
    y, _ = jax.lax.scan(jax.checkpoint(rows, prevent_cse=False), acc, jnp.arange(pieces))
    return y.astype(x.dtype)


def _piece_count(length: int, nbytes: int, piece_bytes: int) -> int:
    """The fewest pieces, a divisor of `length`, that cut `nbytes` to at most `piece_bytes` each."""
    need = -(-nbytes // piece_bytes)
    return next(p for p in range(max(need, 1), length + 1) if length % p == 0)


class Pieces(NamedTuple):
    """How `derived_piecewise_matmul` cuts a weight's output units: each of its `ways` shards (split over the mesh
    axes `axes`; one without a mesh) of `units` in `count` pieces of `width`, the last piece ending at the shard's
    end (overlapping its predecessor where `width` does not divide `units`). transposed: w is [out, in]."""

    ways: int
    units: int
    width: int
    count: int  # type: ignore[assignment]  # shadows tuple.count; callers (and tests) read `.count`
    axes: tuple[str, ...]
    transposed: bool


def pieces_of(w, x_dtype, axes: tuple[str | None, str | None] | None = None, transposed: bool = False
              ) -> Pieces | None:
    """How to cut a frozen weight that is derived in `x_dtype` where it is used, so that a derived piece holds
    about `gathered_piece_bytes`: a quantised kernel (dequantised), or a 16-bit one narrower than `x_dtype` (a
    BitPattern or float kernel, or a head, under float32 compute). w is [in, out] ([out, in] when `transposed`),
    `axes` its logical (in, out) axes. None: use it whole, when nothing is derived, one piece would hold it all,
    or the mesh in context splits other than its output units (`gathered_piecewise_matmul` cuts what fsdp
    splits)."""
    if not isinstance(w, QuantizedArray) and not jnp.dtype(w.dtype).itemsize == 2 < jnp.dtype(x_dtype).itemsize:
        return None  # used as it is, or bitcast back from its bits: nothing derived
    shape = full_shape(w)[-2:] if isinstance(w, QuantizedArray) else getattr(w, "bits", w).shape[-2:]
    d_in, d_out = shape[::-1] if transposed else shape
    mesh = mesh_in_context()
    unit_axes: tuple[str, ...] = ()
    if mesh is not None:
        if axes is None:  # how the mesh splits it is not known: used whole
            return None
        in_axes, unit_axes = mesh_axes_of(axes, (d_in, d_out), mesh.shape)
        if in_axes != () or (unit_axes and isinstance(w, QuantizedArray)):
            return None
    ways = math.prod(mesh.shape[a] for a in unit_axes) if unit_axes else 1
    units = d_out // ways
    multiple = column_multiple(w) if isinstance(w, QuantizedArray) else 1
    itemsize = max(jnp.dtype(x_dtype).itemsize, 4 if isinstance(w, QuantizedArray) else 2)  # NF4: in float32
    fit = max(1, gathered_piece_bytes(platform_in_context()) // (d_in * itemsize))
    if not multiple or fit >= units:
        return None
    count = -(-units // fit)  # as few pieces as fit, of equal widths
    width = -(-units // count // multiple) * multiple
    return Pieces(ways, units, width, -(-units // width), unit_axes, transposed) if width < units else None


def _piece(w, p: jax.Array, layout: Pieces, absmax) -> tuple[jax.Array, jax.Array]:
    """(piece p of `w` in its stored dtype, [ways, width, in] if transposed, else [in, ways, width], without the
    ways axis where there is one shard; its start)."""
    start = jnp.minimum(p * layout.width, layout.units - layout.width)
    if isinstance(w, QuantizedArray):
        return dequantize_columns(w, start, layout.width, absmax), start
    # A 16-bit kernel is sliced as its bits: XLA:CPU widens the operand of a 16-bit float slice to float32 first,
    # whole, out of the loop. A float w's bits are a copy of it (XLA:CPU materialises the bitcast), a BitPattern's
    # are as stored.
    if isinstance(w, BitPattern):
        bits = w.bits if w.layer is None else jax.lax.dynamic_index_in_dim(w.bits, w.layer, keepdims=False)
    else:
        bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    shards = (layout.ways,) if layout.ways > 1 else ()
    if layout.transposed:
        w3 = _split(bits.reshape(*shards, layout.units, bits.shape[-1]), layout, 0)
        piece = jax.lax.dynamic_slice_in_dim(w3, start, layout.width, axis=-2)
    else:
        w3 = _split(bits.reshape(bits.shape[0], *shards, layout.units), layout, 1)
        piece = jax.lax.dynamic_slice_in_dim(w3, start, layout.width, axis=-1)
    return jax.lax.bitcast_convert_type(piece, w.dtype), start


def _split(x: jax.Array, layout: Pieces, dim: int) -> jax.Array:
    """`x` with dimension `dim` (the `ways` shards of the output units) split over their mesh axes."""
    if layout.ways == 1:
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[dim] = layout.axes
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def _specs(layout: Pieces) -> tuple[str, str, tuple[int, ...]]:
    """(einsum of x with a piece, of a piece of the output's gradient with the piece, the output's shape after N)."""
    s = "s" if layout.ways > 1 else ""
    w = f"{s}wi" if layout.transposed else f"i{s}w"
    return f"ni,{w}->n{s}w", f"n{s}w,{w}->ni", ((layout.ways,) if s else ()) + (layout.units,)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _by_pieces(x_NxI, w, out_dtype, layout: Pieces):
    accumulate = wide(x_NxI.dtype)
    absmax = absmax_of(w) if isinstance(w, NF4Array) else None
    spec, _, shape = _specs(layout)

    def product(p):
        w_p, start = _piece(w, p, layout, absmax)
        y_p = jnp.einsum(spec, x_NxI, w_p.astype(x_NxI.dtype), preferred_element_type=accumulate)
        return y_p.astype(out_dtype), start

    def columns(p, y_NxSxU):
        return jax.lax.dynamic_update_slice_in_dim(y_NxSxU, *product(p), axis=-1)

    # the output starts as the first piece padded, not as zeros: XLA:CPU shared one zero buffer between this loop
    # and its recomputation in the backward, and copied it for each (two more [N, out] buffers)
    y_NxSxW, _ = product(0)
    pad = [(0, 0)] * (y_NxSxW.ndim - 1) + [(0, layout.units - layout.width)]
    y_NxSxU = jax.lax.fori_loop(1, layout.count, columns, _split(jnp.pad(y_NxSxW, pad), layout, 1))
    return y_NxSxU.reshape(x_NxI.shape[0], layout.ways * layout.units)


def _by_pieces_fwd(x_NxI, w, out_dtype, layout):
    return _by_pieces(x_NxI, w, out_dtype, layout), (x_NxI, w)


def _by_pieces_bwd(out_dtype, layout, residuals, g_NxO):
    x_NxI, w = residuals
    accumulate = wide(x_NxI.dtype)
    absmax = absmax_of(w) if isinstance(w, NF4Array) else None
    _, spec, shape = _specs(layout)
    g_NxSxU = _split(g_NxO.astype(x_NxI.dtype).reshape(-1, *shape), layout, 1)

    def product(p):  # the last piece's units that its predecessor covered are left out
        w_p, start = _piece(w, p, layout, absmax)
        g_p = jax.lax.dynamic_slice_in_dim(g_NxSxU, start, layout.width, axis=-1)
        g_p = jnp.where(start + jnp.arange(layout.width) >= p * layout.width, g_p, 0)
        return jnp.einsum(spec, g_p, w_p.astype(x_NxI.dtype), preferred_element_type=accumulate)

    # the sum starts as the first piece's product, not as zeros (see `_by_pieces`)
    dx_NxI = jax.lax.fori_loop(1, layout.count, lambda p, dx: dx + product(p), product(0)).astype(x_NxI.dtype)
    if isinstance(w, QuantizedArray | BitPattern):
        return dx_NxI, None
    # a float w's gradient, whole: a frozen head's is never used, and XLA removes it
    dw = jnp.einsum(_SPECS[layout.transposed][2], *((g_NxO, x_NxI) if layout.transposed else (x_NxI, g_NxO)),
                    preferred_element_type=accumulate)
    return dx_NxI, dw.astype(w.dtype)


_by_pieces.defvjp(_by_pieces_fwd, _by_pieces_bwd)


def derived_piecewise_matmul(x: jax.Array, w, layout: Pieces, out_dtype=None) -> jax.Array:
    """x [..., in] @ W as `out_dtype` (default x's), W derived in x's dtype a piece of output units at a time
    (`pieces_of`): a frozen kernel as stored (dequantised, or bitcast back from its bits) or a narrower float w
    (a frozen 16-bit head under float32 compute; [out, in] when `layout.transposed`), each piece converted inside
    the loop that multiplies it and again in the backward, which sums x's gradient over the pieces.

    Whole, XLA:CPU derives the weight once before its first use and keeps it: a float32 copy of a 32,000 x 2,048
    tied bfloat16 table (250 MiB beside its 125), converted out of the chunked loss's loop, and a layer's seven
    kernels dequantised to float32 (172 MiB of a 607M model's 12-layer QLoRA step)."""
    y = _by_pieces(_tokens(x), w, jnp.dtype(out_dtype or x.dtype), layout)
    return checkpoint_name(y.reshape(*x.shape[:-1], y.shape[-1]), MATMUL_OUTPUT)


def dropout_keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Boolean [shape]: True where an element is kept, each independently with probability 1 - rate."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def dropout(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout as torch's `nn.Dropout` in training: kept elements scaled by 1 / (1 - rate), so E[y] = x."""
    return jnp.where(dropout_keep_mask(key, x.shape, rate), x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), 0)


def dense(x: jax.Array, module: dict, adapters: Adapters = Adapters(),
          kernel_axes: tuple[str | None, str | None] | None = None) -> jax.Array:
    """y = x @ W (+ bias), with the dense hooks of `adapters` whose leaves the module holds, in x's dtype; x is
    [..., in], y [..., out].

    adapters: the method's hooks and, in training, the module's dropout key and rate (`Adapters.of_module`).
    kernel_axes: the kernel's logical axes (in, out); with them a frozen 16-bit kernel is all-gathered over fsdp
    right where it is used, in its stored bits (`rules.gathered`), a piece at a time where fsdp alone splits it
    (`gathered_piecewise_matmul`; whole for DoRA, whose norm needs it). A kernel derived in another dtype where it
    is used, dequantised or widened from its 16 bits to float32 compute, is derived a piece at a time too
    (`derived_piecewise_matmul`), so no layer's kernel exists whole in the compute dtype.
    A quantised kernel is dequantised again in the backward pass rather than kept: the backward needs W for
    x's gradient, and keeping every layer's dequantised W would hold a float copy of the whole frozen model (so
    is a frozen kernel's bit pattern: the backward re-reads the scanned slice instead of stacking a copy). Without
    CSE prevention, a layer that remat recomputes derives W once for its recomputation and its backward (measured:
    a 607M QLoRA step held 189 MiB of temporaries with two derivations, 131 MiB with one); across the layer scan's
    forward and backward loops there is nothing to merge, so no W outlives its layer.
    """
    hooks = adapters.hooks_of(module)
    key, rate = adapters.dropout_key, adapters.dropout_rate
    if rate == 0.0 or not any(hook.dropout for hook in hooks):
        key, rate = None, 0.0
    if isinstance(module["kernel"], QuantizedArray | BitPattern):
        rederived = jax.checkpoint(_dense, static_argnums=(3, 4, 5), prevent_cse=False)
        return rederived(x, module, key, hooks, rate, kernel_axes)
    return _dense(x, module, key, hooks, rate, kernel_axes)


def _dense(x: jax.Array, module: dict, dropout_key: jax.Array | None, hooks: tuple[DenseHook, ...],
           dropout_rate: float, kernel_axes: tuple[str | None, str | None] | None) -> jax.Array:
    for hook in hooks:
        if hook.scale_input is not None:
            x = hook.scale_input(x, module)
    stored = kernel_axes is not None and isinstance(module["kernel"], BitPattern)
    split = zero_only_dim(kernel_axes, module["kernel"].bits.shape[-2:]) if stored and kernel_axes is not None else None
    whole = any(hook.needs_kernel(module) for hook in hooks)  # DoRA's norm needs the whole kernel
    derived = isinstance(module["kernel"], QuantizedArray | BitPattern) and not whole
    layout = pieces_of(module["kernel"], x.dtype, kernel_axes) if derived else None
    branch = Branch(dropout_key, dropout_rate, kernel_axes)
    kernel, fused = None, None
    if split is not None and not whole:
        assert kernel_axes is not None  # a split is a stored kernel's
        y = gathered_piecewise_matmul(x, module["kernel"], kernel_axes, split)
    elif layout is not None:
        y = derived_piecewise_matmul(x, module["kernel"], layout)
    else:
        if stored and kernel_axes is not None:
            module = {**module, "kernel": gathered(dequantize(module["kernel"]), kernel_axes)}
        elif kernel_axes is not None and context_ways() > 1:  # left to XLA, the 2-D split's output was replicated
            module = {**module, "kernel": gathered(kernel_of(module, x.dtype), kernel_axes)}
        kernel = kernel_of(module, x.dtype)
        if not stored and not whole:
            fused = next((hook for hook in hooks if hook.product is not None and hook.fuses(module)), None)
        if fused is not None and not folds_branch(platform_in_context(), _split_axes(kernel_axes, kernel.shape),
                                                  gathered=context_ways() > 1):
            fused = None
        product = None if fused is None else fused.product
        y = (matmul(x, kernel) if product is None else
             checkpoint_name(product(x, kernel, module, branch), MATMUL_OUTPUT))
    for hook in hooks:
        if hook.add is not None and hook is not fused:
            y = hook.add(x, y, module, kernel if whole else None, branch)
    if "bias" in module:
        y = y + module["bias"].astype(x.dtype)
    for hook in hooks:
        if hook.scale_output is not None:
            y = hook.scale_output(y, module)
    return y


def _split_axes(kernel_axes, shape: tuple[int, ...]) -> list[tuple[str, ...]]:
    """The mesh axes in context that split each dimension of a kernel of `shape` (none off a mesh)."""
    mesh = mesh_in_context()
    return [] if mesh is None or kernel_axes is None else list(mesh_axes_of(kernel_axes, shape, mesh.shape))


def folds_branch(platform: str, split_axes: list[tuple[str, ...]], gathered: bool) -> bool:
    """Whether `dense` folds a hook's low-rank branch into its base product (`DenseHook.product`), the one
    predicate the forward and the planner ask: on XLA:CPU, where a rank-r branch computed on its own (its
    [tokens, r] x [r, out] product and the add over [tokens, out]) costs more than the r extra rows of one GEMM
    (benchmarks/README.md, issue 34), for a kernel whole at the product: no mesh axis splits it (`split_axes`, per
    dimension), or only the ZeRO axes where `gathered` (the concatenated kernel of a split one is laid out anew).
    On GPU and TPU the concatenation would copy a weight the dot reads in place."""
    allowed = set(ZERO_AXES) if gathered else set()
    return platform == "cpu" and not any(set(axes) - allowed for axes in split_axes)


def project(x: jax.Array, layer: dict, name: str, adapters: Adapters) -> jax.Array:
    """`dense` through module `name` of one layer, with the method's `adapters` (its dropout key drawn for it)."""
    return dense(x, layer[name], adapters.of_module(name), LINEAR_AXES[name])
