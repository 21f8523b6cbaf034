"""Benchmark tasks during training (`[eval] tasks`): `task_scorer` checks the tasks before the run starts and
returns what scores the current weights at each evaluation, through lm-evaluation-harness (`jaxtune.harness`)."""

from __future__ import annotations

from collections.abc import Callable

from jaxtune.config import ForwardOptions
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.run_config import RunConfig


def task_scorer(config: RunConfig, context, shardings, mesh) -> Callable[[dict], dict] | None:
    """None without `[eval] tasks`; else params -> {"eval_<task>/<metric>": value} (lm-eval's metrics, filters
    other than `none` in brackets). Raises JaxtuneError now for a missing or unknown task or no lm-eval installed.

    context: the run's `objectives.base.Context` (its config, method and compute dtype); shardings: the params';
    mesh: the run's.
    """
    ec = config.eval
    if not ec.tasks:
        return None
    from jaxtune.harness import JaxtuneLM, evaluate_tasks, scores
    from jaxtune.harness.tasks import task_specs
    from jaxtune.parallel.offload import on_device

    task_specs(ec.tasks)
    tokenizer = load_tokenizer(config.model.path)
    options = ForwardOptions(compute_dtype=context.options.compute_dtype, attention=context.options.attention)

    def score(params: dict) -> dict:
        lm = JaxtuneLM.from_params(context.cfg, on_device(params, shardings), context.method, tokenizer,
                                   config.model.path, options, batch_size=ec.batch_size,
                                   mesh=mesh if mesh.size > 1 else None)
        results = evaluate_tasks(lm, ec.tasks, limit=ec.limit or None,
                                 num_fewshot=None if ec.num_fewshot < 0 else ec.num_fewshot,
                                 apply_chat_template=ec.apply_chat_template)
        return {f"eval_{name}": value for name, value in scores(results).items()}

    return score
