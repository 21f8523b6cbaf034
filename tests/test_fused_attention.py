"""The backends' fused attention kernels (jaxtune/models/kernels/) equal the dense form wherever the
dispatcher uses them, and the dispatcher picks them only where they cover the mask.

Splash attention is TPU's Pallas kernel; here it runs in Pallas' interpreter: the same kernel code (its blocks, its
mask and segment handling, its own backward) on the CPU. cuDNN's kernel cannot run here; its call
(`jax.nn.dot_product_attention` with the arguments jaxtune passes) runs with the XLA implementation instead, which
checks what is jaxtune's: the layout, the grouping of query heads over key/value heads, the window, the scale and
causality standing in for right padding. cuDNN's own numerics are NVIDIA's to show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import dense_attention, seen_queries, values_and_grads

from jaxtune.config import ForwardOptions
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.models import llama
from jaxtune.models.attention import training_mask
from jaxtune.models.kernels import AttentionShape, FusedAttention, FusedAttentionWarning, choose_kernel
from jaxtune.models.kernels import cudnn as cudnn_kernel
from jaxtune.models.kernels import splash as splash_kernel
from jaxtune.models.kernels.cudnn import cudnn_attention
from jaxtune.models.kernels.splash import splash_attention
from jaxtune.models.params import init_params
from jaxtune.presets import tiny_model_config

B, K, G, HD = 2, 2, 2, 16
T = 384  # three 128-query blocks


def masks(kind: str):
    """(mask, window, masked) over T tokens: masked when the batch has padding or packed segments."""
    rng = np.random.default_rng(1)
    if kind == "causal":
        return training_mask(B, T, 0, None, None), 0, False
    if kind == "sliding":  # a window that ends inside a block
        return training_mask(B, T, 0, None, None), 37, False
    if kind == "padded":  # left padding in row 0, right padding in row 1
        valid = np.ones((B, T), np.int32)
        valid[0, :30] = 0
        valid[1, T - 40:] = 0
        return training_mask(B, T, 0, jnp.asarray(valid), None), 0, True
    if kind == "packed":  # several segments a row, trailing padding in segment 0, and a window
        segments = np.sort(rng.integers(1, 5, size=(B, T)), axis=1).astype(np.int32)
        segments[:, T - 20:] = 0
        return training_mask(B, T, 0, None, jnp.asarray(segments)), 50, True
    if kind == "prefix":  # 128 learned keys before the tokens, a window over slots
        return training_mask(B, T, 128, None, None), 200, False
    raise ValueError(kind)


def inputs(S: int, dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, K, G, T, HD))
    k, v = rng.standard_normal((2, B, K, S, HD))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def splash(mask, window: int, masked: bool):
    """The layer's kernel among the model's windows {0, window}: the traced window picks it."""
    kernel = FusedAttention("splash", tuple(sorted({0, window})), masked, interpret=True)
    return lambda q, k, v: splash_attention(q, k, v, mask, jnp.int32(window), kernel, scale=HD ** -0.5, softcap=None)


def relative(got, want, seen_BxT=None) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if seen_BxT is not None:
        seen = seen_BxT[:, None, None, :, None]
        got, want = np.where(seen, got, 0), np.where(seen, want, 0)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.full
@pytest.mark.parametrize("kind", ["causal", "sliding", "padded", "packed", "prefix"])
def test_splash_equals_dense_float32(kind):
    """Values and gradients within 1e-5 of the float64 dense form, for every query that sees a key."""
    mask, window, masked = masks(kind)
    S = mask.k_valid_BxS.shape[1]
    q, k, v = inputs(S, jnp.float32)
    seen = seen_queries(mask, S, window)
    out, grads = values_and_grads(splash(mask, window, masked), q, k, v, seen)
    assert np.all(np.isfinite(np.asarray(out))), "a query that sees no key must still get a finite output"
    with jax.enable_x64(True):
        dense = lambda q, k, v: dense_attention(q, k, v, mask, window)
        ref, ref_grads = values_and_grads(dense, *(a.astype(jnp.float64) for a in (q, k, v)), seen)
    assert relative(out, ref, seen) <= 1e-5
    for name, got, want in zip("qkv", grads, ref_grads):
        assert relative(got, want) <= 1e-5, name


@pytest.mark.full
@pytest.mark.parametrize("window, padded", [(0, False), (-128, False), (-256, True)])
def test_splash_with_sinks_and_chunks_equals_dense(window, padded):
    """gpt-oss's sinks (splash's `sinks`, against the scaled scores) with causal or Llama 4's chunked masks (chunks
    of 128 and 256 over 384 tokens), with padding: values and the gradients of q, k, v and the sinks within 1e-5 of
    the float64 dense form."""
    valid = np.ones((B, T), np.int32)
    valid[1, T - 40:] = 0 if padded else 1
    mask = training_mask(B, T, 0, jnp.asarray(valid) if padded else None, None)
    q, k, v = inputs(T, jnp.float32)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal((K, G)), jnp.float32)
    kernel = FusedAttention("splash", tuple(sorted({0, window})), padded, interpret=True)
    seen = seen_queries(mask, T, window)

    def loss_of(attend):
        return lambda q, k, v, s: jnp.sum(jnp.where(seen[:, None, None, :, None], attend(q, k, v, s), 0) ** 2)

    ours = lambda q, k, v, s: splash_attention(q, k, v, mask, jnp.int32(window), kernel, scale=HD ** -0.5,  # noqa
                                               softcap=None, sinks_KxG=s)
    out, grads = ours(q, k, v, sinks), jax.grad(loss_of(ours), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    with jax.enable_x64(True):
        dense = lambda q, k, v, s: dense_attention(q, k, v, mask, window, sinks=s)  # noqa: E731
        args = [a.astype(jnp.float64) for a in (q, k, v, sinks)]
        ref, ref_grads = dense(*args), jax.grad(loss_of(dense), argnums=(0, 1, 2, 3))(*args)
    assert relative(out, ref, seen) <= 1e-5
    for name, got, want in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        assert relative(got, want) <= 1e-5, name


@pytest.mark.parametrize("kind", ["causal", "packed"])
@pytest.mark.full
def test_splash_bfloat16_is_the_float32_result_rounded(kind):
    """bfloat16 inputs: the output within one bfloat16 step (2^-8) of the float32 dense result of the same inputs,
    the gradients within 2^-7 of the largest."""
    mask, window, masked = masks(kind)
    S = mask.k_valid_BxS.shape[1]
    q, k, v = inputs(S, jnp.bfloat16)
    seen = seen_queries(mask, S, window)
    out, grads = values_and_grads(splash(mask, window, masked), q, k, v, seen)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    dense = lambda q, k, v: dense_attention(q, k, v, mask, window)
    ref, ref_grads = values_and_grads(dense, *(a.astype(jnp.float32) for a in (q, k, v)), seen)
    error = np.where(seen[:, None, None, :, None], np.abs(np.asarray(out, np.float32) - np.asarray(ref)), 0)
    assert np.all(error <= 2**-8 * np.abs(np.asarray(ref)) + 1e-6)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert relative(got, want) <= 2**-7, name


@pytest.mark.parametrize("kind", ["causal", pytest.param("sliding", marks=pytest.mark.full), "right-padded"])
def test_cudnn_call_equals_dense(kind):
    """jaxtune's call of jax.nn.dot_product_attention ([B, T, K * G, hd] queries over [B, S, K, hd] keys, causal,
    the window as (window - 1, 0)) equals the dense form on every real query, under right padding too."""
    window = 37 if kind == "sliding" else 0
    valid = np.ones((B, T), np.int32)
    if kind == "right-padded":
        valid[0, T - 40:] = 0
        valid[1, T - 1:] = 0
    mask = training_mask(B, T, 0, jnp.asarray(valid), None)
    q, k, v = inputs(T, jnp.float32)
    to_heads_last = lambda q, k, v: (jnp.moveaxis(q, 3, 1), jnp.moveaxis(k, 2, 1), jnp.moveaxis(v, 2, 1))
    windows = tuple(sorted({0, window}))
    call = lambda q, k, v: jnp.moveaxis(cudnn_attention(*to_heads_last(q, k, v), jnp.int32(window), windows,
                                                        scale=HD ** -0.5, implementation="xla"), 1, 3)
    assert bool(cudnn_kernel.right_padded(mask))
    real = valid.astype(bool)
    out, grads = values_and_grads(call, q, k, v, real)
    ref, ref_grads = values_and_grads(lambda q, k, v: dense_attention(q, k, v, mask, window), q, k, v, real)
    assert relative(out, ref, real) <= 1e-5
    for name, got, want in zip("qkv", grads, ref_grads):
        assert relative(got, want) <= 1e-5, name


def test_left_padding_is_not_right_padding():
    valid = np.ones((B, T), np.int32)
    valid[1, :3] = 0
    assert not bool(cudnn_kernel.right_padded(training_mask(B, T, 0, jnp.asarray(valid), None)))


def decide(choice="auto", **changes):
    facts = dict(B=2, T=256, S=256, K=2, G=2, head_dim=64, prefix=0, packed=False, padded=False, softcap=None,
                 dtype=jnp.bfloat16, windows=(0,), sinks=False)
    return choose_kernel(choice, AttentionShape(**{**facts, **changes}), jax.default_backend())


def test_the_dispatcher_takes_a_fused_kernel_only_where_it_covers_the_mask(monkeypatch):
    assert decide() is None  # CPU: blockwise
    assert decide("blockwise") is None
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert decide() == FusedAttention("splash", (0,), False, interpret=False)
    assert decide(packed=True, windows=(0, 4096)) == FusedAttention("splash", (0, 4096), True, interpret=False)
    assert decide(prefix=128, S=384) is not None  # prefix keys: a causal mask with an offset
    assert decide(prefix=128, S=384, packed=True) is None  # prefix keys seen by every segment: blockwise
    assert decide(T=200, S=200) is None  # not a multiple of 128
    assert decide(sinks=True) == FusedAttention("splash", (0,), False, interpret=False)  # gpt-oss's sinks
    assert decide(windows=(-128, 0)) == FusedAttention("splash", (-128, 0), False, interpret=False)  # Llama 4
    assert decide(windows=(-128, 0), prefix=128, S=384) is None  # chunks after prefix keys: blockwise
    assert decide(spans=True) is None and decide("splash", spans=True) is None  # an image's two-way spans: blockwise
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert decide(windows=(-128, 0)) is None  # no chunked mask in cuDNN
    assert decide(dtype=jnp.float32) is None  # cuDNN's flash attention is 16-bit
    assert decide(packed=True) is None and decide(softcap=50.0) is None and decide(prefix=4, S=260) is None
    assert decide(padded=True) is None  # the probe: this machine's jax refuses the cuDNN call
    assert "cuDNN" in cudnn_kernel._cudnn_refuses(2, 256, 2, 2, 64, jnp.bfloat16, (0, 64))
    probed = []
    monkeypatch.setattr(cudnn_kernel, "_cudnn_refuses", lambda *args: probed.append(args) or None)
    assert decide(padded=True) == FusedAttention("cudnn", (0,), True)
    assert decide(sinks=True) is None  # refused before the probe
    monkeypatch.setattr(cudnn_kernel, "_cudnn_refuses", lambda *args: "RuntimeError: cuDNN 8.9 or newer")
    assert decide() is None  # cuDNN refusing the shapes: blockwise
    assert len(probed) == 1


def test_a_fused_kernel_asked_for_where_it_cannot_run_says_why(monkeypatch):
    """Asked for, a kernel runs wherever it covers the mask; a forward it cannot run (an eval batch of 200 tokens)
    takes the blockwise kernel with a warning naming why; cuDNN off a GPU is an error."""
    with pytest.warns(FusedAttentionWarning,
                      match='attention = "splash": .* multiples of 128 positions; the sequence has 200 queries'):
        assert decide("splash", T=200, S=200) is None
    assert decide("splash") == FusedAttention("splash", (0,), False, interpret=True)  # off TPU: interpreted
    with pytest.raises(ConfigError, match='attention = "cudnn": cuDNN runs on NVIDIA GPUs; this backend is cpu'):
        decide("cudnn")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn_kernel, "_cudnn_refuses", lambda *args: "RuntimeError: cuDNN 8.9 or newer")
    with pytest.warns(FusedAttentionWarning, match="RuntimeError: cuDNN 8.9 or newer"):
        assert decide("cudnn") is None
    with pytest.raises(ConfigError, match='attention = "flash": choose one of auto, blockwise, splash, cudnn'):
        decide("flash")


@pytest.mark.full
def test_gemma2_forward_and_gradients_with_splash_equal_blockwise(monkeypatch):
    """A tiny Gemma 2 (a sliding layer and a full one, soft-capped scores, 1 / sqrt(query_pre_attn_scalar)) on
    packed rows with padding: logits and every parameter's gradient through splash attention equal the blockwise
    kernel's within 1e-5 relative, and splash was traced for it."""
    cfg = tiny_model_config("gemma2", initializer_range=0.1)
    assert len(set(cfg.sliding_windows)) == 2 and cfg.attn_logit_softcap
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 128)), jnp.int32)
    segments = np.ones((2, 128), np.int32)
    segments[:, 50:] = 2
    segments[:, 120:] = 0
    weights = jnp.asarray(rng.standard_normal((2, 128, cfg.vocab_size)), jnp.float32)
    traced = []
    monkeypatch.setattr(splash_kernel, "splash_attention",
                        lambda *a, **k: traced.append(1) or splash_attention(*a, **k))

    def logits_and_grads(attention: str):
        options = ForwardOptions(attention=attention)
        logits = lambda p: llama.forward(p, tokens, cfg, segment_ids_BxT=jnp.asarray(segments), options=options)
        loss = lambda p: jnp.sum(logits(p) * weights)
        return jax.jit(lambda p: (logits(p), jax.grad(loss)(p)))(params)

    (want, want_grads), (got, got_grads) = logits_and_grads("blockwise"), logits_and_grads("splash")
    assert traced
    assert relative(got, want) <= 1e-5
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(got_grads),
                          jax.tree.leaves(want_grads)):
        assert relative(g, w) <= 1e-5, jax.tree_util.keystr(path[0])


