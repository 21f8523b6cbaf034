"""jaxtune as an lm-evaluation-harness model (`pip install "jaxtune[eval]"`: lm-eval 0.4.x): importing this package
registers `JaxtuneLM` in lm-eval's model registry as `jaxtune`, so lm-eval's own API and CLI take
`model="jaxtune"` (`python -m jaxtune.harness run --model jaxtune ...` is lm-eval's CLI with it registered).
`evaluate_tasks` runs task names, task YAML files or the bundled tasks (`harness.tasks`).
"""

try:
    import lm_eval  # noqa: F401
except ImportError as e:
    from jaxtune.errors import JaxtuneError

    raise JaxtuneError("benchmark tasks need lm-evaluation-harness: pip install 'jaxtune[eval]' (lm-eval 0.4.x)") from e

from jaxtune.harness.model import JaxtuneLM
from jaxtune.harness.run import evaluate_tasks, scores, table, write_results

__all__ = ["JaxtuneLM", "evaluate_tasks", "scores", "table", "write_results"]
