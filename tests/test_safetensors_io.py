"""jaxtune's safetensors reader and writer against the safetensors library, numpy slicing and bad files."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from jaxtune.errors import JaxtuneError
from jaxtune.io.safetensors import INDEX_FILE, SINGLE_FILE, CheckpointReader, write_safetensors, write_weights


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": rng.standard_normal((6, 5, 7)).astype(np.float32),
        "b.weight": rng.standard_normal((9, 4)).astype(ml_dtypes.bfloat16),
        "c.bias": rng.standard_normal(3).astype(np.float16),
        "d.codes": rng.integers(0, 255, (5, 8), dtype=np.uint8),
        "e.q": rng.integers(-128, 127, (2, 3, 4, 5), dtype=np.int8),
        "f.count": np.array([3, 1 << 40], np.int64),
        "g.empty": np.zeros((0, 4), np.float32),
    }


def entries(values: dict[str, np.ndarray]) -> list:
    return [(name, v.shape, v.dtype, lambda v=v: v) for name, v in values.items()]


def as_numpy(t) -> np.ndarray:
    """A torch tensor's values (bfloat16 as ml_dtypes')."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.reference
def test_what_we_write_the_safetensors_library_reads(tmp_path):
    import torch
    from safetensors.torch import load_file

    dtypes = {np.dtype(np.float32): torch.float32, np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
              np.dtype(np.float16): torch.float16, np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8,
              np.dtype(np.int64): torch.int64}
    values = tensors()
    write_safetensors(tmp_path / SINGLE_FILE, entries(values), {"format": "pt"})
    loaded = load_file(tmp_path / SINGLE_FILE)
    assert set(loaded) == set(values)
    for name, v in values.items():
        assert loaded[name].dtype == dtypes[v.dtype] and tuple(loaded[name].shape) == v.shape
        np.testing.assert_array_equal(as_numpy(loaded[name]), v)


@pytest.mark.reference
def test_what_the_safetensors_library_writes_we_read(tmp_path):
    import torch
    from safetensors.torch import save_file

    values = tensors(1)
    save_file({name: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == ml_dtypes.bfloat16
               else torch.from_numpy(v) for name, v in values.items()}, tmp_path / SINGLE_FILE)
    with CheckpointReader(tmp_path) as reader:
        assert set(reader.names()) == set(values)
        for name, v in values.items():
            assert reader.shape(name) == v.shape and reader.dtype(name) == v.dtype
            got = reader.read(name)
            assert got.dtype == v.dtype
            np.testing.assert_array_equal(got, v)
        assert reader.bytes_read == sum(v.nbytes for v in values.values())


@pytest.mark.parametrize("index", [
    (slice(2, 4),), (slice(None), slice(1, 3)), (slice(1, 5), slice(None), slice(2, 6)),
    (slice(0, 6), slice(0, 5), slice(0, 7)), (slice(3, 3),), (slice(5, 9),), (slice(None), slice(4, 5), slice(6, 7)),
])
def test_a_slice_reads_exactly_its_bytes(tmp_path, index):
    """`read(name, index)` equals numpy's `tensor[index]`, and reads only those bytes (ranges past the end clip as
    numpy clips them)."""
    w = np.arange(6 * 5 * 7, dtype=np.float32).reshape(6, 5, 7)
    write_safetensors(tmp_path / SINGLE_FILE, entries({"w": w}))
    with CheckpointReader(tmp_path) as reader:
        got = reader.read("w", index)
        np.testing.assert_array_equal(got, w[index])
        assert reader.bytes_read == w[index].nbytes
    assert CheckpointReader.total_bytes_read >= w[index].nbytes


