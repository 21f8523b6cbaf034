"""The house's structure: floors, docstrings."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A number followed by a unit of size, time, share or speed: "4 MiB", "1.5 s", "8-10%", "2x faster", "712 tokens/s".
# Not shapes ([B, T], [L, 2F]), dtypes (int32s), versions (0.50) or counts (rank 16, 4 layers).
MEASUREMENT = re.compile(
    r"(?<![\w.^])\d(?:[\d,.]*\d)?\s*"
    r"(?:[KMGT]i?B\b|ms\b|s\b|seconds?\b|minutes?\b|hours?\b|%|×|x (?:faster|slower)|times (?:faster|slower)"
    r"|tok(?:ens)?/s\b)"
)


def test_module_docstrings_are_short_and_hold_no_measurements():
    """A module docstring says what the module is for in at most 10 lines, and cites where numbers come from
    (benchmarks/, experiments/) rather than quoting them: quoted figures drift from the code that measured them."""
    problems = []
    for path in sorted((ROOT / "jaxtune").rglob("*.py")):
        name = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(), filename=str(path))
        first = tree.body[0] if tree.body else None
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            problems.append(f"{name}: no module docstring")
            continue
        lines = first.end_lineno - first.lineno + 1
        if lines > 10:
            problems.append(f"{name}: module docstring of {lines} lines (at most 10)")
        problems += [f"{name}: a measurement in the module docstring: {m.group(0)!r}"
                     for m in MEASUREMENT.finditer(first.value.value)]
    assert not problems, "\n".join(problems)


# The floors, lowest first: a package or top-level module imports only from its own floor or the ones below it, and
# two units of one floor never import each other both ways. Imports under `if TYPE_CHECKING:` are annotations only.
FLOORS = (
    ("errors", "paths", "io", "host_cpu", "host_memory"),  # ground: knows only errors
    ("config",),  # typed frozen dataclasses
    ("parallel",),  # mesh, logical-axis rules, memory kinds, multi-host
    ("models",),  # forward passes, kernels, quantised leaves, HF/GGUF names
    ("data",),  # formats, tokenizer, packing, streaming store
    ("methods",),  # one unit per method
    ("generation",),  # decoding with the KV cache (the CLI's generate, GRPO's rollouts)
    ("objectives",),  # one unit per objective
    ("run_config",),  # the TOML run: the config sections and each objective's
    ("spine",),  # the abstract run, its shardings, the loader, the one jitted step
    ("harness",),  # jaxtune as an lm-evaluation-harness model: task scores for `eval --tasks` and training
    ("presets", "train", "planner", "completions"),  # the faces
    ("launch", "demo"),
    ("cli",),
)


def _runtime_imports(tree: ast.Module, package: str) -> list[str]:
    """Dotted names of the jaxtune modules `tree` imports at run time (relative imports resolved from `package`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names += [base]
    return [n for n in names if n.startswith("jaxtune.")]


def folder_imports() -> dict[str, set[str]]:
    """{unit: units it imports}, a unit being a package under jaxtune/ or a top-level module."""
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "jaxtune").rglob("*.py"):
        parts = path.relative_to(ROOT / "jaxtune").with_suffix("").parts
        if parts == ("__init__",):
            continue  # the public API re-exports every floor
        unit = parts[0]
        module = ".".join(("jaxtune",) + parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for name in _runtime_imports(ast.parse(path.read_text()), package):
            target = name.split(".")[1]
            if target != unit:
                edges.setdefault(unit, set()).add(target)
    return edges


def test_folder_imports_point_only_down():
    floor = {unit: i for i, units in enumerate(FLOORS) for unit in units}
    edges = folder_imports()
    unplaced = sorted((set(edges) | {t for ts in edges.values() for t in ts}) - set(floor))
    assert not unplaced, f"units with no floor in FLOORS: {unplaced}"
    upward = [f"{unit} -> {target}" for unit, targets in edges.items() for target in targets
              if floor[target] > floor[unit]]
    assert not upward, f"imports pointing up a floor: {sorted(upward)}"
    both_ways = sorted({tuple(sorted((u, t))) for u, ts in edges.items() for t in ts if u in edges.get(t, ())})
    assert not both_ways, f"units importing each other: {both_ways}"


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The check reads the imports that matter: a models module reaching into methods is an upward edge, one under
    TYPE_CHECKING is not."""
    source = "from typing import TYPE_CHECKING\nfrom jaxtune.methods.base import Method\n"
    assert _runtime_imports(ast.parse(source), "jaxtune.models") == ["jaxtune.methods.base"]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxtune.methods.base import Method\n"
    assert _runtime_imports(ast.parse(guarded), "jaxtune.models") == []
    assert _runtime_imports(ast.parse("from ..methods import base\n"), "jaxtune.models") == ["jaxtune.methods"]
