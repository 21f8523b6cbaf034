"""Models, data and runs at fsspec URLs (`io.storage`): `memory://` and `file://` stand in for `gs://`, through the
same code, without network."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import fsspec
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from PIL import Image

from jaxtune.data.formats import load_sft_examples
from jaxtune.data.images import image_base, read_image
from jaxtune.data.sources import read_records
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.io import storage
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.models.llama import forward
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.spine.model import load_model
from jaxtune.train.export import export_run
from jaxtune.train.loop import fine_tune
from jaxtune.train.outputs import fetch_run_directory, run_directories, sync_run_directory

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"
ROWS = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:24]]


@pytest.fixture
def bucket():
    """A fresh `memory://` bucket (fsspec's in-memory filesystem is one per process: emptied after the test)."""
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/bucket"):
        fs.rm("/bucket", recursive=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("storage") / "model", "llama", seed=0, initializer_range=0.1)


def test_weights_in_a_bucket_are_read_by_range_without_a_local_copy(model, bucket, monkeypatch, tmp_path):
    """Every tensor read from `memory://` equals the disk's, each by ranged reads smaller than the file, every byte
    read once at most, and no temporary file of the weights' size made (the model's small files are copied)."""
    bucket.put(str(model), "/bucket/model", recursive=True)
    weights = (model / "model.safetensors").stat().st_size
    reads: list[int] = []
    cat_file = MemoryFileSystem.cat_file

    def counted(self, path, start=None, end=None, **kwargs):
        data = cat_file(self, path, start, end, **kwargs)
        if path.endswith(".safetensors"):
            reads.append(len(data))
        return data

    monkeypatch.setattr(MemoryFileSystem, "cat_file", counted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # whatever this process writes to a temporary file
    copied = storage.local_model_dir("memory://bucket/model")
    with CheckpointReader(copied) as remote, CheckpointReader(model) as disk:
        assert sorted(remote.names()) == sorted(disk.names())
        for name in disk.names():
            np.testing.assert_array_equal(remote.read(name), disk.read(name))
        whole = len(reads)
        assert len(reads) > 2 and max(reads) < weights and sum(reads) <= weights  # a header, then tensor by tensor
        matrix = "model.layers.0.self_attn.q_proj.weight"
        np.testing.assert_array_equal(remote.read(matrix, (slice(1, 3),)), disk.read(matrix)[1:3])
        # columns 5..8 of rows 2..9: one request for the span of the rows, as a bucket's latency dominates
        np.testing.assert_array_equal(remote.read(matrix, (slice(2, 10), slice(5, 9))), disk.read(matrix)[2:10, 5:9])
        assert len(reads) == whole + 2 and reads[-1] == (7 * disk.shape(matrix)[1] + 4) * 4
    assert sorted(os.listdir(copied)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= weights]


@pytest.mark.full
def test_a_model_from_memory_gives_the_disk_logits(model, bucket):
    bucket.put(str(model), "/bucket/logits", recursive=True)
    cfg, params = load_model("memory://bucket/logits", dtype=jnp.float32)
    disk_cfg, disk_params = load_model(model, dtype=jnp.float32)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 9)))
    assert cfg == disk_cfg
    np.testing.assert_array_equal(forward(params, tokens, cfg), forward(disk_params, tokens, disk_cfg))


def test_data_streamed_from_a_bucket_equals_the_local_files(tmp_path, bucket):
    """JSONL (plain and gzip) and Parquet read from `memory://` as from disk; an image named relative to the JSONL
    read from beside it in the bucket."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    Image.new("RGB", (5, 3), (200, 10, 30)).save(tmp_path / "red.png")
    bucket.put(str(tmp_path), "/bucket/data", recursive=True)
    with fsspec.open("memory://bucket/data/rows.jsonl.gz", "wt", compression="gzip") as f:
        f.write((tmp_path / "rows.jsonl").read_text())
    tokenizer = Tokenizer.byte_level()
    expected = load_sft_examples(tmp_path / "rows.jsonl", tokenizer, 64)[0]
    for name in ("rows.jsonl", "rows.jsonl.gz", "rows.parquet"):
        assert load_sft_examples(f"memory://bucket/data/{name}", tokenizer, 64)[0] == expected, name
    assert read_records("file://" + str(tmp_path / "rows.jsonl")) == read_records(tmp_path / "rows.jsonl")
    image = read_image("red.png", image_base("memory://bucket/data/rows.jsonl"), "rows.jsonl:1")
    assert image.size == (5, 3) and image.getpixel((0, 0)) == (200, 10, 30)


def test_missing_objects_and_schemes_are_one_line_naming_the_url(bucket, monkeypatch):
    with pytest.raises(JaxtuneError, match=r"^memory://bucket/none.jsonl: data file not found$"):
        read_records("memory://bucket/none.jsonl")
    with pytest.raises(JaxtuneError, match=r"^memory://bucket/absent: model directory not found$"):
        load_model("memory://bucket/absent")
    with pytest.raises(JaxtuneError, match=r"^memory://bucket/data/a.png: not found$"):
        read_image("a.png", "memory://bucket/data", "rows.jsonl:3")
    index = json.dumps({"weight_map": {"w": "a.safetensors"}}).encode()
    bucket.pipe("/bucket/listed/model.safetensors.index.json", index)
    with pytest.raises(JaxtuneError, match=r"^memory://bucket/listed/a.safetensors: file not found \(listed in"):
        CheckpointReader(storage.local_model_dir("memory://bucket/listed"))
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as where it is not installed: its import fails
    with pytest.raises(JaxtuneError, match=r"^gs://b/m: reading gs:// needs its fsspec package: pip install "
                                           r"jaxtune\[gcs\]$"):
        load_model("gs://b/m")
    with pytest.raises(JaxtuneError, match=r"^memory://bucket/m.gguf: a GGUF file is read from a local path"):
        load_model("memory://bucket/m.gguf")
    with pytest.raises(JaxtuneError, match=r"^nosuch://x: Protocol not known: nosuch$"):
        read_records("nosuch://x")


def test_a_run_directory_goes_to_its_url_and_comes_back(tmp_path, bucket, monkeypatch):
    """What the loop does at each checkpoint and at the start: the local copy's files (not the data cache) copied to
    the URL, a removed checkpoint removed there, and a fresh machine's copy fetched back."""
    monkeypatch.chdir(tmp_path)
    run_dir, checkpoints = run_directories("memory://bucket/runs/a/")
    assert (run_dir, checkpoints) == (Path("runs/bucket/runs/a"), Path("runs/bucket/runs/a/checkpoints"))
    assert run_directories("gs://b/r")[1] == "gs://b/r/checkpoints"
    staging = Path("runs") / str(tmp_path).strip("/") / "r"
    assert run_directories(f"file://{tmp_path}/r") == (staging, f"{tmp_path}/r/checkpoints")
    for name in ("config.toml", "metrics.jsonl", "checkpoints/2/state", "checkpoints/4/state", "cache/x/meta.json"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    sync_run_directory("memory://bucket/runs/a/", run_dir)
    shutil.rmtree(run_dir / "checkpoints/2")
    sync_run_directory("memory://bucket/runs/a/", run_dir)
    assert sorted(bucket.find("/bucket/runs/a")) == [f"/bucket/runs/a/{n}" for n in (
        "checkpoints/4/state", "config.toml", "metrics.jsonl")]
    shutil.rmtree("runs")
    fetch_run_directory("memory://bucket/runs/a/", run_dir)
    assert (run_dir / "checkpoints/4/state").read_text() == "checkpoints/4/state"
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()) == [
        "checkpoints/4/state", "config.toml", "metrics.jsonl"]
    # where orbax writes the checkpoints itself (gs://, file://), they are neither copied there nor fetched back
    sync_run_directory(f"file://{tmp_path}/r", run_dir)
    assert sorted(os.listdir(tmp_path / "r")) == ["config.toml", "metrics.jsonl"]
    (tmp_path / "r" / "checkpoints" / "6").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "6" / "state").write_text("6")
    fetch_run_directory(f"file://{tmp_path}/r", staging)
    assert sorted(os.listdir(staging)) == ["config.toml", "metrics.jsonl"]