def test_sharded_weights_are_written_as_transformers_names_them_and_read_back(tmp_path):
    values = {f"model.layers.{i}.w": np.full((64, 64), i, np.float32) for i in range(5)}  # 16 KiB each
    write_weights(tmp_path, entries(values), max_shard_bytes=40_000)  # two tensors a shard
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in values.values())
    assert not (tmp_path / SINGLE_FILE).exists()
    with CheckpointReader(tmp_path) as reader:
        for name, v in values.items():
            assert reader.file_of(name).name == index["weight_map"][name]
            np.testing.assert_array_equal(reader.read(name, (slice(10, 20),)), v[10:20])
    write_weights(tmp_path, entries(values))  # one file now: the shards and their index are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]


def test_writing_calls_each_producer_once_in_order_and_checks_what_it_produced(tmp_path):
    calls = []

    def produce(name, value):
        calls.append(name)
        return value

    values = tensors(2)
    write_safetensors(tmp_path / "x.safetensors",
                      [(n, v.shape, v.dtype, lambda n=n, v=v: produce(n, v)) for n, v in values.items()])
    assert calls == list(values)
    with pytest.raises(ValueError, match=r"tensor b: produced float32\[2, 3\], declared float32\[3, 2\]"):
        write_safetensors(tmp_path / "y.safetensors", [("b", (3, 2), np.float32, lambda: np.zeros((2, 3), np.float32))])


def test_bad_files_name_the_file_and_the_problem(tmp_path):
    values = tensors(3)
    write_safetensors(tmp_path / SINGLE_FILE, entries(values))
    data = (tmp_path / SINGLE_FILE).read_bytes()
    with CheckpointReader(tmp_path) as reader, pytest.raises(JaxtuneError, match="tensor nope is not in the"):
        reader.read("nope")

    (tmp_path / SINGLE_FILE).write_bytes(data[:-10])
    with pytest.raises(JaxtuneError, match=rf"{SINGLE_FILE}: tensor \S+'s data ends at byte \d+, the file has"):
        CheckpointReader(tmp_path)

    (tmp_path / SINGLE_FILE).write_bytes(data[:5])
    with pytest.raises(JaxtuneError, match=rf"{SINGLE_FILE}: not a readable safetensors file \(only 5 bytes\)"):
        CheckpointReader(tmp_path)

    n = int.from_bytes(data[:8], "little")
    (tmp_path / SINGLE_FILE).write_bytes(data[:8] + b"{" * n + data[8 + n:])
    with pytest.raises(JaxtuneError, match=r"not a readable safetensors file \(invalid header"):
        CheckpointReader(tmp_path)

    header = json.loads(data[8:8 + n])
    header["a.weight"]["dtype"] = "F8_E5M2"
    text = json.dumps(header).encode()
    (tmp_path / SINGLE_FILE).write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(JaxtuneError, match="tensor a.weight has dtype 'F8_E5M2', which jaxtune cannot read"):
        CheckpointReader(tmp_path)

    (tmp_path / SINGLE_FILE).unlink()
    with pytest.raises(JaxtuneError, match=rf"no {SINGLE_FILE} or {INDEX_FILE} \(found: nothing\)"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(JaxtuneError, match=r"model-00001-of-00002.safetensors: file not found \(listed in"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(JaxtuneError, match=rf"{INDEX_FILE}: not a weight index"):
        CheckpointReader(tmp_path)


def test_a_float_checkpoint_read_by_shards_is_read_once(tmp_path):
    """The row slices of every tensor, read one after another, cover each byte once (what a sharded load does)."""
    values = {k: v for k, v in tensors(4).items() if v.ndim >= 2 and v.size}
    write_safetensors(tmp_path / SINGLE_FILE, entries(values))
    with CheckpointReader(tmp_path) as reader:
        for name, v in values.items():
            rows = v.shape[0]
            parts = [reader.read(name, (slice(a, min(a + 2, rows)),)) for a in range(0, rows, 2)]
            np.testing.assert_array_equal(np.concatenate(parts), v)
        assert reader.bytes_read == sum(math.prod(v.shape) * v.dtype.itemsize for v in values.values())
