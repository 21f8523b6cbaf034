"""JSONL formats give transformers' ids with the loss on responses only; packed batches are exact and fixed-shape."""

import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxtune.config import tiny_config
from jaxtune.data.batching import count_epoch_batches, epoch_batches, pack_rows
from jaxtune.data.formats import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    Example,
    load_preference_examples,
    load_sft_examples,
    render_chat,
    train_eval_split,
)
from jaxtune.data.sources import read_records
from jaxtune.data.tokenizer import Tokenizer, load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, what is the answer?", "### Response:"] * 20
CHATML = (
    "{{ bos_token }}{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must start with a user or system message') }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": " the answer is 42 \n"},
    {"role": "user", "content": "and the fox?"},
    {"role": "assistant", "content": "jumps over the lazy dog"},
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(ours, transformers') for a trained byte-level BPE with a BOS post-processor and a ChatML template."""
    import transformers

    directory = tmp_path_factory.mktemp("bpe")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|begin|>", "<|end|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>", "eos_token": "<|end|>",
              "pad_token": "<|pad|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def trained_runs(example: Example) -> list[list[int]]:
    """The ids of each maximal run of loss-masked tokens."""
    runs, current = [], []
    for token, m in zip(example.ids, example.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return runs + ([current] if current else [])


@pytest.mark.reference
@pytest.mark.parity
def test_prompt_completion_and_alpaca_ids_equal_transformers(tmp_path, bpe):
    ours, theirs = bpe
    records = [{"prompt": "hello world, ", "completion": "what is the answer?"},
               {"prompt": "", "completion": "the lazy dog"},
               {"instruction": "Answer.", "input": "the quick fox", "output": "jumps"},
               {"instruction": "Say hello", "output": "hello world"}]
    examples, stats = load_sft_examples(write_jsonl(tmp_path / "d.jsonl", records), ours, max_seq_len=512)
    prompts = ["hello world, ", "", ALPACA_PROMPT.format(instruction="Answer.", input="the quick fox"),
               ALPACA_PROMPT_NO_INPUT.format(instruction="Say hello")]
    completions = ["what is the answer?", "the lazy dog", "jumps", "hello world"]
    for ex, prompt, completion in zip(examples, prompts, completions):
        p = theirs(prompt).input_ids
        c = theirs(completion, add_special_tokens=False).input_ids + [theirs.eos_token_id]
        assert p[0] == theirs.bos_token_id
        assert list(ex.ids) == p + c
        assert list(ex.loss_mask) == [0] * len(p) + [1] * len(c)
    assert stats.formats == {"prompt/completion": 2, "alpaca": 2}
    assert stats.examples == 4 and stats.loss_tokens == sum(sum(ex.loss_mask[1:]) for ex in examples)


@pytest.mark.reference
@pytest.mark.parity
def test_chat_equals_apply_chat_template_with_loss_on_assistant_turns(tmp_path, bpe):
    ours, theirs = bpe
    assert render_chat(CHAT[:2], ours, add_generation_prompt=True) == theirs.apply_chat_template(
        CHAT[:2], tokenize=False, add_generation_prompt=True)
    (ex,), stats = load_sft_examples(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]), ours, 512)
    assert list(ex.ids) == theirs.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    runs = [ours.decode(run, skip_special_tokens=False) for run in trained_runs(ex)]
    assert runs == ["the answer is 42<|im_end|>", "jumps over the lazy dog<|im_end|>"]
    assert stats.formats == {"chat": 1}


def test_default_chat_template_without_a_model_template(tmp_path):
    tok = Tokenizer.byte_level()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (ex,), _ = load_sft_examples(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok, 64)
    assert tok.decode(ex.ids, skip_special_tokens=False) == "<s><|user|>\nhi</s>\n<|assistant|>\nyo</s>\n"
    assert [tok.decode(r, skip_special_tokens=False) for r in trained_runs(ex)] == ["yo</s>"]


def test_max_seq_len_drops_long_prompts_and_truncates_completions(tmp_path):
    tok = Tokenizer.byte_level()  # one token a byte, after BOS
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "abc", "completion": "de"},  # 4 + 3 tokens
                                              {"prompt": "abcdef", "completion": "g"},  # 7 + 2
                                              {"prompt": "a", "completion": ""}])  # 2 + 1
    examples, stats = load_sft_examples(path, tok, max_seq_len=5)
    assert [list(ex.ids) for ex in examples] == [[1, *(3 + b for b in b"abcd")], [1, 3 + ord("a"), 2]]
    assert [list(ex.loss_mask) for ex in examples] == [[0, 0, 0, 0, 1], [0, 0, 1]]
    assert (stats.examples, stats.dropped_prompt_too_long, stats.truncated, stats.loss_tokens) == (2, 1, 1, 2)
    _, stats = load_sft_examples(path, tok, max_seq_len=7)
    assert (stats.examples, stats.dropped_prompt_too_long, stats.truncated) == (2, 1, 0)
    with pytest.raises(JaxtuneError, match=r"d.jsonl: no example fits max_seq_len=2 \(3 prompts too long\)"):
        load_sft_examples(path, tok, max_seq_len=2)


