"""The generation engine: the packed prefill equals the left-padded one (cache, logits, greedy tokens; with prefix
tuning, packed and one prompt a row), per-row stop strings end a row's decoding and give what generating to the end
and cutting gives, per-row limits, and bad stop strings or limits are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import numpy_random_params

from jaxtune import generation
from jaxtune.config import SamplingConfig, tiny_config
from jaxtune.data.batching import MIN_BUCKET, bucket
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate, generate_text, pack_prompts, rows_bucket
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method
from jaxtune.models.attention import BRANCH_SHIFT
from jaxtune.models.kv_cache import decode_step, prefill, prefill_packed, prefix_length

jit_prefill = jax.jit(prefill, static_argnames=("cfg", "cache_size", "method", "options"))
jit_packed = jax.jit(prefill_packed, static_argnames=("cfg", "cache_size", "method", "options"))
jit_decode = jax.jit(decode_step, static_argnames=("cfg", "method", "options"))

LENGTHS = (3, 14, 5, 9, 16, 2, 7)  # 7 prompts: a batch bucket of 8, prompt slots 16, 4 packed rows of 16
N = 10
WINDOWED = tiny_config(vocab_size=259, num_layers=2, sliding_windows=(0, 6))
FULL = tiny_config(vocab_size=259, num_layers=2)
PREFIX = method_config("prefix", num_virtual_tokens=4)


def prompts(vocab, lengths=LENGTHS, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


def left_padded(prompts_, T):
    ids, mask = np.zeros((bucket(len(prompts_)), T), np.int32), np.zeros((bucket(len(prompts_)), T), np.int32)
    for row, p in enumerate(prompts_):
        ids[row, T - len(p):], mask[row, T - len(p):] = p, 1
    return ids, mask


def left_padded_greedy(params, cfg, prompts_, steps, method=None):
    """Greedy tokens [B, steps] of the left-padded prefill and one decode step per token (the engine before
    packing), no stop tokens."""
    T = bucket(max(map(len, prompts_)), MIN_BUCKET)
    ids, mask = left_padded(prompts_, T)
    logits, cache = jit_prefill(params, jnp.asarray(ids), cfg, jnp.asarray(mask),
                                cache_size=prefix_length(params) + T + steps, method=method)
    out = []
    for _ in range(steps):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(np.asarray(token))
        logits, cache = jit_decode(params, token, cache, cfg, method=method)
    return np.stack(out, 1)[: len(prompts_)].tolist()


@pytest.fixture(scope="module", params=[pytest.param("windowed", marks=pytest.mark.full), "full",
                                        pytest.param("prefix_windowed", marks=pytest.mark.full),
                                        pytest.param("prefix_full", marks=pytest.mark.full)])
def model(request):
    cfg = WINDOWED if "windowed" in request.param else FULL
    params = numpy_random_params(cfg)
    method = None
    if request.param.startswith("prefix"):
        method = PREFIX
        params = apply_method(params, cfg, method, jax.random.key(1))
    return cfg, params, method


def test_prompts_pack_into_fewer_rows():
    """7 prompts of 56 tokens in all: 4 rows of 16 (not 8 x 16), each prompt's tokens, positions and slots kept."""
    batch = prompts(259)
    packed = pack_prompts(batch, 8, 16, prefix=4)
    assert packed.tokens_RxT.shape == (4, 16) and packed.source_BxW.shape == (8, 16)
    flat_tokens, flat_positions = packed.tokens_RxT.reshape(-1), packed.positions_RxT.reshape(-1)
    flat_segments = packed.segments_RxT.reshape(-1)
    for i, p in enumerate(batch):
        source = packed.source_BxW[i]
        assert (source[: 16 - len(p)] == -1).all() and packed.last_B[i] == source[-1]
        assert flat_tokens[source[16 - len(p):]].tolist() == p
        assert flat_positions[source[16 - len(p):]].tolist() == list(range(4, 4 + len(p)))
        assert len(set(flat_segments[source[16 - len(p):]].tolist())) == 1
    assert (packed.source_BxW[7] == -1).all()
    assert [rows_bucket(n) for n in (1, 5, 8, 9, 10, 11, 17, 34, 100)] == [1, 5, 8, 10, 10, 12, 20, 40, 112]
    one = pack_prompts(batch, 8, 16, one_per_row=True)
    assert one.tokens_RxT.shape == (rows_bucket(len(batch)), 16)  # a row a prompt
    for i, p in enumerate(batch):  # right-aligned in row i, as the cache holds it
        assert one.source_BxW[i, 16 - len(p):].tolist() == list(range(16 * i + 16 - len(p), 16 * (i + 1)))


