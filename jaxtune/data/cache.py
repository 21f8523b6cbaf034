"""Tokenised examples kept beside the run, so a re-run or a resume does not tokenise its data again.

    examples, stats = cached_examples(run_dir / "cache", load_sft_examples, "train.parquet", tokenizer, 512, columns)

The cache file's name is a hash of everything the examples depend on: the loader, the data files (path, size and
modification time, every Arrow file of a `save_to_disk` directory), `columns`, `max_seq_len` and the tokenizer
(its whole `tokenizer.json`, special ids and chat template), so a changed input is tokenised afresh. Each field of
the examples is stored as one concatenated int32 array with offsets (`.npz`), written to a temporary file and
renamed into place, so processes loading at once never read a partial file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from jaxtune.data.formats import DataStats, Example, PreferenceExample
from jaxtune.data.tokenizer import Tokenizer

EXAMPLE_TYPES = {cls.__name__: cls for cls in (Example, PreferenceExample)}


def _fingerprint(load, path: Path, tokenizer: Tokenizer, max_seq_len: int, columns) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    vocab = hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()
    key = [1, load.__module__, load.__name__, stamp, sorted((columns or {}).items()), max_seq_len, vocab,
           tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.chat_template]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def _save(file: Path, examples: list, stats: DataStats) -> None:
    cls = type(examples[0])
    arrays = {}
    for f in dataclasses.fields(cls):
        values = [getattr(e, f.name) for e in examples]
        arrays[f.name] = np.fromiter((x for v in values for x in v), np.int32)
        arrays[f.name + ".offsets"] = np.cumsum([0, *map(len, values)], dtype=np.int64)
    meta = {"type": cls.__name__, "stats": dataclasses.asdict(stats)}
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f"{file.stem}.{os.getpid()}.partial.npz")
    np.savez(partial, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    os.replace(partial, file)


def _load(file: Path) -> tuple[list, DataStats]:
    with np.load(file) as data:
        meta = json.loads(data["meta"].tobytes())
        cls = EXAMPLE_TYPES[meta["type"]]
        names = [f.name for f in dataclasses.fields(cls)]
        columns = {n: (data[n].tolist(), data[n + ".offsets"].tolist()) for n in names}
    count = len(columns[names[0]][1]) - 1
    examples = [cls(**{n: tuple(values[offsets[i]:offsets[i + 1]]) for n, (values, offsets) in columns.items()})
                for i in range(count)]
    return examples, DataStats(**meta["stats"])


def cached_examples(cache_dir: str | Path | None, load, path: str | Path, tokenizer: Tokenizer, max_seq_len: int,
                    columns=None, log=None, deferred: list | None = None) -> tuple[list, DataStats]:
    """`load(path, tokenizer, max_seq_len, columns)` (an SFT or preference loader of `data.formats`), read from
    `cache_dir` when these inputs were tokenised before, else loaded and written there (or, given `deferred`, a
    function that writes it appended there). No cache_dir: no cache."""
    if cache_dir is None or not Path(path).exists():  # the loader names a missing file
        return load(path, tokenizer, max_seq_len, columns)
    file = Path(cache_dir) / f"{_fingerprint(load, Path(path), tokenizer, max_seq_len, columns)}.npz"
    if file.is_file():
        if log:
            log(f"data: {path} read from its tokenised cache {file}")
        return _load(file)
    examples, stats = load(path, tokenizer, max_seq_len, columns)
    write = lambda: _save(file, examples, stats)
    if deferred is None:
        write()
    else:
        deferred.append(write)
    return examples, stats
