"""Training throughput of jaxtune against PyTorch+PEFT at one fixed Llama shape, on whatever CPU runs it.

    .venv/bin/python benchmarks/train_throughput.py            # every configuration, both frameworks
    .venv/bin/python benchmarks/train_throughput.py --quick    # fewer steps
    .venv/bin/python benchmarks/train_throughput.py --only lora_qv         # or lora_qv_bf16: bf16 compute, both sides
    .venv/bin/python benchmarks/train_throughput.py --repeat 2 --retry-busy 2   # on a shared machine
    .venv/bin/python benchmarks/train_throughput.py --from-json a.json b.json   # the table of saved runs

Shape: hidden 512, intermediate 1376, 8 layers, 8 heads / 4 KV heads (head_dim 64), vocab 8192, untied head;
batch 4 x 256 tokens, float32, loss on every token. Methods: full fine-tune, LoRA on q,v, LoRA on every linear
layer, QLoRA (NF4 with double quantisation, LoRA on q,v), and LoRA on q,v with bfloat16 matmuls (jaxtune's
compute_dtype, torch's autocast; weights and optimizer float32); LoRA rank 8, alpha 16; AdamW lr 2e-4, clipping
at 1.0.

Each configuration runs in its own subprocess (`--worker`), so its peak RSS is its own. Per configuration:
tokens/s and step time (median of the timed steps, after warm-up steps), compile time (jaxtune: the train
step's `lower().compile()`; torch runs eagerly), peak RSS (the process's lifetime `ru_maxrss`), the RSS once the
model and optimiser state exist (baseline), and the high-water mark of compiling + training alone (train peak).
Torch runs with both "sdpa" and "eager" attention and the faster is kept. The ratio column divides tokens/s by
PyTorch+PEFT's on the same configuration. Results go to benchmarks/results/train_throughput.json.

A shared machine skews everything, PyTorch most (its OpenMP threads spin at barriers), so each run records how
many cores other processes used meanwhile (from /proc/stat); runs under QUIET_CORES are "quiet", the table uses
only those where there are any, and marks rows that have none. CPU seconds per step are reported beside wall time.

XLA flags: none are set here; jaxtune runs with JAX's defaults (set XLA_FLAGS yourself to try others), and with
glibc's huge pages for its step buffers as `jaxtune train` runs (`host_memory.huge_pages_environment`, recorded as
glibc_tunables); PyTorch with the environment as given. Every
result records the machine it ran on (`machine()`: CPU model, vendor, the ISA extensions that decide the kernels,
XLA_FLAGS' ISA cap, ATEN_CPU_CAPABILITY) and its kind (`machine_kind`, e.g. "GenuineIntel AVX-512+AMX" or
"AuthenticAMD AVX-512, capped at AVX2"); the table has one section per kind, so saved runs of several machines
(`--from-json`) are never mixed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _measure as M  # noqa: E402

TORCH_ATTENTION = ("sdpa", "eager")
QUIET_CORES = 0.25  # a run during which other processes used less than this is "quiet"
LABELS = {"full": "full", "lora_qv": "LoRA (q,v)", "lora_all": "LoRA (all-linear)", "qlora": "QLoRA (NF4, q,v)",
          "lora_qv_bf16": "LoRA (q,v), bf16 compute"}


def worker_names(only: str | None, torch_available: bool) -> list[str]:
    """Worker names "jax:CONFIG" and "torch:CONFIG:ATTN", filtered by `only` (a config or a worker name)."""
    names = []
    for config in M.METHODS:
        names.append(f"jax:{config}")
        if torch_available:
            attns = TORCH_ATTENTION if M.METHODS[config][0] != "qlora" else TORCH_ATTENTION[:1]
            names += [f"torch:{config}:{attn}" for attn in attns]
    if only:
        names = [n for n in names if only in (n, n.split(":")[1], ":".join(n.split(":")[:2]))]
        if not names:
            raise SystemExit(f"--only {only!r} matches nothing; configs: {', '.join(M.METHODS)}")
    return names


def run_worker(name: str, warmup: int, steps: int) -> dict:
    """Measure one configuration in this process and return its result."""
    framework, config, *rest = name.split(":")
    if framework == "jax":
        import _jax_worker

        return _jax_worker.run(config, warmup, steps)
    import _torch_worker

    return _torch_worker.run(config, rest[0], warmup, steps)


def spawn(name: str, warmup: int, steps: int) -> dict:
    """Run one worker in a fresh interpreter; its last stdout line is its JSON result."""
    from jaxtune.host_memory import huge_pages_environment

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--warmup", str(warmup),
           "--steps", str(steps)]
    env = os.environ.copy()
    if name.startswith("jax:"):  # as `jaxtune train` runs (host_memory.restart_with_huge_pages)
        env = huge_pages_environment(env) or env
    t0, busy0, own0 = time.perf_counter(), cpu_busy_s(), children_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, others = time.perf_counter() - t0, cpu_busy_s() - busy0 - (children_cpu_s() - own0)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"framework": name.split(":")[0], "config": name.split(":")[1], "error": " | ".join(tail)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # CPU time that other processes took while this one ran, in cores: the machine may be shared.
    result.update(process_wall_s=wall, other_load_cores=max(others, 0.0) / wall,
                  glibc_tunables=env.get("GLIBC_TUNABLES", ""))
    return result


def cpu_busy_s() -> float:
    """Seconds of non-idle CPU time, all cores together, since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_idle(max_wait_s: float, threshold_cores: float = QUIET_CORES) -> float:
    """Wait (up to max_wait_s) until other processes use under threshold_cores over a second; returns that load."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        busy0 = cpu_busy_s()
        time.sleep(1.0)
        load = cpu_busy_s() - busy0
        if load < threshold_cores or time.perf_counter() > deadline:
            return load
        time.sleep(4.0)


ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # the extensions XLA:CPU's and torch's kernels key on


def machine() -> dict:
    """This host as the benchmark records it with every result."""
    from jaxtune.host_cpu import CPUINFO, cpu_flags, max_isa

    cpuinfo = CPUINFO.read_text() if CPUINFO.exists() else ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = cpu_flags(cpuinfo)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    return {"cpu_model": fields.get("model name", platform.processor()), "vendor": fields.get("vendor_id", ""),
            "cpu_count": os.cpu_count(), "isa": [f for f in ISA if f in flags], "xla_flags": xla_flags,
            "xla_max_isa": max_isa(xla_flags), "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
            "python": platform.python_version()}


def machine_kind(m: dict, source: str = "") -> str:
    """A machine's kind: vendor and widest vector ISA (+AMX), and any cap XLA_FLAGS put on XLA's ISA."""
    from jaxtune.host_cpu import max_isa

    cap = m.get("xla_max_isa", max_isa(m.get("xla_flags", "")))
    cap = f", capped at {cap}" if cap else ""
    if "isa" not in m:  # saved before the benchmark recorded the CPU: the file is all that tells machines apart
        return f"CPU not recorded ({source}){cap}"
    isa = set(m["isa"])
    level = "AVX-512" if "avx512f" in isa else "AVX2" if "avx2" in isa else "no AVX2"
    level += "+AMX" if "amx_bf16" in isa else "+BF16" if "avx512_bf16" in isa else ""
    return f"{m.get('vendor') or 'unknown CPU'} {level}{cap}"


AGGREGATED = ("tokens_per_s", "step_s_median", "compile_s", "peak_rss_mib", "baseline_rss_mib",
              "train_peak_rss_mib", "cpu_s_per_step", "other_load_cores")



def aggregate(results: list[dict]) -> list[dict]:
    """One record per (machine kind, framework, config, variant): the median over repeats of each measured number,
    with the tokens/s of every repeat in `tokens_per_s_runs`. Where some repeats ran on a quiet machine, only those
    count: on a shared 2-core machine a busy neighbour halves the cores a run gets."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r.get("machine_kind"), r["framework"], r["config"], r.get("variant")), []).append(r)
    merged = []
    for runs in groups.values():
        ok = [r for r in runs if "tokens_per_s" in r]
        if not ok:
            merged.append(runs[0])
            continue
        quiet = [r for r in ok if r.get("other_load_cores", 0.0) < QUIET_CORES]
        ok = quiet or ok
        record = dict(ok[0], runs=len(ok), quiet=bool(quiet), tokens_per_s_runs=[r["tokens_per_s"] for r in ok])
        for key in AGGREGATED:
            values = [r[key] for r in ok if r.get(key) is not None]
            record[key] = statistics.median(values) if values else None
        merged.append(record)
    return merged


