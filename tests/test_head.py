"""The chunked head equals the whole-sequence head (values and gradients) for every loss that reads logits, and a
training step holds no [B, T, V] float32 buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.models import head
from jaxtune.models.head import chunk_length, head_logits, label_logps, per_token, token_logps
from jaxtune.objectives.losses import distillation_kl

B, T, D, V = 2, 13, 16, 40


def inputs(dtype):
    """Hidden states in the compute dtype; the trained head a float32 master weight, the teacher's in `dtype`."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
    teacher = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
    params = {"lm_head": {"kernel": jnp.asarray(rng.standard_normal((D, V)) / 4, jnp.float32)}}
    teacher_params = {"embed_tokens": jnp.asarray(rng.standard_normal((V, D)) / 4, dtype)}  # tied
    labels = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
    return hidden, teacher, params, teacher_params, labels, weights


def sft_like(chunked: bool):
    """sum_t w_t log p(label_t): the form of SFT, DPO and GRPO's token terms."""
    def loss(params, hidden, labels, weights):
        logps = label_logps(params, hidden, labels) if chunked else token_logps(head_logits(params, hidden), labels)
        return jnp.sum(logps * weights)

    return loss


def distill_like(chunked: bool, teacher, teacher_params, reverse: bool):
    def loss(params, hidden, labels, weights):
        def chunk(h, t, y):
            s_logits, t_logits = head_logits(params, h), head_logits(teacher_params, t)
            return distillation_kl(s_logits, t_logits, 2.0, reverse), token_logps(s_logits, y)

        if chunked:
            kl, logps = per_token(chunk, hidden, teacher, labels, vocab=V)
        else:
            kl, logps = chunk(hidden, teacher, labels)
        return jnp.sum((kl + logps) * weights)

    return loss


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", B * V * 4)  # 4 tokens a chunk: 4 chunks of 13, the last padded
    assert chunk_length(B, T, V) == 4


@pytest.mark.parametrize("loss_kind, dtype", [
    pytest.param(kind, dtype, marks=() if (kind, dtype) in (("sft", jnp.float32), ("distill_reverse", jnp.bfloat16))
                 else pytest.mark.full, id=f"{kind}-{jnp.dtype(dtype).name}")
    for kind in ("sft", "distill", "distill_reverse") for dtype in (jnp.float32, jnp.bfloat16)])
def test_chunked_head_equals_the_whole_sequence(loss_kind, dtype, small_chunks):
    hidden, teacher, params, teacher_params, labels, weights = inputs(dtype)
    make = (lambda chunked: sft_like(chunked)) if loss_kind == "sft" else (
        lambda chunked: distill_like(chunked, teacher, teacher_params, loss_kind == "distill_reverse"))
    results = []
    for chunked in (True, False):
        value, grads = jax.value_and_grad(make(chunked), argnums=(0, 1))(params, hidden, labels, weights)
        results.append((np.asarray(value), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]))
    (value, grads), (ref, ref_grads) = results
    assert abs(value - ref) <= 1e-5 * abs(ref)
    for got, want in zip(grads, ref_grads):
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_chunk_length_bounds_the_logits():
    assert chunk_length(1, 65536, 128256) == 128  # Llama-3's vocabulary: 128 tokens a chunk, 64 MiB of float32
    assert chunk_length(8, 128, 32000) == 64
    assert chunk_length(4, 10, 96) == 10  # a short sequence is one chunk
    assert chunk_length(1, 100, 1 << 26) == 1


def test_the_head_memory_does_not_grow_with_the_sequence():
    """The gradient of the chunked loss with a 32,000-token vocabulary: its compiled temporaries are a few chunks'
    logits (512 tokens a chunk) whether the sequence has 4,096 or 16,384 tokens, far below one [1, T, V] float32
    buffer (2.1 GB at 16k); only the O(T x D) hidden states and their gradient grow."""
    Vl, Dl = 32000, 64

    def temp_bytes(Tl):
        params = {"lm_head": {"kernel": jax.ShapeDtypeStruct((Dl, Vl), jnp.float32)}}
        hidden = jax.ShapeDtypeStruct((1, Tl, Dl), jnp.float32)
        labels = jax.ShapeDtypeStruct((1, Tl), jnp.int32)
        loss = lambda params, hidden, labels: jnp.sum(label_logps(params, hidden, labels))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, hidden, labels).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(4096), temp_bytes(16384)
    assert long < 16384 * Vl * 4 / 10, long
    assert long - short < 12288 * Dl * 4 * 8, (short, long)  # growth: a few [T, D] float32 arrays


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_head_is_multiplied_as_stored(dtype, tied, monkeypatch):
    """The head's weight, a tied embedding table [V, D] or an `lm_head` kernel [D, V], enters the chunked loss's
    gradient as stored: no copy, transpose or conversion of it in the compiled step (XLA:CPU had copied the
    transposed weight out of the chunk loop, in bfloat16: for the table in the forward, for the kernel in the
    backward)."""
    Vl, Dl, Tl = 4000, 256, 256
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 64 * Vl)  # 64 tokens a chunk: a loop of 4
    params = ({"embed_tokens": jax.ShapeDtypeStruct((Vl, Dl), dtype)} if tied
              else {"lm_head": {"kernel": jax.ShapeDtypeStruct((Dl, Vl), dtype)}})
    hidden = jax.ShapeDtypeStruct((1, Tl, Dl), dtype)
    labels = jax.ShapeDtypeStruct((1, Tl), jnp.int32)
    loss = lambda params, hidden, labels: jnp.sum(label_logps(params, hidden, labels))
    hlo = jax.jit(jax.grad(loss, argnums=1)).lower(params, hidden, labels).compile().as_text()
    made = [line.strip() for line in hlo.splitlines()
            if re.search(rf"= \w+\[({Vl},{Dl}|{Dl},{Vl})\]\S* (copy|convert|transpose|fusion)\(", line)]
    assert not made, made[:3]
