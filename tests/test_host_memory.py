"""The host memory a compile frees goes back to the system: `release_after_compiles` trims the C heap once after
each XLA compile that took `MIN_COMPILE_SECONDS` or more, registered once however often it is asked for; with
`return_large_blocks`, a large block freed goes back at once (their effect on a training run's peak is measured in
benchmarks/load_memory.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import jax
import jax.numpy as jnp

from jaxtune import host_memory

F32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.float32)


def test_every_long_enough_compile_is_followed_by_one_trim(monkeypatch):
    trims = []
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(host_memory, "MIN_COMPILE_SECONDS", 0.0)
    host_memory.release_after_compiles()
    host_memory.release_after_compiles()  # registered once: still one trim a compile
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25).lower(F32(7)).compile()
    assert len(trims) == 1
    jax.jit(lambda x: jnp.cos(x) - 0.5).lower(F32(9)).compile()
    assert len(trims) == 2
    monkeypatch.setattr(host_memory, "MIN_COMPILE_SECONDS", 3600.0)  # a short compile frees little: no trim
    jax.jit(lambda x: jnp.tan(x) + 2.0).lower(F32(11)).compile()
    assert len(trims) == 2


def test_glibc_trims():
    assert host_memory.release_freed_memory() == (platform.libc_ver()[0] == "glibc")


# A child process: glibc's mmap threshold is process-wide and, once fixed, stays so. After a 16 MiB block is freed,
# glibc's dynamic threshold serves an 8 MiB block from the heap, where freeing it (a live block above it) leaves its
# pages resident; with `return_large_blocks` the block is mapped on its own and freeing it unmaps it.
FREED_BLOCK_STAYS = """
import ctypes, sys
from jaxtune import host_memory
if sys.argv[1] == "fixed":
    assert host_memory.return_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
big = libc.malloc(16 << 20); ctypes.memset(big, 1, 16 << 20); libc.free(big)
before = resident()
block = libc.malloc(8 << 20); ctypes.memset(block, 1, 8 << 20)
above = libc.malloc(4096)
libc.free(block)
print(resident() - before)
"""


def test_large_freed_blocks_go_back_to_the_system():
    assert platform.libc_ver()[0] == "glibc"  # what the project runs on; off glibc return_large_blocks does nothing
    stays = {mode: int(subprocess.run([sys.executable, "-c", FREED_BLOCK_STAYS, mode], capture_output=True, text=True,
                                      check=True).stdout) for mode in ("default", "fixed")}
    assert stays["default"] >= 7 << 20, stays  # glibc's own behaviour, which the setting exists for
    assert stays["fixed"] < 1 << 20, stays
