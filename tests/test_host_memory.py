"""The host memory a compile frees goes back to the system: `release_after_compiles` trims the C heap once after
each XLA compile that took `MIN_COMPILE_SECONDS` or more, registered once however often it is asked for (its
effect on a training run's peak is measured in benchmarks/load_memory.py)."""

from __future__ import annotations

import platform

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
