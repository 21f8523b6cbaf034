"""Blockwise attention equals the dense form (values and gradients) for every mask the models use.

The dense reference is the textbook formula over the whole [B, K, G, T, S] score tensor with the mask built
element by element, run in float64; blocks are made small so that several query and key blocks, skipped blocks
and padded last blocks all occur.
"""

from __future__ import annotations

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import ForwardOptions, tiny_config
from jaxtune.methods import method_config
from jaxtune.models import attention
from jaxtune.models.attention import AttentionMask, blockwise_attention, cache_mask, live_blocks, training_mask
from jaxtune.models.kernels import FusedAttentionWarning
from jaxtune.models.kv_cache import decode_step, prefill
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params


def dense_attention(q, k, v, mask: AttentionMask, window: int, scale=None, softcap=None, sinks=None):
    """softmax(q k^T / sqrt(hd)) v with the whole mask, masked scores at the float's minimum; `scale` in place of
    1 / sqrt(hd), scores soft-capped as Gemma 2's eager attention does (c * tanh(s / c)) when `softcap`; with
    `sinks` [K, G], gpt-oss's eager attention: each head's sink appended as a last column of the scores, softmaxed
    with them, then dropped."""
    S = k.shape[2]
    allowed = attention._allowed(mask.q_slot_T, mask.q_segment_BxT, jnp.arange(S), mask.k_valid_BxS,
                                 mask.k_segment_BxS, window)
    s = jnp.einsum("bkgth,bksh->bkgts", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(s.dtype).min)
    if sinks is None:
        return jnp.einsum("bkgts,bksh->bkgth", jax.nn.softmax(s, axis=-1), v)
    sink_column = jnp.broadcast_to(sinks[None, :, :, None, None], s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink_column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bkgts,bksh->bkgth", p, v)


B, K, G, HD = 2, 2, 2, 8


def masks(T: int, kind: str):
    """(mask, window, rows whose queries all see some key) for one kind of mask over T tokens."""
    rng = np.random.default_rng(1)
    if kind == "causal":
        return training_mask(B, T, 0, None, None), 0
    if kind == "sliding":
        return training_mask(B, T, 0, None, None), 5
    if kind == "padded":  # left padding in row 0, right padding in row 1
        mask_BxT = np.ones((B, T), np.int32)
        mask_BxT[0, :3] = 0
        mask_BxT[1, T - 4:] = 0
        return training_mask(B, T, 0, jnp.asarray(mask_BxT), None), 0
    if kind == "packed":  # several segments a row, trailing padding in segment 0
        segments = np.sort(rng.integers(1, 5, size=(B, T)), axis=1).astype(np.int32)
        segments[:, T - 3:] = 0
        return training_mask(B, T, 0, None, jnp.asarray(segments)), 0
    if kind == "prefix":  # 3 learned keys before the tokens, with a sliding window over slots
        return training_mask(B, T, 3, None, None), 6
    if kind == "cache":  # 4 new tokens at slots 9..12 of a 21-slot cache, left padding in row 1
        valid = np.arange(21)[None, :] < 13
        valid = np.repeat(valid, B, axis=0)
        valid[1, :2] = False
        return cache_mask(jnp.asarray(9), 4, jnp.asarray(valid)), 0
    raise ValueError(kind)


def inputs(T: int, S: int, dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, K, G, T, HD))
    k, v = rng.standard_normal((2, B, K, S, HD))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def seen_queries(mask: AttentionMask, S: int, window: int) -> np.ndarray:
    """[B, T] True where a query may see some key (a query that sees none has no defined output)."""
    allowed = attention._allowed(mask.q_slot_T, mask.q_segment_BxT, jnp.arange(S), mask.k_valid_BxS,
                                 mask.k_segment_BxS, window)
    return np.asarray(jnp.any(allowed, axis=-1))


def values_and_grads(fn, q, k, v, seen_BxT):
    """fn's output and the gradients of a fixed random projection of its seen queries' outputs."""
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    seen = jnp.asarray(seen_BxT)[:, None, None, :, None]
    loss = lambda q, k, v: jnp.sum(jnp.where(seen, fn(q, k, v).astype(jnp.float32) * weights, 0))
    return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)  # one program each


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 4)


BLOCKS = {"blocks": 4, "one_block": 64}


