"""Method transforms: identity at init, merge/unmerge, QLoRA storage, gradients only where trainable, bad configs."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import tiny_config
from jaxtune.methods import method_config
from jaxtune.methods.lora import merge, unmerge
from jaxtune.methods.transform import apply_method, combine, parameter_report, partition, trainable_mask
from jaxtune.models.llama import forward
from jaxtune.models.params import count_params, init_params
from jaxtune.models.quant import NF4Array, QuantizedArray, nbytes

CFG = tiny_config(num_layers=2, vocab_size=128, hidden_size=128, intermediate_size=256, initializer_range=0.1)
jit_forward = jax.jit(forward, static_argnames=("cfg", "method", "options"))


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(CFG, jax.random.key(0))


def ids(seed=0, shape=(2, 16)):
    return jax.random.randint(jax.random.key(seed), shape, 0, CFG.vocab_size)


@pytest.mark.parametrize("method", [method_config("lora"),
                                    method_config("lora", dora=True, target_modules=("all-linear",)),
                                    method_config("ia3"), method_config("adapter", adapter_size=16)])
def test_fresh_adapters_leave_the_model_unchanged(params, method):
    """LoRA with B = 0, DoRA with m = ||W||, IA3 with ones and adapters with up = 0 compute the base model."""
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    np.testing.assert_allclose(jit_forward(adapted, ids(), CFG, method=method), jit_forward(params, ids(), CFG),
                               atol=2e-5)


def test_merge_equals_unmerged_and_unmerge_restores(params):
    method = method_config("lora", rank=4, target_modules=("all-linear",), rslora=True)
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    q_proj = adapted["layers"]["q_proj"]
    q_proj["lora_b"] = 0.1 * jax.random.normal(jax.random.key(2), q_proj["lora_b"].shape)
    merged = merge(adapted, method)
    assert "lora_a" not in merged["layers"]["q_proj"]
    np.testing.assert_allclose(jit_forward(merged, ids(), CFG), jit_forward(adapted, ids(), CFG, method=method),
                               atol=1e-4)
    restored = unmerge(merged, partition(adapted, trainable_mask(adapted, method))[0], method)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), restored, adapted)
    with pytest.raises(ValueError, match="DoRA cannot be unmerged"):
        unmerge(merged, adapted, method_config("lora", dora=True))


@pytest.mark.parametrize("double_quant, limit", [(True, 0.52), (False, 0.57)])
def test_qlora_frozen_weights_bytes_per_parameter(params, double_quant, limit):
    method = method_config("qlora", bits=4, double_quant=double_quant)
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    kernels = [m["kernel"] for m in adapted["layers"].values() if isinstance(m, dict) and "kernel" in m]
    assert all(isinstance(k, NF4Array) for k in kernels) and len(kernels) == 7
    elements = sum(math.prod(k.codes.shape[:-1]) * math.prod(k.shape) for k in kernels)
    assert sum(nbytes(k) for k in kernels) / elements <= limit


@pytest.mark.parametrize("bits, tolerance", [(4, 0.5), pytest.param(8, 0.05, marks=pytest.mark.full)])
def test_qlora_forward_is_the_dequantised_model(params, bits, tolerance):
    """QLoRA at init computes the model with dequantised weights. Its distance to the float model is the
    quantisation error: weights lose 9% (NF4) and 0.6% (int8) relative RMS, which this random, untrained model
    amplifies to about 36% and 3% of the logits."""
    method = method_config("qlora", bits=bits)
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    out = jit_forward(adapted, ids(), CFG, method=method)
    dequantised = merge(adapted, method)  # B = 0: the merge is exactly the dequantised base
    np.testing.assert_allclose(out, jit_forward(dequantised, ids(), CFG), atol=1e-4)
    ref = jit_forward(params, ids(), CFG)
    assert 0 < float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < tolerance


@pytest.mark.parametrize("method", [method_config("lora"), pytest.param(method_config("qlora"), marks=pytest.mark.full),
                                    pytest.param(method_config("prefix", num_virtual_tokens=4), marks=pytest.mark.full),
                                    pytest.param(method_config("adapter", adapter_size=8), marks=pytest.mark.full)])
def test_gradients_reach_only_trainable_leaves(params, method):
    """Differentiating w.r.t. the trainable half only: the compiled gradient holds exactly the trainable bytes,
    so frozen weights get no gradient buffers."""
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    trainable, frozen = partition(adapted, trainable_mask(adapted, method))

    def loss(trainable, frozen, tokens):
        logits = forward(combine(trainable, frozen), tokens, CFG, method=method)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    grad_fn = jax.jit(jax.grad(loss))
    grads = grad_fn(trainable, frozen, ids())
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    trainable_bytes = sum(x.nbytes for x in jax.tree.leaves(trainable))
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(frozen))
    compiled = grad_fn.lower(trainable, frozen, ids()).compile()
    output_bytes = compiled.memory_analysis().output_size_in_bytes  # plus an 8-byte pointer per tuple element
    assert 0 <= output_bytes - trainable_bytes <= 8 * len(jax.tree.leaves(trainable))
    assert trainable_bytes < frozen_bytes / 4


def test_full_fine_tune_is_the_identity_transform(params):
    method = method_config("full")
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    assert jax.tree.structure(adapted) == jax.tree.structure(params)
    report = parameter_report(adapted, method)
    assert report.trainable == report.total == count_params(params)


def test_report_counts_quantised_weights_by_elements(params):
    method = method_config("qlora", rank=8, target_modules=("all-linear",))
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    report = parameter_report(adapted, method)
    D, F, L = CFG.hidden_size, CFG.intermediate_size, CFG.num_layers
    lora = L * 8 * sum(d_in + d_out for d_in, d_out in [(D, 64), (D, 32), (D, 32), (64, D), (D, F), (D, F), (F, D)])
    assert report.trainable == lora
    assert report.total == count_params(params) + lora
    assert f"trainable%: {100 * lora / report.total:.4f}" in str(report)
    assert isinstance(adapted["layers"]["up_proj"]["kernel"], QuantizedArray)


def test_abstract_transform_allocates_nothing():
    """The planner's path: eval_shape through init and the QLoRA transform of an 8B model."""
    from test_model_shapes import REAL

    cfg = REAL["Llama-3-8B"][0]
    method = method_config("qlora", rank=16, target_modules=("all-linear",))
    shapes = jax.eval_shape(lambda k: apply_method(init_params(cfg, k, "bfloat16"), cfg, method, k), jax.random.key(0))
    report = parameter_report(shapes, method)
    assert report.total - report.trainable == 8_030_261_248
    assert report.trainable == 41_943_040  # PEFT's count for r=16 on all linear layers of Llama-3-8B


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="lora", target_modules=("qkv",)), 'target_modules = "qkv": not a linear module of a decoder layer; '
                                                 "valid names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                                 "down_proj, qkv_proj, gate_up_proj, in_proj_qkv, in_proj_z, "
                                                 "in_proj_b, in_proj_a, out_proj, in_proj_qkvz, in_proj_ba, q_a_proj, "
                                                 "q_b_proj, kv_a_proj_with_mqa, kv_b_proj, "
                                                 "all-linear, or paths such as "
                                                 "model.layers.0.self_attn.q_proj"),
    (dict(kind="lora", rank=0), "rank = 0: LoRA's rank is a positive integer"),
    (dict(kind="qlora", bits=3), "bits = 3: choose one of 4, 8"),
    (dict(kind="lorax"), 'kind = "lorax": choose one of full, lora, qlora, ia3, prefix, adapter'),
])
def test_bad_method_configs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        method_config(**kwargs)
