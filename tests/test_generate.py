"""Generation: the cached decode equals the full forward, greedy tokens equal transformers' `generate`, sampling
filters equal transformers' warpers, stop tokens and strings cut, and the decode loop compiles once per bucket."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import numpy_random_params, padded_batch

from jaxtune.config import SamplingConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.generation import begin, decode_more, filter_logits, generate, generate_text
from jaxtune.methods import method_config
from jaxtune.methods.lora import merge
from jaxtune.methods.peft import load_peft_adapter
from jaxtune.methods.transform import apply_method
from jaxtune.models.kv_cache import decode_step, prefill
from jaxtune.models.llama import forward
from jaxtune.spine.model import load_model

jit_forward = jax.jit(forward, static_argnames=("cfg", "method", "options"))
jit_prefill = jax.jit(prefill, static_argnames=("cfg", "cache_size", "method", "options"))
jit_decode = jax.jit(decode_step, static_argnames=("cfg", "method", "options"))

# Tests share shapes (3 prompts -> a batch bucket of 4, at most 16 tokens, 12 new) to share compiled programs.
PROMPT_LENGTHS = (7, 12, 3)
CFG = tiny_config(vocab_size=259, num_layers=2, sliding_windows=(0, 6))
GREEDY = SamplingConfig(max_new_tokens=12)
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=1.0)


@pytest.fixture(scope="module")
def tiny():
    return CFG, numpy_random_params(CFG)


def prompts(vocab, lengths=PROMPT_LENGTHS, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


def left_padded(prompts_):
    T = max(map(len, prompts_))
    ids = np.zeros((len(prompts_), T), np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts_):
        ids[row, T - len(p):], mask[row, T - len(p):] = p, 1
    return ids, mask


def randomize_lora(params, seed=1):
    """Non-zero LoRA B (PEFT's init leaves it at zero, which would make the test vacuous)."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    layers = {name: {**m, "lora_b": 0.3 * jax.random.normal(next(keys), m["lora_b"].shape)}
              if isinstance(m, dict) and "lora_b" in m else m for name, m in params["layers"].items()}
    return {**params, "layers": layers}


def cached_logits(params, cfg, ids, mask, t0, method=None):
    """Logits [B, T, V] for positions t0-1 .. T-1: prefill ids[:, :t0], then one decode step per token."""
    logits, cache = jit_prefill(params, jnp.asarray(ids[:, :t0]), cfg, jnp.asarray(mask[:, :t0]),
                                cache_size=ids.shape[1] + 4 + (method.num_virtual_tokens if method else 0),
                                method=method)
    out = [logits]
    for t in range(t0, ids.shape[1]):
        logits, cache = jit_decode(params, jnp.asarray(ids[:, t]), cache, cfg, method=method)
        out.append(logits)
    return np.stack(out, axis=1)


@pytest.mark.full
def test_prefill_and_decode_equal_the_full_forward(tiny):
    """Every step's logits, for an unpadded and a left-padded row, with a sliding window (6) shorter than the
    sequence, and prefix tuning: its keys fill the first P cache slots and real tokens start at position P."""
    cfg, params = tiny
    method = method_config("prefix", num_virtual_tokens=5)
    params = apply_method(params, cfg, method, jax.random.key(1))
    ids, mask, _ = padded_batch(cfg.vocab_size)
    ids, mask = ids[:2], mask[:2]
    positions = 5 + np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    full = np.asarray(jit_forward(params, jnp.asarray(ids), cfg, positions_BxT=jnp.asarray(positions),
                                  attention_mask_BxT=jnp.asarray(mask), method=method))
    assert np.abs(cached_logits(params, cfg, ids, mask, t0=4, method=method) - full[:, 3:]).max() <= 1e-4


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", *(pytest.param(arch, marks=pytest.mark.full) for arch in (
    "mistral", "qwen2_sliding", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe")), "qwen3_moe"])
def test_greedy_equals_transformers_generate(arch, hf_model_dir):
    """A batch of prompts of different lengths, left-padded in transformers; Mistral's window (5) and Qwen2's (4,
    on two of three layers) are shorter than prompt + generation."""
    import torch

    directory, model = hf_model_dir(arch)
    cfg, params = load_model(directory)
    batch = prompts(cfg.vocab_size)
    n = 16
    ids, mask = left_padded(batch)
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    ref = ref[:, ids.shape[1]:].numpy().tolist()
    assert generate(params, cfg, batch, SamplingConfig(max_new_tokens=n), eos_ids=()) == ref


