"""What a resumed run may change (`check_resume`), and the record a run directory keeps of every config it ran with.

A resume continues the same run: the data order, the model and what trains must be those its checkpoint was saved
with. Settings that only steer the steps still to come (schedule, length, eval/checkpoint/log cadence) or where the
arrays live (mesh, offload, remat, attention kernel) may change (`RESUMABLE`); each change is logged, recorded in
metrics.jsonl at its step, and the config from that step on kept as `config-step-N.toml` beside `config.toml`
(`record_config`; `run_config_at` reads the one a step ran with). Any other change is refused in one line naming
the keys.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import method_unit
from jaxtune.objectives import objective_named
from jaxtune.run_config import RunConfig, dump_run_config, load_run_config

RESUMABLE = frozenset({
    "train.epochs", "train.max_steps", "train.learning_rate", "train.schedule", "train.warmup_steps",
    "train.min_lr_ratio", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints", "train.log_every",
    "train.report_to", "train.push_to_hub", "train.profile_steps", "train.progress_every_s",
    "train.max_nonfinite_steps",
    "model.remat", "model.attention", "model.context_attention", "model.tiled_mlp", "offload.optimizer_state",
    "offload.frozen_params", "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.context", "mesh.tensor"})
NOT_COMPARED = frozenset({"train.resume_step", "train.output_dir"})  # how to find the run, not what it is


def check_resume(saved: dict, current: dict, where) -> dict[str, tuple]:
    """{"section.key": (saved value, this run's)} of the settings that differ from those the checkpoint at `where`
    was saved with (`saved`, flattened as `run_config.config_items` gives them); a JaxtuneError naming those that a
    resume may not change."""
    changed = {k: (saved[k], v) for k, v in current.items()
               if k in saved and k not in NOT_COMPARED and _as_now(saved[k], v) != v}
    refused = {k: c for k, c in changed.items() if k not in RESUMABLE}
    if refused:
        keys = "; ".join(f"{k} = {json.dumps(a)} there, {json.dumps(b)} here" for k, (a, b) in refused.items())
        raise JaxtuneError(f"{where} was saved by a run with another config ({keys}): resuming would not continue the "
                           "same run. Keep those settings (a resume may change the learning-rate schedule, epochs, "
                           "max_steps, the eval/checkpoint/log cadence, the mesh, offload and remat), or choose a new "
                           "train.output_dir")
    return changed


def _as_now(saved, current):
    """A string saved for a key that is now a list (`[grpo] reward`) reads as the loader reads it: a list of one."""
    return ([saved] if saved else []) if isinstance(saved, str) and isinstance(current, list) else saved


def record_config(run_dir: Path, config: RunConfig, start: int, changes: dict) -> None:
    """config.toml for a run starting at step 0; config-step-N.toml for a resume at N that changed settings."""
    if start == 0:
        (run_dir / "config.toml").write_text(dump_run_config(config))
    elif changes:
        (run_dir / f"config-step-{start}.toml").write_text(dump_run_config(config))


def run_config_at(run_dir: str | Path, step: int) -> RunConfig:
    """The config a run directory's step `step` was trained with: the latest config-step-N.toml with N < step
    (N <= step for step 0), else config.toml."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise JaxtuneError(f"{run_dir}: not a run directory (no config.toml)")
    later = sorted((int(p.stem.removeprefix("config-step-")), p) for p in run_dir.glob("config-step-*.toml")
                   if p.stem.removeprefix("config-step-").isdigit())
    chosen = [p for n, p in later if n < step]
    return load_run_config(chosen[-1] if chosen else run_dir / "config.toml")


def export_hint(run_dir: Path, config: RunConfig, step: int) -> str:
    """How to get a result out of the run's checkpoint at `step`, as a clause for a message."""
    merged = method_unit(config.method).trains_base or objective_named(config.train.objective).export is not None
    target = "--merged OUT" if merged else "--peft OUT"
    return f"`jaxtune export --run {run_dir} --step {step} {target}` writes its result"
