"""Output locations, checked before anything is written: a run or export that cannot write fails at once, naming
the path, instead of after minutes of work (or halfway through, leaving a partial directory).

    check_output_dir(path, "train.output_dir")   # writable, or a JaxtuneError naming the key and the path
    with run_directory_lock(run_dir): ...        # one writer per run directory (flock)
    with writing(path, needed): ...              # refused when the disk lacks room; a full disk is one line
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def run_directory_lock(run_dir: Path, what: str = "train.output_dir") -> Iterator[_DirectoryLock]:
    """Hold `run_dir` for one writer: an exclusive `flock` on the directory itself while the block runs, or a
    JaxtuneError naming the process that holds it. The kernel drops the lock with its process, so a killed run
    leaves nothing stuck, and no file is added to the directory. A directory that does not exist yet is locked once
    it does (`lock.acquire()` after creating it). Where the file system has no flock (some network mounts), runs
    are not kept apart."""
    lock = _DirectoryLock(run_dir, what)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


class _DirectoryLock:
    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self.fd: int | None = None

    def acquire(self) -> None:
        if self.fd is not None or not self.path.is_dir():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _flock_holder(self.path)
            raise JaxtuneError(f"{self.what} {str(self.path)!r}: another jaxtune run is writing to it"
                               f"{f' (process {holder})' if holder else ''}; wait for it to end, or choose another "
                               f"{self.what}") from None
        except OSError:  # no flock here
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _flock_holder(path: Path) -> int | None:
    """The process holding a flock on `path`, from Linux's /proc/locks (None elsewhere or when not found)."""
    try:
        st, lines = path.stat(), Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for fields in (line.split() for line in lines):
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            return int(fields[4])
    return None


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system of `path` (or of its nearest existing parent); None where it cannot be told."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


NO_ROOM = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EFBIG: "file too large", errno.EACCES: "permission denied", errno.EROFS: "read-only file system"}


def check_room(path: str | Path, needed: int) -> None:
    """A JaxtuneError naming `path` when its disk has less than `needed` bytes free."""
    free = free_bytes(Path(path).parent)
    if free is not None and needed > free:
        raise JaxtuneError(f"{path}: not enough space to write it (needs {human_bytes(needed)}, "
                           f"{human_bytes(free)} free)")


@contextmanager
def writing(path: str | Path, needed: int) -> Iterator[None]:
    """Write `needed` bytes to the file `path` in the block: refused at once when its disk has less free, and a
    failure for want of room or permission midway is one JaxtuneError naming the path, the bytes needed and free
    (the partial file removed) instead of an OSError."""
    path = Path(path)
    check_room(path, needed)
    try:
        yield
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        path.unlink(missing_ok=True)
        free = free_bytes(path.parent)
        raise JaxtuneError(f"{path}: cannot write it: {NO_ROOM[e.errno]} (needs {human_bytes(needed)}"
                           f"{f', {human_bytes(free)} free' if free is not None else ''})") from None
