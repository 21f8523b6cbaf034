"""The images a record holds, in TRL's vision formats: `"images"` (a list) or `"image"` (one), each a path relative to
the data file's directory (or absolute), raw bytes, or `{"bytes", "path"}` as `datasets`' Image feature stores them in
Parquet and Arrow; and the `{"type": "image"}` parts of its messages (or prompt / completion) they fill, in order.
`record_images` decodes them with Pillow, in full (a truncated file fails here, not mid-run), each failure one line
naming the file, the record's position, the key and the image."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from jaxtune.errors import JaxtuneError
from jaxtune.io import storage
from jaxtune.io.storage import is_url


def image_parts(value) -> int:
    """The `{"type": "image"}` parts in a message list, one message, or a prompt / completion (text: 0)."""
    if isinstance(value, list):
        return sum(map(image_parts, value))
    if isinstance(value, dict):
        if value.get("type") == "image":
            return 1
        return image_parts(value.get("content", []))
    return 0


OTHER_MEDIA = ("audio", "audios", "video", "videos", "input_audio")  # parts' types and records' keys


def other_media(value) -> str | None:
    """What in a record (or a message, a part) is neither text nor an image: `key 'audio'`, `a part of type
    'audio'`; None if nothing."""
    if isinstance(value, list):
        return next(filter(None, map(other_media, value)), None)
    if not isinstance(value, dict):
        return None
    if value.get("type") in OTHER_MEDIA:
        return f"a part of type {value['type']!r}"
    key = next((k for k in OTHER_MEDIA if k in value), None)
    if key is not None:
        return f"key {key!r}"
    return next(filter(None, map(other_media, (value.get(k) for k in ("messages", "prompt", "completion", "chosen",
                                                                        "rejected", "content")))), None)


def image_references(record: dict, where: str) -> list:
    """The record's images as it gives them (`images` a list, or `image` one; none: []), not yet read."""
    if "images" in record and "image" in record:
        raise JaxtuneError(f"{where}: both \"images\" and \"image\"; give one")
    value = record.get("images", [record["image"]] if "image" in record else [])
    if value is None:
        return []
    if not isinstance(value, list):
        raise JaxtuneError(f"{where}: \"images\" must be a list (of paths or image bytes), got {type(value).__name__}")
    return value


def _decoded(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise JaxtuneError(f"{what}: not an image Pillow can read ({type(e).__name__}: {e})") from None
    return image


def image_base(data_path: str | Path) -> str | Path:
    """Where a dataset's relative image paths start: its directory, or the directory (or bucket prefix) of its file."""
    if is_url(data_path):
        return storage.parent(str(data_path))
    return Path(data_path) if Path(data_path).is_dir() else Path(data_path).parent


def read_image(reference, base: str | Path, what: str) -> Image.Image:
    """One image: a path (relative to `base`, a directory or a bucket URL) or a URL, bytes, or `{"bytes", "path"}`
    (bytes first, as `datasets` reads)."""
    if isinstance(reference, dict):
        if reference.get("bytes") is not None:
            return _decoded(bytes(reference["bytes"]), what)
        reference = reference.get("path")
    if isinstance(reference, (bytes, bytearray, memoryview)):
        return _decoded(bytes(reference), what)
    if not isinstance(reference, str) or not reference:
        raise JaxtuneError(f"{what}: expected a path, image bytes or {{\"bytes\", \"path\"}}, got {reference!r:.60}")
    if is_url(reference) or (is_url(base) and not reference.startswith("/")):
        url = reference if is_url(reference) else storage.join(str(base), reference)
        with storage.open_url(url) as f:
            return _decoded(f.read(), f"{what} ({url})")
    path = Path(reference).expanduser()
    path = path if path.is_absolute() else Path(base) / path
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise JaxtuneError(f"{what}: {path} not found") from None
    except OSError as e:
        raise JaxtuneError(f"{what}: {path} cannot be read ({e.strerror})") from None
    return _decoded(data, f"{what} ({path})")


def record_images(record: dict, where: str, base: str | Path, parts: int) -> list[Image.Image]:
    """The record's images, read: `where` names the record ("data.jsonl:7"), `base` the directory relative paths
    start from, `parts` the image parts its text holds (`image_parts`), which must be as many."""
    media = other_media(record)
    if media:
        raise JaxtuneError(f"{where}: {media}: jaxtune trains on text and images (a model's audio tower and video "
                           "are left)")
    references = image_references(record, where)
    if len(references) != parts:
        raise JaxtuneError(f"{where}: {len(references)} image{'s' * (len(references) != 1)} for {parts} "
                           f"{{\"type\": \"image\"}} part{'s' * (parts != 1)} in the text; give one image per part")
    key = "images" if "images" in record else "image"
    return [read_image(r, base, f"{where}: {key}[{i}]" if key == "images" else f"{where}: image")
            for i, r in enumerate(references)]
