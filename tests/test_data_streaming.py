"""A dataset larger than memory streams: its records are read, tokenised and written to a store a chunk at a time,
and a run's batches are built from the memory-mapped store as they are used, so host memory is O(examples), not
O(tokens). Measured with tracemalloc (numpy's buffers and Python's objects; a memory map's pages are not
allocations), against the in-memory loader on the same file; the store's batches equal the in-memory ones."""

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.data.batching import count_epoch_batches, epoch_batches
from jaxtune.data.cache import cached_examples
from jaxtune.data.formats import load_sft_examples, sft_examples, train_eval_split
from jaxtune.data.store import TokenStore
from jaxtune.data.tokenizer import Tokenizer

EXAMPLES, SEQ = 4000, 512


def _rows(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    sentence = lambda k: " ".join(rng.choice(words, k))
    return [{"prompt": sentence(int(rng.integers(5, 40))), "completion": sentence(int(rng.integers(20, 70)))}
            for _ in range(n)]


def _peak(fn):
    """(fn's result, the peak of memory allocated while it ran, in bytes)."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _stream_and_train(tmp_path, data, tokenizer):
    """What a run does with its data: tokenise into a store, split, build an epoch's plan and read a few batches."""
    store, stats = cached_examples(tmp_path / f"cache-{data.stem}", sft_examples, data, tokenizer, SEQ)
    train, held_out = train_eval_split(store, 0.05, seed=0)
    batches = epoch_batches(train, 8, SEQ, seed=0, epoch=1)
    for i in range(3):
        batches[i]
    return store, stats, train, held_out, batches


@pytest.mark.full
def test_a_large_dataset_streams_through_a_store(tmp_path):
    """Four times the data: the in-memory loader's peak grows with it (to four times the dataset's int32 ids), the
    store's does not (its constant: a chunk of records being tokenised, the writer's buffer; measured 11 and 12 MB
    against 27 and 100 MB in memory)."""
    tokenizer, peaks = Tokenizer.byte_level(), {}
    for n in (EXAMPLES, 4 * EXAMPLES):
        data = tmp_path / f"rows{n}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _rows(n)))
        (store, stats, train, held_out, batches), streamed = _peak(lambda: _stream_and_train(tmp_path, data, tokenizer))
        (examples, _), in_memory = _peak(lambda: load_sft_examples(data, tokenizer, SEQ))
        peaks[n] = streamed, in_memory, 4 * int(store.lengths.sum())
    (small, small_in_memory, _), (large, large_in_memory, large_bytes) = peaks.values()
    assert large_in_memory > 3 * small_in_memory and large_in_memory > 2 * large_bytes, peaks
    assert large < 1.25 * small and large < large_in_memory / 6, peaks

    # the same examples, split and batches as the in-memory path gives
    assert isinstance(store, TokenStore) and len(store) == stats.examples == 4 * EXAMPLES
    assert list(store) == examples
    train_list, held_out_list = train_eval_split(examples, 0.05, seed=0)
    assert list(train) == train_list and list(held_out) == held_out_list
    assert count_epoch_batches(train, 8, SEQ) == len(batches) == count_epoch_batches(train_list, 8, SEQ)
    for ours, theirs in zip(batches, epoch_batches(train_list, 8, SEQ, seed=0, epoch=1)):
        assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)


def test_parquet_is_read_a_record_batch_at_a_time(tmp_path):
    rows = _rows(3000)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "big.parquet", row_group_size=500)
    tokenizer = Tokenizer.byte_level()
    store, _ = cached_examples(tmp_path / "cache", sft_examples, tmp_path / "big.parquet", tokenizer, SEQ)
    (tmp_path / "same.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert list(store) == load_sft_examples(tmp_path / "same.jsonl", tokenizer, SEQ)[0]