def assert_same_prefill(params, cfg, method, batch, packed, T):
    """The packed prefill's cache (keys and values of every valid slot, which slots are valid, next positions) and
    last-token logits equal the left-padded prefill's."""
    P = prefix_length(params)
    size = P + T + N
    ids, mask = left_padded(batch, T)
    logits, cache = jit_prefill(params, jnp.asarray(ids), cfg, jnp.asarray(mask), cache_size=size, method=method)
    packed_logits, packed_cache = jit_packed(params, packed, cfg, cache_size=size, method=method)
    valid, B = np.asarray(cache.valid_BxS), len(batch)
    np.testing.assert_array_equal(np.asarray(packed_cache.valid_BxS), valid)
    np.testing.assert_array_equal(np.asarray(packed_cache.next_position_B)[:B], np.asarray(cache.next_position_B)[:B])
    assert int(packed_cache.length) == int(cache.length) == P + T
    for new, old in ((packed_cache.k, cache.k), (packed_cache.v, cache.v)):
        new, old = (np.moveaxis(np.asarray(a), 3, 2) for a in (new, old))  # [L, B, S, K, hd]
        assert np.abs(new[:, valid] - old[:, valid]).max() <= 1e-5
    assert np.abs(np.asarray(packed_logits)[:B] - np.asarray(logits)[:B]).max() <= 1e-4


def test_packed_prefill_equals_the_left_padded_prefill(model):
    """With a sliding window (6) shorter than the prompts and with prefix tuning (packed without a window, one
    prompt a row under one)."""
    cfg, params, method = model
    batch = prompts(cfg.vocab_size)
    P = prefix_length(params)
    packed = pack_prompts(batch, 8, 16, P, one_per_row=bool(P and any(cfg.sliding_windows)))
    assert packed.tokens_RxT.shape[0] == (rows_bucket(len(batch)) if P and any(cfg.sliding_windows) else 4)
    assert_same_prefill(params, cfg, method, batch, packed, 16)


def test_prompts_sharing_a_prefix_compute_it_once(model):
    """Prompts that begin alike (12 tokens, 10 for one; one prompt is that beginning, one repeats another) are packed
    as a prefix tree, its shared tokens once, where no sliding window is narrower than a row; the prefill and the
    greedy tokens are those of each prompt alone."""
    cfg, params, method = model
    rng = np.random.RandomState(3)
    extra = lambda n: rng.randint(0, cfg.vocab_size, n).tolist()  # noqa: E731
    base = extra(12)
    batch = [base + extra(1), base + extra(3), base[:10] + extra(4), base, base + extra(5), extra(6)]
    batch.append(list(batch[1]))
    P = prefix_length(params)
    share = not any(cfg.sliding_windows)
    packed = pack_prompts(batch, 8, 32, P, share=share)
    assert (packed.segments_RxT >= 2 ** BRANCH_SHIFT).any() == share
    # six prompts share 10 tokens (saving 50), more than five sharing 12 (48)
    assert (packed.segments_RxT > 0).sum() == sum(map(len, batch)) - (5 * 10 if share else 0)
    assert_same_prefill(params, cfg, method, batch, packed, 32)
    ours = generate(params, cfg, batch, SamplingConfig(max_new_tokens=N), eos_ids=(), method=method)
    assert ours == left_padded_greedy(params, cfg, batch, N, method)


def test_greedy_tokens_equal_the_left_padded_engine(model):
    cfg, params, method = model
    batch = prompts(cfg.vocab_size, seed=1)
    ours = generate(params, cfg, batch, SamplingConfig(max_new_tokens=N), eos_ids=(), method=method)
    assert ours == left_padded_greedy(params, cfg, batch, N, method)


