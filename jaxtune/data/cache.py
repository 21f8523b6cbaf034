"""Tokenised examples kept beside the run, so a re-run or a resume does not tokenise its data again.

    examples, stats = cached_examples(run_dir / "cache", sft_examples, "train.parquet", tokenizer, 512, columns)

An entry is named by a hash of everything the examples depend on: the loader, the data files (path, size and
modification time; every file of a directory), `columns`, `max_seq_len` and the tokenizer (its whole
`tokenizer.json`, special ids and chat template). It is a `data.store` (tokenised a chunk at a time straight into
its files, read back memory-mapped), built under a temporary name and renamed into place whole, so processes
loading at once never read a partial one; given `deferred`, it is moved there only once the run starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from jaxtune.data.formats import DataStats
from jaxtune.data.sources import source_files
from jaxtune.data.store import StoreWriter, TokenStore
from jaxtune.data.tokenizer import Tokenizer


def _fingerprint(stream, path: Path, tokenizer: Tokenizer, max_seq_len: int, columns) -> str:
    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in source_files(path)]
    vocab = hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()
    key = [2, stream.__module__, stream.__name__, stamp, sorted((columns or {}).items()), max_seq_len, vocab,
           tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.chat_template]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def cached_examples(cache_dir: str | Path | None, stream, path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                    columns=None, log=None, deferred: list | None = None) -> tuple:
    """(examples, stats) of `stream(path, tokenizer, max_seq_len, columns, stats)` (`data.formats.sft_examples` or
    `preference_examples`): a `TokenStore` read from `cache_dir` when these inputs were tokenised before, else
    streamed into a new store there, or, given `deferred`, into a temporary directory that a function appended to
    `deferred` moves there (so the run's directory is written only once the run starts). No cache_dir: a list."""
    if cache_dir is None or not source_files(path):  # the loader names a missing file
        stats = DataStats()
        return list(stream(path, tokenizer, max_seq_len, columns, stats)), stats
    final = Path(cache_dir) / _fingerprint(stream, Path(path), tokenizer, max_seq_len, columns)
    if (final / "meta.json").is_file():
        if log:
            log(f"data: {path} read from its tokenised cache {final}")
        store = TokenStore.open(final)
        return store, store.stats
    if deferred is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f"{final.name}.", suffix=".partial", dir=final.parent))
    else:
        building = Path(tempfile.mkdtemp(prefix="jaxtune-data-"))
    stats = DataStats()
    try:
        with StoreWriter(building, stats) as writer:
            for example in stream(path, tokenizer, max_seq_len, columns, stats):
                writer.append(example)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    if deferred is None:
        _publish(building, final)
        return TokenStore.open(final), stats
    store = TokenStore.open(building)  # memory-mapped: the files stay readable once moved (or removed)
    # once no store reads them and they were not moved (the run never started), the files go
    weakref.finalize(store.files, shutil.rmtree, building, True)
    deferred.append(lambda: _publish(building, final))
    return store, stats


def _publish(building: Path, final: Path) -> None:
    """Move a finished store into its place, unless another process published the same entry first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(building, final)
    except OSError:  # another process's entry is there, or another filesystem
        if not (final / "meta.json").is_file():
            shutil.copytree(building, final, dirs_exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)
