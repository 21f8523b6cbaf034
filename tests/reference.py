"""The float64 reference the parity tests measure jaxtune and transformers/PEFT against.

A max-abs-difference tolerance between two float32 programs depends on the CPU and BLAS: the order of a dot
product's additions differs between AVX2 and AVX-512 kernels, and a model whose attention is peaked amplifies
those last-bit differences into 1e-4 differences of logits, in either framework (measured on AMD Zen 3: the
jaxtune / transformers ratio of float32 errors ranged 0.3x-6x from one random batch to the next on such a model,
and 1.0x-1.3x on a well-conditioned one). So parity is asserted against a float64 run of the same weights:

  * `float64_reference(model)`: the transformers (or PEFT) model in float64, computed in float64 throughout.
    transformers keeps RMSNorm's statistics, RoPE's cos/sin and the eager attention's softmax (Gemma's only
    attention) in float32 even in a `.double()` model; here they run in float64 (cos/sin of the same float32
    angles, as jaxtune's float64 forward does).
  * `jaxtune_float64(...)`: jaxtune's forward with compute_dtype "float64": equal to the reference to ~1e-12,
    which shows the same function is computed, on any CPU.
  * `assert_float32_parity`: jaxtune's float32 error from the reference is at most FACTOR times the reference
    framework's own float32 error, token by token (the geometric mean over real tokens of the ratio of the two
    errors), and the two float32 outputs agree to `atol`.
"""

from __future__ import annotations

import copy
import inspect
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.gemma2 import modeling_gemma2 as gemma2_modeling
from transformers.models.gemma3 import modeling_gemma3 as gemma3_modeling
from transformers.models.gemma4 import modeling_gemma4 as gemma4_modeling
from transformers.models.llama4 import modeling_llama4 as llama4_modeling
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5_modeling
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5_moe_modeling
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next_modeling

from jaxtune.config import ForwardOptions
from jaxtune.models.llama import forward

FACTOR = 2.0  # jaxtune's float32 error / transformers' float32 error, token by token; measured 0.9-1.1 on these models


def _rms_norm_float64(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    if type(self).__name__.startswith("Gemma4"):  # scales by the weight, where it has one
        normed = x * torch.rsqrt(variance + self.eps)
        return normed * self.weight if self.with_scale else normed
    if type(self).__name__.startswith(("Gemma", "Qwen3_5", "Qwen3Next")):  # scales by 1 + weight
        return (1 + self.weight) * (x * torch.rsqrt(variance + self.eps))
    return self.weight * (x * torch.rsqrt(variance + getattr(self, "variance_epsilon", getattr(self, "eps", None))))


def _l2_norm_float64(self, x):  # Llama 4's weightless query/key norm
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _sigmoid_router_float64(self, x):  # Llama 4's router (its sigmoid in float32 even in a float64 model)
    logits = torch.nn.functional.linear(x, self.weight)
    top, index = torch.topk(logits, self.top_k, dim=1)
    return torch.full_like(logits, float("-inf")).scatter_(1, index, top).sigmoid(), logits


def _complex_rotary_float64(self, x, position_ids):
    """Llama 4's rotation as complex numbers: of the same float32 angles, in complex128."""
    freqs = position_ids[..., None].float() * self.inv_freq.float()
    return torch.polar(torch.ones_like(freqs, dtype=torch.float64), freqs.double()) * self.attention_scaling


def _rotate_in_their_dtype(apply_rotary_emb):
    """Llama 4's `apply_rotary_emb`, rotating float64 queries and keys in float64 (it casts them to float32)."""
    def rotate(xq, xk, freqs_cis):
        if xq.dtype != torch.float64:
            return apply_rotary_emb(xq, xk, freqs_cis)
        as_complex = lambda x: torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))  # noqa: E731
        return tuple(torch.view_as_real(as_complex(x) * freqs_cis[:, :, None, :]).flatten(3) for x in (xq, xk))

    return rotate


