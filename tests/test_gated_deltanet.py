"""The gated delta rule (`models/gated_deltanet.py`): the chunked form against a float64 recurrence written here in
numpy, over lengths that are and are not multiples of the chunk, its gradients against the recurrence's, the
token-by-token form continuing a chunked prefill, and both against transformers' own torch functions; the UT
transform's inverse against numpy's, by matmuls alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.models.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule, unit_lower_inverse

B, H, N, DK, DV = 2, 2, 4, 8, 6  # two query/key heads serve four value heads


def inputs(T: int, seed: int = 0, dtype=np.float32):
    """q, k [B, T, H, dk], v [B, T, N, dv], g (log decays in [-1, 0)) and beta (in (0, 1)) [B, T, N]."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, DK))
    v = rng.standard_normal((B, T, N, DV))
    g = -rng.uniform(0.0, 1.0, (B, T, N))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, N))))
    return tuple(a.astype(dtype) for a in (q, k, v, g, beta))


def numpy_recurrence(q, k, v, g, beta, state=None):
    """The rule as Yang et al. write it, token by token in float64: (outputs [B, T, N, dv], state [B, N, dk, dv])."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    q, k = (np.repeat(a, N // H, axis=2) for a in (q, k))
    q, k = (a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6) for a in (q, k))
    q = q / np.sqrt(DK)
    S = np.zeros((B, N, DK, DV)) if state is None else np.asarray(state, np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(v.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bnk,bnkv->bnv", k[:, t], S)) * beta[:, t][..., None]
        S = S + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = np.einsum("bnk,bnkv->bnv", q[:, t], S)
    return out, S


@pytest.mark.parametrize("T, chunk", [(64, 64), (50, 64), *(pytest.param(*c, marks=pytest.mark.full)
                                                             for c in ((130, 64), (37, 16)))])
def test_chunked_equals_the_float64_recurrence(T, chunk):
    """In float64 to 1e-10 (the same function), in float32 to 1e-5 relative; the final state too."""
    args = inputs(T)
    want, want_S = numpy_recurrence(*args)
    with jax.enable_x64(True):
        out, S = jax.jit(chunk_gated_delta_rule, static_argnames="chunk")(
            *(jnp.asarray(a, jnp.float64) for a in args), chunk=chunk)
        assert np.abs(np.asarray(out) - want).max() <= 1e-10 and np.abs(np.asarray(S) - want_S).max() <= 1e-10
    out32, S32 = jax.jit(chunk_gated_delta_rule, static_argnames="chunk")(*map(jnp.asarray, args), chunk=chunk)
    assert out32.dtype == jnp.float32
    assert np.abs(np.asarray(out32) - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(np.asarray(S32) - want_S).max() <= 1e-5 * np.abs(want_S).max()


@pytest.mark.full
def test_gradients_equal_the_recurrence():
    """d(sum of outputs x a fixed cotangent)/d(q, k, v, g, beta), float64: chunked (chunk 16 over 40 tokens)
    equals token by token to 1e-10."""
    args = inputs(40, seed=1)
    cotangent = np.random.default_rng(2).standard_normal((B, 40, N, DV))
    with jax.enable_x64(True):
        args64 = tuple(jnp.asarray(a, jnp.float64) for a in args)
        loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * cotangent)  # noqa: E731
        chunked = jax.grad(loss(lambda *a: chunk_gated_delta_rule(*a, chunk=16)), argnums=range(5))(*args64)
        stepped = jax.grad(loss(recurrent_gated_delta_rule), argnums=range(5))(*args64)
    for name, got, want in zip(("q", "k", "v", "g", "beta"), chunked, stepped):
        assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-10 * np.abs(np.asarray(want)).max(), name


def test_decoding_continues_a_chunked_prefill():
    """A prefill of 23 tokens (chunked, its final state) then 9 tokens one at a time equals 32 tokens chunked."""
    args = inputs(32, seed=3)
    chunked = jax.jit(chunk_gated_delta_rule, static_argnames="chunk")
    step = jax.jit(recurrent_gated_delta_rule)
    whole, _ = chunked(*map(jnp.asarray, args), chunk=16)
    head, state = chunked(*(jnp.asarray(a[:, :23]) for a in args), chunk=16)
    tail = []
    for t in range(23, 32):
        out, state = step(*(jnp.asarray(a[:, t:t + 1]) for a in args), state_BxNxKxV=state)
        tail.append(out)
    got = np.concatenate([np.asarray(head)] + [np.asarray(o) for o in tail], axis=1)
    assert np.abs(got - np.asarray(whole)).max() <= 1e-5


@pytest.mark.reference
def test_equal_to_transformers_torch_functions():
    """transformers' `torch_chunk_gated_delta_rule` (chunk 64 over 90 tokens) and `torch_recurrent_gated_delta_rule`,
    with its in-kernel L2 norm and an initial state: outputs and final states within 1e-5 relative."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    args = inputs(90, seed=4)
    state = np.random.default_rng(5).standard_normal((B, N, DK, DV)).astype(np.float32)
    ours, ours_S = jax.jit(chunk_gated_delta_rule, static_argnames="chunk")(*map(jnp.asarray, args), chunk=64,
                                                                            state_BxNxKxV=jnp.asarray(state))
    tensors = [torch.from_numpy(a) for a in args]
    for fn, kwargs in ((torch_chunk_gated_delta_rule, {"chunk_size": 64}), (torch_recurrent_gated_delta_rule, {})):
        theirs, theirs_S = fn(*tensors, initial_state=torch.from_numpy(state), output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kwargs)
        assert np.abs(np.asarray(ours) - theirs.numpy()).max() <= 1e-5 * np.abs(theirs.numpy()).max(), fn.__name__
        assert np.abs(np.asarray(ours_S) - theirs_S.numpy()).max() <= 1e-5 * np.abs(theirs_S.numpy()).max()