def best_torch(records: list[dict]) -> dict[str, dict]:
    """Per config, the torch variant with the highest tokens/s (or the unavailable/error record)."""
    best: dict[str, dict] = {}
    for r in records:
        if r["framework"] != "torch":
            continue
        current = best.get(r["config"])
        if current is None or r.get("tokens_per_s", 0) > current.get("tokens_per_s", 0):
            best[r["config"]] = r
    return best


def _speed(r: dict) -> str:
    runs = r.get("tokens_per_s_runs", [])
    spread = f" ({min(runs):.0f}–{max(runs):.0f})" if len(runs) > 1 else ""
    return f"{r['tokens_per_s']:.0f}{spread}"


def tables(records: list[dict]) -> str:
    """One section per machine kind: its machine, its table and the targets checked on its numbers."""
    kinds = dict.fromkeys(r.get("machine_kind") for r in records)
    sections = []
    for kind in kinds:
        mine = [r for r in records if r.get("machine_kind") == kind]
        m = next((r["machine"] for r in mine if "machine" in r), {})
        head = (f"### {kind}: {m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores; "
                f"XLA_FLAGS={m.get('xla_flags') or '(none)'}; ATEN_CPU_CAPABILITY="
                f"{m.get('aten_cpu_capability') or '(default)'}") if kind else "### (machine not recorded)"
        sections.append(head + "\n\n" + table(mine) + "\n\n" + "\n".join(targets(mine)))
    return "\n\n".join(sections)


