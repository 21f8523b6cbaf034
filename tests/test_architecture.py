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
# two units of one floor never import each other both ways; imports under `if TYPE_CHECKING:` (annotations) too.
FLOORS = (
    ("errors", "paths", "io", "hub", "host_cpu", "host_memory"),  # ground: knows only errors
    ("config",),  # typed frozen dataclasses
    ("parallel",),  # mesh, logical-axis rules, memory kinds, multi-host
    ("models",),  # forward passes, kernels, quantised leaves, HF/GGUF names
    ("data",),  # formats, tokenizer, packing, streaming store
    ("methods",),  # one unit per method
    ("generation", "environments", "stop_strings", "image_decoding"),  # decoding with the KV cache (the CLI's
    # generate, GRPO's rollouts); RL environments; stop strings, read on the host between decode chunks; the padded
    # decode of prompts with images (image rollouts, `generate --image`, the harness)
    ("rollouts",),  # RL sampling: the rollout engine (a paged KV cache, continuous batching), an external sampler
    ("objectives",),  # one unit per objective
    ("run_config",),  # the TOML run: the config sections and each objective's
    ("spine",),  # the abstract run, its shardings, the loader, the one jitted step
    ("image_generation",),  # generation with images: the loader's vision model, image_decoding's decode
    ("harness",),  # jaxtune as an lm-evaluation-harness model: task scores for `eval --tasks` and training
    ("presets", "train", "planner", "completions"),  # the faces
    ("launch", "demo"),
    ("cli",),
)


def _runtime_imports(tree: ast.Module, package: str, annotations: bool = False) -> list[str]:
    """Dotted names of the jaxtune modules `tree` imports at run time (relative imports resolved from `package`);
    with `annotations`, those under `if TYPE_CHECKING:` too."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not annotations:
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
        for name in _runtime_imports(ast.parse(path.read_text()), package, annotations=True):
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
    """The check reads every import: a models module reaching into methods is an upward edge, at run time or under
    TYPE_CHECKING for its annotations alone."""
    source = "from typing import TYPE_CHECKING\nfrom jaxtune.methods.base import Method\n"
    assert _runtime_imports(ast.parse(source), "jaxtune.models") == ["jaxtune.methods.base"]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxtune.methods.base import Method\n"
    assert _runtime_imports(ast.parse(guarded), "jaxtune.models") == []
    assert _runtime_imports(ast.parse(guarded), "jaxtune.models", annotations=True) == ["jaxtune.methods.base"]
    assert _runtime_imports(ast.parse("from ..methods import base\n"), "jaxtune.models") == ["jaxtune.methods"]


# ---- units: a method, an objective or an attention kernel is named only in its own module (or package) ----------

def unit_homes() -> dict[str, set[Path]]:
    """{a unit's name: the files that may compare it}: its own module (or package, for a unit that is one), and
    its registry's `__init__.py`. Method kinds, objective names (and aliases) and attention kernels."""
    import inspect

    from jaxtune.methods import METHODS
    from jaxtune.models.kernels import KERNELS
    from jaxtune.objectives import ALIASES, OBJECTIVES

    def home(obj) -> set[Path]:
        path = Path(inspect.getsourcefile(obj)).resolve()
        package = path.parent
        own = {package} if (package / "__init__.py").is_file() and package.name not in (
            "methods", "objectives", "kernels") else {path}
        return own
    homes: dict[str, set[Path]] = {}
    for kind, unit in METHODS.items():
        homes.setdefault(kind, set()).update(home(unit.options) | {ROOT / "jaxtune/methods/__init__.py"})
    for name, objective in OBJECTIVES.items():
        homes.setdefault(name, set()).update(home(objective.loss_terms) | home(objective.prepare)
                                             | {ROOT / "jaxtune/objectives/__init__.py"})
    for alias, name in ALIASES.items():
        homes[alias] = homes[name]
    for name, kernel in KERNELS.items():
        homes.setdefault(name, set()).update(home(kernel.attend) | {ROOT / "jaxtune/models/kernels/__init__.py"})
    return homes


# an expression that holds a unit's identity: a method's kind, an objective's name, an attention choice
UNIT_FIELDS = re.compile(r"\b(kind|objective|method|attention|choice|kernel)\b")


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def unit_names_compared(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) of each place `source` compares a unit's identity with one of `names`: `x.kind == "lora"`,
    `objective in ("grpo", "rloo")`, a `match` on one, or a table keyed by two or more of them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s for side in sides for s in _strings(side) if s in names]
            about = [side for side in sides if not _strings(side) and UNIT_FIELDS.search(ast.unparse(side))]
            if named and about:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
            if len(keys) >= 2:
                found.append((node.lineno, f"a table keyed by {keys}"))
        elif isinstance(node, ast.Match) and UNIT_FIELDS.search(ast.unparse(node.subject)):
            cases = [p.value.value for c in node.cases for p in ast.walk(c.pattern)
                     if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)]
            if any(c in names for c in cases):
                found.append((node.lineno, f"match {ast.unparse(node.subject)}"))
    return found


