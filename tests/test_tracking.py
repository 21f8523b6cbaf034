"""What a run reports besides metrics.jsonl: TensorBoard event files read back by tensorboard's own reader, progress
lines where stderr is not a terminal, per-phase times, and a jax.profiler trace of chosen steps."""

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxtune.config import TrainConfig
from jaxtune.errors import ConfigError
from jaxtune.models.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


def test_tensorboard_progress_phases_and_profile(tmp_path):
    model = write_random_model(tmp_path / "model", "llama", seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{model}"\n[method]\nkind = "lora"\n[data]\ntrain = "{data}"\nmax_seq_len = 64\n'
        f'[train]\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 4\nbatch_size = 4\nlog_every = 1\n'
        'eval_every = 2\nreport_to = ["tensorboard"]\nprofile_steps = [2, 3]\nprogress_every_s = 1e-6\n')
    lines = []
    fine_tune(load_run_config(tmp_path / "run.toml"), log=lines.append)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

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


def test_tracking_config_errors():
    with pytest.raises(ConfigError, match="report_to"):
        TrainConfig(report_to=("wandb",))
    with pytest.raises(ConfigError, match=r"profile_steps.*needs \[first, last\]"):
        TrainConfig(profile_steps=(3, 2))
