"""Float32 compute over 16-bit and quantised frozen weights (the CPU default): what the step derives a piece at a
time computes what the whole weight computes, holds no whole widened copy, and the planner counts what it holds."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from steps import sft_gradients

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, tiny_config
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.models import linear
from jaxtune.models.params import init_params
from jaxtune.models.quant import BitPattern, as_bit_patterns
from jaxtune.parallel.mesh import make_mesh
from jaxtune.planner import compile_step, estimate, get_device
from jaxtune.spine.run import abstract_run

F32 = ForwardOptions(compute_dtype="float32")
METHODS = {"lora": method_config("lora", rank=4, target_modules=("all-linear",)),
           "qlora nf4": method_config("qlora", rank=4, target_modules=("all-linear",)),
           "qlora int8": method_config("qlora", rank=4, bits=8)}


def bf16_run(cfg, method):
    """(trainable, frozen as the spine holds it under float32 compute, one batch [1, 2, 24]) with LoRA's B nonzero."""
    params = apply_method(init_params(cfg, jax.random.key(0)), cfg, method, jax.random.key(1))
    params = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16) if x.dtype == jnp.float32 else x, params)
    trainable, frozen = partition(params, trainable_mask(params, method))
    trainable = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape) * 0.05, trainable)
    tokens = jax.random.randint(jax.random.key(3), (1, 2, 24), 0, cfg.vocab_size)
    batch = {"input_ids": tokens, "labels": jnp.roll(tokens, -1, axis=-1), "loss_mask": jnp.ones(tokens.shape),
             "positions": jnp.broadcast_to(jnp.arange(24), tokens.shape),
             "segment_ids": jnp.ones(tokens.shape, jnp.int32)}
    return trainable, as_bit_patterns(frozen, head=True), batch


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.full
def test_pieces_compute_what_the_whole_weight_computes(name, tied, monkeypatch):
    """Loss and gradients of a step whose frozen bfloat16 head and bfloat16, NF4 or int8 kernels are derived in
    float32 a few columns at a time (pieces of 1,280 bytes: 5 of the head's 509 units, so the last piece
    overlaps) equal those of the same step with every weight derived whole."""
    method = METHODS[name]
    cfg = tiny_config(vocab_size=509, tie_word_embeddings=tied, initializer_range=0.1)
    trainable, frozen, batch = bf16_run(cfg, method)
    assert isinstance(frozen["embed_tokens"], BitPattern)
    step = lambda: jax.jit(sft_gradients, static_argnums=(3, 4, 5))(trainable, frozen, batch, cfg, method, F32)

    monkeypatch.setitem(linear.GATHERED_PIECE_BYTES, "cpu", 1 << 40)
    whole_loss, _, whole_grads = step()
    monkeypatch.setitem(linear.GATHERED_PIECE_BYTES, "cpu", 1280)
    assert linear.pieces_of(frozen["embed_tokens"] if tied else frozen["lm_head"]["kernel"], jnp.float32,
                            transposed=tied).count > 1
    loss, _, grads = step()
    np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, whole_grads)


# A shape whose float32 head (16,000 x 512, 31 MiB) and MLP kernels (512 x 2,816, 5.5 MiB) pass the 4 MiB pieces
WIDE = ModelConfig(vocab_size=16000, hidden_size=512, intermediate_size=2816, num_layers=4, num_heads=8,
                   num_kv_heads=4, head_dim=64, tie_word_embeddings=True)


@pytest.mark.parametrize("name", ["lora", "qlora nf4"])
@pytest.mark.full
def test_float32_compute_holds_no_whole_widened_head_or_kernel(name):
    """The compiled float32 step over a frozen bfloat16 tied head and bfloat16 (or NF4) kernels makes no float32
    array of the head's or of a kernel's shape, nor a 16-bit copy or slice of one: the head and each layer's
    kernels are read from their bits a piece at a time, never widened or sliced whole (XLA:CPU had converted
    the whole head once for the step, and sliced every layer's kernels off their stacks)."""
    plan = TrainPlan(METHODS[name], 2, 128, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="float32", remat="full"))  # 256 tokens, not D
    run = abstract_run(WIDE, plan, make_mesh(MeshConfig(), jax.devices()[:1]))
    text = run.step.lower(run.state, run.frozen, run.second, run.batch).compile().as_text()
    D, F, V = WIDE.hidden_size, WIDE.intermediate_size, WIDE.vocab_size
    for shape in (f"{V},{D}]", f"{D},{V}]", f"{D},{F}]", f"{F},{D}]"):
        assert not re.search(r"f32\[" + shape, text), shape
        assert not re.search(r"= (?:u16|bf16)\[" + shape + r"\{[^}]*\} (?:fusion|copy|dynamic-slice)\(", text), shape


@pytest.mark.parametrize("method, param_dtype, remat", [
    (METHODS["lora"], "bfloat16", "full"), (METHODS["lora"], "bfloat16", "none"),
    (method_config("lora"), "float32", "full"), (method_config("qlora"), "bfloat16", "full"),
    (METHODS["qlora nf4"], "bfloat16", "none")])
@pytest.mark.full
def test_estimate_under_float32_compute_is_within_ten_percent_of_the_compiled_step(method, param_dtype, remat):
    """The planner's per-device figure (without the runtime reserve) against XLA's analysis of the trainer's step,
    float32 compute over bfloat16, NF4 and float32 weights (4 rows of 128 tokens: the loss is one chunk): no
    widened head, the one more logits buffer and the layer's derived pieces that reading by pieces holds."""
    plan = TrainPlan(method, 4, 128, 1, param_dtype=param_dtype,
                     forward=ForwardOptions(compute_dtype="float32", remat=remat), mesh=MeshConfig(fsdp=1))
    compiled, est = compile_step(WIDE, plan), estimate(WIDE, plan, get_device("cpu"))
    assert abs(est.compiled_bytes / compiled.total_bytes - 1) < 0.10, (compiled, est.to_dict()["per_device"])
