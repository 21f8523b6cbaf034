"""Host memory the runtime frees goes back to the operating system: after each compile, and large blocks when freed.

Compiling a training step allocates hundreds of MiB in small pieces (the HLO, LLVM's IR, the buffer assignment;
about 400 MiB for a 12-layer step split over 8 devices) and frees them when the executable is built. glibc keeps
freed small pieces in its heap, so the process's resident set stays that much higher for the whole run, and the
step's buffers, allocated next in large blocks of their own, come on top of it: a short `jaxtune train` of a 607M
model on 8 fake CPU devices peaked about 400 MiB above what its arrays and the step need (README, "Memory while
loading").
`release_after_compiles` asks glibc (`malloc_trim`) to return the free pages after every backend compile of a
second or more (JAX's `/jax/core/compile/backend_compile_duration` event, sent when a compile ends, before the
executable runs).

`return_large_blocks` fixes glibc's mmap threshold (`mallopt(M_MMAP_THRESHOLD)`) at `MMAP_THRESHOLD_BYTES`. By
default glibc raises the threshold to the size of each mmapped block freed, up to 32 MiB, so once XLA:CPU frees a
step's first buffers, later buffers of that size come from the heap, whose freed pages stay resident and
fragmented: a short train of a 607M model on 8 fake devices peaked 70-140 MiB higher (1,988-2,027 MiB against
1,880-1,907; README, "Memory while loading"), a full fine-tune of the benchmark model 300-380 MiB higher. Each block
mapped afresh costs page faults: at a 1 MiB threshold the SmolLM2 demo's steps took 8-10% longer; at 4 MiB they
take as long as with glibc's default, and so does the full fine-tune. The heap's top is trimmed only past
`TRIM_THRESHOLD_BYTES` (`M_TRIM_THRESHOLD`; glibc's 128 KiB made the full fine-tune 6% slower); the trims after
loading and after long compiles (above) still return everything free.

Where the C library is not glibc there is nothing to call, and nothing is done.
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
