"""What a run reports besides `metrics.jsonl`: TensorBoard event files, a W&B run, progress lines for logs, phase times.

    trackers = Trackers(("tensorboard", "wandb"), run_dir, config_toml)   # run_dir/tensorboard, run_dir/wandb
    trackers.write({"step": 10, "loss": 2.3, ...})                        # every number of a record, as a scalar
    progress = ProgressLines(total_steps, first_step, log)                # where stderr is not a terminal (CI, pods)
    progress.update(step, loss, tokens_per_s)                             # a line every `every_s`, with an ETA

TensorBoard files come from the `tensorboard` package's own event writer (no TensorFlow), the config as text; W&B
gets the config's sections and is offline (run_dir/wandb, for `wandb sync`) unless credentials or WANDB_MODE say.
"""

from __future__ import annotations

import json
import time
import tomllib
import warnings
from collections.abc import Sequence
from pathlib import Path

from jaxtune.errors import JaxtuneWarning


class Trackers:
    """The run's reporters (`[train] report_to`): each record's numbers logged under their metric names. A reporter
    whose package is not installed is a warning (the run goes on with metrics.jsonl), not a stop: neither package
    is a dependency of jaxtune."""

    def __init__(self, kinds: Sequence[str], run_dir: str | Path, config_text: str):
        self._writers = []
        makers = {"tensorboard": lambda: _tensorboard_writer(Path(run_dir) / "tensorboard", config_text),
                  "wandb": lambda: _wandb_writer(Path(run_dir), config_text)}
        for kind in kinds:
            try:
                self._writers.append(makers[kind]())
            except ImportError:
                warnings.warn(f"train.report_to = {json.dumps(list(kinds))}: the {kind} package is not installed "
                              f"(pip install {kind}); this run reports to metrics.jsonl without it", JaxtuneWarning,
                              stacklevel=2)

    def write(self, record: dict) -> None:
        for writer in self._writers:
            writer(record)

    def close(self) -> None:
        for writer in self._writers:
            writer(None)
        self._writers = []


def _tensorboard_writer(directory: Path, config_text: str):
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(directory))
    text = Summary.Value(tag="config", metadata=SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name="text")), tensor=TensorProto(dtype=7, string_val=[config_text.encode()],  # 7: DT_STRING
                                                 tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])))
    writer.add_event(Event(wall_time=time.time(), step=0, summary=Summary(value=[text])))

    def write(record: dict | None) -> None:
        if record is None:
            writer.close()
            return
        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in _numbers(record).items()]
        writer.add_event(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))
        writer.flush()

    return write


def _numbers(record: dict) -> dict:
    """A metrics record's scalars: every number but the step (a bool is no scalar)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _wandb_writer(run_dir: Path, config_text: str):
    import wandb

    settings = wandb.setup().settings  # WANDB_* variables and wandb's settings files (`wandb offline`)
    # Without credentials wandb.init would stop asking for an API key. The process goes offline, not only the run:
    # wandb's own telemetry follows the process-wide mode and would otherwise contact the server.
    if settings.mode == "online" and not wandb.login(prompt=False, verify=False):
        wandb.setup(wandb.Settings(mode="offline"))
    # silent, console off: `train`'s own output stays as it is; W&B gets the records, not a copy of stdout.
    run = wandb.init(project=settings.project or "jaxtune", name=run_dir.name, dir=run_dir,
                     config=tomllib.loads(config_text), settings=wandb.Settings(silent=True, console="off"))

    def write(record: dict | None) -> None:
        if record is None:
            run.finish()
        else:
            run.log(_numbers(record), step=int(record["step"]))

    return write


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s")


class ProgressLines:
    """A progress line every `every_s` seconds (and at the last step): step, loss, tokens/s, elapsed and ETA,
    for logs where tqdm's bar would be one unreadable line."""

    def __init__(self, total: int, first: int, log, every_s: float = 10.0):
        self.total, self.first, self.log, self.every_s = total, first, log, every_s
        self.started = self.last = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s and step != self.total:
            return
        self.last = now
        done = step - self.first
        eta = (now - self.started) / max(done, 1) * (self.total - step)
        self.log(f"step {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%): loss {loss:.4f}, "
                 f"{tokens_per_s:.0f} tokens/s, {_duration(now - self.started)} elapsed, ETA {_duration(eta)}")
