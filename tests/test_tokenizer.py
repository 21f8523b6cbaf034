"""Tokenizers give transformers' ids and special tokens, from the model's own files."""

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxtune.data.tokenizer import Tokenizer, load_tokenizer
from jaxtune.errors import JaxtuneError

TEXTS = ["Hello world!", "  leading spaces and\nnewlines\t", "ünïcödé — 漢字 🙂", "", "The quick brown fox " * 5]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer", "instruction: answer"] * 20


def write_bpe_tokenizer(directory, with_bos: bool):
    """A byte-level BPE trained on a small corpus; BOS added by the post-processor (Llama 3 style) or not (Qwen2)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|begin|>", "<|end|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    if with_bos:
        backend.post_processor = processors.TemplateProcessing(single="<|begin|> $A", pair="<|begin|> $A $B",
                                                               special_tokens=[("<|begin|>", 0)])
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "pad_token": "<|pad|>",
              "bos_token": "<|begin|>" if with_bos else None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.reference
@pytest.mark.parametrize("with_bos", [True, False])
def test_ids_and_special_tokens_equal_transformers(tmp_path, with_bos):
    import transformers

    write_bpe_tokenizer(tmp_path, with_bos)
    ours, theirs = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.bos_id == (0 if with_bos else None)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs(text, add_special_tokens=special).input_ids
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.reference
def test_byte_level_tokenizer_round_trips_and_loads_in_transformers(tmp_path):
    import transformers

    ours = Tokenizer.byte_level()
    ours.save(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.vocab_size == 259
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == ours.bos_id == theirs.bos_token_id
        assert ids[1:] == [3 + b for b in text.encode()]
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == text


def test_model_without_tokenizer_gets_the_byte_level_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (1, 2, 0, 259)


def test_ids_from_config_when_tokenizer_config_is_silent(tmp_path):
    write_bpe_tokenizer(tmp_path, with_bos=False)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 1)


def test_bad_tokenizer_files_are_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(JaxtuneError, match="tokenizer.json: not a readable tokenizer"):
        load_tokenizer(tmp_path)
    write_bpe_tokenizer(tmp_path, with_bos=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nowhere|>"}))
    with pytest.raises(JaxtuneError, match="eos_token '<|nowhere|>' is not in tokenizer.json's vocabulary"):
        load_tokenizer(tmp_path)