@pytest.fixture
def blocks(request, monkeypatch):
    """Blocks of 4 (several query and key blocks, dead and padded ones: the loops) or of 64 (the whole row one
    block: the loop-free path)."""
    monkeypatch.setattr(attention, "BLOCK", BLOCKS[request.param])


def kinds_and_blocks(kinds: list[str], everyday: tuple[str, str]) -> list:
    """Every (kind, blocks) case; all but the `everyday` (blocks, kind) one are in the full tier."""
    return [pytest.param(kind, b, id=f"{b}-{kind}", marks=() if (b, kind) == everyday else pytest.mark.full)
            for b in BLOCKS for kind in kinds]


FLOAT32_KINDS = ["causal", "sliding", "padded", "packed", "prefix", "cache"]


@pytest.mark.parametrize("kind, blocks", kinds_and_blocks(FLOAT32_KINDS, ("blocks", "packed")), indirect=["blocks"])
def test_blockwise_equals_dense_float32(kind, blocks):
    T = 4 if kind == "cache" else 13  # 13: four query blocks of 4, the last padded
    mask, window = masks(T, kind)
    S = mask.k_valid_BxS.shape[1]
    q, k, v = inputs(T, S, jnp.float32)
    seen = seen_queries(mask, S, window)
    assert seen.any() and (kind not in ("padded", "packed") or not seen.all() or kind == "packed")
    out, grads = values_and_grads(lambda q, k, v: blockwise_attention(q, k, v, mask, window), q, k, v, seen)
    with jax.enable_x64(True):
        q64, k64, v64 = (a.astype(jnp.float64) for a in (q, k, v))
        ref, ref_grads = values_and_grads(lambda q, k, v: dense_attention(q, k, v, mask, window), q64, k64, v64,
                                          seen)
        ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
    seen_out = seen[:, None, None, :, None]
    scale = np.max(np.abs(ref))
    np.testing.assert_array_less(np.abs(np.where(seen_out, np.asarray(out) - ref, 0)), 1e-5 * scale)
    for name, got, want in zip("qkv", grads, ref_grads):
        err = np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want))
        assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("kind, blocks", kinds_and_blocks(["causal", "sliding", "padded", "prefix"],
                                                          ("one_block", "sliding")), indirect=["blocks"])
def test_soft_capped_attention_equals_dense_float64(kind, blocks):
    """Gemma 2's attention: scores scaled by 1 / sqrt(query_pre_attn_scalar) and capped at 2.0 (the inputs are
    scaled up so most scores sit on the tanh's flat part; uncapped, the result differs)."""
    T = 13
    mask, window = masks(T, kind)
    S = mask.k_valid_BxS.shape[1]
    q, k, v = inputs(T, S, jnp.float32)
    q = q * 4.0
    seen = seen_queries(mask, S, window)
    capped = lambda q, k, v: blockwise_attention(q, k, v, mask, window, scale=0.5, softcap=2.0)
    out, grads = values_and_grads(capped, q, k, v, seen)
    with jax.enable_x64(True):
        q64, k64, v64 = (a.astype(jnp.float64) for a in (q, k, v))
        dense = lambda q, k, v: dense_attention(q, k, v, mask, window, scale=0.5, softcap=2.0)
        ref, ref_grads = values_and_grads(dense, q64, k64, v64, seen)
        uncapped = np.asarray(dense_attention(q64, k64, v64, mask, window, scale=0.5))
        ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
    seen_out = seen[:, None, None, :, None]
    err = lambda got, want: np.max(np.abs(np.where(seen_out, got - want, 0))) / np.max(np.abs(want))
    assert err(np.asarray(out), ref) <= 1e-5
    assert err(uncapped, ref) > 0.1
    for name, got, want in zip("qkv", grads, ref_grads):
        assert np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)) <= 1e-5, name


@pytest.mark.parametrize("kind, blocks", kinds_and_blocks(["causal", "packed", "prefix"], ("blocks", "prefix")),
                         indirect=["blocks"])
