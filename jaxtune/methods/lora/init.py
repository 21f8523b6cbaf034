"""LoRA initialisations from the base weights, as PEFT 0.21's `init_lora_weights` computes them, one layer at a time.

On one layer's weight W [out, in] (torch's layout; jaxtune's kernel is W^T), rank r and LoRA scale s, in float32:
    pissa  W = V S U^T (`pissa_init`, Meng et al. 2024): B = V_r sqrt(S_r / s), A = sqrt(S_r / s) U_r^T
    olora  W = Q R (`olora_init`, Büyükakyüz 2024): B = Q_r, A = R_r (on a quantised base, Q R of its dequantised W)
    loftq  (`loftq_utils.loftq_init`, Li et al. 2023) T = W; `loftq_iter` times: Q = dequant(quant(T)), W - Q =
           U S V^T, B = U_r sqrt(S_r), A = sqrt(S_r) V_r^T, T = W - B A; the base becomes Q (A, B not divided by s)
PiSSA and OLoRA leave W - s B A as the base (quantised for QLoRA); A and B equal PEFT's up to one sign per rank
component. `as_plain_lora` is PEFT's conversion to a LoRA of rank 2r on the unchanged base."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.methods.lora.layout import ModuleLoRA, lora_layout
from jaxtune.models.quant import QuantizedArray, dequantize, quantize_by_rows, quantize_int8, quantize_nf4

if TYPE_CHECKING:
    from jaxtune.methods.lora.options import LoRAConfig

LoRAOptions = TypeVar("LoRAOptions", bound="LoRAConfig")  # LoRA's or QLoRA's

BASE_INITS = ("pissa", "olora", "loftq")  # the inits that change the frozen base
INITS = ("default", "gaussian") + BASE_INITS
CONVERTED_INITS = ("pissa", "olora")  # exported as PEFT's plain LoRA of rank 2r on the original weights


def changed_modules(method: LoRAConfig, cfg: ModelConfig) -> dict[str, ModuleLoRA]:
    """{module: its LoRA layout} of the modules whose base `method`'s init changes (none for other inits)."""
    if method.init not in BASE_INITS:
        return {}
    return lora_layout(method, cfg.layer_stacks())


def _round_trip(x_OxI: jax.Array, bits: int) -> jax.Array:
    """bitsandbytes' quantise-dequantise of a torch-layout weight, float32 (NF4 in blocks of 64, no double
    quantisation, as LoftQ's `Params4bit(compress_statistics=False)`; int8: `Int8Params`)."""
    q = quantize_nf4(x_OxI.T) if bits == 4 else quantize_int8(x_OxI.T)
    return dequantize(q).T


def _pissa(w_OxI, rank: int, scale):
    v, s, uh = jnp.linalg.svd(w_OxI, full_matrices=False)
    root_R = jnp.sqrt(s[:rank] / scale)
    a_RxI, b_OxR = root_R[:, None] * uh[:rank], v[:, :rank] * root_R
    return a_RxI, b_OxR, w_OxI - (scale * b_OxR) @ a_RxI


def _olora(w_OxI, rank: int, scale):
    q, r = jnp.linalg.qr(w_OxI)
    a_RxI, b_OxR = r[:rank], q[:, :rank]
    return a_RxI, b_OxR, w_OxI - (scale * b_OxR) @ a_RxI


def _loftq(w_OxI, rank: int, bits: int, iters: int):
    target = w_OxI
    for i in range(iters):
        base = _round_trip(target, bits)
        u, s, vh = jnp.linalg.svd(w_OxI - base, full_matrices=False)
        root_R = jnp.sqrt(s[:rank])
        a_RxI, b_OxR = root_R[:, None] * vh[:rank], u[:, :rank] * root_R
        if i + 1 < iters:
            target = w_OxI - b_OxR @ a_RxI
    return a_RxI, b_OxR, base