@pytest.mark.reference
def test_preference_examples(tmp_path, bpe):
    ours, theirs = bpe
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello", "chosen": "world", "rejected": "the lazy dog"}])
    (ex,), stats = load_preference_examples(path, ours, 512)
    assert list(ex.prompt) == theirs("hello").input_ids
    assert list(ex.chosen) == theirs("world", add_special_tokens=False).input_ids + [theirs.eos_token_id]
    assert list(ex.rejected) == theirs("the lazy dog", add_special_tokens=False).input_ids + [theirs.eos_token_id]
    (short,), stats = load_preference_examples(path, ours, len(ex.prompt) + 2)
    assert short.chosen == ex.chosen[:2] and short.rejected == ex.rejected[:2] and stats.truncated == 1


CHAT_OK = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
BAD_SFT = [
    (['{"prompt": "a", "completion": "b"}', '{"prompt": "a",'], "d.jsonl:2: invalid JSON"),
    (["[1, 2]"], "d.jsonl:1: expected a JSON object, got array"),
    ([{"instruction": "x", "input": "y"}], "d.jsonl:1: alpaca record is missing field 'output'"),
    ([{"instruction": "x", "output": 3}], "d.jsonl:1: alpaca field 'output' must be a string, got number"),
    (["", {"prompt": "x"}], "d.jsonl:2: prompt/completion record is missing field 'completion'"),
    ([{"prompt": ["x"], "completion": "y"}], "d.jsonl:1: prompt/completion field 'prompt' must be a string"),
    ([{"messages": "hi"}], "d.jsonl:1: chat field 'messages' must be a non-empty array, got string"),
    ([CHAT_OK, {"messages": [{"role": "user"}]}], "d.jsonl:2: chat record is missing field 'messages[0].content'"),
    ([{"messages": [{"role": "user", "content": 1}]}], "d.jsonl:1: chat field 'messages[0].content' must be a string"),
    ([{"messages": [{"role": "user", "content": "q"}]}], "d.jsonl:1: chat record has no assistant message"),
    ([{"prompt": "x", "chosen": "y", "rejected": "z"}], "d.jsonl:1: a preference record"),
    ([{"text": "x"}], "d.jsonl:1: unknown record with keys ['text']"),
    (["", "  "], "d.jsonl: no examples"),
]


@pytest.mark.parametrize("lines, message", BAD_SFT)
def test_bad_sft_data_names_file_line_and_field(tmp_path, lines, message):
    with pytest.raises(JaxtuneError, match=re.escape(message)):
        load_sft_examples(write_jsonl(tmp_path / "d.jsonl", lines), Tokenizer.byte_level(), 64)


@pytest.mark.reference
def test_other_bad_inputs(tmp_path, bpe):
    with pytest.raises(JaxtuneError, match="nowhere.jsonl: data file not found"):
        read_records(tmp_path / "nowhere.jsonl")
    pairs = [{"prompt": "x", "chosen": "y", "rejected": "z"}, {"prompt": "x", "chosen": "y"}]
    path = write_jsonl(tmp_path / "p.jsonl", pairs)
    with pytest.raises(JaxtuneError, match=re.escape("p.jsonl:2: preference record is missing field 'rejected'")):
        load_preference_examples(path, Tokenizer.byte_level(), 64)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "assistant", "content": "a"}]}])
    with pytest.raises(JaxtuneError, match="c.jsonl:1: chat template: Conversations must start with a user"):
        load_sft_examples(path, bpe[0], 64)


def random_examples(n: int, seed: int, max_len: int = 12) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(2, max_len + 1))
        prompt = int(rng.integers(1, length))
        ids = tuple(int(t) for t in rng.integers(3, 259, length))
        out.append(Example(ids, (0,) * prompt + (1,) * (length - prompt)))
    return out


