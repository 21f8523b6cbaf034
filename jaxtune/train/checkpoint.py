"""Orbax checkpoints of the train state, with the data position, kept K at a time.

Orbax writes each step into a temporary directory and renames it when complete, so a checkpoint either exists
whole or not at all; an interrupted write leaves nothing a resume would pick up. A checkpoint that exists but
cannot be read (a damaged disk, a file deleted by hand) is reported with its step and the steps still there,
so the run can be pointed at the previous one with `--set train.resume_step=N`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxtune.errors import JaxtuneError


class Checkpoints:
    """Save and restore `(state, meta)` pairs under `directory/<step>/`; `meta` is a small JSON dict."""

    def __init__(self, directory: str | Path, keep: int):
        """directory: a local path, or a "gs://bucket/..." URL that orbax writes to directly (needs gcsfs:
        `pip install 'etils[epath-gcs]'`)."""
        remote = "://" in str(directory)
        self.directory = epath.Path(str(directory) if remote else Path(directory).absolute())
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """The state (with the shardings and dtypes of `abstract_state`) and meta saved at `step`."""
        if step not in self.steps():
            raise JaxtuneError(f"{self.directory}: no checkpoint for step {step} (have: {self.steps() or 'none'})")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            others = [s for s in self.steps() if s != step]
            hint = f"; use an earlier one with --set train.resume_step={others[-1]}" if others else ""
            first_line = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise JaxtuneError(f"{self.directory / str(step)}: checkpoint for step {step} is unreadable "
                               f"({first_line}){hint}") from None
        return restored["state"], restored["meta"]

    def discard_after(self, step: int) -> None:
        """Delete the checkpoints of steps after `step`: a run resumed from an earlier step replaces them."""
        for later in [s for s in self.steps() if s > step]:
            self.manager.delete(later)

    def close(self) -> None:
        self.manager.close()
