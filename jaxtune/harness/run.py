"""Benchmark tasks through lm-evaluation-harness with jaxtune's model: `evaluate_tasks` (what `jaxtune eval
--tasks` and `[eval] tasks` run), `write_results` (lm-eval's results JSON), `scores` (the flat numbers a run logs).
"""

from __future__ import annotations

import json
import logging
import math
import platform
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import jax
import jaxlib
import lm_eval
import lm_eval.evaluator
from lm_eval.utils import handle_non_serializable, make_table
from PIL import UnidentifiedImageError

from jaxtune.errors import JaxtuneError
from jaxtune.harness.model import JaxtuneLM
from jaxtune.harness.tasks import task_specs


def _environment(storage: dict) -> None:
    """lm-eval's environment record for jaxtune's model: jax's versions and devices, in place of torch's collect_env
    (imports torch and transformers, runs pip and nvidia-smi: seconds an evaluation, about a library not used)."""
    devices = jax.devices()
    storage.update({"pretty_env_info": f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {len(devices)} x "
                                       f"{devices[0].device_kind} ({devices[0].platform}), python "
                                       f"{platform.python_version()}, {platform.platform()}",
                    "transformers_version": "N/A (jaxtune's model)", "lm_eval_version": version("lm_eval"),
                    "upper_git_hash": None})


def evaluate_tasks(lm: JaxtuneLM, tasks: Sequence[str], *, limit: float | None = None,
                   num_fewshot: int | None = None, apply_chat_template: bool = False, log_samples: bool = False,
                   quiet: bool = True) -> dict:
    """lm-eval's results object (`results`, `groups`, `configs`, `versions`, `n-shot`, ...) of `tasks` (names, task
    YAML files or bundled tasks: `harness.tasks.task_specs`) scored by `lm`.

    limit: examples a task at most (a fraction of it if < 1), as lm-eval's --limit. The results' environment record
    is jax's (`_environment`).
    """
    specs, manager = task_specs(tasks)
    if quiet:
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        with mock.patch.object(lm_eval.evaluator, "add_env_info", _environment):
            results = lm_eval.simple_evaluate(
                model=lm, tasks=specs, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                apply_chat_template=apply_chat_template, log_samples=log_samples, torch_random_seed=None,
                bootstrap_iters=0 if quiet else 100000)
    except JaxtuneError:
        raise
    except UnidentifiedImageError as e:  # `datasets` decodes a task's images while lm-eval loads it: no doc named yet
        raise JaxtuneError(f"tasks {', '.join(tasks)}: an image in a task's dataset is not one Pillow can read "
                           f"({type(e).__name__}; lm-eval decodes them as it loads the task, before naming a doc)"
                           ) from None
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