@pytest.mark.full
def test_batches_of_one_call_share_one_shape(model, monkeypatch):
    """batch_rows: the prompts decode a few at a time, every batch one prefill shape (rows and row tokens) and one
    cache, and each prompt's greedy tokens are those of the left-padded engine."""
    cfg, params, method = model
    batch = prompts(cfg.vocab_size, seed=1)
    shapes = []
    real = generation.begin
    monkeypatch.setattr(generation, "begin", lambda params, packed, *a, **kw: shapes.append(
        (packed.tokens_RxT.shape, packed.source_BxW.shape, kw["cache_size"])) or real(params, packed, *a, **kw))
    ours = generate(params, cfg, batch, SamplingConfig(max_new_tokens=N), eos_ids=(), method=method, batch_rows=2)
    assert len(shapes) == -(-len(batch) // 2) and len(set(shapes)) == 1
    assert ours == left_padded_greedy(params, cfg, batch, N, method)


@pytest.fixture(scope="module")
def tiny():
    return WINDOWED, numpy_random_params(WINDOWED)


@pytest.mark.full
def test_stop_when_ends_a_row_at_its_chunk(tiny):
    """A row whose check fires stops at the end of that chunk of 4 steps, the others run on, and every row's tokens
    begin as they do without the check; once all rows have stopped nothing more is decoded or asked."""
    cfg, params = tiny
    batch = prompts(cfg.vocab_size, seed=2)
    sampling = SamplingConfig(max_new_tokens=16)
    full = generate(params, cfg, batch, sampling, eos_ids=())
    asked = []

    def stop_when(row, tokens):
        asked.append((row, len(tokens)))
        return row in (1, 4) and len(tokens) >= 5

    out = generate(params, cfg, batch, sampling, eos_ids=(), stop_when=stop_when, chunk_steps=4)
    assert [len(t) for t in out] == [16, 8, 16, 16, 8, 16, 16]
    assert all(t == f[: len(t)] for t, f in zip(out, full))
    assert sorted({n for _, n in asked}) == [4, 8, 12] and (1, 12) not in asked
    asked.clear()
    out = generate(params, cfg, batch, sampling, eos_ids=(), stop_when=lambda row, t: asked.append(row) or True,
                   chunk_steps=4)
    assert [len(t) for t in out] == [4] * 7 and sorted(asked) == list(range(7))


def ascii_piece(text: str, at: int, n: int = 1) -> str:
    """The first n-character run of ASCII letters and digits from index `at` (random bytes decode to odd text)."""
    return next(text[i: i + n] for i in range(at, len(text)) if text[i: i + n].isascii() and text[i: i + n].isalnum())


def test_stop_strings_per_row_equal_generating_to_the_end_then_cutting(tiny):
    """One list for every row and one list per row, against the full generation cut by the same strings."""
    cfg, params = tiny
    tokenizer = Tokenizer.byte_level()
    texts_in = ["Hello", "a longer prompt", "x", "another one"]
    sampling = SamplingConfig(max_new_tokens=24)
    full = generate_text(params, cfg, tokenizer, texts_in, sampling)
    per_row = [[ascii_piece(full[0], 2)], [], [ascii_piece(full[2], 6, 2), "absent"], [ascii_piece(full[3], 4)]]
    cut = lambda text, stops: text[: min([text.find(s) for s in stops if s in text], default=len(text))]  # noqa: E731
    expected = [cut(text, stops) for text, stops in zip(full, per_row)]
    assert generate_text(params, cfg, tokenizer, texts_in, sampling, stop_strings=per_row, chunk_steps=4) == expected
    assert len(expected[0]) < len(full[0]) and expected[1] == full[1]
    shared = [per_row[0][0], per_row[3][0]]
    assert (generate_text(params, cfg, tokenizer, texts_in, sampling, stop_strings=shared, chunk_steps=5)
            == [cut(text, shared) for text in full])
    # a one-character stop string is a token's whole text: its rows end at that token, within a chunk
    char = next(c for c in full[1] if c.isascii() and c.isprintable())
    assert tokenizer.tokens_containing([char, "two chars"]) == tokenizer.encode(char, add_special_tokens=False)
    assert (generate_text(params, cfg, tokenizer, texts_in, sampling, stop_strings=[char], chunk_steps=24)
            == [cut(text, [char]) for text in full])


def test_each_row_has_its_own_limit(tiny):
    cfg, params = tiny
    batch = prompts(cfg.vocab_size, seed=3)
    limits = [1, 12, 5, 3, 12, 7, 2]
    full = generate(params, cfg, batch, SamplingConfig(max_new_tokens=12), eos_ids=())
    out = generate(params, cfg, batch, SamplingConfig(max_new_tokens=99), eos_ids=(), max_new_tokens_of_row=limits)
    assert out == [f[:n] for f, n in zip(full, limits)]


def test_bad_stop_strings_and_limits_raise_clear_errors(tiny):
    cfg, params = tiny
    tokenizer = Tokenizer.byte_level()
    with pytest.raises(JaxtuneError, match="stop_strings takes a list of strings .* got the string '###'"):
        generate_text(params, cfg, tokenizer, ["a", "b"], stop_strings="###")
    with pytest.raises(JaxtuneError, match=r"one list per prompt \(2\)"):
        generate_text(params, cfg, tokenizer, ["a", "b"], stop_strings=[["x"], ["y"], ["z"]])
    with pytest.raises(JaxtuneError, match="max_new_tokens_of_row has 1 entries for 2 prompts"):
        generate(params, cfg, [[1], [2]], max_new_tokens_of_row=[3])
    with pytest.raises(JaxtuneError, match=r"max_new_tokens_of_row\[1\] = 0: must be an integer >= 1"):
        generate(params, cfg, [[1], [2]], max_new_tokens_of_row=[3, 0])
    with pytest.raises(JaxtuneError, match="chunk_steps = 0: must be >= 1"):
        generate(params, cfg, [[1]], chunk_steps=0)
    with pytest.raises(JaxtuneError, match="batch_rows = 0: must be >= 1"):
        generate(params, cfg, [[1]], batch_rows=0)
