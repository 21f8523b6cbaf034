"""What the tiers and jaxtune import: with JAXTUNE_TESTS_NO_TORCH=1 the test processes, and the processes they start,
cannot import torch, transformers or peft; jaxtune itself never imports them, and `import jaxtune` loads no heavy
library; the modules the everyday tier leaves uncollected hold only full-tier tests."""

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
REFERENCE_STACK = ("torch", "transformers", "peft")

# Run as the test processes run tests/conftest.py, then as a process one of them starts.
BLOCKED = """
import importlib.util, runpy, subprocess, sys
runpy.run_path(sys.argv[1])
for name in ("torch", "transformers", "peft", "transformers.models.llama"):
    try:
        __import__(name)
    except ImportError as e:
        assert "the fast tier runs without torch" in str(e), e
    else:
        raise AssertionError(f"{name} imported")
    assert importlib.util.find_spec(name.partition(".")[0]) is None  # a probe (datasets') finds nothing
child = subprocess.run([sys.executable, "-c", "import peft"], capture_output=True, text=True)
assert child.returncode == 1 and "the fast tier runs without torch" in child.stderr, child.stderr
import numpy, safetensors.numpy, tokenizers, datasets  # the fast tier's own dependencies still import
print("blocked")
"""


def environment(**extra) -> dict:
    """This process's environment without the blocker (the fast tier's own run sets it), plus `extra`."""
    site = str(TESTS / "no_torch")
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    env = {k: v for k, v in os.environ.items() if k not in ("JAXTUNE_TESTS_NO_TORCH", "PYTHONPATH")}
    return {**env, **({"PYTHONPATH": os.pathsep.join(path)} if path else {}), **extra}


def test_the_fast_tier_cannot_import_the_reference_stack():
    out = subprocess.run([sys.executable, "-c", BLOCKED, str(TESTS / "conftest.py")], capture_output=True, text=True,
                         env=environment(JAXTUNE_TESTS_NO_TORCH="1"), timeout=120)
    assert out.returncode == 0 and out.stdout == "blocked\n", out.stderr


def test_jaxtune_and_its_cli_do_not_import_the_reference_stack():
    """Checked without the blocker: not even an import that would fail quietly."""
    code = "import sys, jaxtune, jaxtune.cli; print(sorted(m for m in sys.modules if m.partition('.')[0] in {}))"
    out = subprocess.run([sys.executable, "-c", code.format(REFERENCE_STACK)], capture_output=True, text=True,
                         env=environment(), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"


def test_importing_jaxtune_and_its_cli_loads_no_heavy_library():
    """`import jaxtune` (its public names load on first use) and the CLI's module load none of JAX, orbax,
    tensorstore, matplotlib or jinja2; `jaxtune --help` answers without them (benchmarks/import_time.py times it)."""
    heavy = ("jax", "jaxlib", "orbax", "tensorstore", "matplotlib", "jinja2", "optax", "numpy")
    code = ("import sys, jaxtune, jaxtune.cli; print(sorted(m for m in sys.modules if m.partition('.')[0] in "
            f"{heavy}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment(), timeout=120)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stdout + out.stderr
    code = ("import sys\nfrom jaxtune.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            f"    assert e.code == 0\nprint(sorted(m for m in sys.modules if m.partition('.')[0] in {heavy}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment(), timeout=120)
    assert out.returncode == 0 and out.stdout.endswith("[]\n") and "usage: jaxtune" in out.stdout, out.stderr
    code = "import jaxtune; print(jaxtune.ModelConfig.__module__, 'load_model' in dir(jaxtune))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment(), timeout=300)
    assert out.stdout == "jaxtune.config.model True\n", out.stderr


def test_every_public_name_loads_from_the_module_the_table_names():
    """Each name of `jaxtune.PUBLIC` is defined where the table says (a renamed or moved function fails here, not in
    a user's notebook), and `import jaxtune` offers nothing else."""
    import importlib

    import jaxtune

    for name, module in jaxtune.PUBLIC.items():
        assert getattr(jaxtune, name) is getattr(importlib.import_module(module), name), name
    assert set(jaxtune.__all__) == set(jaxtune.PUBLIC)
    try:
        jaxtune.not_a_public_name  # noqa: B018
    except AttributeError as e:
        assert "no attribute 'not_a_public_name'" in str(e)
    else:
        raise AssertionError("an unknown name resolved")


def test_the_modules_the_everyday_tier_does_not_collect_are_wholly_the_full_tiers():
    """tests/conftest.py's FULL_TIER_MODULES import what only `.ci/full` installs: every test in them is marked `full`,
    so not collecting them in the everyday tier leaves out nothing the everyday tier runs."""
    from conftest import FULL_TIER_MODULES

    for name in FULL_TIER_MODULES:
        tree = ast.parse((TESTS / name).read_text())
        tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
        marks = [{ast.unparse(d) for d in node.decorator_list} for node in tests]
        assert tests and all("pytest.mark.full" in m for m in marks), name
