"""Which lm-eval tasks a `--tasks` list names: `task_specs`.

Each name is a task YAML file (lm-eval's format; `dataset_kwargs.data_files` relative to the file), a task bundled
with jaxtune (`jaxtune/assets/tasks`: jaxtune_facts, jaxtune_qa, jaxtune_text; with images jaxtune_colours,
jaxtune_colours_choice), or a task, group or tag of lm-eval's
own registry (indexed only when one is asked for: it takes seconds).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from jaxtune.errors import JaxtuneError

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "tasks"


def bundled_tasks() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.yaml"))


def _with_local_data(config: dict, directory: Path) -> dict:
    """The config with relative `data_files` made relative to `directory` (the YAML's) where they exist there."""
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if not files:
        return config

    def local(path):
        if isinstance(path, list):
            return [local(p) for p in path]
        candidate = directory / path
        relative = "://" not in str(path) and not Path(path).is_absolute()
        return str(candidate) if relative and candidate.exists() else path

    files = {split: local(p) for split, p in files.items()} if isinstance(files, dict) else local(files)
    return {**config, "dataset_kwargs": {**config["dataset_kwargs"], "data_files": files}}


def _yaml_task(path: Path) -> dict:
    try:
        config = load_yaml(path)
    except Exception as e:  # a YAML or !function error: lm-eval's own message, on one line
        raise JaxtuneError(f"{path}: not an lm-eval task file: {str(e).splitlines()[0]}") from e
    if "task" not in config:
        raise JaxtuneError(f"{path}: an lm-eval task file needs a 'task' name")
    return _with_local_data(config, path.parent)


def task_specs(names: Sequence[str]) -> tuple[list[str | dict], TaskManager]:
    """(what `lm_eval.simple_evaluate(tasks=...)` takes for each name, the TaskManager that resolves them).

    Raises JaxtuneError for a missing YAML file or a name that is neither bundled nor in lm-eval's registry.
    """
    if not names:
        raise JaxtuneError("no tasks given: name lm-eval tasks, task YAML files, or " + ", ".join(bundled_tasks()))
    specs: list[str | dict] = []
    registry: list[str] = []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            if not Path(name).is_file():
                raise JaxtuneError(f"{name}: task file not found")
            specs.append(_yaml_task(Path(name)))
        elif (BUNDLED / f"{name}.yaml").is_file():
            specs.append(_yaml_task(BUNDLED / f"{name}.yaml"))
        else:
            specs.append(name)
            registry.append(name)
    manager = TaskManager(include_defaults=bool(registry))
    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    for name in registry:
        if name not in known and not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, [*known, *bundled_tasks()], n=3)
            raise JaxtuneError(f"unknown task {name!r}: not a task YAML file, a bundled task ("
                               f"{', '.join(bundled_tasks())}) or in lm-eval's registry"
                               + (f"; did you mean {', '.join(close)}?" if close else ""))
    return specs, manager
