"""Benchmark tasks through lm-evaluation-harness with jaxtune's model: `evaluate_tasks` (what `jaxtune eval
--tasks` and `[eval] tasks` run), `write_results` (lm-eval's results JSON), `scores` (the flat numbers a run logs).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import lm_eval
from lm_eval.utils import handle_non_serializable, make_table

from jaxtune.errors import JaxtuneError
from jaxtune.harness.model import JaxtuneLM
from jaxtune.harness.tasks import task_specs


def evaluate_tasks(lm: JaxtuneLM, tasks: Sequence[str], *, limit: float | None = None,
                   num_fewshot: int | None = None, apply_chat_template: bool = False, log_samples: bool = False,
                   quiet: bool = True) -> dict:
    """lm-eval's results object (`results`, `groups`, `configs`, `versions`, `n-shot`, ...) of `tasks` (names, task
    YAML files or bundled tasks: `harness.tasks.task_specs`) scored by `lm`.

    limit: examples a task at most (a fraction of it if < 1), as lm-eval's --limit.
    """
    specs, manager = task_specs(tasks)
    if quiet:
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=specs, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
            apply_chat_template=apply_chat_template, log_samples=log_samples, torch_random_seed=None,
            bootstrap_iters=0 if quiet else 100000)
    except JaxtuneError:
        raise
    except (FileNotFoundError, ValueError, KeyError) as e:  # a task's data or config, as lm-eval/datasets say it
        raise JaxtuneError(f"tasks {', '.join(tasks)}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return results


def write_results(results: dict, path: str | Path) -> Path:
    """lm-eval's results JSON at `path` (its samples apart), and the readable table beside it (`.md`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in results.items() if k != "samples"}
    path.write_text(json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    path.with_suffix(".md").write_text(table(results))
    return path


def table(results: dict) -> str:
    """lm-eval's markdown table of the results (and of the groups, if any)."""
    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def scores(results: dict) -> dict[str, float]:
    """{"TASK/METRIC": value} for every finite metric of every task and group (filters named only when not
    `none`), what training writes to metrics.jsonl as `task/...`."""
    flat = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                metric, _, filter_name = key.partition(",")
                if metric in ("alias", "sample_len") or metric.endswith("_stderr"):
                    continue
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    continue
                name = metric if filter_name in ("", "none") else f"{metric}[{filter_name}]"
                flat[f"{task}/{name}"] = float(value)
    return flat