def test_llama4_chunks_and_temperature_follow_positions_in_a_padded_cache():
    """A Llama 4 shape (chunks of 4, a NoPE layer with temperature): a prompt left-padded by 3 slots (not a multiple
    of the chunk), prefilled then decoded, gives the logits of the unpadded row's full forward."""
    cfg = tiny_config(vocab_size=259, num_layers=2, sliding_windows=(-4, 0), nope_layers=(1,), temperature_floor=2)
    params = numpy_random_params(cfg)
    ids = np.asarray(prompts(cfg.vocab_size, (10,)))
    full = np.asarray(jit_forward(params, jnp.asarray(ids), cfg))
    padded, mask = np.pad(ids, ((0, 0), (3, 0))), np.pad(np.ones_like(ids), ((0, 0), (3, 0)))
    assert np.abs(cached_logits(params, cfg, padded, mask, t0=10) - full[:, 6:]).max() <= 1e-4


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.full
def test_llama4_greedy_equals_transformers_generate_of_each_prompt(hf_model_dir):
    """Prompts of lengths 7, 12 and 3 packed, then left-padded in one cache, decoded past chunk boundaries (4): each
    row as transformers generates its prompt alone (chunks and the NoPE layer's temperature by position)."""
    import torch

    directory, model = hf_model_dir("llama4")
    cfg, params = load_model(directory)
    batch, n = prompts(cfg.vocab_size), 10
    with torch.no_grad():
        ref = [model.generate(input_ids=torch.tensor([p]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0, eos_token_id=None)[0, len(p):].tolist() for p in batch]
    assert generate(params, cfg, batch, SamplingConfig(max_new_tokens=n), eos_ids=()) == ref


def peft_greedy(model, ids, mask, steps):
    """Greedy tokens [B, steps] from PEFT's own full forward passes, no cache, positions cumsum(mask) - 1 as HF's
    generate gives them. (transformers 5.24's `generate` with PEFT 0.21's prefix cache disagrees with that forward
    even on one unpadded row, so the uncached forward is the reference.)"""
    import torch

    ids, mask, out = torch.tensor(ids), torch.tensor(mask), []
    with torch.no_grad():
        for _ in range(steps):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            token = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)
            out.append(token)
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1).numpy().tolist()


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.full
def test_greedy_with_prefix_tuning_equals_peft(hf_model_dir, tmp_path):
    """Left-padded prompts of different lengths: PEFT too starts real tokens at position P + cumsum(mask) - 1."""
    import peft
    import torch
    import transformers

    directory, _ = hf_model_dir("llama")
    cfg, params = load_model(directory)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                peft.PrefixTuningConfig(num_virtual_tokens=5, task_type="CAUSAL_LM")).eval()
    model.save_pretrained(tmp_path / "adapter")
    method, adapted = load_peft_adapter(tmp_path / "adapter", params, cfg)
    batch = prompts(cfg.vocab_size)
    ids, mask = left_padded(batch)
    ours = generate(adapted, cfg, batch, SamplingConfig(max_new_tokens=16), eos_ids=(), method=method)
    assert ours == peft_greedy(model, ids, mask, 16)
    assert ours != generate(params, cfg, batch, SamplingConfig(max_new_tokens=16), eos_ids=())


@pytest.mark.full
def test_lora_generation_equals_merged_generation(tiny):
    cfg, params = tiny
    method = method_config("lora", rank=4, alpha=8, target_modules=("all-linear",))
    adapted = randomize_lora(apply_method(params, cfg, method, jax.random.key(2)))
    batch = prompts(cfg.vocab_size)
    ours = generate(adapted, cfg, batch, GREEDY, eos_ids=(), method=method)
    assert ours == generate(merge(adapted, method), cfg, batch, GREEDY, eos_ids=())
    assert ours != generate(params, cfg, batch, GREEDY, eos_ids=()), "the adapter must change the tokens"


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (5, 1.0), (4, 0.5), (1, 0.9), (0, 0.0)])
def test_filters_equal_transformers_warpers(top_k, top_p):
    import torch
    import transformers

    logits = np.random.RandomState(top_k).randn(4, 50).astype(np.float32) * 2
    scores = torch.tensor(logits)
    if top_k:
        scores = transformers.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = transformers.TopPLogitsWarper(top_p)(None, scores)
    ours = np.asarray(filter_logits(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p)))
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(scores.numpy()))


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny):
    cfg, params = tiny
    batch = prompts(cfg.vocab_size)
    greedy = generate(params, cfg, batch, GREEDY, eos_ids=())
    for sampling in (SAMPLED.replace(top_k=1, seed=3), SAMPLED.replace(top_p=1e-6, seed=4)):
        assert generate(params, cfg, batch, sampling, eos_ids=()) == greedy


def test_samples_lie_in_the_top_k_and_repeat_with_the_seed(tiny):
    cfg, params = tiny
    batch = prompts(cfg.vocab_size, seed=1)
    sampling = SAMPLED.replace(temperature=2.0, top_k=3, seed=7)
    out = generate(params, cfg, batch, sampling, eos_ids=())
    assert out == generate(params, cfg, batch, sampling, eos_ids=())
    assert out != generate(params, cfg, batch, sampling.replace(seed=8), eos_ids=())
    assert out != generate(params, cfg, batch, GREEDY, eos_ids=()), "temperature 2 should leave the greedy path"
    assert all(len(new) == 12 for new in out)
    ids, mask = left_padded([prompt + new for prompt, new in zip(batch, out)])  # the last 12 columns are `out`
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    logits = jit_forward(params, jnp.asarray(ids), cfg, positions_BxT=jnp.asarray(positions),
                         attention_mask_BxT=jnp.asarray(mask))
    top3_BxNx3 = np.argsort(-np.asarray(logits)[:, -13:-1], axis=-1)[..., :3]
    assert (top3_BxNx3 == np.asarray(out)[..., None]).any(-1).all()