@pytest.mark.slow
@pytest.mark.full
def test_splash_trains_under_shard_map_on_a_mesh_as_blockwise_on_one_device():
    """LoRA on the tiny Gemma 2, three steps of the spine's step: splash attention on one device and on
    fsdp=4 x tensor=2 (each device's rows and key/value heads under shard_map) give the blockwise kernel's losses
    (tests/parallel_worker.py splash, on 8 fake CPU devices)."""
    worker = Path(__file__).with_name("parallel_worker.py")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, str(worker), "splash"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("traced") == {"blockwise": [0, 0], "splash": [2, 0], "splash fsdp=4 x tensor=2": [2, 2]}
    assert all(diff <= 1e-5 for diff in out.values()), out


def test_the_run_config_chooses_the_kernel_for_the_trainer_and_the_planner(tmp_path):
    from jaxtune.run_config import dump_run_config, load_run_config
    from jaxtune.spine.run import train_plan

    config = load_run_config(None, ["model.attention=blockwise"])
    assert load_run_config(None, [f"model.attention={config.model.forward.attention}"]) == config
    assert "attention = \"blockwise\"" in dump_run_config(config)
    assert train_plan(config, "float32").forward.attention == "blockwise"
    assert train_plan(load_run_config(None), "float32").forward.attention == "auto"
    with pytest.raises(JaxtuneError, match="model.attention=flash: choose one of auto, blockwise, splash, cudnn"):
        load_run_config(None, ["model.attention=flash"])
