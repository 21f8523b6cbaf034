"""The rollout engine: its greedy tokens equal `generate`'s on the repeated prompts (mixed lengths and limits, EOS
mid-way, with and without LoRA, a pool small enough that samples wait), sampled with top_k 1 equals greedy, its
first tokens follow the filtered softmax, every page goes back after a run and 100 runs reuse one program, stop
strings end samples where `generate`'s end (their slots taken by the next samples, one program for any chunking),
and the pool too small or a model it does not page is one line."""

from dataclasses import replace
from math import prod
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import numpy_random_params

from jaxtune.config import SamplingConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import filter_logits, generate
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method
from jaxtune.models.kv_cache import prefill
from jaxtune.models.params import init_params
from jaxtune.rollouts import PagePool, sample_groups
from jaxtune.rollouts.engine import advance, run
from jaxtune.stop_strings import StopStrings

# Shapes shared by the tests (4 prompts of at most 16 tokens, groups of 3, limits up to 16, 4 slots, pages of 4
# tokens, a pool of 32) so that they share compiled programs.
CFG = tiny_config(vocab_size=259, num_layers=2)
LENGTHS = (3, 14, 5, 9)
G = 3
POOL = PagePool(slots=4, page_size=4, num_pages=32)
GREEDY = SamplingConfig(max_new_tokens=16)


@pytest.fixture(scope="module")
def params():
    return numpy_random_params(CFG)


def prompts(seed=0, lengths=LENGTHS):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, CFG.vocab_size, n).tolist() for n in lengths]


def limits(seed=0):
    return np.random.RandomState(100 + seed).randint(1, 17, len(LENGTHS) * G).tolist()


def repeated(batch):
    return [p for p in batch for _ in range(G)]


def eos_mid_way(params, batch, method=None):
    """A token that greedy decoding reaches mid-way in some rows: as EOS it ends them early."""
    full = generate(params, CFG, repeated(batch), GREEDY, eos_ids=(), method=method)
    middle = [t for row in full for t in row[2:10]]
    return max(set(middle), key=middle.count)


def lora_params(params):
    method = method_config("lora", rank=4, alpha=8, target_modules=("all-linear",))
    adapted = apply_method(params, CFG, method, jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(1), 16))
    layers = {name: {**m, "lora_b": 0.3 * jax.random.normal(next(keys), m["lora_b"].shape)}
              if isinstance(m, dict) and "lora_b" in m else m for name, m in adapted["layers"].items()}
    return {**adapted, "layers": layers}, method


@pytest.mark.parametrize("lora", [False, True])
def test_greedy_equals_generate(params, lora):
    """Token for token, each sample ending at its own limit or at EOS mid-way, include_stop both ways; the LoRA
    adapter runs unmerged and changes the tokens."""
    method = None
    if lora:
        params, method = lora_params(params)
    batch, limit = prompts(), limits()
    eos = eos_mid_way(params, batch, method)
    ours = sample_groups(params, CFG, batch, G, GREEDY, pool=POOL, eos_ids=[eos], method=method, include_stop=True,
                         max_new_tokens_of_sample=limit)
    theirs = generate(params, CFG, repeated(batch), GREEDY, eos_ids=[eos], method=method, include_stop=True,
                      max_new_tokens_of_row=limit)
    assert ours.tokens == theirs
    assert any(row[-1] == eos and len(row) < n for row, n in zip(ours.tokens, limit)), "EOS must end some row early"
    assert any(len(row) == n and eos not in row for row, n in zip(ours.tokens, limit))
    assert ours.free_pages == ours.num_pages
    if lora:
        assert ours.tokens != sample_groups(params, CFG, batch, G, GREEDY, pool=POOL, eos_ids=[eos],
                                            include_stop=True, max_new_tokens_of_sample=limit).tokens