def test_eos_and_stop_tokens_cut_the_output(tiny):
    cfg, params = tiny
    batch = prompts(cfg.vocab_size)
    full = generate(params, cfg, batch, GREEDY, eos_ids=())
    stop = full[0][4]
    cut = generate(params, cfg, batch, GREEDY, eos_ids=(), stop_token_ids=(stop,))
    assert cut[0] == full[0][: full[0].index(stop)]
    for row, new in zip(full, cut):
        assert new == (row[: row.index(stop)] if stop in row else row)
    assert generate(params, cfg, batch, GREEDY, eos_ids=(stop,)) == cut


def test_generate_text_cuts_at_stop_strings(tiny):
    cfg, params = tiny
    tokenizer = Tokenizer.byte_level()
    texts_in = ["Hello", "a longer prompt", "x"]
    texts = generate_text(params, cfg, tokenizer, texts_in, SAMPLED.replace(seed=1))
    assert all(texts) and len(texts) == 3
    stop = texts[0][3:5]
    cut = generate_text(params, cfg, tokenizer, texts_in, SAMPLED.replace(seed=1), stop_strings=("not there", stop))
    for text, short in zip(texts, cut):
        assert short == (text[: text.find(stop)] if stop in text else text)
    assert len(cut[0]) <= 3 < len(texts[0])


@pytest.mark.full
def test_decode_loop_compiles_once_per_bucket(tiny):
    """Other prompts (lengths within one bucket), another batch size below the same power of two, another seed,
    temperature and top-k: the same decode loop; the prefill once per number of packed rows (1, then 2)."""
    cfg, params = tiny
    generate(params, cfg, prompts(cfg.vocab_size, (4, 9, 2)), SAMPLED)
    loops, prefills = decode_more._cache_size(), begin._cache_size()
    generate(params, cfg, prompts(cfg.vocab_size, (11, 3, 8), seed=1), SAMPLED.replace(temperature=1.3, top_k=9,
                                                                                        top_p=0.8, seed=5))
    generate(params, cfg, prompts(cfg.vocab_size, (16, 1, 1, 5), seed=2), SAMPLED)
    assert decode_more._cache_size() == loops and begin._cache_size() <= prefills + 1  # 2 rows: maybe compiled before


def test_bad_inputs_raise_clear_errors(tiny):
    cfg, params = tiny
    with pytest.raises(JaxtuneError, match="no prompts"):
        generate(params, cfg, [], SamplingConfig())
    with pytest.raises(JaxtuneError, match="prompt 1 is empty"):
        generate(params, cfg, [[1, 2], []], SamplingConfig())
    with pytest.raises(JaxtuneError, match="prompt 0 has 513 tokens, more than the model's context of 512"):
        generate(params, cfg, [[1] * 513], SamplingConfig())
    with pytest.raises(JaxtuneError, match="prompt 0 has 500 tokens: with max_new_tokens=64 it would pass"):
        generate(params, cfg, [[1] * 500], SamplingConfig())
    with pytest.raises(JaxtuneError, match="prompt 0: token id 259 is outside the vocabulary"):
        generate(params, cfg, [[1, 259]], SamplingConfig())
    with pytest.raises(JaxtuneError, match="stop tokens: token id -1"):
        generate(params, cfg, [[1]], SamplingConfig(), stop_token_ids=(-1,))
    with pytest.raises(JaxtuneError, match="prompt length 8 \\(\\+ 0 prefix tokens\\) does not fit the cache of 6"):
        prefill(params, jnp.ones((1, 8), jnp.int32), cfg, cache_size=6)
    with pytest.raises(JaxtuneError, match="a single string"):
        generate_text(params, cfg, Tokenizer.byte_level(), "hello", SamplingConfig())
    for bad, message in [(dict(max_new_tokens=0), "max_new_tokens = 0: must be >= 1"),
                         (dict(temperature=-1.0), "temperature = -1.0: must be >= 0"),
                         (dict(top_k=-2), "top_k = -2: must be >= 0"),
                         (dict(top_p=1.5), "top_p = 1.5: must be in (0.0, 1.0]"),
                         (dict(top_p=0.0), "top_p = 0.0: must be in (0.0, 1.0]")]:
        with pytest.raises(ConfigError, match=re.escape(message)):  # a JaxtuneError and a ValueError, as every config's
            SamplingConfig(**bad)
