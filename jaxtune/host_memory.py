"""Host memory the runtime frees goes back to the operating system: after each compile, and large blocks when freed.

Compiling a step allocates much in small pieces (HLO, LLVM IR, buffer assignment) and frees it once the executable
is built; glibc keeps freed small pieces in its heap, under the step's own buffers, for the whole run.
`release_after_compiles` calls `malloc_trim` (`release_freed_memory`) after every backend compile of
`MIN_COMPILE_SECONDS` or more (JAX's `COMPILE_EVENT`). `return_large_blocks` pins glibc's mmap threshold at
`MMAP_THRESHOLD_BYTES` (glibc raises it as blocks are freed, so later step buffers would come from the fragmented
heap) and its trim threshold at `TRIM_THRESHOLD_BYTES`: resident memory against page faults, as measured by
benchmarks/load_memory.py and benchmarks/train_throughput.py. Without glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Compiles shorter than this are not followed by a trim: they free little, and the pages a trim returns are
# faulted in again by the next compile (trimming after every compile made the tiny demo's run 12% slower).
MIN_COMPILE_SECONDS = 1.0


# Blocks this large or larger are mapped on their own and unmapped when freed: XLA:CPU's large step buffers (a
# device's temporaries, gathered weight pieces, activations), not the interpreter's small objects.
MMAP_THRESHOLD_BYTES = 1 << 22
TRIM_THRESHOLD_BYTES = 1 << 26
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers


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
    jax.monitoring.register_event_duration_secs_listener(_after_compile)