@partial(jax.jit, static_argnames=("rank", "method"))
def init_layer(w_IxO: jax.Array, rank: int, scale: float, method: LoRAConfig):
    """One layer's (lora_a [in, rank] float32, lora_b [rank, out] float32, base) under `method.init` (one of
    BASE_INITS) from its kernel [in, out]. base: [in, out] in the kernel's dtype, or for QLoRA the quantised
    `method.bits` weight of one layer (NF4 with `method.double_quant`)."""
    from jaxtune.methods.lora.options import QLoRAConfig  # here: options imports this module

    w_OxI = w_IxO.T.astype(jnp.float32)
    quantize = _quantizer(method) if isinstance(method, QLoRAConfig) else None
    if method.init == "pissa":
        a_RxI, b_OxR, base = _pissa(w_OxI, rank, scale)
        base = base.astype(w_IxO.dtype)  # PEFT's residual model, as saved; quantised as a QLoRA base loads it
    elif method.init == "olora":
        # PEFT's OLoRA on a bitsandbytes layer: Q R of the dequantised weight, re-quantised in float32
        if quantize is not None:
            w_OxI = dequantize(quantize(w_IxO)).T.astype(jnp.float32)
        a_RxI, b_OxR, base = _olora(w_OxI, rank, scale)
        base = base if quantize is not None else base.astype(w_IxO.dtype)
    else:
        assert isinstance(method, QLoRAConfig)  # LoftQ is QLoRA's (`LoRAConfig` checks)
        a_RxI, b_OxR, base = _loftq(w_OxI, rank, method.bits, method.loftq_iter)
        base = base.astype(w_IxO.dtype)  # PEFT's LoftQ base, as saved and then loaded quantised
    if quantize is not None:
        q = quantize(base.T)
        base = replace(q, dtype=np.dtype(w_IxO.dtype))
    else:
        base = base.T
    return a_RxI.T, b_OxR.T, base


def _stack(layers: list):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def _quantizer(method):
    """QLoRA's quantisation of one weight [in, out] (NF4, with `double_quant`, or int8)."""
    return (lambda x: quantize_nf4(x, method.double_quant)) if method.bits == 4 else quantize_int8


def initialise_module(kernel, lora: ModuleLoRA, method: LoRAConfig, layer=None):
    """(lora_a [L, in, R], lora_b [L, R, out], base kernel [L, in, out], quantised for QLoRA) of one module of L
    layers, each adapted layer initialised by `init_layer` (a layer of rank r < R padded with zeros, one not
    adapted kept). layer(i) -> kernel [in, out] of layer i in its dtype (default: `kernel[i]`)."""
    layer = layer or (lambda i: kernel[i])
    R = lora.max_rank
    a_list, b_list, bases = [], [], []
    for i, (r, scale) in enumerate(zip(lora.ranks, lora.scales)):
        w = layer(i)
        if r:
            a, b, base = init_layer(w, r, float(scale), method)
        else:
            d_in, d_out = w.shape
            a, b = jnp.zeros((d_in, 0), jnp.float32), jnp.zeros((0, d_out), jnp.float32)
            base = replace(_quantizer(method)(w), dtype=np.dtype(w.dtype)) if method.quantized else w
        a_list.append(jnp.pad(a, ((0, 0), (0, R - r))))
        b_list.append(jnp.pad(b, ((0, R - r), (0, 0))))
        bases.append(base)
    return _stack(a_list), _stack(b_list), _stack(bases)


def initialise(params: dict, cfg: ModelConfig, method: LoRAConfig) -> tuple[dict, dict]:
    """(params with each changed module's base kernel, {module: {"lora_a", "lora_b"}}) for a float base tree in
    memory; a QLoRA method's changed kernels come back quantised. Identity where `method.init` keeps the base."""
    layers, initial = dict(params["layers"]), {}
    for name, lora in changed_modules(method, cfg).items():
        kernel = layers[name]["kernel"]
        if isinstance(kernel, QuantizedArray):
            raise ValueError(f"{method.init} initialises from the float weights: call it before quantising")
        a, b, base = initialise_module(kernel, lora, method)
        layers[name] = {**layers[name], "kernel": base}
        initial[name] = {"lora_a": a, "lora_b": b}
    return {**params, "layers": layers}, initial


