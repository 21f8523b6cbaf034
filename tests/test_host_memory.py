"""The host memory a compile frees goes back to the system: `release_after_compiles` trims the C heap once after
each XLA compile that took `MIN_COMPILE_SECONDS` or more, registered once however often it is asked for; with
`return_large_blocks`, a large block freed goes back at once (their effect on a training run's peak is measured in
benchmarks/load_memory.py). `jaxtune train` run as a program starts again with glibc's huge pages, under which a
freshly mapped block faults in 2 MiB at a time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

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


@pytest.mark.full
def test_large_freed_blocks_go_back_to_the_system():
    assert platform.libc_ver()[0] == "glibc"  # what the project runs on; off glibc return_large_blocks does nothing
    stays = {mode: int(subprocess.run([sys.executable, "-c", FREED_BLOCK_STAYS, mode], capture_output=True, text=True,
                                      check=True).stdout) for mode in ("default", "fixed")}
    assert stays["default"] >= 7 << 20, stays  # glibc's own behaviour, which the setting exists for
    assert stays["fixed"] < 1 << 20, stays


def test_the_huge_pages_environment_adds_glibcs_tunable_where_it_changes_something(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(host_memory, "THP_MODE", mode)
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 36))
    mode.write_text("always [madvise] never\n")
    assert host_memory.huge_pages_environment({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert host_memory.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    assert host_memory.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's
    for thp in ("[always] madvise never\n", "always madvise [never]\n"):  # every page huge already, or none can be
        mode.write_text(thp)
        assert host_memory.huge_pages_environment({}) is None
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 34))  # no hugetlb tunable before glibc 2.35
    assert host_memory.huge_pages_environment({}) is None
    mode.unlink()  # no transparent huge pages in this kernel
    monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 36))
    assert host_memory.huge_pages_environment({}) is None


# A child process: the minor page faults of writing a freshly mapped 64 MiB block, as XLA:CPU's step buffers are.
FAULTS_OF_A_MAPPED_BLOCK = """
import ctypes, resource
from jaxtune import host_memory
host_memory.return_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
ctypes.memset(libc.malloc(64 << 20), 1, 64 << 20)
print(faults() - before)
"""


@pytest.mark.full
def test_with_huge_pages_a_mapped_block_faults_in_two_mib_at_a_time():
    as_run = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # conftest turns huge pages off
    huge = host_memory.huge_pages_environment(as_run)
    assert huge is not None  # glibc >= 2.35 and THP on request: the machines the project runs on
    faults = {name: int(subprocess.run([sys.executable, "-c", FAULTS_OF_A_MAPPED_BLOCK], env=env, capture_output=True,
                                       text=True, check=True).stdout) for name, env in (("4k", None), ("huge", huge))}
    assert faults["4k"] >= (64 << 20) // 4096, faults
    assert faults["huge"] < (64 << 20) // 4096 // 10, faults


# `jaxtune train` run as a program starts again, in the same process, under the huge-pages environment.
RESTARTING_TRAIN = """
import os, sys
print(os.getpid(), os.environ.get("GLIBC_TUNABLES", "-"), flush=True)
from jaxtune.cli import main
sys.argv = ["jaxtune", "train", "missing.toml"]
sys.exit(main())
"""


def test_jaxtune_train_run_as_a_program_restarts_with_huge_pages(monkeypatch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", RESTARTING_TRAIN], env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    (pid, before), (same_pid, after) = (line.split() for line in run.stdout.splitlines())
    assert (before, same_pid, after) == ("-", pid, host_memory.HUGE_PAGES_TUNABLE), run.stdout
    assert run.returncode == 2 and "missing.toml" in run.stderr, run.stderr

    from jaxtune import cli  # called as a function (a notebook, these tests): never restarted

    monkeypatch.setattr(cli, "restart_with_huge_pages", lambda: pytest.fail("restarted"))
    assert cli.main(["train", str(tmp_path / "missing.toml")]) == 2
