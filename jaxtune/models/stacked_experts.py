"""Expert tensors stored as whole stacks [E, in, out] (gpt-oss, Llama 4) in a checkpoint <-> jaxtune's stacks.

transformers keeps a layer's experts as `mlp.experts.gate_up_proj` [E, D, 2F] ([in, out]; gpt-oss interleaves gate
and up, gate the even columns, up the odd ones; Llama 4 (`feed_forward.experts`) puts gate's half first),
gpt-oss's `gate_up_proj_bias` [E, 2F] (interleaved likewise), `down_proj` [E, F, D] and gpt-oss's `down_proj_bias`
[E, D]; gpt-oss's released checkpoints store the two kernels as MXFP4
(`gate_up_proj_blocks` [E, 2F, D/32, 16] uint8 and `_scales` [E, 2F, D/32], i.e. [out, in]; `down_proj_*`
likewise), decoded here an expert slice at a time (`mxfp4.decode_mxfp4`), never the whole model. jaxtune's stacks
are [E, in, out] with gate_up's columns [gate | up] (`params.expert_specs`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

STACKS = ("gate_up_proj", "down_proj")
INTERLEAVED = {"GptOssForCausalLM": True, "Llama4ForCausalLM": False}  # the architectures stored so: gate/up paired


def tensor_name(layer: int, stack: str, part: str = "") -> str:
    """`model.layers.{layer}.mlp.experts.{stack}{part}` (part "", "_bias", "_blocks" or "_scales")."""
    return f"model.layers.{layer}.mlp.experts.{stack}{part}"


def expected(layers: tuple[int, ...], E: int, D: int, F: int, quantized: bool, bias: bool
             ) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the experts of `layers`, as transformers holds them or (`quantized`) as MXFP4."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in layers:
        for stack, (d_in, d_out) in (("gate_up_proj", (D, 2 * F)), ("down_proj", (F, D))):
            if quantized:
                shapes[tensor_name(i, stack, "_blocks")] = (E, d_out, d_in // 32, 16)
                shapes[tensor_name(i, stack, "_scales")] = (E, d_out, d_in // 32)
            else:
                shapes[tensor_name(i, stack)] = (E, d_in, d_out)
            if bias:
                shapes[tensor_name(i, stack, "_bias")] = (E, d_out)
    return shapes


def is_quantized(names) -> bool:
    return any(name.endswith("mlp.experts.gate_up_proj_blocks") for name in names)


def deinterleave(x_xO: np.ndarray) -> np.ndarray:
    """[..., 2F] gate/up interleaved -> [..., 2F] as [gate | up]."""
    return np.concatenate([x_xO[..., ::2], x_xO[..., 1::2]], axis=-1)


def interleave(x_xO: np.ndarray) -> np.ndarray:
    """[..., 2F] as [gate | up] -> interleaved (the inverse of `deinterleave`)."""
    gate, up = np.split(x_xO, 2, axis=-1)
    return np.stack([gate, up], axis=-1).reshape(x_xO.shape)


def read(reader, layer: int, stack: str, leaf: str, index: tuple[slice, ...], interleaved: bool) -> np.ndarray:
    """Leaf `leaf` ("kernel" [E, in, out] or "bias" [E, out]) of expert stack `stack` in `layer`, restricted to
    `index` (slices of those dims), in jaxtune's layout; MXFP4 kernels decoded for the experts asked only."""
    experts = index[0]
    if leaf == "bias":
        value = reader.read(tensor_name(layer, stack, "_bias"), (experts,))
    elif tensor_name(layer, stack) in reader:
        value = reader.read(tensor_name(layer, stack), (experts,))
    else:  # MXFP4 [E, out, in/32, 16] -> [E, out, in] -> ours [E, in, out]
        from jaxtune.models.mxfp4 import decode_mxfp4

        blocks = reader.read(tensor_name(layer, stack, "_blocks"), (experts,))
        scales = reader.read(tensor_name(layer, stack, "_scales"), (experts,))
        value = np.swapaxes(decode_mxfp4(blocks, scales, ml_dtypes.bfloat16), -1, -2)  # exact in bfloat16
    if stack == "gate_up_proj" and interleaved:
        value = deinterleave(value)
    return value[(slice(None),) + tuple(index[1:])]


def as_stored(stack: str, value: np.ndarray, interleaved: bool) -> np.ndarray:
    """One layer's leaf of `stack` ([E, in, out] or [E, out]) as transformers holds it."""
    return interleave(value) if stack == "gate_up_proj" and interleaved else value
