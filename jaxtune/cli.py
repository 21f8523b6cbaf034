"""`jaxtune ...`: parses arguments and calls the library; errors are one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys

from jaxtune.errors import JaxtuneError


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


def cmd_info(args) -> None:
    from jaxtune.models.summary import model_summary

    summary = model_summary(args.model)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['architecture']}: {summary['layers']} layers, hidden {summary['hidden_size']}, "
          f"{summary['heads']} heads / {summary['kv_heads']} kv heads, vocab {summary['vocab_size']}"
          f"{', tied embeddings' if summary['tied_embeddings'] else ''}")
    print(f"parameters: {summary['parameters']:,}")
    for group, count in summary["parameters_by_group"].items():
        print(f"  {group:<14}{count:>16,}  {100 * count / summary['parameters']:5.1f}%")
    print("dtypes: " + ", ".join(f"{k} ({v:,})" for k, v in summary["dtypes"].items()))
    print(f"weights: {_human_bytes(summary['weights_bytes'])}")


def cmd_init(args) -> None:
    from jaxtune.models.presets import write_random_model

    path = write_random_model(args.out, args.arch, seed=args.seed)
    print(f"wrote a random {args.arch} model to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxtune", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="describe a Hugging Face model directory")
    info.add_argument("--model", required=True, help="directory with config.json and *.safetensors")
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(run=cmd_info)

    init = sub.add_parser("init", help="write a tiny random model (with the byte-level tokenizer) as an HF directory")
    init.add_argument("out", help="directory to write")
    init.add_argument("--arch", default="llama", choices=("llama", "mistral", "qwen2"))
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(run=cmd_init)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except JaxtuneError as e:
        print(f"jaxtune: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