def test_blockwise_bfloat16_rounds_the_float32_result(kind, blocks):
    """bfloat16 inputs: scores, softmax and sums are float32, so the output is the float32 dense result of the
    same bfloat16 inputs rounded once (within one bfloat16 step, 2^-8 relative), and the gradients (the incoming
    bfloat16 gradient rounded too) are within 2^-7 of the largest and closer than the dense form run in bfloat16."""
    T = 13
    mask, window = masks(T, kind)
    S = mask.k_valid_BxS.shape[1]
    q, k, v = inputs(T, S, jnp.bfloat16)
    seen = seen_queries(mask, S, window)
    out, grads = values_and_grads(lambda q, k, v: blockwise_attention(q, k, v, mask, window), q, k, v, seen)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    dense = lambda q, k, v: dense_attention(q, k, v, mask, window)
    ref, ref_grads = values_and_grads(dense, *(a.astype(jnp.float32) for a in (q, k, v)), seen)
    _, dense_grads = values_and_grads(dense, q, k, v, seen)
    seen_out = seen[:, None, None, :, None]
    out_err = np.where(seen_out, np.abs(np.asarray(out, np.float32) - np.asarray(ref)), 0)
    assert np.all(out_err <= 2**-8 * np.abs(np.asarray(ref)) + 1e-6)
    for name, got, want, bf16 in zip("qkv", grads, ref_grads, dense_grads):
        err, dense_err = (np.max(np.abs(np.asarray(g, np.float32) - np.asarray(want))) / np.max(np.abs(want))
                          for g in (got, bf16))
        assert err <= 2**-7 and err <= dense_err, (name, err, dense_err)


def sink_case(case: str):
    """(mask, window, block size, [B, T] queries that see no key: those before their row's first real token)."""
    T, window, block = {"one_block": (13, 5, 64), "dead_blocks": (13, 3, 4),
                        "gpt_oss": (300, 128, attention.BLOCK)}[case]
    valid = np.ones((B, T), np.int32)
    if case == "dead_blocks":  # both rows' first 5 tokens padding: query block 0 sees no key in any row (skipped)
        valid[:, :5] = 0
    else:  # left padding in row 0, right padding in row 1
        valid[0, :3] = 0
        valid[1, T - 4:] = 0
    return training_mask(B, T, 0, jnp.asarray(valid), None), window, block, np.cumsum(valid, axis=1) == 0


@pytest.mark.parametrize("case", [*(pytest.param(c, marks=pytest.mark.full) for c in ("one_block", "dead_blocks")),
                                  "gpt_oss"])
def test_attention_sinks_equal_dense_float64(case, monkeypatch):
    """gpt-oss's sinks: output and gradients of q, k, v and the sinks equal the dense form's (the sink a last score
    column, dropped after the softmax) in float64, on every query: one that sees no key gets 0, finite. Cases: one
    block (the loop-free path) with padding and a window; blocks of 4 with a whole query block dead (skipped), a
    window killing blocks below the diagonal and a padded last block; 300 tokens in blocks of 256 with gpt-oss's
    window of 128 and padding."""
    mask, window, block, unseen_BxT = sink_case(case)
    monkeypatch.setattr(attention, "BLOCK", block)
    T, S = mask.q_slot_T.shape[0], mask.k_valid_BxS.shape[1]
    if case == "dead_blocks":
        assert not np.asarray(jax.jit(live_blocks, static_argnums=(1, 2))(mask, T, S))[0].any()
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        q, k, v = inputs(T, S, jnp.float64)
        sinks = jnp.asarray(2 * rng.standard_normal((K, G)))
        weights = jnp.asarray(rng.standard_normal(q.shape))

        def values_and_grads(fn):  # output, then the gradients of q, k, v, sinks, as float64 numpy arrays
            loss = lambda *a: jnp.sum(fn(*a) * weights)  # noqa: E731
            return [np.asarray(a) for a in jax.tree.leaves(
                jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, k, v, sinks))]

        got = values_and_grads(lambda q, k, v, s: blockwise_attention(q, k, v, mask, window, sinks_KxG=s))
        want = values_and_grads(lambda q, k, v, s: dense_attention(q, k, v, mask, window, sinks=s))
        no_sinks = np.asarray(jax.jit(lambda q, k, v: dense_attention(q, k, v, mask, window))(q, k, v))
    relative = lambda got, want: np.max(np.abs(got - want)) / np.max(np.abs(want))  # noqa: E731
    for name, got_, want_ in zip(["out", "q", "k", "v", "sinks"], got, want):
        assert got_.dtype == np.float64 and relative(got_, want_) <= 1e-12, name
    unseen = np.broadcast_to(unseen_BxT[:, None, None, :, None], got[0].shape)
    assert unseen.any() and np.all(got[0][unseen] == 0)
    assert relative(no_sinks, want[0]) > 0.1  # the sinks matter


