"""Where examples come from: JSONL (plain or gzip), Parquet, Arrow, or a `datasets.Dataset.save_to_disk` directory.

    records = read_records("train.parquet", columns={"prompt": "question", "completion": "answer"})
    # [(row number, {"prompt": ..., "completion": ...}), ...]: the same records the JSONL file would give

Every source gives (position, record) pairs, position a line number for JSONL and a 1-based row number for tables,
so errors name "file:position". `columns` maps our field names to the dataset's column names where they differ
(only the mapped columns are renamed; the others keep their names). Parquet and Arrow are read with pyarrow; a
`save_to_disk` directory is its `state.json`'s Arrow files in order (a `DatasetDict` directory names its splits).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from pathlib import Path

from jaxtune.errors import JaxtuneError

TABLE_SUFFIXES = (".parquet", ".arrow")


def json_type(value) -> str:
    """A Python value's JSON type name, for error messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def _jsonl_lines(path: Path):
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError as e:
        raise JaxtuneError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile, a truncated stream
        raise JaxtuneError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    records = []
    for n, line in _jsonl_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise JaxtuneError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise JaxtuneError(f"{path}:{n}: expected a JSON object, got {json_type(record)}")
        records.append((n, record))
    return records


def _arrow_table(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all()  # what `datasets` writes
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise JaxtuneError(f"{path}: not a readable {path.suffix[1:]} file ({e})") from None


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


def _read_table(path: Path) -> list[tuple[int, dict]]:
    import pyarrow as pa

    files = _saved_dataset_files(path) if path.is_dir() else [path]
    table = pa.concat_tables([_arrow_table(f) for f in files]) if len(files) > 1 else _arrow_table(files[0])
    return list(enumerate(table.to_pylist(), 1))


def _renamed(path: Path, records: list[tuple[int, dict]], columns: Mapping[str, str]) -> list[tuple[int, dict]]:
    present = set().union(*(r.keys() for _, r in records[:1000]))
    for ours, theirs in columns.items():
        if theirs not in present:
            raise JaxtuneError(f"{path}: no column {theirs!r} (mapped to {ours!r} by [data] columns); columns: "
                               f"{', '.join(sorted(present))}")
    rename = {theirs: ours for ours, theirs in columns.items()}
    return [(n, {rename.get(k, k): v for k, v in r.items()}) for n, r in records]


def read_records(path: str | Path, columns: Mapping[str, str] | None = None) -> list[tuple[int, dict]]:
    """(line or row number, record) for every example of a JSONL (.jsonl, .jsonl.gz), Parquet or Arrow file or a
    `save_to_disk` directory, with `columns` ({our name: theirs}) renamed; errors name the file and the line."""
    path = Path(path)
    if not path.exists():
        raise JaxtuneError(f"{path}: data file not found")
    records = _read_table(path) if path.is_dir() or path.suffix in TABLE_SUFFIXES else _read_jsonl(path)
    if not records:
        raise JaxtuneError(f"{path}: no examples")
    return _renamed(path, records, columns) if columns else records
