"""Datasets in the forms people keep them: Parquet, Arrow, `datasets.save_to_disk` directories and gzipped JSONL give
the same examples and batches as the same rows in JSONL, with columns mapped by [data] columns."""

import gzip
import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.config import DataConfig
from jaxtune.data.batching import epoch_batches
from jaxtune.data.cache import cached_examples
from jaxtune.data.formats import load_preference_examples, load_sft_examples, preference_examples, sft_examples
from jaxtune.data.sources import read_records
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"
ROWS = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:40]]
CHATS = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
         for r in ROWS[:12]]
RENAMED = [{"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(ROWS)]
MAPPING = {"prompt": "question", "completion": "answer"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same rows as JSONL, .jsonl.gz, Parquet (columns renamed), an Arrow file and a save_to_disk directory."""
    root = tmp_path_factory.mktemp("sources")
    out = {"jsonl": write_jsonl(root / "rows.jsonl", ROWS), "chat_jsonl": write_jsonl(root / "chat.jsonl", CHATS)}
    with gzip.open(root / "rows.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    out["gz"] = root / "rows.jsonl.gz"
    pq.write_table(pa.Table.from_pylist(RENAMED), root / "renamed.parquet")
    out["parquet"] = root / "renamed.parquet"
    pq.write_table(pa.Table.from_pylist(CHATS), root / "chat.parquet")
    out["chat_parquet"] = root / "chat.parquet"
    datasets.Dataset.from_list(ROWS).save_to_disk(root / "saved", max_shard_size="2KB")  # several Arrow files
    out["saved"] = root / "saved"
    out["arrow"] = next((root / "saved").glob("data-00000-*.arrow"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(root / "dict")
    out["dict"] = root / "dict"
    return out


def test_every_source_gives_the_jsonl_examples_and_batches(files):
    tokenizer = Tokenizer.byte_level()
    expected, _ = load_sft_examples(files["jsonl"], tokenizer, 64)
    assert len(list((files["saved"]).glob("*.arrow"))) > 1
    for name, columns in (("gz", None), ("parquet", MAPPING), ("saved", None)):
        examples, stats = load_sft_examples(files[name], tokenizer, 64, columns)
        assert examples == expected, name
        batches = epoch_batches(examples, 4, 64, seed=0, epoch=1)
        for ours, theirs in zip(batches, epoch_batches(expected, 4, 64, seed=0, epoch=1)):
            assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
    first_file = load_sft_examples(files["arrow"], tokenizer, 64)[0]
    assert first_file == expected[:len(first_file)]
    chats = load_sft_examples(files["chat_jsonl"], tokenizer, 64)[0]
    assert load_sft_examples(files["chat_parquet"], tokenizer, 64)[0] == chats  # messages: a list of structs


@pytest.mark.full
def test_training_reads_a_parquet_file_through_mapped_columns(files, tmp_path):
    """`[data] columns = {prompt = "question", completion = "answer"}` in a run's TOML: the run trains on the
    Parquet file as on the JSONL one, loss for loss."""
    model = write_random_model(tmp_path / "model", "llama", seed=0)
    losses = {}
    for name, extra in (("jsonl", ""), ("parquet", 'columns = {prompt = "question", completion = "answer"}\n')):
        (tmp_path / f"{name}.toml").write_text(
            f'[model]\npath = "{model}"\n[method]\nkind = "lora"\n[data]\ntrain = "{files[name]}"\n'
            f'max_seq_len = 64\n{extra}[train]\noutput_dir = "{tmp_path / name}"\nmax_steps = 2\nbatch_size = 4\n'
            'log_every = 1\n')
        config = load_run_config(tmp_path / f"{name}.toml")
        fine_tune(config, log=lambda _: None)
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r]
    assert config.data.columns == (("completion", "answer"), ("prompt", "question"))
    assert len(list((tmp_path / "parquet" / "cache").glob("*/meta.json"))) == 1  # train (eval is a split of it)
    assert losses["parquet"] == losses["jsonl"] and len(losses["jsonl"]) == 2


def test_preference_pairs_from_parquet(tmp_path):
    pairs = [{"q": "Q: 2+2?\nA:", "good": " 4", "bad": " 5"}, {"q": "Q: 3+3?\nA:", "good": " 6", "bad": " 9"}]
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "pairs.parquet")
    tokenizer = Tokenizer.byte_level()
    ours = load_preference_examples(tmp_path / "pairs.parquet", tokenizer, 32,
                                    {"prompt": "q", "chosen": "good", "rejected": "bad"})[0]
    plain = [{"prompt": p["q"], "chosen": p["good"], "rejected": p["bad"]} for p in pairs]
    assert ours == load_preference_examples(write_jsonl(tmp_path / "pairs.jsonl", plain), tokenizer, 32)[0]


def test_bad_sources_name_the_file_and_column(files, tmp_path):
    with pytest.raises(JaxtuneError, match=r"renamed.parquet: no column 'prompt_text' \(mapped to 'prompt' by "
                                           r"\[data\] columns\); columns: answer, id, question"):
        read_records(files["parquet"], {"prompt": "prompt_text"})
    with pytest.raises(JaxtuneError, match=r"dict: a DatasetDict; give one split's directory \(train\)"):
        read_records(files["dict"])
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(JaxtuneError, match="broken.parquet: not a readable parquet file"):
        read_records(tmp_path / "broken.parquet")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(JaxtuneError, match="broken.jsonl.gz: cannot be read"):
        read_records(tmp_path / "broken.jsonl.gz")
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    with pytest.raises(JaxtuneError, match="bad.jsonl.gz:2: invalid JSON"):
        read_records(tmp_path / "bad.jsonl.gz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(JaxtuneError, match="empty: not a dataset directory"):
        read_records(tmp_path / "empty")
    with pytest.raises(ConfigError, match="maps 'question', not a field of ours"):
        DataConfig(columns={"question": "q"})


def test_tokenised_examples_are_cached_beside_the_run(files, tmp_path, monkeypatch):
    """Tokenised once: the second read of the same inputs comes from the cache (the tokenizer is not called) and
    equals the first; a changed file, max_seq_len, column map or tokenizer is tokenised afresh; a run's cache lives
    in its directory, and a resumed run reads it."""
    tokenizer, cache = Tokenizer.byte_level(), tmp_path / "cache"
    cached = lambda *args: (lambda store, stats: (list(store), stats))(*cached_examples(cache, *args))
    first = cached(sft_examples, files["parquet"], tokenizer, 64, MAPPING)
    assert len(list(cache.glob("*/meta.json"))) == 1

    def no_tokenizing(*_, **__):
        raise AssertionError("tokenised again")

    with monkeypatch.context() as patch:
        patch.setattr(type(tokenizer.backend), "encode_batch", no_tokenizing)
        assert cached(sft_examples, files["parquet"], tokenizer, 64, MAPPING) == first
    pairs = [{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}]
    pair_file = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    pair_store = cached(preference_examples, pair_file, tokenizer, 32)
    assert pair_store == cached(preference_examples, pair_file, tokenizer, 32)
    assert pair_store == load_preference_examples(pair_file, tokenizer, 32)
    cached(sft_examples, files["parquet"], tokenizer, 48, MAPPING)
    cached(sft_examples, files["jsonl"], tokenizer, 64)
    assert len(list(cache.glob("*/meta.json"))) == 4
    changed = write_jsonl(tmp_path / "rows.jsonl", ROWS[:10])
    assert cached(sft_examples, changed, tokenizer, 64) == load_sft_examples(changed, tokenizer, 64)
    write_jsonl(changed, ROWS[:20])  # the same path, new content: a new size and modification time
    assert cached(sft_examples, changed, tokenizer, 64) == load_sft_examples(changed, tokenizer, 64)
