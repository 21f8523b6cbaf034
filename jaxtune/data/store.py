"""Tokenised examples kept on disk and read as they are used, so a dataset larger than memory trains.

    with StoreWriter(directory) as writer:               # tokens appended to each field's file every FLUSH_TOKENS
        for example in sft_examples("train.jsonl", tokenizer, 2048):
            writer.append(example)
    examples = TokenStore.open(directory)   # a Sequence[Example], memory-mapped; .lengths [N]; .take(indices) on disk

A field (`Example`: ids, loss_mask) is one flat file `<field>.bin` with offsets `<field>.offsets.npy` [N + 1], beside
`meta.json`: host memory is O(examples), not O(tokens); a batch's tokens are read when it is built.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from jaxtune.data.formats import DataStats, Example, LabelledExample, PreferenceExample

EXAMPLE_TYPES = {cls.__name__: cls for cls in (Example, PreferenceExample, LabelledExample)}
FLUSH_TOKENS = 1 << 18  # tokens a writer holds before appending them to its files
FIELD_FILE_DTYPES = {"loss_mask": np.uint8}  # a field's file dtype; int32 (token ids) where unnamed


class StoreWriter:
    """Appends examples (all of one type) to a store directory; `close()` (or leaving the `with`) writes the offsets
    and `meta.json` with `stats`, which make it a store. An unfinished directory has no meta.json."""

    def __init__(self, directory: str | Path, stats: DataStats | None = None):
        self.directory, self.stats = Path(directory), stats
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cls: type[Any] | None = None
        self.files: dict[str, BinaryIO] = {}
        self.pending: dict[str, list] = {}
        self.lengths: dict[str, list[int]] = {}
        self.held = 0

    def append(self, example) -> None:
        if self.cls is None:
            self.cls = type(example)
            for n in (f.name for f in dataclasses.fields(self.cls)):
                self.files[n], self.pending[n], self.lengths[n] = open(self.directory / f"{n}.bin", "wb"), [], []
        for n, pending in self.pending.items():
            values = getattr(example, n)
            pending.append(values)
            self.lengths[n].append(len(values))
            self.held += len(values)
        if self.held >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for n, pending in self.pending.items():
            if pending:
                count = sum(self.lengths[n][-len(pending):])
                values = itertools.chain.from_iterable(pending)
                self.files[n].write(np.fromiter(values, FIELD_FILE_DTYPES.get(n, np.int32), count).tobytes())
            self.pending[n] = []
        self.held = 0

    def close(self) -> None:
        if self.cls is None:
            raise ValueError(f"{self.directory}: a store needs at least one example")
        self._flush()
        for n, f in self.files.items():
            f.close()
            np.save(self.directory / f"{n}.offsets.npy", np.cumsum([0, *self.lengths[n]], dtype=np.int64))
        stats = dataclasses.asdict(self.stats) if self.stats is not None else None
        (self.directory / "meta.json").write_text(json.dumps({"type": self.cls.__name__, "stats": stats,
                                                              "count": len(next(iter(self.lengths.values())))}))

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is None:
            self.close()
        else:
            for f in self.files.values():
                f.close()


class StoreFiles:
    """A store's fields, memory-mapped: `values[name]` [total] and `offsets[name]` [N + 1]; one object shared by a
    store and every subset taken of it."""

    def __init__(self, values: dict, offsets: dict):
        self.values, self.offsets = values, offsets


class TokenStore(Sequence):
    """Examples read from a store's memory-mapped files: `store[i]` is an example of the store's type (tuples of
    ints), `lengths` the token count of each ([N], of the first field: an Example's ids)."""

    def __init__(self, cls: type, files: StoreFiles, indices: np.ndarray, stats: DataStats | None):
        self.cls, self.files, self.indices, self.stats = cls, files, indices, stats

    @classmethod
    def open(cls, directory: str | Path) -> TokenStore:
        directory = Path(directory)
        meta = json.loads((directory / "meta.json").read_text())
        example_type = EXAMPLE_TYPES[meta["type"]]
        names = [f.name for f in dataclasses.fields(example_type)]
        offsets = {n: np.load(directory / f"{n}.offsets.npy") for n in names}
        dtype = lambda n: FIELD_FILE_DTYPES.get(n, np.int32)
        values: dict[str, np.ndarray] = {
            n: np.memmap(directory / f"{n}.bin", dtype(n), "r") if offsets[n][-1] else np.zeros(0, dtype(n))
            for n in names}
        stats = DataStats(**meta["stats"]) if meta["stats"] is not None else None
        return cls(example_type, StoreFiles(values, offsets), np.arange(meta["count"]), stats)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        k = self.indices[i]
        offsets = self.files.offsets
        return self.cls(**{n: tuple(v[offsets[n][k]:offsets[n][k + 1]].tolist()) for n, v in self.files.values.items()})

    def take(self, indices: np.ndarray) -> TokenStore:
        """The examples at `indices` (positions in this store), without reading their tokens."""
        return TokenStore(self.cls, self.files, self.indices[np.asarray(indices, np.int64)], self.stats)

    @property
    def lengths(self) -> np.ndarray:
        """[N] tokens of each example's first field."""
        first = next(iter(self.files.offsets.values()))
        return (first[self.indices + 1] - first[self.indices]).astype(np.int64)


def example_lengths(examples: Sequence) -> np.ndarray:
    """[N] len(ids) of each example: a store's offsets, or the examples' own ids."""
    if isinstance(examples, TokenStore):
        return examples.lengths
    return np.fromiter((len(ex.ids) for ex in examples), np.int64, len(examples))
