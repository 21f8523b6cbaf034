"""The GGML type of each tensor in a quantised GGUF file, as `llama-quantize` picks it (llama.cpp's
`llama_tensor_get_type` in src/llama-quant.cpp, no importance matrix, no overrides) for the file types jaxtune
writes: the `_M` mixtures give the value projection and `ffn_down` of the first and last eighth of the layers (and
every third between) Q6_K, the output head (or a tied embedding table) Q6_K, and a tensor whose rows are not whole
blocks the nearest type whose are (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, else F16).

    tensor_types([(name, shape), ...], "q4_k_m", layers=30, experts=0)  # -> {name: GGMLQuantizationType}
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as Q

# the file type written and the type of every tensor the mixture does not move
MIXTURES = {"q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0), "q5_0": (LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
            "q4_k_s": (LlamaFileType.MOSTLY_Q4_K_S, Q.Q4_K), "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
            "q5_k_s": (LlamaFileType.MOSTLY_Q5_K_S, Q.Q5_K), "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
            "q6_k": (LlamaFileType.MOSTLY_Q6_K, Q.Q6_K)}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "altup", "laurel", "per_layer_model_proj",
         "shortconv.conv.weight", "attn_rel_b.weight")  # small or sensitive tensors llama-quantize copies as they are
_LAYER = re.compile(r"blk\.(\d+)\.")


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantises a tensor (tensor_allows_quantization): a matrix named `*weight`, not a norm,
    router or convolution."""
    return len(shape) >= 2 and name.endswith("weight") and not any(part in name for part in _KEPT)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of n, and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    """tensor_get_category: the first of llama.cpp's substring tests the name passes."""
    if name in ("output.weight", "token_embd.weight", "per_layer_token_embd.weight"):
        return "output" if name == "output.weight" else "token_embd"
    for part, category in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                           ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                           ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                           ("ffn_down", "ffn_down")):
        if part in name:
            return category
    return "other"


def _layer_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order (its loader's weight_name_comparer): layer number (-1 outside blocks), then name."""
    match = _LAYER.match(name)
    return (int(match[1]) if match else -1, name)


def tensor_types(tensors: list[tuple[str, tuple[int, ...]]], kind: str, *, layers: int, experts: int,
                 big_llama: bool = False) -> dict[str, Q | None]:
    """GGML type of each quantised tensor (None for one llama-quantize leaves as it is) of a file of `kind` (a key
    of MIXTURES). tensors: (GGUF name, numpy shape [.., rows, cols]); layers: the block count; experts: the routed
    experts (0 for none); big_llama: llama.cpp counts the model a 70B (its value projections one step up)."""
    ftype, default = MIXTURES[kind]
    F = LlamaFileType
    ordered = sorted(tensors, key=lambda t: _layer_order(t[0]))
    n_wv = sum(_category(name) == "attn_v" for name, _ in ordered)
    tied = not any(name == "output.weight" for name, _ in ordered)
    counter = {"attn_v": 0, "ffn_down": 0}
    types: dict[str, Q | None] = {}
    for name, shape in ordered:
        if not quantized(name, shape):
            types[name] = None
            continue
        category, cols, new = _category(name), shape[-1], default
        if category == "output" or (tied and category == "token_embd"):
            new = Q.Q8_0 if cols % GGML_QUANT_SIZES[new][0] else Q.Q6_K
        elif category == "attn_v":
            i = counter["attn_v"]
            if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i, n_wv):
                new = Q.Q6_K
            elif ftype == F.MOSTLY_Q4_K_S and i < 4:
                new = Q.Q5_K
            new = Q.Q5_K if big_llama and new == Q.Q4_K else new
            new = Q.Q8_0 if experts == 8 else new
            counter["attn_v"] += 1
        elif category == "attn_k" and experts == 8:
            new = Q.Q8_0
        elif category == "ffn_down":
            i = int(_LAYER.match(name)[1]) if experts > 1 else counter["ffn_down"]  # type: ignore[index]
            if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i, layers):
                new = Q.Q6_K
            elif ftype == F.MOSTLY_Q4_K_S and i < layers // 8:
                new = Q.Q5_K
            counter["ffn_down"] += 1
        elif category == "attn_output" and experts == 8 and ftype in (F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M):
            new = Q.Q5_K
        if cols % GGML_QUANT_SIZES[new][0]:  # tensor_type_fallback (llama.cpp refuses Q4_0/Q5_0 rows: F16 here)
            new = _FALLBACK.get(new, Q.F16)
            new = Q.F16 if cols % GGML_QUANT_SIZES[new][0] else new
        types[name] = new
    return types