@pytest.mark.full  # the everyday tier decodes gpt-oss's sinks against transformers (test_families.py)
def test_a_model_with_sinks_decodes_as_its_forward():
    """Sinks in a model's layers (`layers["sinks"]` [L, H]; a sliding layer of 6 and a global one): the full
    forward's logits equal a prefill's and then each decode step's (its dense one-query attention) for a left-padded
    row and a full one, and differ from the model's without sinks; splash, asked for, takes them (its values:
    test_fused_attention.py)."""
    cfg = tiny_config(vocab_size=64, sliding_windows=(6, 0), initializer_range=0.1)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))  # one program, not op by op
    sinks_LxH = jnp.asarray(np.random.default_rng(1).standard_normal((cfg.num_layers, cfg.num_heads)), jnp.float32)
    with_sinks = {**params, "layers": {**params["layers"], "sinks": sinks_LxH}}
    T, t0 = 10, 4
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T)), jnp.int32)
    mask_np = np.ones((2, T), np.int32)
    mask_np[0, :3] = 0
    mask, positions = jnp.asarray(mask_np), jnp.asarray(np.clip(np.cumsum(mask_np, axis=1) - 1, 0, None))
    full = lambda p: forward(p, ids, cfg, positions_BxT=positions, attention_mask_BxT=mask)  # noqa: E731
    want, without = (np.asarray(a) for a in jax.jit(lambda: (full(with_sinks), full(params)))())
    logits, cache = jax.jit(prefill, static_argnames=("cfg", "cache_size"))(with_sinks, ids[:, :t0], cfg,
                                                                              mask[:, :t0], cache_size=T)
    decode = jax.jit(decode_step, static_argnames=("cfg",))
    got = [logits]
    for t in range(t0, T):
        logits, cache = decode(with_sinks, ids[:, t], cache, cfg)
        got.append(logits)
    assert np.max(np.abs(np.stack(got, axis=1) - want[:, t0 - 1:])) <= 1e-5
    assert np.max(np.abs(without - want)) > 1e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedAttentionWarning)  # a kernel that declined would warn
        jax.eval_shape(lambda p: forward(p, jnp.zeros((2, 128), jnp.int32), cfg,
                                         options=ForwardOptions(attention="splash")), with_sinks)


def test_skipped_blocks(small_blocks):
    """Causal: blocks above the diagonal are dead; a window kills blocks far below it; packed segments kill the
    blocks between segments of every row."""
    T = 16
    causal = np.asarray(live_blocks(training_mask(1, T, 0, None, None), T, T))
    np.testing.assert_array_equal(causal, np.tril(np.ones((4, 4), bool)))
    segments = jnp.asarray(np.repeat(np.arange(1, 5), 4)[None].astype(np.int32))
    packed = np.asarray(live_blocks(training_mask(1, T, 0, None, segments), T, T))
    np.testing.assert_array_equal(packed, np.eye(4, dtype=bool))
    blocked = attention._blocked_mask(training_mask(1, T, 0, None, None), T, T)
    windowed = np.asarray(attention._window_live(blocked, jnp.asarray(3))) & causal
    np.testing.assert_array_equal(windowed, np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool))


def _compiled_attention(T: int, block: int, monkeypatch) -> tuple[str, str]:
    """(forward, backward) XLA:CPU programs of one causal attention call over T tokens in blocks of `block`, as
    separate programs (as the layer scan's forward and backward are)."""
    monkeypatch.setattr(attention, "BLOCK", block)
    q = jnp.zeros((2, 2, 2, T, 16), jnp.float32)
    k = v = jnp.zeros((2, 2, T, 16), jnp.float32)
    mask = training_mask(2, T, 0, None, None)
    forward = jax.jit(lambda q, k, v: jax.vjp(lambda *a: blockwise_attention(*a, mask), q, k, v))
    _, vjp = forward(q, k, v)
    backward = jax.jit(lambda vjp, g: vjp(g))
    return forward.lower(q, k, v).compile().as_text(), backward.lower(vjp, q).compile().as_text()


