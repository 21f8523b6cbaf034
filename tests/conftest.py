"""What every test needs: the environment (the CPU backend, XLA's compilation cache shared by the test processes and
reported at the end, no huge-pages restart of the CLI), XLA_FLAGS restored after each test, torch-free helpers, and
the tiers.

The everyday tier is `pytest` (the README's test command): every test not marked `full`. `pytest --full` runs every
test (`.ci/full`: with llama.cpp and libtpu installed, and the parity tests again with AVX2 forced). Tests that need
torch, transformers or peft (directly, through tests/reference.py or tests/hf_models.py, through `hf_model_dir`, or
in a process they start) are marked `reference`: with JAXTUNE_TESTS_NO_TORCH=1, importing those raises ImportError
here and in the processes the tests start (no_torch/), so `-m "not reference"` proves the rest runs without them.
"""

from __future__ import annotations

import ast
import collections
import functools
import hashlib
import os
import runpy
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test reaches the Hugging Face Hub: a Hub id resolves from a cache the test writes (tests/test_hub.py), or from a
# fake endpoint on 127.0.0.1 the test points huggingface_hub at.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The CPU backend only: with libtpu installed (the test extra, for compiling TPU programs from topologies), JAX would
# otherwise try to start a TPU backend in every process and write libtpu's notices into the CLI's one-line stderr.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's backend (LLVM) optimisation off, as the device workers already run (tests/eight_devices.py): the suite's
# programs are tiny and each compiled once, so compiling is most of their cost (measured: a third less wall time on
# two modules); the results are XLA's either way (no fast-math), and benchmarks/ run with JAX's defaults.
UNOPTIMISED = "--xla_backend_optimization_level=0"
if UNOPTIMISED not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {UNOPTIMISED}".strip()
# XLA's compiled programs are kept on disk and shared by the test processes (xdist workers and the CLI runs they
# start), which compile the same tiny models' steps over and over: a third of the suite's time. The directory is
# per XLA_FLAGS, so the AVX2-forced pass never reuses programs compiled for AVX-512.
_flags = hashlib.sha256(os.environ.get("XLA_FLAGS", "").encode()).hexdigest()[:12]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"jaxtune-tests-xla-{_flags}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# `jaxtune train` and `demo` run as programs restart once under glibc's huge pages (`host_memory`): a test's CLI
# process has nothing to gain from that, so the tunable is set (to off) and they start once.
if "glibc.malloc.hugetlb=" not in os.environ.get("GLIBC_TUNABLES", ""):
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=0"]))

NO_TORCH = os.environ.get("JAXTUNE_TESTS_NO_TORCH") == "1"
if NO_TORCH:
    _site = Path(__file__).parent / "no_torch"
    runpy.run_path(str(_site / "sitecustomize.py"))
    _path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(_site), *(p for p in _path if p and p != str(_site))])

import numpy as np
import pytest

CACHE = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def _cache_entries() -> tuple[int, int]:
    """(programs, bytes) in XLA's compilation cache directory."""
    files = [p for p in CACHE.rglob("*") if p.is_file()] if CACHE.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


_CACHE_AT_START = _cache_entries()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="the full tier: tests marked `full` too (.ci/full)")


# Modules whose every test is the full tier's and which import what only the full tier installs (llama.cpp, built from
# source): the everyday tier does not collect them.
FULL_TIER_MODULES = ("test_llama_cpp.py", "test_llama_cpp_kquants.py")


def pytest_collection_modifyitems(config, items):
    """The everyday tier leaves out the tests marked `full` (deselected, as `-m "not full"` would). The modules with
    the most end-to-end (`slow`) tests come first: `--dist loadfile` hands whole modules to the workers in this
    order, so the longest are not left to one worker at the end."""
    if not config.getoption("--full"):
        kept = [item for item in items if item.get_closest_marker("full") is None]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full") is not None])
            items[:] = kept
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: each module's own order is kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """XLA's compilation cache: what it held at the start and the end (a warm cache makes the suite faster)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    (n0, b0), (n1, b1) = _CACHE_AT_START, _cache_entries()
    terminalreporter.write_line(f"XLA compilation cache {CACHE}: {n0} programs ({b0 / 2**20:.0f} MiB) at the start, "
                                f"{n1} ({b1 / 2**20:.0f} MiB) at the end")


@pytest.fixture(autouse=True)
def _xla_flags_as_they_were():
    """XLA_FLAGS restored after every test: code run in-process (`plan --target cpu-8` asks for fake devices) may set
    it, and a later test's subprocess in the same worker would inherit eight CPU devices."""
    before = os.environ.get("XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = before


def _memory_maps() -> int:
    """This process's memory mappings (Linux's /proc; 0 where there is none)."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _map_limit() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # Linux's default


@pytest.fixture(autouse=True)
def _programs_within_the_map_limit():
    """XLA:CPU maps each program it compiles or reads from the cache in 25-150 regions of memory and JAX keeps every
    program a process ran: one process running the full tier's parity, PEFT and family modules passed Linux's
    `vm.max_map_count` (65,530; 59,300 maps 45 s before) and died in its next mapping (a segfault reading a cached
    program). Past half the limit JAX's caches are dropped; a later test reads its programs back from the disk cache."""
    yield
    if _memory_maps() > _map_limit() // 2:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Factory: arch name -> (directory, transformers model of tests/hf_models.py), cached for the session. Its tests
    are marked `reference`."""
    from hf_models import make_hf_model

    cache = {}

    def get(arch: str):
        if arch not in cache:
            directory = tmp_path_factory.mktemp(arch)
            cache[arch] = (directory, make_hf_model(arch, directory))
        return cache[arch]

    return get


def padded_batch(vocab: int, seed: int = 0):
    """Token ids [3, 12], a left-padded row and a right-padded row, mask and HF-style positions."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, vocab, (3, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, positions


def numpy_random_params(cfg, seed: int = 0) -> dict:
    """Random weights of `cfg` drawn with numpy (no compile), scaled as hf_models.randomize so logits are O(1)."""
    import jax

    from jaxtune.models.params import abstract_params

    rng = np.random.RandomState(seed)

    def draw(path, spec):
        if "norm" in jax.tree_util.keystr(path):
            return 1 + 0.1 * rng.randn(*spec.shape).astype(np.float32)
        fan_in = spec.shape[-2] if "kernel" in jax.tree_util.keystr(path) else 1
        return (rng.randn(*spec.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(cfg))


@functools.cache
def marked_reference(path: Path) -> bool:
    """Whether the test file's module-level `pytestmark` carries `pytest.mark.reference` (read without importing)."""
    for node in ast.parse(path.read_bytes()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "reference" for n in ast.walk(node.value))
    return False


def pytest_ignore_collect(collection_path: Path, config):
    """Not imported: the full tier's own modules in the everyday tier (FULL_TIER_MODULES) and, without torch, a test
    file marked `reference` as a whole (it may import torch at the top). None: the other hooks decide."""
    if collection_path.name in FULL_TIER_MODULES and not config.getoption("--full"):
        return True
    if NO_TORCH and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return marked_reference(collection_path) or None
    return None
