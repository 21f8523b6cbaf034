"""Where examples come from: JSONL (plain or gzip), Parquet, Arrow, or a `datasets.Dataset.save_to_disk` directory.

    records = iter_records("train.parquet", columns={"prompt": "question", "completion": "answer"})  # as consumed

Every source gives (position, record) pairs, position a line number for JSONL and a 1-based row number for tables,
so errors name "file:position". `columns` maps our field names to the dataset's column names where they differ.
Parquet and Arrow are read with pyarrow; a `save_to_disk` directory is its `state.json`'s Arrow files in order (a
`DatasetDict` directory names its splits); a glob (`data/train-*.parquet`, as a Hub dataset resolves to:
`jaxtune.hub`) is its matching tables in name order.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
from collections.abc import Mapping
from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.io import storage
from jaxtune.io.storage import is_url

TABLE_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024  # rows of a Parquet file read at a time


def json_type(value) -> str:
    """A Python value's JSON type name, for error messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def _text(path: Path | str):
    """A local file or a URL's object (streamed, `io.storage`) as text, gunzipped for a `.gz` name."""
    gzipped = str(path).endswith(".gz")
    if is_url(path):
        return storage.open_url(path, "rt", compression="gzip" if gzipped else None, encoding="utf-8")
    return (gzip.open if gzipped else open)(path, "rt", encoding="utf-8")


def _jsonl_lines(path: Path | str):
    try:
        with _text(path) as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError as e:
        raise JaxtuneError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile, a truncated stream
        raise JaxtuneError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def _jsonl_records(path: Path | str):
    for n, line in _jsonl_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise JaxtuneError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise JaxtuneError(f"{path}:{n}: expected a JSON object, got {json_type(record)}")
        yield n, record


def _record_batches(path: Path | str):
    """The record batches of a Parquet or Arrow file (local or a URL's, read by range), read one at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    suffix = "." + str(path).rsplit(".", 1)[-1]
    try:
        if suffix == ".parquet":
            with storage.open_url(path) if is_url(path) else open(path, "rb") as f:
                yield from pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS)
            return
        with storage.open_url(path) if is_url(path) else pa.memory_map(str(path)) as source:
            try:
                batches = pa.ipc.open_stream(source)  # what `datasets` writes
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from batches
    except (pa.ArrowInvalid, OSError) as e:
        raise JaxtuneError(f"{path}: not a readable {suffix[1:]} file ({e})") from None


def _saved_dataset_files(directory: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` directory, in order."""
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        raise JaxtuneError(f"{directory}: a DatasetDict; give one split's directory ({', '.join(splits)})")
    state = directory / "state.json"
    if not state.is_file():
        raise JaxtuneError(f"{directory}: not a dataset directory (no state.json, as `save_to_disk` writes)")
    try:
        files = [directory / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise JaxtuneError(f"{state}: not a dataset state ({type(e).__name__}: {e})") from None
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise JaxtuneError(f"{missing[0]}: file not found (listed in {state})")
    return files


def source_files(path: str | Path) -> list[Path]:
    """The files a data path reads: a glob's matches in name order (none: []), a file itself, a directory's files."""
    path = Path(path)
    if glob.has_magic(path.name):
        return sorted(path.parent.glob(path.name))
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path] if path.exists() else []


def _table_records(path: Path | str):
    if is_url(path):
        files: list = [path]
    else:
        path = Path(path)
        files = source_files(path) if glob.has_magic(path.name) else _saved_dataset_files(path) if path.is_dir() \
            else [path]
    n = 0
    for f in files:
        for batch in _record_batches(f):
            for record in batch.to_pylist():
                n += 1
                yield n, record


def _renamed(path: Path | str, records, columns: Mapping[str, str]):
    first = list(itertools.islice(records, 1000))
    present = set().union(*(r.keys() for _, r in first))
    for ours, theirs in columns.items():
        if first and theirs not in present:
            raise JaxtuneError(f"{path}: no column {theirs!r} (mapped to {ours!r} by [data] columns); columns: "
                               f"{', '.join(sorted(present))}")
    rename = {theirs: ours for ours, theirs in columns.items()}
    for n, r in itertools.chain(first, records):
        yield n, {rename.get(k, k): v for k, v in r.items()}


def iter_records(path: str | Path, columns: Mapping[str, str] | None = None):
    """(line or row number, record) for every example of a JSONL (.jsonl, .jsonl.gz), Parquet or Arrow file or a
    `save_to_disk` directory, read as they are consumed (a file larger than memory streams through), with
    `columns` ({our name: theirs}) renamed; errors name the file and the line, an empty dataset included. A URL
    (`gs://`, any fsspec URL) names a JSONL, Parquet or Arrow file in a bucket, streamed; a local glob (a Hub
    dataset's shards) reads its files in name order as one table."""
    if is_url(path):
        if not storage.exists(str(path)):
            raise JaxtuneError(f"{path}: data file not found")
        table = str(path).endswith(TABLE_SUFFIXES)
    else:
        path = Path(path)
        if not (path.exists() or source_files(path)):
            found = "no file matches it" if glob.has_magic(path.name) else "data file not found"
            raise JaxtuneError(f"{path}: {found}")
        table = path.is_dir() or path.suffix in TABLE_SUFFIXES
    records = _table_records(path) if table else _jsonl_records(path)
    if columns:
        records = _renamed(path, records, columns)
    empty = True
    for item in records:
        empty = False
        yield item
    if empty:
        raise JaxtuneError(f"{path}: no examples")


def read_records(path: str | Path, columns: Mapping[str, str] | None = None) -> list[tuple[int, dict]]:
    """Every record of `iter_records`, in a list."""
    return list(iter_records(path, columns))