def _router_float64(self, x):
    """A mixture's router (transformers casts its softmax to float32 even in a float64 model)."""
    logits = torch.nn.functional.linear(x.reshape(-1, self.hidden_dim), self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def _grouped_sigmoid_router_float64(self, x):
    """DeepSeek-V3's router (transformers computes it in float32 even in a float64 model)."""
    x = x.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(scores.dtype)
    groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
    kept = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1)[1], 1)
    kept = kept[:, :, None].expand(-1, -1, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    index = choice.masked_fill(~kept.bool(), float("-inf")).topk(self.top_k, dim=-1)[1]
    weights = scores.gather(1, index)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, index


def _gemma4_router_float64(self, x):
    """Gemma 4's router (its softmax in float32 even in a float64 model)."""
    x = self.norm(x) * self.scale * self.scalar_root_size
    probs = torch.softmax(self.proj(x), dim=-1)
    top, index = torch.topk(probs, self.config.top_k_experts, dim=-1)
    return probs, top / top.sum(dim=-1, keepdim=True) * self.per_expert_scale[index], index


def _gated_rms_norm_float64(self, x, gate):  # Qwen3.5's Gated DeltaNet output norm
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * normed * torch.nn.functional.silu(gate)


def _delta_rule_in_float64(rule):
    """Qwen3.5's gated delta rule (chunked or recurrent), for float64 inputs the recurrence token by token in float64
    (transformers computes it in float32): S = exp(g) S, S += k (beta (v - k^T S))^T, o = S^T q / sqrt(dk)."""
    def run(query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
            **kwargs):
        if query.dtype != torch.float64:
            return rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        **kwargs)
        repeat = value.shape[2] // key.shape[2]
        q, k = (a.repeat_interleave(repeat, dim=2) for a in (query, key))
        if use_qk_l2norm_in_kernel:
            q, k = (a * torch.rsqrt((a * a).sum(-1, keepdim=True) + 1e-6) for a in (q, k))
        q = q * q.shape[-1] ** -0.5
        B, T, N, dv = value.shape
        S = torch.zeros(B, N, q.shape[-1], dv, dtype=torch.float64) if initial_state is None else initial_state.double()
        out = torch.empty(B, T, N, dv, dtype=torch.float64)
        for t in range(T):
            S = S * g[:, t].double().exp()[..., None, None]
            delta = (value[:, t] - torch.einsum("bnk,bnkv->bnv", k[:, t], S)) * beta[:, t, :, None]
            S = S + k[:, t, :, :, None] * delta[:, :, None, :]
            out[:, t] = torch.einsum("bnk,bnkv->bnv", q[:, t], S)
        return out, S if output_final_state else None

    return run


def _rotary_float64(self, x, position_ids, layer_type=None):
    if position_ids.ndim == 3:  # Qwen3.5's three position streams, one for text: all equal
        assert bool((position_ids == position_ids[:1]).all())
        position_ids = position_ids[0]
    prefix = f"{layer_type}_" if layer_type else ""  # Gemma 3 keeps one table a layer type
    inv_freq, scaling = getattr(self, f"{prefix}inv_freq"), getattr(self, f"{prefix}attention_scaling")
    freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)  # float32 angles, as in float32
    # gpt-oss's tables are half width (its rotation reads each half against the same angles)
    emb = (freqs if type(self).__name__ == "GptOssRotaryEmbedding" else torch.cat((freqs, freqs), dim=-1)).double()
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def _softmax_in_float64(eager_attention_forward):
    """Gemma's eager attention, its softmax in float64 for float64 inputs (float32 inputs: unchanged)."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
        if query.dtype != torch.float64:
            return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, softcap=softcap, **kwargs)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if attention_mask is not None:
            scores = scores + attention_mask
        out = torch.matmul(torch.softmax(scores, dim=-1), value)
        return out.transpose(1, 2).contiguous(), None

    return attention


for _module in (gemma2_modeling, gemma3_modeling, gemma4_modeling):
    _module.eager_attention_forward = _softmax_in_float64(_module.eager_attention_forward)
llama4_modeling.apply_rotary_emb = _rotate_in_their_dtype(llama4_modeling.apply_rotary_emb)


def _without_float32_casts(method):
    """`method` recompiled with its `.float()` casts removed (Qwen3.5's Gated DeltaNet computes its decay from
    float32 copies of A_log and of in_proj_a's output, even in a float64 model)."""
    source = textwrap.dedent(inspect.getsource(method))
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("@"))
    namespace: dict = {}
    exec(compile(source.replace(".float()", ""), inspect.getsourcefile(method), "exec"),
         vars(inspect.getmodule(method)), namespace)
    return namespace[method.__name__]


_deltanet_forward_float64 = {cls.__name__: _without_float32_casts(cls.forward) for cls in (
    qwen3_5_modeling.Qwen3_5GatedDeltaNet, qwen3_5_moe_modeling.Qwen3_5MoeGatedDeltaNet,
    qwen3_next_modeling.Qwen3NextGatedDeltaNet)}
for _module in (qwen3_5_modeling, qwen3_5_moe_modeling, qwen3_next_modeling):
    for _name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(_module, _name, _delta_rule_in_float64(getattr(_module, _name)))