def test_resets_restart_each_segment_from_zero():
    """Packed rows: with resets at segment starts (one at a chunk's first token, one mid-chunk, one chunk with
    none), each segment's outputs equal the float64 recurrence over that segment alone; the final state is the last
    segment's."""
    T, chunk = 40, 8
    starts = [0, 8, 13, 29]  # 8: a chunk's first token; 13, 29 mid-chunk; chunk 16..23 has no reset
    args = inputs(T, seed=3)
    reset = np.zeros((B, T), bool)
    reset[:, starts] = True
    bounds = starts + [T]
    with jax.enable_x64(True):
        out, S = jax.jit(chunk_gated_delta_rule, static_argnames="chunk")(
            *(jnp.asarray(a, jnp.float64) for a in args), chunk=chunk, reset_BxT=jnp.asarray(reset))
    for a, b in zip(bounds, bounds[1:]):
        want, want_S = numpy_recurrence(*(x[:, a:b] for x in args))
        assert np.abs(np.asarray(out)[:, a:b] - want).max() <= 1e-10, (a, b)
    assert np.abs(np.asarray(S) - want_S).max() <= 1e-10


@pytest.mark.parametrize("C", [1, 6, 64])
def test_unit_lower_inverse_equals_numpy_and_calls_no_lapack(C):
    """(I + strictly_lower(a))^-1 to float64's rounding (a's upper part and diagonal ignored, C padded to a power of
    two); the rule's backward lowers to no LAPACK call (jaxlib's batched triangular solve, run twice at once from
    XLA:CPU's 2-thread pool, waited on that pool forever: a Qwen3.5 training step hung)."""
    a = np.random.default_rng(C).normal(size=(3, C, C)) * 0.5
    with jax.enable_x64(True):
        got = np.asarray(unit_lower_inverse(jnp.asarray(a)))
    want = np.linalg.inv(np.eye(C) + np.tril(a, -1))
    assert np.abs(got - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
    q, k, v, g, beta = inputs(70)
    loss = lambda v: chunk_gated_delta_rule(q, k, v, g, beta)[0].sum()  # noqa: E731
    hlo = jax.jit(jax.grad(loss)).lower(jnp.asarray(v)).compile().as_text()
    assert "custom_call_target=\"lapack" not in hlo