def test_no_unit_is_compared_outside_its_own_module():
    """Nothing outside a unit asks which method, objective or attention kernel it is dealing with by name: it asks
    the unit (`Method`, `Objective`, `AttentionKernel`) what it declares."""
    homes = unit_homes()
    problems = []
    for path in sorted((ROOT / "jaxtune").rglob("*.py")):
        path = path.resolve()
        names = {name for name, where in homes.items()
                 if not any(path == h or h in path.parents for h in where)}
        for line, what in unit_names_compared(path.read_text(), names):
            problems.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not problems, "\n".join(problems)


def test_the_unit_check_sees_a_planted_comparison():
    """A `kind == "lora"` planted in the planner is found; the same text in LoRA's own package, or a remat policy
    compared with "full", is not."""
    homes = unit_homes()
    planner = (ROOT / "jaxtune/planner/estimate.py").read_text()
    names_outside = {name for name, where in homes.items()
                     if not any(ROOT / "jaxtune/planner" in h.parents or h == ROOT / "jaxtune/planner" for h in where)}
    assert unit_names_compared(planner, names_outside) == []
    planted = planner + "\n\ndef _leak(plan):\n    return plan.method.kind == \"lora\"\n"
    assert [what for _, what in unit_names_compared(planted, names_outside)] == ["plan.method.kind == 'lora'"]
    for leak in ('x = objective in ("grpo", "rloo")', 'x = {"full": 1, "lora": 2}[plan.method.kind]',
                 'match choice:\n    case "splash":\n        pass'):
        assert unit_names_compared(leak, names_outside), leak
    assert unit_names_compared('x = plan.forward.remat.policy == "full"', names_outside) == []
    lora_home = homes["lora"]
    assert any((ROOT / "jaxtune/methods/lora/options.py").resolve().is_relative_to(h) or
               (ROOT / "jaxtune/methods/lora/options.py").resolve() == h for h in lora_home)


# ---- kernel choices: each made by one predicate, which the model and the planner both ask ------------------------

# {predicate: the module that defines it}: the attention kernel (registry of fused kernels, else blockwise), a
# mixture's grouped matmul (megablox, tiles or ragged_dot), whether a method's branch folds into its base product
KERNEL_PREDICATES = {"choose_kernel": "jaxtune/models/kernels/base.py", "grouped_kernel": "jaxtune/models/moe.py",
                     "folds_branch": "jaxtune/models/linear.py"}
# what an attention kernel's choice reads (`AttentionKernel`): read anywhere else, the choice is being made again
KERNEL_CHOICE_FIELDS = {"covers", "probe", "platforms", "off_platform"}


def kernel_choice_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of each read of an attention kernel's choice fields in `source`."""
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in KERNEL_CHOICE_FIELDS]


def predicate_callers(name: str) -> set[str]:
    """The top-level packages of jaxtune ("models", "planner", ...) whose modules call `name`."""
    callers = set()
    for path in (ROOT / "jaxtune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == name:
                callers.add(path.relative_to(ROOT / "jaxtune").parts[0])
    return callers


def test_each_kernel_choice_is_made_once_and_asked_by_model_and_planner():
    """The attention kernel, the grouped matmul and the folded branch are each decided by one function, which both
    the forward (`jaxtune/models/`) and the planner call; nothing outside `kernels/base.py` reads what an attention
    kernel's choice is made of."""
    for name, home in KERNEL_PREDICATES.items():
        assert f"def {name}(" in (ROOT / home).read_text(), (name, home)
        assert {"models", "planner"} <= predicate_callers(name), (name, predicate_callers(name))
    reads = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in sorted((ROOT / "jaxtune").rglob("*.py"))
             if path != ROOT / KERNEL_PREDICATES["choose_kernel"]
             for line, what in kernel_choice_reads(path.read_text())]
    assert not reads, "\n".join(reads)


def test_the_kernel_check_sees_a_second_choice():
    """A planner that asks a kernel whether it covers a shape itself, or which platforms it runs on, is found."""
    planner = (ROOT / "jaxtune/planner/kernels.py").read_text()
    assert kernel_choice_reads(planner) == []
    planted = planner + "\n\ndef _again(kernel, shape):\n    return kernel.covers(shape) is None\n"
    assert [what for _, what in kernel_choice_reads(planted)] == ["kernel.covers"]
    assert kernel_choice_reads("x = 'tpu' in KERNELS['splash'].platforms") == [(1, "KERNELS['splash'].platforms")]
