"""Where a run writes. A local `train.output_dir` is the run directory itself; a URL (`gs://bucket/path`, any fsspec
URL) is written locally to `runs/bucket/path` and copied to the URL at each checkpoint and at the end (and back
from it at the start, so a run restarted on another machine resumes). Orbax writes checkpoints to `gs://` and
`file://` itself; for other schemes they are in the local copy and copied with the rest.

    run_dir, checkpoint_dir = run_directories(output_dir)   # checkpoint_directory(output_dir, run_dir) its second
    fetch_run_directory(output_dir, run_dir); ...; sync_run_directory(output_dir, run_dir)
"""

from __future__ import annotations

from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.io import storage
from jaxtune.io.storage import is_url

LOCAL_ONLY = ("cache",)  # the tokenised data beside the run: rebuilt from the data, never copied


def _orbax_writes(url: str) -> bool:
    return url.startswith(("gs://", "file://"))


def run_directories(output_dir: str) -> tuple[Path, str | Path]:
    """(run directory, checkpoint directory) of `train.output_dir`."""
    run_dir = Path("runs") / output_dir.split("://", 1)[1].strip("/") if is_url(output_dir) else Path(output_dir)
    return run_dir, checkpoint_directory(output_dir, run_dir)


def checkpoint_directory(output_dir: str, run_dir: Path) -> str | Path:
    """Where the checkpoints of the run with `train.output_dir` `output_dir`, kept locally in `run_dir`, are."""
    if is_url(output_dir) and _orbax_writes(output_dir):
        return storage.local_path(output_dir.rstrip("/")) + "/checkpoints"
    return run_dir / "checkpoints"


def _not_copied(url: str) -> tuple[str, ...]:
    """The run directory's entries never copied between `url` and the local copy."""
    return (*LOCAL_ONLY, "checkpoints") if _orbax_writes(url) else LOCAL_ONLY


def fetch_run_directory(output_dir: str, run_dir: Path) -> None:
    """A URL output's files (config, metrics, the checkpoints orbax cannot read there) brought into `run_dir`."""
    if is_url(output_dir):
        storage.download_tree(output_dir, run_dir, _not_copied(output_dir))


def sync_run_directory(output_dir: str, run_dir: Path) -> None:
    """The local `run_dir`'s files copied to a URL output, but the data cache and the checkpoints orbax wrote there."""
    if is_url(output_dir) and run_dir.is_dir():
        storage.upload_tree(run_dir, output_dir, _not_copied(output_dir))


def local_run_directory(run: str | Path) -> Path:
    """A run directory given as its `output_dir` URL: its local copy, fetched; a local one as it is."""
    if not is_url(run):
        return Path(run)
    if not storage.exists(run):
        raise JaxtuneError(f"{run}: run directory not found")
    run_dir = run_directories(run)[0]
    fetch_run_directory(run, run_dir)
    return run_dir
