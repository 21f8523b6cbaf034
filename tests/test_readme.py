"""The README's promises: CI runs exactly the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    commands = readme_commands()
    assert len(commands) == 2
    assert "jaxtune" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_python_examples_import_what_they_name():
    """Every `from jaxtune... import a, b` line of the README's notebook examples names something that exists."""
    import importlib

    missing = []
    for block in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for module, names in re.findall(r"^\s*from (jaxtune\S*) import ([^#\n]+)", block, re.M):
            loaded = importlib.import_module(module)
            for name in names.replace("(", "").replace(")", "").split(","):
                name = name.strip().split(" as ")[0]
                if name and not hasattr(loaded, name):
                    missing.append(f"{module}.{name}")
    assert not missing, missing
