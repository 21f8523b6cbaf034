"""Host memory the runtime frees goes back to the operating system: after each compile, and large blocks when freed.

Compiling a step allocates much in small pieces and frees it once the executable is built; glibc keeps them in its
heap, under the step's buffers, for the whole run: `release_after_compiles` calls `malloc_trim` after every compile
of `MIN_COMPILE_SECONDS` or more. `return_large_blocks` pins glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` (glibc
raises it as blocks are freed, so step buffers would come from the fragmented heap) and its trim threshold: resident
memory against page faults (benchmarks/load_memory.py, train_throughput.py). `restart_with_huge_pages` (`jaxtune
train`, `demo`) runs the program again with glibc mapping those blocks as transparent huge pages, so a step's freshly
mapped temporaries fault in a huge page at a time. Without glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Compiles shorter than this are not followed by a trim: they free little, and the pages a trim returns are
# faulted in again by the next compile (trimming after every compile made the tiny demo's run 12% slower).
MIN_COMPILE_SECONDS = 1.0


# Blocks this large or larger are mapped on their own and unmapped when freed: XLA:CPU's large step buffers (a
# device's temporaries, gathered weight pieces, activations), not the interpreter's small objects.
MMAP_THRESHOLD_BYTES = 1 << 22
TRIM_THRESHOLD_BYTES = 1 << 26
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) the memory malloc maps
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never": the kernel's choice


@functools.cache
def _libc_function(name: str):
    """glibc's function `name`, or None where the C library has none."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name, None) if library else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the operating system; whether there was a `malloc_trim` to call."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)
    return trim is not None


@functools.cache
def return_large_blocks() -> bool:
    """From now on in this process, blocks of `MMAP_THRESHOLD_BYTES` or more are mapped on their own, so freeing one
    returns it to the operating system, and the heap is trimmed past `TRIM_THRESHOLD_BYTES` free (see the module
    doc); whether glibc's `mallopt` took both (called once)."""
    mallopt = _libc_function("mallopt")
    return (mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)


def _after_compile(event: str, duration_secs: float, **kwargs) -> None:
    if event == COMPILE_EVENT and duration_secs >= MIN_COMPILE_SECONDS:
        release_freed_memory()


@functools.cache
def release_after_compiles() -> None:
    """From now on in this process, `release_freed_memory` after every XLA compile of `MIN_COMPILE_SECONDS` or more
    (registered once)."""
    import jax  # here: `jaxtune` restarts under huge pages (`restart_with_huge_pages`) before it loads JAX

    jax.monitoring.register_event_duration_secs_listener(_after_compile)


def _glibc_version() -> tuple[int, ...]:
    name, version = platform.libc_ver()  # ("glibc", "2.36"); ("", "") off glibc
    return tuple(int(part) for part in version.split(".")[:2]) if name == "glibc" else ()


def huge_pages_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with `HUGE_PAGES_TUNABLE` added to GLIBC_TUNABLES (which glibc reads once, as a process starts), or
    None where that would change nothing: glibc older than 2.35 or none, transparent huge pages only on request
    ("madvise") not the kernel's mode, or the tunable already set."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if _glibc_version() < (2, 35) or "glibc.malloc.hugetlb=" in tunables:
        return None
    try:
        if "[madvise]" not in THP_MODE.read_text():
            return None
    except OSError:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGE_PAGES_TUNABLE]))}


def restart_with_huge_pages() -> None:
    """Run this program again in place (`os.execve`: same interpreter, arguments and process id) under
    `huge_pages_environment`, where it changes something; else return.

    XLA:CPU maps a step's large temporaries anew at every step (see `return_large_blocks`); with 4 KiB pages their
    first writes cost tens of thousands of page faults a step (benchmarks/README.md, issue 34). Call it before any
    work: what the process holds is not carried over."""
    environ = huge_pages_environment(os.environ)
    if environ is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, environ)
    except OSError:  # the interpreter cannot be run again (an embedded one): go on with 4 KiB pages
        return
