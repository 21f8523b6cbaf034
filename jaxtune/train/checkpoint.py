"""Orbax checkpoints of the train state, with the data position, kept K at a time.

    ckpts = Checkpoints(run_dir / "checkpoints", keep=3)   # or gs://...; read_only=True beside a running run
    ckpts.save(step, state, meta); state, meta = ckpts.restore(ckpts.steps()[-1], abstract_state)

Orbax writes a step into a temporary directory and renames it when complete, so a checkpoint exists whole or not at
all. An unreadable one is reported with the steps still there (`--set train.resume_step=N`); one of other shapes
than the run's with the config keys that changed (`check_shapes`, against `meta["config"]`); a save that fails for
want of space or permission in one line naming the directory, the space needed and free, its partial step removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxtune.errors import JaxtuneError
from jaxtune.paths import NO_ROOM, free_bytes, human_bytes

STATE_SECTIONS = ("model", "method", "offload")  # config sections whose keys can change the train state's shapes


def _shapes(tree) -> dict[str, tuple]:
    """'path/to/leaf' -> (shape, dtype) of every array leaf of a state tree or of orbax's metadata of one."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    key = lambda path: "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return {key(path): (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in flat
            if hasattr(leaf, "shape")}


class Checkpoints:
    """Save and restore `(state, meta)` pairs under `directory/<step>/`; `meta` is a small JSON dict."""

    def __init__(self, directory: str | Path, keep: int, read_only: bool = False):
        """directory: a local path, or a "gs://bucket/..." URL that orbax writes to directly (`pip install
        jaxtune[gcs]`). read_only: only read (an export beside a running run, whose partial
        checkpoint a writer's start would remove)."""
        remote = "://" in str(directory)
        self.directory = epath.Path(str(directory) if remote else Path(directory).absolute())
        options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep, create=False,
                                               enable_async_checkpointing=False, cleanup_tmp_directories=not read_only,
                                               read_only=read_only, save_interval_steps=0 if read_only else 1)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        with _orbax_quiet():  # read_only: "Given directory is read only" is what was asked
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        needed = _local_bytes(state)
        free = None if "://" in str(self.directory) else free_bytes(self.directory)
        if free is not None and free < needed:  # refused before a write fails midway, leaving orbax's threads
            raise JaxtuneError(self._no_room(step, needed, free, "no space left on device"))
        try:
            with _orbax_quiet():  # a failed write is logged with tracebacks from orbax's threads, then raised here
                self.manager.save(step, args=args, force=True)
                self.manager.wait_until_finished()
        except Exception as e:  # tensorstore reports a full disk as ValueError("RESOURCE_EXHAUSTED: ...")
            reason = _write_failure(e)
            if reason is None:
                raise
            with _orbax_quiet(), contextlib.suppress(Exception):  # the other writes of the step end before we go on
                self.manager.close()
            self._remove_partial(step)
            free = None if "://" in str(self.directory) else free_bytes(self.directory)
            raise JaxtuneError(self._no_room(step, needed, free, reason)) from None

    def _no_room(self, step: int, needed: int, free: int | None, reason: str) -> str:
        kept = [s for s in self.steps() if s < step]
        shown_free = f", {human_bytes(free)} free" if free is not None else ""
        space = f" (a checkpoint takes about {human_bytes(needed)}{shown_free})"
        last = (f"the last complete checkpoint, step {kept[-1]}, is intact: make room and run the same command to "
                f"resume from it" if kept else "no earlier checkpoint exists")
        return f"{self.directory}: cannot write the checkpoint of step {step}: {reason}{space}; {last}"

    def _remove_partial(self, step: int) -> None:
        """Drop what a failed save of `step` left (orbax's temporary directory), freeing its space at once."""
        if "://" in str(self.directory) or not Path(str(self.directory)).is_dir():
            return
        for path in Path(str(self.directory)).iterdir():
            if path.name == str(step) or path.name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(path, ignore_errors=True)

    def saved_config(self, step: int) -> dict:
        """The flattened config ("section.key" -> value) the checkpoint of `step` was saved with ({} if unreadable)."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:  # unreadable: `restore` reports it with the step to fall back to
            return {}
        return meta.get("config", {})

    def restore_params(self, step: int, abstract_params: dict) -> dict:
        """Only the trainable params of the state saved at `step` (the optimizer's moments stay on disk), in the
        shardings and dtypes of `abstract_params`."""
        if step not in self.steps():
            raise JaxtuneError(f"{self.directory}: no checkpoint for step {step} (have: {self.steps() or 'none'})")
        target = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)}
        args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                return checkpointer.restore(self.directory / str(step) / "state", args=args)["params"]
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            raise JaxtuneError(f"{self.directory / str(step)}: checkpoint for step {step} is unreadable "
                               f"({_first_line(e)})") from None

    def check_shapes(self, step: int, abstract_state: dict, config: dict) -> None:
        """A JaxtuneError when the state saved at `step` differs in structure, shape or dtype from `abstract_state`:
        it names the keys of `config` (the run's, flattened "section.key" -> value) that differ from the saved run's
        config, or else the first leaf that differs."""
        try:
            saved_tree = self.manager.item_metadata(step)["state"].tree
        except Exception:  # unreadable: `restore` reports it with the step to fall back to
            return
        saved_config = self.saved_config(step)
        saved, wanted = _shapes(saved_tree), _shapes(abstract_state)
        if saved == wanted:
            return
        leaf = next(iter(sorted(set(saved) ^ set(wanted)) or [k for k in sorted(wanted) if saved[k] != wanted[k]]))
        where = f"{self.directory / str(step)}"
        shown = lambda table: f"{table[leaf][1]}{list(table[leaf][0])}" if leaf in table else "absent"
        detail = f"{leaf}: saved {shown(saved)}, this run {shown(wanted)}"
        changed = {k: (saved_config.get(k), v) for k, v in config.items() if k in saved_config and saved_config[k] != v}
        shaping = {k: v for k, v in changed.items() if k.split(".")[0] in STATE_SECTIONS or k == "train.objective"}
        if shaping or changed:
            keys = "; ".join(f"{k} = {json.dumps(a)} there, {json.dumps(b)} here" for k, (a, b) in
                             (shaping or changed).items())
            raise JaxtuneError(f"{where} was saved by a run with another config ({keys}): the train state's shapes "
                               f"differ ({detail}). Keep the config the run started with, or choose a new "
                               "train.output_dir")
        raise JaxtuneError(f"{where}: the saved train state does not fit this run ({detail}); choose a new "
                           "train.output_dir")

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
            raise JaxtuneError(f"{self.directory / str(step)}: checkpoint for step {step} is unreadable "
                               f"({_first_line(e)}){hint}") from None
        return restored["state"], restored["meta"]

    def discard_after(self, step: int) -> None:
        """Delete the checkpoints of steps after `step`: a run resumed from an earlier step replaces them."""
        for later in [s for s in self.steps() if s > step]:
            self.manager.delete(later)

    def close(self) -> None:
        self.manager.close()


@contextmanager
def _orbax_quiet():
    """absl's logger (orbax's) silent but for fatal errors while the block runs."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl.setLevel(level)


def _local_bytes(state: dict) -> int:
    """Bytes this process writes of a state: one copy of each of its devices' distinct shards."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
               for shard in x.addressable_shards if shard.replica_id == 0)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _write_failure(e: BaseException) -> str | None:
    """"no space left on device" (or the like) when `e` is a failed write for want of room or permission, else None."""
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, OSError) and cause.errno in NO_ROOM:
            return NO_ROOM[cause.errno]
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "No space left" in text:
        return "no space left on device"
    if "PERMISSION_DENIED" in text or "Permission denied" in text:
        return "permission denied"
    return None
