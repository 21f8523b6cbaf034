"""Paths that are URLs: `gs://bucket/...` and any other fsspec URL (`memory://`, `file://`, `s3://` with s3fs), read
and written through fsspec so that a reader never sees a difference from a local disk.

    is_url("gs://b/m"); size(url); read_range(url, start, n)   # CheckpointReader's headers and tensors, by range
    open_url(url, "rb")                    # a data file streamed (JSONL, Parquet), an image beside it
    local_model_dir(url)                   # a model's small files copied once a process, its weights left there
    upload_tree(local_dir, url); download_tree(url, local_dir)   # a run directory's files to and from the bucket
    upload(local, url)                     # an export's file or directory
A missing object is one JaxtuneError naming the URL; a scheme whose fsspec package is absent names its install.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, TypeGuard

from jaxtune.errors import JaxtuneError

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
INSTALL = {"gs": "pip install jaxtune[gcs]", "gcs": "pip install jaxtune[gcs]", "s3": "pip install s3fs",
           "az": "pip install adlfs", "abfs": "pip install adlfs"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")  # read by range, never copied
_mirrors: dict[str, Path] = {}  # model URL -> this process's copy of its small files
_uploaded: dict[tuple[str, str], tuple[int, int]] = {}  # (local file, url) -> (size, mtime_ns) when last uploaded


def is_url(path: Any) -> TypeGuard[str]:
    return isinstance(path, str) and URL.match(path) is not None


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, the path within it) of `url`; an unknown scheme or a missing package is one line."""
    import fsspec

    scheme = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        raise JaxtuneError(f"{url}: reading {scheme}:// needs its fsspec package: "
                           f"{INSTALL.get(scheme, f'install the fsspec implementation of {scheme}://')}") from None
    except ValueError as e:
        raise JaxtuneError(f"{url}: {e}") from None


def join(base: str, *names: str) -> str:
    return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])


def parent(url: str) -> str:
    head, _, rest = url.partition("://")
    return f"{head}://{rest.rstrip('/').rsplit('/', 1)[0]}" if "/" in rest.rstrip("/") else url


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def size(url: str) -> int:
    fs, path = filesystem(url)
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        raise JaxtuneError(f"{url}: not found") from None


def read_range(url: str, start: int, length: int) -> bytes:
    """`length` bytes of `url` from byte `start` (one ranged request on a bucket)."""
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path, start=start, end=start + length)
    except FileNotFoundError:
        raise JaxtuneError(f"{url}: not found") from None


def open_url(url: str, mode: str = "rb", **options) -> IO:
    """`url` opened for streaming (read ahead in blocks, never fetched whole); options: fsspec's (`compression`,
    `encoding`, ...)."""
    fs, path = filesystem(url)
    if "r" in mode and not fs.isfile(path):
        raise JaxtuneError(f"{url}: not found")
    return fs.open(path, mode, **options)


def local_model_dir(url: str) -> Path:
    """A local directory holding `url`'s files other than weights (config.json, tokenizer, chat template,
    preprocessor config, the weight index), copied once a process and removed at its exit; `remote_of` maps its
    weight files back to the bucket."""
    if url in _mirrors:
        return _mirrors[url]
    fs, path = filesystem(url)
    if not fs.isdir(path):
        raise JaxtuneError(f"{url}: model directory not found" if not fs.exists(path) else
                           f"{url}: expected a model directory (config.json + *.safetensors), found a file")
    mirror = Path(tempfile.mkdtemp(prefix="jaxtune-model-"))
    atexit.register(shutil.rmtree, mirror, True)
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry["type"] == "file" and not name.endswith(WEIGHT_SUFFIXES):
            (mirror / name).write_bytes(fs.cat_file(entry["name"]))
    _mirrors[url] = mirror
    return mirror


def remote_of(local: Path) -> str | None:
    """The URL of a `local_model_dir` copy, or of a file named inside one (its weights are there only); None for
    any other path."""
    for url, mirror in _mirrors.items():
        if local == mirror:
            return url
        if local.parent == mirror:
            return join(url, local.name)
    return None


def upload_tree(local_dir: Path, url: str, skip: tuple[str, ...] = (), remove_others: bool = True) -> None:
    """Copy `local_dir`'s files to `url` (same relative names), those changed since this process last uploaded
    them; top-level entries named in `skip` stay local. remove_others: a file there that `local_dir` no longer has
    (an old checkpoint orbax dropped) is removed."""
    fs, root = filesystem(url)
    listed = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.relative_to(local_dir).parts[0] not in skip)
    for path in listed:
        relative = path.relative_to(local_dir)
        stat = path.stat()
        key, stamp = (str(path), url), (stat.st_size, stat.st_mtime_ns)
        if _uploaded.get(key) == stamp:
            continue
        fs.makedirs(join(root, *relative.parts[:-1]), exist_ok=True)
        fs.put_file(str(path), join(root, relative.as_posix()))
        _uploaded[key] = stamp
    if remove_others and fs.isdir(root):
        names = {p.relative_to(local_dir).as_posix() for p in listed}
        for remote in fs.find(root):
            relative = remote[len(root.rstrip("/")) + 1:]
            if relative.split("/", 1)[0] not in skip and relative not in names:
                fs.rm_file(remote)


def download_tree(url: str, local_dir: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy `url`'s files (a run directory in the bucket) into `local_dir`, those not there already with that size;
    top-level entries named in `skip` stay there."""
    fs, root = filesystem(url)
    if not fs.isdir(root):
        return
    for remote, info in fs.find(root, detail=True).items():
        relative = remote[len(root.rstrip("/")) + 1:]
        target = local_dir / relative
        if relative.split("/", 1)[0] in skip or (target.is_file() and target.stat().st_size == info["size"]):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
        stat = target.stat()
        _uploaded[(str(target), url)] = (stat.st_size, stat.st_mtime_ns)


def upload(local: Path, url: str) -> None:
    """A file, or a directory's files, copied to `url` (other files there kept)."""
    if local.is_dir():
        upload_tree(local, url, remove_others=False)
        return
    fs, path = filesystem(url)
    fs.makedirs(parent(path) if "/" in path.strip("/") else path, exist_ok=True)
    fs.put_file(str(local), path)


def local_path(url: str) -> str:
    """A `file://` URL's local path (what orbax writes to); any other URL as it is."""
    return url.removeprefix("file://") if url.startswith("file://") else url