def test_samples_wait_for_pages(params):
    """A pool just big enough for the worst sample beside the prompts: samples wait for pages (the peak stays in the
    pool) and the tokens are still generate's; one page fewer is refused in one line before anything runs."""
    batch, limit = prompts(), limits()
    waiting = np.cumsum([-(-n // POOL.page_size) for n in LENGTHS][::-1])[::-1]  # a prompt's pages and the later ones'
    smallest = max(-(-(n - 1) // POOL.page_size) + waiting[i // G] for i, n in enumerate(limit))
    small = PagePool(slots=4, page_size=4, num_pages=smallest)
    ours = sample_groups(params, CFG, batch, G, GREEDY, pool=small, eos_ids=(), max_new_tokens_of_sample=limit)
    assert ours.tokens == generate(params, CFG, repeated(batch), GREEDY, eos_ids=(), max_new_tokens_of_row=limit)
    assert ours.peak_pages <= smallest and ours.free_pages == smallest
    assert ours.steps > 2 * -(-sum(limit) // small.slots), "samples waited for pages (4 busy slots would take half)"
    with pytest.raises(JaxtuneError, match=r"^the page pool of \d+ pages of 4 tokens cannot hold sample \d+: .*"
                                           r"raise PagePool.num_pages to \d+$") as error:
        sample_groups(params, CFG, batch, G, GREEDY, pool=PagePool(4, 4, smallest - 1), eos_ids=(),
                      max_new_tokens_of_sample=limit)
    assert "\n" not in str(error.value)


def test_sampled_top_k_1_is_greedy_and_first_tokens_follow_the_softmax(params):
    """top_k 1 samples the argmax; at temperature 1.5, top_k 6, the first tokens of 80 runs x 6 samples of one prompt
    (other seeds) fall on its six most likely tokens with the filtered softmax's frequencies."""
    batch, limit = prompts(), limits()
    greedy = sample_groups(params, CFG, batch, G, GREEDY, pool=POOL, eos_ids=(), max_new_tokens_of_sample=limit)
    top1 = sample_groups(params, CFG, batch, G, GREEDY.replace(temperature=1.0, top_k=1, seed=3), pool=POOL,
                         eos_ids=(), max_new_tokens_of_sample=limit)
    assert top1.tokens == greedy.tokens
    sampling = GREEDY.replace(temperature=1.5, top_k=6)
    twice = [batch[1], batch[1], batch[0], batch[2]]  # packed in 3 rows, as `batch`: the same program
    counts = np.zeros(CFG.vocab_size)
    for seed in range(80):
        out = sample_groups(params, CFG, twice, G, sampling.replace(seed=seed), pool=POOL, eos_ids=(),
                            max_new_tokens_of_sample=limit)
        np.add.at(counts, [row[0] for row in out.tokens[: 2 * G]], 1)
        assert out.free_pages == out.num_pages
    logits, _ = jax.jit(prefill, static_argnames=("cfg",))(params, np.asarray([batch[1]]), CFG)
    probs = np.asarray(jax.nn.softmax(filter_logits(logits / 1.5, np.int32(6), np.float32(1.0))))[0]
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(probs))
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.08  # total variation; ~0.04 expected at 480 draws


def test_pages_return_and_one_program_serves_100_batches(params):
    """100 rollout batches of new prompts (the same shapes): every page back after each, no new compile, no arrays
    left alive."""
    sample_groups(params, CFG, prompts(0), G, GREEDY, pool=POOL, eos_ids=(), max_new_tokens_of_sample=limits(0))
    programs, alive = run._cache_size(), len(jax.live_arrays())
    for seed in range(1, 101):
        out = sample_groups(params, CFG, prompts(seed), G, GREEDY, pool=POOL, eos_ids=(),
                            max_new_tokens_of_sample=limits(seed))
        assert out.free_pages == out.num_pages and out.peak_pages <= out.num_pages
        assert [len(row) for row in out.tokens] == limits(seed)
    assert run._cache_size() == programs
    assert len(jax.live_arrays()) <= alive


def test_stop_strings_end_samples_where_generate_does_and_free_their_slots(params):
    """Greedy with one list of stop strings per sample (a 2-token string, a sample stopping at its first token, a
    group that never stops): generate's tokens with the same `StopStrings`, which are the full generation cut
    where the text first holds a string (with include_stop, ending with the token that completed it; without,
    before it); every page back; the freed slots take the next samples (fewer steps than without); chunks of 4
    and 7 steps run one compiled program."""
    tokenizer = Tokenizer.byte_level()
    batch, limit = prompts(), limits()
    full = generate(params, CFG, repeated(batch), GREEDY, eos_ids=(), max_new_tokens_of_row=limit)
    text = [tokenizer.decode(row) for row in full]
    first = next(i for i, row in enumerate(full) if (t := tokenizer.decode(row[:1])).isascii() and t.isprintable())
    pair = next((i, c) for i in range(len(full)) for c in text[i] if i // G != first // G and c != "\ufffd"
                and len(tokenizer.encode(c, add_special_tokens=False)) == 2)  # one character of two byte tokens
    late = next((i, c) for i in range(len(full)) for c in text[i] if i // G not in (first // G, pair[0] // G)
                and c.isascii() and c.isalnum() and c not in tokenizer.decode(full[i][:5]))
    never = next(g for g in range(len(batch)) if g not in (first // G, pair[0] // G, late[0] // G))
    strings = {first // G: [tokenizer.decode(full[first][:1])], pair[0] // G: [pair[1], "absent"],
               late[0] // G: [late[1]], never: []}
    per_sample = [strings[i // G] for i in range(len(full))]
    stops = StopStrings.of(tokenizer, per_sample, len(full))
    ours = sample_groups(params, CFG, batch, G, GREEDY, pool=POOL, eos_ids=(), include_stop=True,
                         max_new_tokens_of_sample=limit, stop_when=stops, chunk_steps=4)
    assert ours.tokens == generate(params, CFG, repeated(batch), GREEDY, eos_ids=(), include_stop=True,
                                   max_new_tokens_of_row=limit, stop_when=stops, chunk_steps=4)
    assert ours.tokens == [stops.cut(i, row, True) for i, row in enumerate(full)]
    assert len(ours.tokens[first]) == 1 and ours.tokens[pair[0]] != full[pair[0]]
    for i, c in (pair, late):
        assert c in tokenizer.decode(ours.tokens[i]) and c not in tokenizer.decode(ours.tokens[i][:-1])
    assert len(ours.tokens[late[0]]) > 5 and len(ours.tokens[pair[0]]) >= 2
    assert all(ours.tokens[i] == full[i] for i in range(never * G, never * G + G))
    assert ours.free_pages == ours.num_pages
    plain = sample_groups(params, CFG, batch, G, GREEDY, pool=POOL, eos_ids=(), max_new_tokens_of_sample=limit)
    assert ours.steps < plain.steps, "the slots stop strings free take the next samples"
    programs = advance._cache_size()
    without = sample_groups(params, CFG, batch, G, GREEDY, pool=POOL, eos_ids=(), max_new_tokens_of_sample=limit,
                            stop_when=stops, chunk_steps=7)
    assert without.tokens == [stops.cut(i, row, False) for i, row in enumerate(full)]
    assert [len(a) - len(b) for a, b in zip(ours.tokens, without.tokens)] == [
        int(stops.end(i, row) is not None) for i, row in enumerate(full)]
    assert advance._cache_size() == programs


def test_sampled_stops_cut_the_samples_drawn_without_them(params):
    """Sampled (temperature 1.5, top-k 6): a sample's keys are its own, so with stop strings (each sample's own
    character, 3 tokens in) its tokens are those drawn without them, cut where `StopStrings` cuts."""
    tokenizer = Tokenizer.byte_level()
    hot = GREEDY.replace(temperature=1.5, top_k=6, seed=5)
    batch, limit = prompts(), limits()
    free = sample_groups(params, CFG, batch, G, hot, pool=POOL, eos_ids=(), max_new_tokens_of_sample=limit)
    chars = [tokenizer.decode(row[3:4]) if len(row) > 3 else "" for row in free.tokens]
    stops = StopStrings.of(tokenizer, [[c] if c.isprintable() and c != "\ufffd" else [] for c in chars], len(chars))
    ours = sample_groups(params, CFG, batch, G, hot, pool=POOL, eos_ids=(), max_new_tokens_of_sample=limit,
                         include_stop=True, stop_when=stops, chunk_steps=3)
    assert ours.tokens == [stops.cut(i, row, True) for i, row in enumerate(free.tokens)]
    assert sum(a != b for a, b in zip(ours.tokens, free.tokens)) >= 3 and ours.free_pages == ours.num_pages


def test_refusals_are_one_line(params):
    for cfg, what in [(tiny_config(vocab_size=259, num_layers=2, sliding_windows=(0, 6)), "sliding-window"),
                      (tiny_config(vocab_size=259, num_layers=2, kv_lora_rank=8, qk_rope_head_dim=8, v_head_dim=16),
                       "latent attention")]:
        with pytest.raises(JaxtuneError, match=f"^the rollout engine's paged cache .*not {what}.*generate for"):
            sample_groups({}, cfg, prompts(), G, GREEDY)
    with pytest.raises(JaxtuneError, match="context of 512"):
        sample_groups(params, CFG, prompts(), G, GREEDY.replace(max_new_tokens=510), pool=POOL)


def test_grpo_samples_with_the_engine_and_the_planner_counts_its_pages():
    """`[grpo] rollout_engine = "paged"`: GRPO's `sample_group` takes the engine's samples (with top_k = 1, the
    padded decode's, row for row), and the planner's rollout cache is the engine's pool as it sizes it by default:
    its pages x page size x layers x K x hd, keys and values (not rows x the whole row)."""
    from jaxtune.config import ForwardOptions
    from jaxtune.config.plan import TrainPlan
    from jaxtune.objectives.grpo import sample_group
    from jaxtune.objectives.rollout_config import GRPOConfig
    from jaxtune.planner.estimate import _rollout_kv
    from jaxtune.rollouts import PagePool, sample_groups

    cfg = tiny_config(vocab_size=259, eos_token_id=(2,), max_position_embeddings=128, initializer_range=0.3)
    params = init_params(cfg, jax.random.key(0))
    prompts = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 20]]
    paged = GRPOConfig(reward="x.y", group_size=2, max_new_tokens=12, top_k=1, rollout_engine="paged",
                       rollout_slots=4, rollout_page_size=4)
    rows, completions = sample_group(params, cfg, None, prompts, paged, 0, (2,))
    assert (rows, completions) == sample_group(params, cfg, None, prompts, replace(paged, rollout_engine="padded"),
                                               0, (2,))
    plan = TrainPlan(method_config("full"), 4, 28, 1, objective="grpo", generate_tokens=12,
                     section=replace(paged, group_size=4), forward=ForwardOptions(compute_dtype="float32"))
    engine = sample_groups(params, cfg, [list(range(1, 17))] * 1, 4, SamplingConfig(max_new_tokens=12),
                           pool=PagePool(4, 4))
    layer_page = 4 * cfg.num_kv_heads * cfg.head_dim * 4
    counted = _rollout_kv(cfg, plan, SimpleNamespace(b=4, kv_heads=cfg.num_kv_heads), lambda shape, i: i * prod(shape))
    assert counted == 2 * cfg.num_layers * engine.num_pages * layer_page
    padded = _rollout_kv(cfg, replace(plan, section=replace(paged, rollout_engine="padded")),
                         SimpleNamespace(b=4, kv_heads=cfg.num_kv_heads), lambda shape, i: i * prod(shape))
    assert padded == 2 * cfg.num_layers * 4 * 28 * cfg.num_kv_heads * cfg.head_dim * 4