def _write_config(path: Path, model: str, data: str, out: str, max_steps: int) -> Path:
    path.write_text(f'[model]\npath = "{model}"\n[method]\nkind = "lora"\nrank = 4\n[data]\ntrain = "{data}"\n'
                    f'max_seq_len = 64\neval_fraction = 0.25\n[train]\noutput_dir = "{out}"\nmax_steps = {max_steps}\n'
                    'batch_size = 4\nlearning_rate = 1e-2\nlog_every = 1\ncheckpoint_every = 2\n')
    return path


@pytest.mark.full
@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_run_reads_and_writes_a_bucket_and_resumes_from_it(model, tmp_path, bucket, monkeypatch, scheme):
    """Model and data read from `memory://`, the run written to `memory://` or `file://` (checkpoints by orbax, as
    to gs://): the same metrics and adapter as the local run; then, from a fresh working directory (a new machine),
    the same command with more steps resumes from the bucket's checkpoint, and the run exports by its URL."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    bucket.put(str(model), "/bucket/model", recursive=True)
    bucket.put(str(tmp_path / "rows.jsonl"), "/bucket/rows.jsonl")
    local = fine_tune(load_run_config(_write_config(tmp_path / "local.toml", str(model), str(tmp_path / "rows.jsonl"),
                                                    str(tmp_path / "local"), 4)), log=lambda _: None)
    out = "memory://bucket/run" if scheme == "memory" else f"file://{tmp_path}/bucket/run"
    fs, root = storage.filesystem(out)
    (tmp_path / "machine1").mkdir()
    monkeypatch.chdir(tmp_path / "machine1")
    remote = load_run_config(_write_config(tmp_path / "remote.toml", "memory://bucket/model",
                                           "memory://bucket/rows.jsonl", out, 4))
    result = fine_tune(remote, log=lambda _: None)
    assert result.train_loss == local.train_loss and result.eval_loss == local.eval_loss
    assert fs.cat_file(f"{root}/metrics.jsonl").decode().count("\n") == (local.run_dir / "metrics.jsonl").read_text(
    ).count("\n")
    assert fs.cat_file(f"{root}/adapter/adapter_model.safetensors") == (
        local.run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    assert json.loads(fs.cat_file(f"{root}/adapter/adapter_config.json"))["base_model_name_or_path"] == \
        "memory://bucket/model"
    assert fs.exists(f"{root}/checkpoints/4") and fs.exists(f"{root}/config.toml") and not fs.exists(f"{root}/cache")
    (tmp_path / "machine2").mkdir()
    monkeypatch.chdir(tmp_path / "machine2")
    lines: list[str] = []
    longer = _write_config(tmp_path / "longer.toml", "memory://bucket/model", "memory://bucket/rows.jsonl", out, 6)
    fine_tune(load_run_config(longer), log=lines.append)
    assert any(line.startswith("resumed from step 4") for line in lines)
    assert fs.exists(f"{root}/checkpoints/6")
    # `jaxtune export` of the run by its URL, from a third machine, to a URL
    (tmp_path / "machine3").mkdir()
    monkeypatch.chdir(tmp_path / "machine3")
    assert export_run(out, "peft", "memory://bucket/exported", step=4) == "memory://bucket/exported"
    assert bucket.cat_file("/bucket/exported/adapter_model.safetensors") == (
        local.run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