def float64_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers or PEFT model whose norms and rotary embeddings also run in float64 (a
    mixture's experts as a loop over experts: torch's grouped matmul has no float64)."""
    model = copy.deepcopy(model).double().eval()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(base).__name__.endswith("MoeForCausalLM") or type(base).__name__.startswith(("Mixtral", "GptOss",
                                                                                            "Llama4", "Qwen3Next",
                                                                                            "DeepseekV3", "Gemma4")):
        base.set_experts_implementation("eager")
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
        elif name.endswith("RMSNormGated"):
            module.forward = types.MethodType(_gated_rms_norm_float64, module)
        elif name in _deltanet_forward_float64:
            module.forward = types.MethodType(_deltanet_forward_float64[name], module)
        elif name == "Llama4Router":
            module.forward = types.MethodType(_sigmoid_router_float64, module)
        elif name == "Llama4TextL2Norm":
            module.forward = types.MethodType(_l2_norm_float64, module)
        elif name == "Llama4TextRotaryEmbedding":
            module.forward = types.MethodType(_complex_rotary_float64, module)
        elif name.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rotary_float64, module)
        elif name == "Gemma4TextRouter":
            module.forward = types.MethodType(_gemma4_router_float64, module)
        elif name == "DeepseekV3TopkRouter":
            module.forward = types.MethodType(_grouped_sigmoid_router_float64, module)
        elif name.endswith("TopKRouter") and name != "GptOssTopKRouter":  # gpt-oss's computes in its own dtype
            module.forward = types.MethodType(_router_float64, module)
    return model


_forward = jax.jit(forward, static_argnames=("cfg", "method", "options"))


def jaxtune_float64(params: dict, ids: np.ndarray, cfg, method=None, **kwargs) -> np.ndarray:
    """jaxtune's logits with float64 weights and compute (keyword arguments as for `forward`, numpy arrays)."""
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating)
                                else x, params)
        kwargs = {k: jnp.asarray(v) for k, v in kwargs.items()}
        out = _forward(params64, jnp.asarray(ids), cfg, method=method,
                       options=ForwardOptions(compute_dtype="float64"), **kwargs)
        return np.asarray(out)


def logits_four_ways(torch_model, params: dict, cfg, method=None, seed: int = 0, reference=None) -> dict:
    """On `padded_batch(vocab, seed)`: the torch model's float32 and float64-reference logits and jaxtune's in
    float32 and float64, with the mask of real tokens: {"ref32", "ref64", "out32", "out64", "valid"}.

    Prefix tuning: both sides place real tokens after the P virtual tokens (positions P..), as PEFT does.
    `reference`: the model's `float64_reference`, if already made.
    """
    from conftest import padded_batch

    ids, mask, positions = padded_batch(cfg.vocab_size, seed)
    kwargs = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    ours = {"attention_mask_BxT": mask}
    if method is None or method.kind != "prefix":
        kwargs["position_ids"] = torch.tensor(positions)
        ours["positions_BxT"] = positions
    with torch.no_grad():
        ref32 = torch_model(**kwargs).logits.numpy()
        ref64 = (reference or float64_reference(torch_model))(**kwargs).logits.numpy()
    out32 = np.asarray(_forward(params, jnp.asarray(ids), cfg, method=method,
                                **{k: jnp.asarray(v) for k, v in ours.items()}))
    return {"ref32": ref32, "ref64": ref64, "out32": out32, "out64": jaxtune_float64(params, ids, cfg, method, **ours),
            "valid": mask > 0}


def token_errors(x: np.ndarray, ref: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """||x - ref|| over the last axis at each position where `valid` [B, T] is true: [real tokens] (at least float32's
    smallest normal, so that a ratio of two is defined where a token comes out exact)."""
    errors = np.linalg.norm(np.asarray(x, np.float64)[valid] - np.asarray(ref, np.float64)[valid], axis=-1)
    return np.maximum(errors, np.finfo(np.float32).tiny)


def assert_float32_parity(ours: np.ndarray, theirs: np.ndarray, ref64: np.ndarray, valid: np.ndarray,
                          atol: float = 1e-4, factor: float = FACTOR) -> None:
    """jaxtune's float32 `ours` is as close to the float64 `ref64` as the other framework's float32 `theirs`: the
    geometric mean over real tokens of ours' error / theirs' is within `factor`; and `ours` is within `atol` of
    `theirs` beyond theirs' own largest error (Qwen3.5's float32 delta rule in transformers is 1e-4 off on O(10)
    logits where jaxtune's is 3x closer).

    Token by token, not as one norm over the batch: a token whose output is ill-conditioned carries most of either
    error norm, and a ratio of the norms is then one rounding's luck over another's. In the tiny Qwen3.5 with an
    all-linear LoRA, one token held 82% of jaxtune's squared error (downstream of two value heads' delta-rule
    outputs near cancellation, 1/20 of their usual size: in_proj_qkv's float32 products alone, the rest in float64,
    gave a relative error of 8e-6); with the hidden axis permuted in both models (the same function, other
    summation orders) the ratio of norms ranged 0.2x-3.4x, either framework's error 9x, the geometric mean of the
    per-token ratios 0.6x-1.1x. A less accurate computation raises that mean at every token."""
    ours_errors, their_errors = token_errors(ours, ref64, valid), token_errors(theirs, ref64, valid)
    ratio = float(np.exp(np.mean(np.log(ours_errors / their_errors))))
    assert ratio <= factor, (f"jaxtune's float32 error {ratio:.3g} x the reference's own, token by token (> {factor}); "
                             f"largest {ours_errors.max():.3g} vs {their_errors.max():.3g}")
    their_largest = np.abs(np.asarray(theirs, np.float64) - ref64)[valid].max()
    assert np.abs(np.asarray(ours) - theirs)[valid].max() <= atol + their_largest
