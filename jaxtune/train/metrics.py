"""`metrics.jsonl` (`MetricsLog`: one JSON object a line, cut back to the step a run resumes from) and the loss plot
drawn from it (`plot_losses`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

PHASES = ("data", "step", "eval", "checkpoint")  # where a step's wall time goes: time_{phase}_s in each record
WALL_CLOCK_FIELDS = ("tokens_per_s", *(f"time_{phase}_s" for phase in PHASES))  # differ between identical runs


class MetricsLog:
    """Appends records to a JSONL file. On resume from step S, records after S are dropped first, so the file
    of a resumed run reads like that of a run never interrupted. With `path=None` (the processes other than 0
    of a multi-process run) records are only kept in memory."""

    def __init__(self, path: str | Path | None, resume_step: int = 0):
        self.path = None if path is None else Path(path)
        self.kept: list[dict] = []
        if self.path is None:
            return
        kept = []
        if self.path.is_file() and resume_step > 0:
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.path is None:
            self.kept.append(record)
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def sync(self) -> None:
        """Make every record written so far durable (fsync): a checkpoint published after this has its lines."""
        if self.path is not None and self.path.exists():
            with self.path.open("a") as f:
                os.fsync(f.fileno())

    def has_eval(self, step: int) -> bool:
        """Whether an evaluation of `step` is recorded (any "eval_..." field)."""
        return any(r.get("step") == step and any(k.startswith("eval_") for k in r) for r in self.records())

    def records(self) -> list[dict]:
        if self.path is None:
            return list(self.kept)
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def perplexity(mean_loss: float) -> float:
    return math.exp(mean_loss) if mean_loss < 700 else math.inf


def plot_losses(records: list[dict], path: str | Path) -> Path:
    """Training loss per logged step and eval loss per evaluation, as a PNG; with `[eval] tasks`, their scores
    (`eval_<task>/<metric>`) per evaluation in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    task_keys = sorted({k for r in records for k in r if k.startswith("eval_") and "/" in k})
    fig, axes = plt.subplots(1, 2 if task_keys else 1, figsize=(12 if task_keys else 7, 4), squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train), label="train loss (completion tokens)")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("mean token loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    if task_keys:
        ax = axes[0, 1]
        for key in task_keys:
            ax.plot(*zip(*[(r["step"], r[key]) for r in records if key in r]), "o-", label=key.removeprefix("eval_"))
        ax.set_xlabel("step")
        ax.set_ylabel("task score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
