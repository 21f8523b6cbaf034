"""Model cards and pushes: `model_card` writes the README.md the Hub reads (YAML front matter: base_model,
library_name, tags, datasets; then the method, data and final metrics), `run_card` fills it from a run directory,
and `push_run_result` uploads a finished run's result (`[train] push_to_hub`), keeping it locally if that fails.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from jaxtune.errors import JaxtuneError, JaxtuneWarning
from jaxtune.hub import hub_id_of, parse_id, push
from jaxtune.run_config import RunConfig

# what a pushed result is, by export target: (library_name, its tag besides the method's)
KINDS = {"peft": ("peft", None), "merged": ("transformers", "merged"), "gguf": ("gguf", "gguf"),
         "gguf-lora": ("gguf", "gguf")}


def as_hub_id(ref: str | Path | None) -> str | None:
    """The Hub id `ref` names or was resolved from (a cache snapshot path), else None (a local path)."""
    if ref is None:
        return None
    hub = parse_id(str(ref), splits=True)
    return hub["repo"] if hub is not None else hub_id_of(ref)


def model_card(repo_id: str, target: str, base_model: str | None, method: str | None, objective: str | None = None,
               data: tuple[str, ...] = (), metrics: dict | None = None) -> str:
    """README.md for `repo_id`: front matter as the Hub expects (base_model and datasets when they are Hub ids), a
    line saying how it was made (`target`: a key of KINDS; method None: the base model as it is), and a table of
    `metrics` ({name: value})."""
    library, tag = KINDS[target]
    base, datasets = as_hub_id(base_model), list(dict.fromkeys(d for d in map(as_hub_id, data) if d))
    tags = list(dict.fromkeys(filter(None, ("jaxtune", tag, method, objective))))
    front = ([f"base_model: {json.dumps(base)}"] if base else []) + [f"library_name: {library}", "tags:"]
    front += [f"- {json.dumps(t)}" for t in tags] + (["datasets:"] + [f"- {json.dumps(d)}" for d in datasets]
                                                     if datasets else [])
    named = f"[{base}](https://huggingface.co/{base})" if base else f"`{base_model}`"
    made = (f"A {method} fine-tune{f' ({objective})' if objective else ''} of {named}, trained with jaxtune"
            f"{' on ' + ', '.join(f'`{d}`' for d in dict.fromkeys(as_hub_id(d) or d for d in data)) if data else ''}"
            f"; written as {target}."
            if method else f"{named}, written by jaxtune as {target}.")
    table = ["| metric | value |", "|---|---|", *(f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
                                                 for k, v in (metrics or {}).items())]
    return "\n".join(["---", *front, "---", "", f"# {repo_id.split('/')[-1]}", "", made, "",
                      *(["## Final metrics", "", *table, ""] if metrics else [])])


def final_metrics(run_dir: str | Path) -> dict:
    """The last step's train loss and the last evaluation's eval_* values of run_dir/metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    trained = [r for r in records if "loss" in r]
    evaluated = [r for r in records if any(k.startswith("eval_") for k in r)]
    return {**({"step": trained[-1]["step"], "train_loss": trained[-1]["loss"]} if trained else {}),
            **({k: v for k, v in evaluated[-1].items() if k.startswith("eval_")} if evaluated else {})}


def run_card(repo_id: str, target: str, config: RunConfig, run_dir: str | Path) -> str:
    """`model_card` of a run: its base model, method, objective, data and final metrics."""
    data = tuple(d for d in (config.data.train, config.data.eval) if d)
    return model_card(repo_id, target, config.model.path, config.method.kind, config.train.objective, data,
                      final_metrics(run_dir))


def push_run_result(run_dir: Path, config: RunConfig, result: Path, log) -> str | None:
    """Push a finished run's `result` (adapter/ or model/) to `[train] push_to_hub` with its card; the commit URL. A
    failure is one warning naming the repo and where the result stays (None): the run's files are never touched."""
    repo, target = config.train.push_to_hub, "peft" if result.name == "adapter" else "merged"
    try:
        url = push(result, repo, run_card(repo, target, config, run_dir))
    except Exception as e:  # noqa: BLE001 - whatever the upload hits, the run is done and its files are kept
        reason = str(e) if isinstance(e, JaxtuneError) else f"{repo}: {type(e).__name__}: {e}"
        warnings.warn(f"train.push_to_hub: {reason.splitlines()[0] if reason else reason}; the result stays in "
                      f"{result} (push it later: jaxtune export --run {run_dir} --{target} OUT --push {repo})",
                      JaxtuneWarning, stacklevel=2)
        return None
    log(f"pushed {result} to {url}")
    return url
