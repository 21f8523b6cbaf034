"""Rollout batches kept for the steps that take them later: GRPO's and RLOO's `num_iterations` > 1 (TRL's mu) and
`off_policy_steps` = 1 (one-step-off rollouts).

A batch is sampled at the first of its `num_iterations` steps, or one-step-off during the step before its own. A
resumed run cannot sample it again (the policy has moved on), so each batch is also written to the run's directory,
`<run>/cache/rollouts/<epoch>-<generation>.npz`, and a resumed run reads it back: the same batches as a run never
stopped. The newest `keep` are kept: two for num_iterations (checkpoints fall at multiples of it, `_prepare` checks,
or when stopped, the newest file then the one needed); one-step-off, those since the last periodic checkpoint too.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxtune.errors import JaxtuneError

KEEP = 2


class RolloutStore:
    """The rollout batch in use, in memory and (with a `directory`) on disk, by (epoch, generation)."""

    def __init__(self, directory: Path | None, keep: int = KEEP):
        self.directory, self.keep = directory, keep
        self.held: tuple[tuple[int, int], dict] | None = None

    def _path(self, epoch: int, generation: int) -> Path | None:
        return None if self.directory is None else self.directory / f"{epoch}-{generation}.npz"

    def put(self, epoch: int, generation: int, batch: dict) -> None:
        self.held = ((epoch, generation), batch)
        if self.directory is None:
            return
        path = self.directory / f"{epoch}-{generation}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # processes sharing the directory
        with open(partial, "wb") as f:
            np.savez(f, **batch)
        os.replace(partial, path)  # a file that exists is whole
        written = sorted(self.directory.glob("*-*.npz"), key=lambda p: tuple(int(x) for x in p.stem.split("-")))
        for old in written[:-self.keep]:
            old.unlink(missing_ok=True)  # another process may have removed it

    def find(self, epoch: int, generation: int) -> dict | None:
        """The batch of (epoch, generation), from memory or the run's directory; None if in neither."""
        if self.held is not None and self.held[0] == (epoch, generation):
            return self.held[1]
        path = self._path(epoch, generation)
        if path is None or not path.exists():
            return None
        with np.load(path) as stored:
            batch = {k: stored[k] for k in stored.files}
        self.held = ((epoch, generation), batch)
        return batch

    def get(self, epoch: int, generation: int, what: str) -> dict:
        """The batch of (epoch, generation), from memory or the run's directory; `what` names the step in the error
        when it is in neither."""
        batch = self.find(epoch, generation)
        if batch is None:
            path = self._path(epoch, generation)
            raise JaxtuneError(f"{what} reuses the rollouts sampled at the first of its num_iterations steps, which "
                               f"this process did not sample and {path or 'no run directory'} does not hold; resume "
                               "from a checkpoint at a multiple of num_iterations steps")
        return batch