def as_plain_lora(params: dict, method: LoRAOptions, initial: dict, cfg: ModelConfig) -> tuple[dict, LoRAOptions]:
    """A PiSSA/OLoRA adapter as PEFT's plain LoRA on the original base (`PeftModel.save_pretrained` with
    `path_initial_model_for_weight_conversion`): W + s (B A - B0 A0) = (W - s B0 A0) + s B A, so per layer of rank
    r, A' = [A; A0] and B' = [B, -B0] of rank 2r, alpha doubled (rsLoRA: times sqrt 2; PEFT doubles an alpha_pattern
    even then) so the scale stays. initial: {module: {"lora_a", "lora_b"}} of the init (`initial_adapters`)."""
    factor = 2**0.5 if method.rslora else 2.0
    plain = replace(method, init="default", rank=2 * method.rank, alpha=factor * method.alpha,
                    rank_pattern=tuple((k, 2 * v) for k, v in method.rank_pattern),
                    alpha_pattern=tuple((k, factor * v) for k, v in method.alpha_pattern))
    layers = dict(params["layers"])
    for name, lora in lora_layout(method, cfg.layer_stacks(tuple(initial))).items():
        a, b = (np.asarray(layers[name][k], np.float32) for k in ("lora_a", "lora_b"))
        a0, b0 = (np.asarray(initial[name][k], np.float32) for k in ("lora_a", "lora_b"))
        a2, b2 = np.zeros((*a.shape[:2], 2 * a.shape[2]), np.float32), np.zeros((b.shape[0], 2 * b.shape[1],
                                                                                  b.shape[2]), np.float32)
        for i, r in enumerate(lora.ranks):
            a2[i, :, :2 * r] = np.concatenate([a[i, :, :r], a0[i, :, :r]], axis=1)
            b2[i, :2 * r] = np.concatenate([b[i, :r], -b0[i, :r]], axis=0)
        layers[name] = {**layers[name], "lora_a": a2, "lora_b": b2}
    return {**params, "layers": layers}, plain


def changed_module_names(method: LoRAConfig, cfg: ModelConfig) -> tuple[str, ...]:
    """The modules whose kernels `method`'s init changes (`BaseInit.modules`)."""
    return tuple(changed_modules(method, cfg))


def read_layers(method: LoRAConfig, cfg: ModelConfig, name: str, read_layer: Callable[[int], np.ndarray]
                ) -> Iterator[tuple[object, dict[str, np.ndarray]]]:
    """For each layer of module `name`, read as its [in, out] array by read_layer(i): (its base kernel as the
    init leaves it, quantised for QLoRA, on the host; {"lora_a" [in, R], "lora_b" [R, out]} float32) where R is
    the module's largest rank, a layer of rank r < R zero beyond r, one not adapted all zeros (`BaseInit.layers`)."""
    from jaxtune.methods.lora.options import QLoRAConfig  # here: options imports this module

    lora = changed_modules(method, cfg)[name]
    R = lora.max_rank
    for i, (r, scale) in enumerate(zip(lora.ranks, lora.scales)):
        w_IxO = read_layer(i)
        a, b = np.zeros((w_IxO.shape[0], R), np.float32), np.zeros((R, w_IxO.shape[1]), np.float32)
        if r:
            a[:, :r], b[:r], base = jax.device_get(init_layer(jnp.asarray(w_IxO), r, float(scale), method))
        elif isinstance(method, QLoRAConfig):
            base = quantize_by_rows(lambda x, y: w_IxO.T[x:y], w_IxO.shape, w_IxO.dtype, method.bits,
                                    method.double_quant)
        else:
            base = w_IxO
        yield base, {"lora_a": a, "lora_b": b}
