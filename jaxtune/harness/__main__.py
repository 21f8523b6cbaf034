"""lm-eval's own command line with jaxtune's model registered: `python -m jaxtune.harness run --model jaxtune
--model_args model=DIR_OR_GGUF[,adapter=DIR] --tasks ...` (everything else as `lm_eval`). A JaxtuneError (a bad
model_args key or value, a missing model) ends in one line on stderr and exit 2, as jaxtune's own CLI."""

import sys

from lm_eval.__main__ import cli_evaluate

from jaxtune.errors import JaxtuneError
from jaxtune.harness import JaxtuneLM  # noqa: F401  (importing the package registers the `jaxtune` model)


def main() -> int:
    try:
        cli_evaluate()
    except JaxtuneError as e:
        print(f"jaxtune: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
