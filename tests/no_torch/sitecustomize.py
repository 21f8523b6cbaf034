"""The fast tier's import blocker. With JAXTUNE_TESTS_NO_TORCH=1, `import torch` (transformers, peft) raises
ImportError and a probe for them (`importlib.util.find_spec`) finds nothing, as on a machine without them: a test
that needs them and is not marked `reference` fails in the fast tier.

tests/conftest.py runs this file in the test processes and puts its folder on PYTHONPATH, so that Python also runs
it, as `sitecustomize`, in every process a test starts (the CLI, workers).
"""

import importlib.machinery
import importlib.util
import os
import sys

BLOCKED = ("torch", "transformers", "peft")


class ReferenceStackBlocker:
    """A meta path finder ahead of the others that refuses the reference stack's packages."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} here: the fast tier runs without torch, transformers and peft "
                "(JAXTUNE_TESTS_NO_TORCH=1); a test that needs them is marked `reference`", name=name)
        return None


def install():
    if any(type(finder).__name__ == ReferenceStackBlocker.__name__ for finder in sys.meta_path):
        return
    imported = sorted(name for name in sys.modules if name.partition(".")[0] in BLOCKED)
    if imported:
        raise RuntimeError(f"JAXTUNE_TESTS_NO_TORCH=1, but {imported[0]} was imported before the blocker")
    sys.meta_path.insert(0, ReferenceStackBlocker())
    find_spec = importlib.util.find_spec

    def probe(name, package=None):  # "is it installed?" (datasets asks about torch on import): no
        return None if name.partition(".")[0] in BLOCKED else find_spec(name, package)

    importlib.util.find_spec = probe


if os.environ.get("JAXTUNE_TESTS_NO_TORCH") == "1":
    install()

if __name__ == "sitecustomize":  # Python imports one sitecustomize: also run the one this file hides, if any
    here = os.path.dirname(os.path.abspath(__file__))
    hidden = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [entry for entry in sys.path if os.path.abspath(entry or ".") != here])
    if hidden is not None:
        hidden.loader.exec_module(importlib.util.module_from_spec(hidden))
