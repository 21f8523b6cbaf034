"""What a run reports besides metrics.jsonl: TensorBoard event files read back by tensorboard's own reader, an offline
W&B run read back from its transaction log, progress lines where stderr is not a terminal, per-phase times, and a
jax.profiler trace of chosen steps."""

import json
import sys
from pathlib import Path

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto.wandb_internal_pb2 import Record

from jaxtune.config import TrainConfig
from jaxtune.errors import ConfigError, JaxtuneWarning
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune
from jaxtune.train.tracking import Trackers

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


def _train(tmp_path: Path, train_toml: str, log=lambda line: None) -> list[dict]:
    """Four LoRA steps on a tiny random Llama, evaluated every 2; metrics.jsonl's records."""
    model = write_random_model(tmp_path / "model", "llama", seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{model}"\n[method]\nkind = "lora"\n[data]\ntrain = "{data}"\nmax_seq_len = 64\n'
        f'[train]\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 4\nbatch_size = 4\nlog_every = 1\n'
        f'eval_every = 2\n{train_toml}')
    fine_tune(load_run_config(tmp_path / "run.toml"), log=log)
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.full
def test_tensorboard_progress_phases_and_profile(tmp_path):
    lines = []
    records = _train(tmp_path, 'report_to = ["tensorboard"]\nprofile_steps = [2, 3]\nprogress_every_s = 1e-6\n',
                     lines.append)

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    for tag in ("loss", "grad_norm", "eval_loss", "time_step_s"):
        logged = [(r["step"], r[tag]) for r in records if tag in r]
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [s for s, _ in logged] and logged
        assert [v for _, v in read] == pytest.approx([v for _, v in logged], rel=1e-6)
    config = events.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert 'report_to = ["tensorboard"]' in config

    train = [r for r in records if "loss" in r]
    assert all(r[f"time_{phase}_s"] >= 0 for r in train for phase in ("data", "step", "eval", "checkpoint"))
    assert sum(r["time_step_s"] for r in train) > 0 and any(r["time_eval_s"] > 0 for r in records)
    progress = [line for line in lines if "/4 (" in line]
    assert [line.split()[1] for line in progress] == ["1/4", "2/4", "3/4", "4/4"]
    assert all("tokens/s" in line and "ETA" in line for line in progress)
    assert any(line.startswith("loading ") for line in lines) and any("compile included" in line for line in lines)
    assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))


def _wandb_records(path: Path) -> list[Record]:
    """The records of a W&B transaction log (`run-*.wandb`): a 7-byte header (":W&B", magic, version), then the
    LevelDB log format (github.com/google/leveldb/blob/main/doc/log_format.md): 32 KiB blocks of chunks, each
    crc32c (4) length (2, little-endian) type (1: full, 2: first, 3: middle, 4: last), a record split over chunks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's zero-filled trailer
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(Record.FromString(pending))
    return records


def _items(items) -> dict:
    """A history or config record's items: their key (or key path, joined by ".") -> their value."""
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    """No API key, login or chosen mode anywhere wandb looks, so the run must go offline; the process-wide wandb
    setup is torn down around the test so neither this test nor another sees the other's settings."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR",
                 "WANDB_BASE_URL", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    for name, value in (("HOME", home), ("NETRC", home / ".netrc"), ("WANDB_CONFIG_DIR", home / "config"),
                        ("WANDB_CACHE_DIR", home / "cache"), ("WANDB_DATA_DIR", home / "data")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings of the repository
    wandb.teardown()
    yield
    wandb.teardown()


@pytest.mark.full
def test_wandb_offline_run_matches_metrics(tmp_path, no_wandb_credentials):
    records = _train(tmp_path, 'report_to = ["wandb"]\n')
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    logged = _wandb_records(log)

    rows = {}  # step -> the numbers of every metrics record at that step, as W&B merges them
    for r in records:
        rows.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step" and not isinstance(v, bool)})
    history = {}
    for r in logged:
        if r.WhichOneof("record_type") == "history":
            items = _items(r.history.item)
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert history == rows and any("loss" in row for row in rows.values())

    (run,) = [r.run for r in logged if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "run" and run.project == "jaxtune"
    config = _items(run.config.update)
    assert config["model"]["path"] == str(tmp_path / "model")
    assert config["train"]["learning_rate"] == 2e-4 and config["train"]["report_to"] == ["wandb"]


@pytest.mark.parametrize("missing", ["wandb", "tensorboard"])
def test_a_missing_tracker_package_is_a_warning_and_the_others_still_report(tmp_path, monkeypatch, missing):
    """Neither package is a dependency: a config that names one (the README's example names tensorboard) runs
    without it, with one warning, and the reporters that are installed still get every record."""
    for name in [m for m in sys.modules if m.split(".")[0] == missing] + [missing]:
        monkeypatch.setitem(sys.modules, name, None)  # what `import wandb` meets where it is not installed
    with pytest.warns(JaxtuneWarning, match=rf"the {missing} package is not installed \(pip install {missing}\)"):
        trackers = Trackers(("wandb", "tensorboard") if missing == "wandb" else (missing,), tmp_path, "")
    trackers.write({"step": 1, "loss": 2.5})
    trackers.close()
    if missing == "wandb":
        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        assert [e.value for e in events.Scalars("loss")] == [2.5]


def test_tracking_config_errors():
    with pytest.raises(ConfigError, match="report_to"):
        TrainConfig(report_to=("mlflow",))
    with pytest.raises(ConfigError, match=r"profile_steps.*needs \[first, last\]"):
        TrainConfig(profile_steps=(3, 2))
