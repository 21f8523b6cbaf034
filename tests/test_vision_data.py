"""Images in records (TRL's vision formats, `jaxtune.data.images`): paths relative to the data file, bytes and
`datasets`' {"bytes", "path"} (Parquet), counted against the text's image parts; a missing, undecodable or uncounted
image is one line naming the file, the position, the key and the image."""

import io

import numpy as np
import pytest
from PIL import Image

from jaxtune.data.images import image_parts, record_images
from jaxtune.data.sources import read_records
from jaxtune.errors import JaxtuneError

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red and blue."}]}]


def _png(colour, size=(9, 5), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, format="PNG")
    return out.getvalue()


def test_images_by_path_bytes_and_datasets_feature_read_in_order(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(_png((255, 0, 0)))
    record = {"messages": MESSAGES, "images": ["img/red.png", {"bytes": _png((0, 0, 255), (4, 6)), "path": "x.png"}]}
    assert image_parts(MESSAGES) == 2 and image_parts("plain text") == 0
    red, blue = record_images(record, "d.jsonl:1", tmp_path, 2)
    assert red.size == (9, 5) and np.asarray(red)[0, 0].tolist() == [255, 0, 0]
    assert blue.size == (4, 6) and np.asarray(blue)[0, 0].tolist() == [0, 0, 255]
    one = record_images({"prompt": [{"type": "image"}], "image": str(tmp_path / "img" / "red.png")}, "w", tmp_path, 1)
    assert one[0].size == (9, 5)  # "image": one, an absolute path


def test_parquet_rows_hold_image_bytes(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"prompt": ["a", "b"], "images": pa.array([[{"bytes": _png((1, 2, 3)), "path": None}],
                                                                [{"bytes": _png(9, mode="L"), "path": None}]],
                                                               pa.list_(image))})
    pq.write_table(table, tmp_path / "d.parquet")
    (_, first), (_, second) = read_records(tmp_path / "d.parquet")
    assert np.asarray(record_images(first, "d.parquet:1", tmp_path, 1)[0])[0, 0].tolist() == [1, 2, 3]
    assert record_images(second, "d.parquet:2", tmp_path, 1)[0].mode == "L"


@pytest.mark.parametrize("record, parts, message", [
    ({"images": ["missing.png"]}, 1, r"^d.jsonl:3: images\[0\]: .*missing.png not found$"),
    ({"images": ["bad.png"]}, 1, r"^d.jsonl:3: images\[0\] \(.*bad.png\): not an image Pillow can read"),
    ({"images": [{"bytes": b"\x89PNG\r\n\x1a\n" + b"\0" * 20}]}, 1, r"^d.jsonl:3: images\[0\]: not an image Pillow"),
    ({"images": ["a.png", "b.png"]}, 1, r"^d.jsonl:3: 2 images for 1 \{\"type\": \"image\"\} part in the text"),
    ({}, 2, r"^d.jsonl:3: 0 images for 2 "),
    ({"images": "a.png"}, 1, r"^d.jsonl:3: \"images\" must be a list"),
    ({"images": [7]}, 1, r"^d.jsonl:3: images\[0\]: expected a path, image bytes or"),
    ({"images": [], "image": "a.png"}, 0, "both"),
])
def test_a_bad_image_is_one_line(tmp_path, record, parts, message):
    (tmp_path / "bad.png").write_bytes(_png((0, 0, 0))[:40])  # truncated
    with pytest.raises(JaxtuneError, match=message):
        record_images(record, "d.jsonl:3", tmp_path, parts)
