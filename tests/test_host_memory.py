"""The host memory a compile frees goes back to the system: `release_after_compiles` trims the C heap once after
each XLA compile, registered once however often it is asked for (its effect on a training run's peak is measured
in benchmarks/load_memory.py)."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp

from jaxtune import host_memory


def test_every_compile_is_followed_by_one_trim(monkeypatch):
    trims = []
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: trims.append(1))
    host_memory.release_after_compiles()
    host_memory.release_after_compiles()  # registered once: still one trim a compile
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25).lower(jax.ShapeDtypeStruct((7,), jnp.float32)).compile()
    assert len(trims) == 1
    jax.jit(lambda x: jnp.cos(x) - 0.5).lower(jax.ShapeDtypeStruct((9,), jnp.float32)).compile()
    assert len(trims) == 2


def test_glibc_trims():
    assert host_memory.release_freed_memory() == (platform.libc_ver()[0] == "glibc")
