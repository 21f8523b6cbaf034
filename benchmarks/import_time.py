"""Start-up cost of two checkouts, side by side: wall seconds of `python -c "import jaxtune"` and of
`python -m jaxtune.cli --help`, each checkout's source put first on PYTHONPATH, the two run in turn for `--rounds`
rounds (the machine's drift falls on both). Medians and the per-round ratio's median.

    python benchmarks/import_time.py --before /tmp/jaxtune-before              # a checkout of the older revision
    python benchmarks/import_time.py --before /tmp/jaxtune-before --rounds 15 --out results/import_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"import jaxtune": ["-c", "import jaxtune"], "jaxtune --help": ["-m", "jaxtune.cli", "--help"]}


def seconds(source: Path, args: list[str]) -> float:
    """Wall seconds of one interpreter running `args` in `source` (first on the import path: `-c` puts the working
    directory there)."""
    env = {**os.environ, "PYTHONPATH": str(source), "JAX_PLATFORMS": "cpu"}
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, cwd=source, check=True, capture_output=True)
    return time.perf_counter() - started


def cpu_model() -> str:
    """/proc/cpuinfo's model name, with "AMX" where the CPU has it (the README keeps a section per CPU kind)."""
    from jaxtune.host_cpu import CPUINFO, cpu_flags

    info = CPUINFO.read_text() if CPUINFO.exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())
    return name + (", AMX" if "amx_tile" in cpu_flags(info) else "")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the revision to compare against")
    parser.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    for name, command in COMMANDS.items():  # once each, untimed: the page cache and .pyc files
        seconds(args.before, command), seconds(args.after, command)
    result: dict = {"machine": cpu_model(), "python": platform.python_version(), "rounds": args.rounds,
                    "commands": {}}
    for name, command in COMMANDS.items():
        before, after = [], []
        for i in range(args.rounds):
            order = ((args.before, before), (args.after, after))
            for source, times in order if i % 2 == 0 else order[::-1]:
                times.append(seconds(source, command))
        result["commands"][name] = {
            "before_s": statistics.median(before), "after_s": statistics.median(after),
            "ratio": statistics.median(b / a for b, a in zip(before, after)), "before_all": before, "after_all": after}
        print(f"{name:16s} before {statistics.median(before):.3f} s  after {statistics.median(after):.3f} s  "
              f"({result['commands'][name]['ratio']:.1f}x)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