def unpack(batch: dict) -> list[tuple[tuple, tuple]]:
    """(ids, loss_mask[1:]) of every packed example, checking the row layout on the way."""
    found = []
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        used = int((seg > 0).sum())
        assert (seg[used:] == 0).all() and (seg[:used] > 0).all(), "padding only at the end of a row"
        assert all(batch[k][r, used:].sum() == 0 for k in batch), "padding is zeros"
        assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all() and (used == 0 or seg[0] == 1)
        for s in range(1, int(seg.max(initial=0)) + 1):
            sel = np.flatnonzero(seg == s)
            assert (batch["positions"][r, sel] == np.arange(len(sel))).all()
            assert (batch["input_ids"][r, sel[1:]] == batch["labels"][r, sel[:-1]]).all()
            ids = (*batch["input_ids"][r, sel].tolist(), int(batch["labels"][r, sel[-1]]))
            found.append((ids, tuple(batch["loss_mask"][r, sel].astype(int).tolist())))
    return found


def test_packing_places_every_example_once_without_crossing_rows():
    examples = random_examples(40, seed=0)
    rows = pack_rows(examples, seq_len=16)
    assert {k: (v.dtype, v.shape[1]) for k, v in rows.items()} == {
        "input_ids": (np.int32, 16), "labels": (np.int32, 16), "loss_mask": (np.float32, 16),
        "segment_ids": (np.int32, 16), "positions": (np.int32, 16)}
    assert collections.Counter(unpack(rows)) == collections.Counter((ex.ids, ex.loss_mask[1:]) for ex in examples)
    total = sum(len(ex.ids) - 1 for ex in examples)
    assert rows["input_ids"].shape[0] <= total // 16 + 3  # packed tightly
    with pytest.raises(JaxtuneError, match="does not fit seq_len=10"):
        pack_rows(examples, seq_len=10)


def test_packed_logits_equal_each_example_alone():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))
    examples = random_examples(7, seed=1, max_len=14)
    rows = pack_rows(examples, seq_len=24)
    fwd = jax.jit(forward, static_argnames="cfg")
    packed = np.asarray(fwd(params, jnp.asarray(rows["input_ids"]), cfg, positions_BxT=jnp.asarray(rows["positions"]),
                            segment_ids_BxT=jnp.asarray(rows["segment_ids"])))
    # Alone: one example a row, right-padded (causal attention: padding after a token never changes its logits).
    longest = max(len(ex.ids) for ex in examples) - 1
    alone_ids = np.zeros((len(examples), longest), np.int32)
    for k, ex in enumerate(examples):
        alone_ids[k, :len(ex.ids) - 1] = ex.ids[:-1]
    alone = np.asarray(fwd(params, jnp.asarray(alone_ids), cfg))
    by_ids = {ex.ids[:-1]: k for k, ex in enumerate(examples)}
    checked = 0
    for r in range(rows["input_ids"].shape[0]):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            sel = np.flatnonzero(rows["segment_ids"][r] == s)
            k = by_ids[tuple(rows["input_ids"][r, sel].tolist())]
            np.testing.assert_allclose(packed[r, sel], alone[k, :len(sel)], atol=1e-5)
            checked += 1
    assert checked == len(examples) and rows["input_ids"].shape[0] < len(examples)


@pytest.mark.parametrize("pack", [True, False])
def test_epoch_batches_are_deterministic_fixed_shape_and_complete(pack):
    examples = random_examples(30, seed=2)
    want = collections.Counter((ex.ids, ex.loss_mask[1:]) for ex in examples)
    steps = count_epoch_batches(examples, batch_size=4, seq_len=16, pack=pack)
    orders = []
    for epoch in range(3):
        batches = epoch_batches(examples, batch_size=4, seq_len=16, seed=7, epoch=epoch, pack=pack)
        assert len(batches) == steps
        assert all(v.shape == (4, 16) for b in batches for v in b.values())
        found = [x for b in batches for x in unpack(b)]
        assert collections.Counter(found) == want
        if not pack:
            assert all(b["segment_ids"].max() <= 1 for b in batches)
        again = epoch_batches(examples, batch_size=4, seq_len=16, seed=7, epoch=epoch, pack=pack)
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, again) for k in a)
        orders.append(found)
    assert orders[0] != orders[1] and orders[1] != orders[2]
    unpacked_steps = -(-30 // 4)
    assert steps < unpacked_steps if pack else steps == unpacked_steps


def test_train_eval_split():
    items = list(range(50))
    train, evals = train_eval_split(items, 0.1, seed=3)
    assert len(evals) == 5 and sorted(train + evals) == items and train == sorted(train)
    assert train_eval_split(items, 0.1, seed=3) == (train, evals)
    assert train_eval_split(items, 0.1, seed=4)[1] != evals
    assert train_eval_split(items, 0.0, seed=3) == (items, [])
    assert len(train_eval_split(items, 0.001, seed=3)[1]) == 1
    with pytest.raises(JaxtuneError, match="eval_fraction=1.0 must be in"):
        train_eval_split(items, 1.0, seed=3)
