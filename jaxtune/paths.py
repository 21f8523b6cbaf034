"""Output locations, checked before anything is written: a run or export that cannot write fails at once, naming
the path, instead of after minutes of work (or halfway through, leaving a partial directory)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from jaxtune.errors import JaxtuneError


def check_output_dir(path: str | Path, what: str) -> Path:
    """`path` as a Path, or a JaxtuneError naming `what` (e.g. "train.output_dir") when a directory cannot be
    created or written there: a file in the way, or no write permission on the nearest existing parent."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise JaxtuneError(f"{what} {str(path)!r}: {existing} is a file, not a directory")
    try:  # a real write: permissions alone miss read-only mounts and pseudo file systems (and root passes them)
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise JaxtuneError(f"{what} {str(path)!r}: {existing} is not writable ({e.strerror})") from None
    return path


def run_directories(output_dir: str) -> tuple[Path, str | Path]:
    """(run directory, checkpoint directory) of `train.output_dir`. A `gs://bucket/path` output keeps its
    checkpoints there (orbax writes to Cloud Storage directly, so a re-created TPU VM resumes from them) and writes
    the other files (config, metrics, plot, result) to the local `runs/bucket/path`."""
    if output_dir.startswith("gs://"):
        return Path("runs") / output_dir.removeprefix("gs://").strip("/"), output_dir.rstrip("/") + "/checkpoints"
    return Path(output_dir), Path(output_dir) / "checkpoints"