@pytest.mark.parametrize("sinks", [False, True])
def test_one_block_backward_takes_the_row_sum_from_its_own_block(sinks, monkeypatch):
    """A row of one block whose keys are the whole row's (`whole_row`) takes rowsum(g o) as rowsum(p dp): the
    gradients never read the output (NaN here) and equal those from rowsum(g o) (a sink's value is 0); the loops
    (several blocks) and a part of a row keep rowsum(g o)."""
    monkeypatch.setattr(attention, "BLOCK", 64)
    T = 13
    mask, window = masks(T, "packed")
    q, k, v = inputs(T, T, jnp.float32)
    sinks_KxG = jnp.array([[0.5, -1.0], [2.0, 0.0]], jnp.float32) if sinks else None
    live = live_blocks(mask, T, T)
    out, lse = jax.jit(attention.attend_blocks, static_argnums=(6, 7))(q, k, v, mask, window, live, 0.125, None,
                                                                        sinks_KxG)
    g = jax.random.normal(jax.random.key(3), out.shape, jnp.float32)
    grads = jax.jit(lambda out, whole_row: attention.attention_grads(q, k, v, mask, window, live, out, lse, g, 0.125,
                                                                     None, whole_row=whole_row), static_argnums=1)
    from_out, from_block = grads(out, False), grads(jnp.full_like(out, jnp.nan), True)
    for got, want in zip(from_block, from_out):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert np.isnan(np.asarray(grads(jnp.full_like(out, jnp.nan), False)[0])).all()


@pytest.mark.full
def test_one_block_runs_without_loops_and_multiplies_no_score_block_transposed(monkeypatch):
    """A row that is one block (up to BLOCK tokens) computes with no loop or conditional (on XLA:CPU they cost
    about a third of a short row's attention), and the backward contracts the score-sized [G*T, S] blocks as they
    are: only [T, head_dim]-sized operands are transposed, never a whole p or ds block. Several blocks: loops
    that skip dead blocks."""
    T = 64
    score_elements = 2 * 2 * 2 * T * T  # [B, K, G, T, S]
    for block, loops in ((T, False), (16, True)):
        forward, backward = _compiled_attention(T, block, monkeypatch)
        for text in (forward, backward):
            assert bool(re.search(r" (while|conditional)\(", text)) == loops, (block, text[:2000])
        transposed = [math.prod(int(d) for d in dims.split(",")) for dims in
                      re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} (?:copy|transpose)\(", backward)]
        if not loops:
            assert transposed and max(transposed) <= score_elements // 4, transposed  # q-sized: 1/4 here


@pytest.mark.full
def test_long_sequence_memory_is_linear():
    """The compiled forward and backward of one attention call hold O(T x block) temporaries, not O(T^2)."""
    def temp_bytes(T):
        q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, 2, 2, T, 64), (1, 2, T, 64), (1, 2, T, 64)))
        mask = jax.eval_shape(lambda: training_mask(1, T, 0, None, None))

        def loss(q, k, v, mask):
            return jnp.sum(blockwise_attention(q, k, v, mask))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, mask).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(4096), temp_bytes(16384)
    dense_scores = 2 * 2 * 16384 * 16384 * 4  # one float32 score tensor at 16k
    assert large < dense_scores / 40, large
    assert large <= 4.5 * small, (small, large)  # 4x the tokens: at most ~4x the memory


@pytest.mark.full
def test_a_16k_token_lora_step_compiles_to_memory_linear_in_the_sequence():
    """The trainer's own step (the spine's), LoRA on q and v, one row: its compiled temporaries at 16,384 tokens are
    at most 4x (plus 10%) those at 4,096, and a small fraction of one dense [1, H, T, T] float32 score tensor."""
    from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.planner import compile_step

    cfg = ModelConfig(vocab_size=32000, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=16384)
    temp = {T: compile_step(cfg, TrainPlan(method_config("lora", rank=8), 1, T, 1, param_dtype="float32",
                                           forward=ForwardOptions(compute_dtype="float32", remat="full"),
                                           mesh=MeshConfig(1, 1, 1))).temp_bytes
            for T in (4096, 16384)}
    dense_scores = 4 * 16384 * 16384 * 4
    assert temp[16384] <= 4.4 * temp[4096], temp
    assert temp[16384] < dense_scores / 10, temp
