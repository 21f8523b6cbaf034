"""Host memory XLA's compiler frees goes back to the operating system after each compile.

Compiling a training step allocates hundreds of MiB in small pieces (the HLO, LLVM's IR, the buffer assignment;
about 400 MiB for a 12-layer step split over 8 devices) and frees them when the executable is built. glibc keeps
freed small pieces in its heap, so the process's resident set stays that much higher for the whole run, and the
step's buffers, allocated next in large blocks of their own, come on top of it: a short `jaxtune train` of a 607M
model on 8 fake CPU devices peaked about 400 MiB above what its arrays and the step need (README, "Memory while
loading").
`release_after_compiles` asks glibc (`malloc_trim`) to return the free pages after every backend compile of a
second or more (JAX's `/jax/core/compile/backend_compile_duration` event, sent when a compile ends, before the
executable runs). Where
the C library is not glibc there is nothing to call, and nothing is done.
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


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the operating system; whether there was a `malloc_trim` to call."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return trim is not None


def _after_compile(event: str, duration_secs: float, **kwargs) -> None:
    if event == COMPILE_EVENT and duration_secs >= MIN_COMPILE_SECONDS:
        release_freed_memory()


@functools.cache
def release_after_compiles() -> None:
    """From now on in this process, `release_freed_memory` after every XLA compile of `MIN_COMPILE_SECONDS` or more
    (registered once)."""
    jax.monitoring.register_event_duration_secs_listener(_after_compile)