def table(records: list[dict]) -> str:
    """The markdown table of one machine kind: one jaxtune and one (fastest) PyTorch row per configuration."""
    torch_best = best_torch(records)
    rows = ["| config | framework | tokens/s | step ms | CPU s/step | compile s | peak RSS MiB | "
            "baseline / train-peak RSS MiB | ratio vs PEFT |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for config in M.METHODS:
        jax_r = next((r for r in records if r["framework"] == "jax" and r["config"] == config), None)
        torch_r = torch_best.get(config)
        for r in (jax_r, torch_r):
            if r is None:
                continue
            framework = "jaxtune"
            if r["framework"] == "torch":
                framework = f"{'PyTorch' if config == 'full' else 'PyTorch+PEFT'} ({r.get('variant')})"
            if "tokens_per_s" not in r:
                reason = r.get("unavailable") or r.get("error", "")
                rows.append(f"| {LABELS[config]} | {framework} | n/a | n/a | n/a | n/a | n/a | n/a | n/a ({reason}) |")
                continue
            ratio = "1.00" if r["framework"] == "torch" else "n/a"
            if r["framework"] == "jax" and torch_r and "tokens_per_s" in torch_r:
                ratio = f"{r['tokens_per_s'] / torch_r['tokens_per_s']:.2f}"
            compile_s = "—" if r["compile_s"] is None else f"{r['compile_s']:.2f}"
            if not r.get("quiet", True):
                framework += f" [busy machine: others used {r['other_load_cores']:.1f} cores]"
            rows.append(f"| {LABELS[config]} | {framework} | {_speed(r)} | {1e3 * r['step_s_median']:.0f} | "
                        f"{r['cpu_s_per_step']:.2f} | {compile_s} | {r['peak_rss_mib']:.0f} | "
                        f"{r['baseline_rss_mib']:.0f} / "
                        f"{r['train_peak_rss_mib']:.0f} | {ratio} |")
    return "\n".join(rows)


def targets(records: list[dict]) -> list[str]:
    """The issue's targets, checked against this run's numbers."""
    by = {(r["framework"], r["config"]): r for r in records if "tokens_per_s" in r}
    torch_qv = best_torch(records).get("lora_qv")
    jax_qv, jax_q = by.get(("jax", "lora_qv")), by.get(("jax", "qlora"))
    lines = []

    def verdict(ok: bool, *timed: dict) -> str:  # a time measured on a busy machine decides nothing
        if not all(r.get("quiet", True) for r in timed):
            return "undecided (measured while other processes used the cores)"
        return "met" if ok else "MISSED"

    # issue 13: every LoRA configuration (QLoRA against PEFT's LoRA on q,v) >= 1.2x PEFT, the full fine-tune >= 1.0x
    torch_best = best_torch(records)
    for config, against, target in (("lora_qv", "lora_qv", 1.2), ("lora_all", "lora_all", 1.2),
                                    ("qlora", "lora_qv", 1.2), ("full", "full", 1.0)):
        ours, theirs = by.get(("jax", config)), torch_best.get(against)
        if ours and theirs and "tokens_per_s" in theirs:
            speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
            lines.append(f"{LABELS[config]} tokens/s vs PEFT {LABELS[against]}: {speed:.2f}x (target >= {target}x): "
                         f"{verdict(speed >= target, ours, theirs)}")
    ours, theirs = by.get(("jax", "lora_qv_bf16")), torch_best.get("lora_qv_bf16")
    if ours and theirs and "tokens_per_s" in theirs:  # issue 34: >= 1.0x PEFT's autocast
        speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
        lines.append(f"{LABELS['lora_qv_bf16']} tokens/s vs PEFT autocast: {speed:.2f}x (target >= 1.0x): "
                     f"{verdict(speed >= 1.0, ours, theirs)}")
    if jax_qv and torch_qv and "tokens_per_s" in torch_qv:
        jax_peak, torch_peak = jax_qv["peak_rss_mib"], torch_qv["peak_rss_mib"]
        lines.append(f"LoRA (q,v) peak RSS {jax_peak:.0f} vs PEFT {torch_peak:.0f} MiB (target <=): "
                     f"{verdict(jax_peak <= torch_peak)}")
    if jax_qv:
        lines.append(f"LoRA (q,v) compile {jax_qv['compile_s']:.2f} s (target < 5 s): "
                     f"{verdict(jax_qv['compile_s'] < 5, jax_qv)}")
    if jax_q and jax_qv:
        slow = jax_q["step_s_median"] / jax_qv["step_s_median"]
        lines.append(f"QLoRA step / LoRA (q,v) step: {slow:.2f}x (target <= 1.5x): "
                     f"{verdict(slow <= 1.5, jax_q, jax_qv)}")
    shown = [r for r in records if r["framework"] == "jax"] + list(best_torch(records).values())
    busy = [f"{r['framework']}:{r['config']}" for r in shown if not r.get("quiet", True)]
    if busy:
        lines.append(f"warning: no quiet run of {', '.join(busy)} (other processes were using the cores)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps (default 2 and 10)")
    parser.add_argument("--only", help="one config (full, lora_qv, lora_all, qlora, lora_qv_bf16) or worker "
                                       "(jax:lora_qv, ...)")
    parser.add_argument("--steps", type=int, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, help="untimed steps before timing")
    parser.add_argument("--no-torch", action="store_true", help="jaxtune only")
    parser.add_argument("--output", default=str(HERE / "results" / "train_throughput.json"))
    parser.add_argument("--repeat", type=int, default=1, help="run every configuration this many times, in turn")
    parser.add_argument("--wait-idle", type=float, default=120.0, metavar="S",
                        help="before each configuration, wait up to S seconds for other processes to go quiet")
    parser.add_argument("--retry-busy", type=int, default=0, metavar="K",
                        help="measure a configuration up to K more times while other processes disturb it")
    parser.add_argument("--from-json", nargs="+", metavar="JSON", help="print the table of saved runs, measure nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.from_json:
        results = []
        for path in args.from_json:
            report = json.loads(Path(path).read_text())
            for r in report["results"]:  # runs saved before results carried their machine: the file's
                r.setdefault("machine", report.get("machine", {}))
                r.setdefault("machine_kind", machine_kind(r["machine"], Path(path).name))
                results.append(r)
        print(tables(aggregate(results)))
        return
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (3 if args.quick else 10)

    if args.worker:
        print(json.dumps(run_worker(args.worker, warmup, steps)))
        return

    try:
        import torch  # noqa: F401  (only to know whether the torch side can run; workers import their own)

        torch_available = not args.no_torch
    except ImportError:
        torch_available = False
    results = []
    host = machine()
    todo = [(r, n, 0) for r in range(args.repeat) for n in worker_names(args.only, torch_available)]
    while todo:
        repeat, name, attempt = todo.pop(0)
        idle_before = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else None
        result = spawn(name, warmup, steps)
        result.update(repeat=repeat, other_load_before=idle_before, machine=host, machine_kind=machine_kind(host))
        results.append(result)
        if result.get("other_load_cores", 0.0) >= QUIET_CORES and attempt < args.retry_busy:
            todo.append((repeat, name, attempt + 1))  # measured on a busy machine: try again later
        summary = (f"{result['tokens_per_s']:.0f} tok/s, {1e3 * result['step_s_median']:.0f} ms/step, "
                   f"{result['cpu_s_per_step']:.2f} CPU-s/step, others used {result['other_load_cores']:.2f} cores"
                   if "tokens_per_s" in result else result.get("unavailable") or result.get("error"))
        print(f"{name}: {summary}", file=sys.stderr, flush=True)
        records = write_report(args.output, host, warmup, steps, results)  # after every worker: a partial run is kept
    print(tables(records))


def write_report(path: str, host: dict, warmup: int, steps: int, results: list[dict]) -> list[dict]:
    records = aggregate(results)
    report = {"machine": host,
              "shape": M.SHAPE, "batch": [M.BATCH, M.SEQ], "warmup": warmup, "steps": steps,
              "summary": records, "results": results}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
