"""Where a train step's time goes, by category: jaxtune's step against PyTorch+PEFT's (issue 54).

    .venv/bin/python benchmarks/step_profile.py lora_qv full --torch --steps 4 --retry-busy 3
    .venv/bin/python benchmarks/step_profile.py --from-json before.json after.json   # side by side

jaxtune: the train-throughput benchmark's step (`_jax_worker.model_and_batch`, `abstract_run(...).step`, compiled
once), in a worker process with `jaxtune train`'s host-memory settings; 2 warm-up steps, then N under
`jax.profiler.trace`. Each XLA:CPU thunk of the Perfetto trace is one instruction of `compiled.as_text()`; its
category comes from the ops it runs and their `op_name`s, which carry the model's named scopes (attention, mlp,
kernel, norm, rope, activation, lora, head, optimizer; "transpose(" marks the backward). A thunk's time is its share
of the wall clock: two thunks running at once on two threads get half each, so the categories add up to the time
some thunk ran, and the wall step is printed beside it.

PyTorch: `_torch_worker.build`'s model and `train_step` (sdpa attention) under `torch.profiler` (CPU, shapes
recorded). Module hooks open `record_function` ranges (RMSNorm: norm, the rotary embedding and
`apply_rotary_pos_emb`: rope, the attention and MLP modules, the attention function: kernel, the MLP's act_fn and
its product with up: activation, PEFT's LoRA layers: lora, their base layer back to its sub-layer, lm_head up to the
loss: head, clipping, AdamW and zero_grad: optimizer). A backward op takes the ranges of the forward op whose
autograd node it runs (the same `sequence_nr`). Every event's self time is counted once.

GEMMs (a dot; aten::mm, addmm, bmm) are split by sub-layer (attention projections, MLP) into forward,
backward-input and backward-weight: a backward GEMM whose contraction runs over the step's tokens (the einsum's
token labels t, n or ..., on jaxtune's side; the contracted size B*T on torch's) is a weight gradient. The layer
scan's stacking: zero-filled stacks (a broadcast of a constant outside every scope), and the scan's own
dynamic-slice reads and dynamic-update-slice writes. Saves benchmarks/results/step_profile.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _measure as M  # noqa: E402
from train_throughput import (  # noqa: E402
    QUIET_CORES,
    children_cpu_s,
    cpu_busy_s,
    machine,
    machine_kind,
    wait_for_idle,
)

GEMM_PARTS = ("fwd", "bwd-input", "bwd-weight")
CATEGORIES = (
    *(f"attention GEMMs {part}" for part in GEMM_PARTS), *(f"MLP GEMMs {part}" for part in GEMM_PARTS),
    "head + loss", "attention kernel fwd", "attention kernel bwd", "norms", "RoPE", "MLP activation",
    "LoRA branches", "optimizer", "scan stacking", "copies/transposes", "other",
)
IDLE = "(no op running)"
# A named scope (jaxtune's `jax.named_scope`, the torch side's range) -> the category of its non-GEMM work; the
# innermost scope of these decides. "attention" and "mlp" name the GEMMs' sub-layer.
SCOPES = {"kernel": "attention kernel", "lora": "LoRA branches", "norm": "norms", "rope": "RoPE",
          "activation": "MLP activation", "head": "head + loss", "optimizer": "optimizer",
          "attention": "attention", "mlp": "MLP"}
# XLA ops that only move data (with what a fusion's parameters and tuples need).
MOVEMENT = {"copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice", "dynamic-update-slice",
            "concatenate", "pad", "constant", "parameter", "tuple", "get-tuple-element"}
PLUMBING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}  # no work, whatever the op
SCAN_SLICING = ("dynamic_index_in_dim", "dynamic_update_index_in_dim")  # lax.scan's reads and writes of its stacks
TOKEN_LABELS = {"t", "n", "..."}  # jaxtune's einsum labels of the tokens (linear._SPECS, lora_product)


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """One instruction of a compiled program: its `op_name`, the opcodes it runs (a fusion's, through nested
    fusions; scalar index arithmetic left out), the op_names of its dots and of its other work (not data movement)."""

    name: str
    op_name: str
    ops: frozenset[str]
    dots: tuple[str, ...]
    work: tuple[str, ...]


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")


def _split_instruction(rhs: str) -> tuple[str, str, str]:
    """(shape, opcode, the rest) of an instruction's right-hand side `shape opcode(operands), attributes` (a tuple
    shape has spaces)."""
    if rhs.startswith("("):
        depth = 0
        for i, c in enumerate(rhs):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                break
        shape, rest = rhs[:i + 1], rhs[i + 1:].lstrip()
    else:
        shape, _, rest = rhs.partition(" ")
    opcode = rest.split("(", 1)[0]
    return shape, opcode, rest[len(opcode):]


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of `text` (`compiled.as_text()`) by name."""
    computations: dict[str, list[tuple[str, str, str, list[str], bool]]] = {}
    current: list | None = None
    for line in text.splitlines():
        if current is None:
            head = _COMPUTATION.match(line)
            if head:
                current = computations.setdefault(head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif match := _INSTRUCTION.match(line):
            shape, opcode, rest = _split_instruction(match.group(2))
            op_name = re.search(r'op_name="([^"]*)"', rest)
            current.append((match.group(1), opcode, op_name.group(1) if op_name else "",
                            re.findall(r"calls=%([\w.\-]+)", rest), re.fullmatch(r"\w+\[\]", shape) is not None))

    def contents(entries) -> tuple[set[str], list[str], list[str]]:
        ops: set[str] = set()
        dots, work = [], []
        for _, opcode, op_name, called, scalar in entries:
            if not scalar and not called and opcode not in PLUMBING:
                ops.add(opcode)
                dots += [op_name] if opcode == "dot" else []
                work += [op_name] if opcode not in MOVEMENT and opcode != "dot" else []
            for c in called:
                more = contents(computations.get(c, []))
                ops |= more[0]
                dots += more[1]
                work += more[2]
        return ops, dots, work

    instructions = {}
    for body in computations.values():
        for entry in body:
            ops, dots, work = contents([entry])
            instructions[entry[0]] = Instruction(name=entry[0], op_name=entry[2], ops=frozenset(ops),
                                                 dots=tuple(dots), work=tuple(work))
    return instructions


def scopes_of(op_name: str) -> list[str]:
    """The names along an op_name, transforms peeled: "jit(step)/transpose(jvp(head))/mlp/dot_general" ->
    ["step", "head", "mlp", "dot_general"] (an empty transform, "jvp()", names nothing)."""
    names = []
    for part in op_name.split("/"):
        while (inner := re.fullmatch(r"[\w.]+\((.*)\)", part)) is not None:
            part = inner.group(1)
        if part:
            names.append(part)
    return names


def _innermost_scope(names: list[str]) -> str | None:
    return next((SCOPES[n] for n in reversed(names) if n in SCOPES), None)


def _weight_gradient(op_name: str) -> bool:
    """Whether a backward dot contracts over the tokens: its einsum spec ("lhs,rhs->out", the op_name's part
    before dot_general) has a token label in both operands and not in the output."""
    spec = next((p for p in reversed(op_name.split("/")) if "->" in p), "")
    operands, _, out = spec.partition("->")
    labels = lambda s: set(re.findall(r"\.\.\.|\w", s))  # noqa: E731
    lhs, _, rhs = operands.partition(",")
    return bool((labels(lhs) & labels(rhs) & TOKEN_LABELS) - labels(out))


def gemm_category(scope: str | None, backward: bool, weight_gradient: bool) -> str:
    """A GEMM's category from its innermost scope, direction and (backward) whether it is a weight gradient."""
    if scope in ("attention", "MLP"):
        part = "bwd-weight" if backward and weight_gradient else "bwd-input" if backward else "fwd"
        return f"{scope} GEMMs {part}"
    return work_category(scope, backward, movement=False)


def work_category(scope: str | None, backward: bool, movement: bool) -> str:
    """The category of work that is not a GEMM of the projections (nor the scan's stacking) in `scope`."""
    if scope == "attention kernel":
        return f"attention kernel {'bwd' if backward else 'fwd'}"
    if scope in CATEGORIES:
        return scope
    return "copies/transposes" if movement else "other"


def categorize(instruction: Instruction) -> str:
    """One jaxtune thunk's category (see the module doc): by its dots, else by the scope most of its work is in,
    else (data movement only) the scan's stacking or the scope of its op_name."""
    if instruction.dots:
        op_name = instruction.dots[0]
        return gemm_category(_innermost_scope(scopes_of(op_name)), "transpose(" in op_name, _weight_gradient(op_name))
    if instruction.work:
        scopes = Counter(s for s in (_innermost_scope(scopes_of(op_name)) for op_name in instruction.work) if s)
        finer = Counter({s: n for s, n in scopes.items() if s not in ("attention", "MLP")}) or scopes
        backward = sum("transpose(" in op_name for op_name in instruction.work) * 2 > len(instruction.work)
        return work_category(finer.most_common(1)[0][0] if finer else None, backward, movement=False)
    op_name = instruction.op_name
    scope = _innermost_scope(scopes_of(op_name))
    if any(s in op_name for s in SCAN_SLICING) or (scope is None and instruction.ops == {"broadcast"}):
        return "scan stacking"
    return work_category(scope, "transpose(" in op_name, movement=True)


def thunk_seconds(events: list[dict]) -> dict[str, float]:
    """Seconds per thunk name from a Perfetto trace's events: the leaf thunks (events with an `hlo_op` that contain
    no other such event on their thread) share the wall clock equally while they overlap."""
    thunks = sorted((e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})),
                    key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    leaves = []
    for i, e in enumerate(thunks):
        after = thunks[i + 1] if i + 1 < len(thunks) else None
        if not (after and after["tid"] == e["tid"] and after["ts"] < e["ts"] + e["dur"]):
            leaves.append(e)
    edges = sorted([(e["ts"], 1, i) for i, e in enumerate(leaves)] + [(e["ts"] + e["dur"], -1, i)
                                                                       for i, e in enumerate(leaves)])
    seconds: dict[str, float] = defaultdict(float)
    running: set[int] = set()
    last = None
    for t, kind, i in edges:
        if running and last is not None and t > last:
            share = (t - last) * 1e-6 / len(running)
            for j in running:
                seconds[leaves[j]["name"]] += share
        last = t
        (running.add if kind == 1 else running.discard)(i)
    return dict(seconds)


def jax_categories(hlo_text: str, events: list[dict], top: int = 0) -> tuple[dict[str, float], list[dict]]:
    """Seconds per category of a traced program (a thunk not in the program: "other"), and its `top` thunks
    (seconds, category, name, op_name)."""
    instructions = parse_hlo(hlo_text)
    totals: dict[str, float] = defaultdict(float)
    thunks = []
    for name, s in thunk_seconds(events).items():
        instruction = instructions.get(name)
        category = categorize(instruction) if instruction else "other"
        totals[category] += s
        thunks.append({"s": s, "category": category, "name": name,
                       "op_name": (instruction.dots[0] if instruction.dots else instruction.op_name) if instruction
                       else ""})
    return dict(totals), sorted(thunks, key=lambda t: -t["s"])[:top]


# ---- the torch side ---------------------------------------------------------------------------------------------

RANGE = "step_profile:"  # the prefix of this script's record_function ranges
TORCH_GEMMS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}  # -> index of the left operand
TORCH_MOVEMENT = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::transpose", "aten::t", "aten::view",
                  "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::expand", "aten::permute",
                  "aten::as_strided", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::cat",
                  "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias",
                  "aten::to", "aten::_to_copy", "aten::resize_", "aten::zeros", "aten::zero_", "aten::fill_"}


@dataclass(frozen=True, kw_only=True)
class TorchOp:
    """One profiled torch event: its name, self time (s), the ranges around it (outermost first; a backward op's
    are its forward op's), whether it ran in the backward, and its input shapes."""

    name: str
    self_s: float
    scopes: tuple[str, ...]
    backward: bool
    shapes: tuple = ()


def torch_category(op: TorchOp, tokens: int) -> str:
    """One torch event's category: a GEMM by its ranges and (backward) whether it contracts over `tokens`, other
    work by its innermost range."""
    scopes = list(op.scopes) + ([op.name[len(RANGE):]] if op.name.startswith(RANGE) else [])
    scope = _innermost_scope(scopes)
    if op.name in TORCH_GEMMS:
        left = op.shapes[TORCH_GEMMS[op.name]] if len(op.shapes) > TORCH_GEMMS[op.name] else ()
        return gemm_category(scope, op.backward, bool(left) and left[-1] == tokens)
    if scope == "MLP" and op.name == "aten::mul":  # LlamaMLP.forward's act_fn(gate) * up, outside act_fn
        return "MLP activation"
    return work_category(scope, op.backward, op.name in TORCH_MOVEMENT)


# ---- the jaxtune side -------------------------------------------------------------------------------------------

def jax_profile(name: str, steps: int, warmup: int = 2, setup: tuple | None = None) -> dict:
    """jaxtune's step of configuration `name` (the benchmark's model, or `setup`: `model_and_batch`'s tuple)
    traced over `steps` steps: ms a step by category, and the wall step."""
    import tempfile

    import _jax_worker
    import jax

    from jaxtune.config import MeshConfig
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.spine.run import abstract_run

    cfg, plan, tc, trainable, frozen, batch = setup or _jax_worker.model_and_batch(name)
    run = abstract_run(cfg, plan, make_mesh(MeshConfig(), jax.devices()[:1]), tc, warmup + steps)
    holder = {"state": run.init_state(trainable, seed=0)}
    del trainable  # a full fine-tune's state holds these buffers, donated
    compiled = run.step.lower(holder["state"], frozen, None, batch).compile()

    def step() -> float:
        start = time.perf_counter()
        holder["state"], _ = compiled(holder["state"], frozen, None, batch)
        jax.block_until_ready(holder["state"])
        return time.perf_counter() - start

    untraced = [step() for _ in range(warmup)]
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            times = [step() for _ in range(steps)]
        trace = next(Path(directory).rglob("perfetto_trace.json.gz"))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    totals, top = jax_categories(compiled.as_text(), events, top=15)
    top = [{**t, "ms": 1e3 * t.pop("s") / steps} for t in top]  # a step's
    return result("jax", name, steps, times, totals, untraced_ms=1e3 * untraced[-1], top_thunks=top,
                  jax_version=jax.__version__)


def result(framework: str, name: str, steps: int, times: list[float], totals: dict[str, float], **extra) -> dict:
    """A worker's record: ms a step per category (of `totals`, seconds over all `steps`), the wall step (the mean of
    `times`) and the categories' sum."""
    categories = {c: 1e3 * totals.get(c, 0.0) / steps for c in CATEGORIES}
    return {"framework": framework, "config": name, "steps": steps, "wall_ms": 1e3 * statistics.mean(times),
            "wall_ms_all": [1e3 * t for t in times], "categorized_ms": sum(categories.values()),
            "categories": categories, **extra}


# ---- runs and tables --------------------------------------------------------------------------------------------

def run_worker(worker: str, steps: int) -> dict:
    framework, name = worker.split(":")
    if framework == "jax":
        from jaxtune.host_memory import release_after_compiles, return_large_blocks

        release_after_compiles()  # the host memory settings `jaxtune train` runs with, as train_throughput.py's
        return_large_blocks()
        return jax_profile(name, steps)
    from _torch_ranges import torch_profile

    return torch_profile(name, steps)


def spawn(worker: str, steps: int) -> dict:
    """One worker in a fresh interpreter (a jaxtune one under huge pages, as train_throughput.py spawns it); its
    last stdout line is its JSON result."""
    from jaxtune.host_memory import huge_pages_environment

    env = os.environ.copy()
    if worker.startswith("jax:"):
        env = huge_pages_environment(env) or env
    start, busy, own = time.perf_counter(), cpu_busy_s(), children_cpu_s()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--steps", str(steps)],
                          capture_output=True, text=True, env=env)
    wall, others = time.perf_counter() - start, cpu_busy_s() - busy - (children_cpu_s() - own)
    if proc.returncode != 0:
        raise SystemExit(f"{worker}: " + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]))
    # other processes' CPU time meanwhile, in cores: a profile taken beside them is skewed (torch's most)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "glibc_tunables": env.get("GLIBC_TUNABLES", ""),
            "other_load_cores": max(others, 0.0) / wall}


def _cell(r: dict, key: str) -> str:
    if key in ("wall_ms", "untraced_ms"):
        return f"{r[key]:.1f}" if key in r else "—"
    ms = r["wall_ms"] - r["categorized_ms"] if key == IDLE else r["categorized_ms"] if key == "sum" else \
        r["categories"][key]
    return f"{ms:.1f} ({ms / r['wall_ms']:.0%})"


def tables(reports: list[tuple[str, dict]]) -> str:
    """One markdown table per configuration: ms a step (share of the wall step) per category, a column per
    framework and report (a report's label heads its columns when there are several, before/after)."""
    configs = list(dict.fromkeys(r["config"] for _, report in reports for r in report["results"]))
    sections = []
    for config in configs:
        columns = []
        for framework, title in (("jax", "jaxtune"), ("torch", "PyTorch+PEFT" if config != "full" else "PyTorch")):
            for label, report in reports:  # a framework's before and after side by side
                r = next((r for r in report["results"] if r["config"] == config and r["framework"] == framework),
                         None)
                if r is not None:
                    busy = " [busy]" if r.get("other_load_cores", 0.0) >= QUIET_CORES else ""
                    columns.append((f"{title} {label}".strip() + busy, r))
        head = "| category | " + " | ".join(title for title, _ in columns) + " |"
        rows = [head, "|---|" + "---:|" * len(columns)]
        for key, shown in [(c, c) for c in CATEGORIES] + [("sum", "sum of the categories"), (IDLE, IDLE),
                                                          ("wall_ms", "wall step"),
                                                          ("untraced_ms", "a step without the profiler")]:
            rows.append(f"| {shown} | " + " | ".join(_cell(r, key) for _, r in columns) + " |")
        sections.append(f"#### {config} (ms a step, share of the wall step)\n\n" + "\n".join(rows))
    return "\n\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="full, lora_qv, lora_all or lora_qv_bf16")
    parser.add_argument("--torch", action="store_true", help="profile PyTorch+PEFT's step too")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    parser.add_argument("--output", default=str(HERE / "results" / "step_profile.json"))
    parser.add_argument("--from-json", nargs="+", metavar="JSON", help="print saved profiles side by side")
    parser.add_argument("--wait-idle", type=float, default=120.0, metavar="S",
                        help="before each worker, wait up to S seconds for other processes to go quiet")
    parser.add_argument("--retry-busy", type=int, default=0, metavar="K",
                        help="profile a worker up to K more times while other processes disturb it; the quietest kept")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.steps)))
        return
    if args.from_json:
        several = len(args.from_json) > 1
        saved = []
        for path in args.from_json:
            try:
                saved.append((Path(path).stem if several else "", json.loads(Path(path).read_text())))
            except (OSError, ValueError) as error:
                parser.error(f"--from-json {path}: {error}")
        print(tables(saved))
        return
    unknown = [c for c in args.configs if c not in M.METHODS or c == "qlora"]
    if unknown or not args.configs:
        parser.error(f"configurations: full, lora_qv, lora_all or lora_qv_bf16 (not {', '.join(unknown)})" if unknown
                     else "name one or more configurations, or --from-json")
    host = machine()
    results = []
    for config in args.configs:
        for framework in ("jax", "torch") if args.torch else ("jax",):
            tries = []
            while not tries or (tries[-1]["other_load_cores"] >= QUIET_CORES and len(tries) <= args.retry_busy):
                wait_for_idle(args.wait_idle)
                tries.append(spawn(f"{framework}:{config}", args.steps))
                print(f"{framework}:{config}: wall {tries[-1]['wall_ms']:.0f} ms a step, categories "
                      f"{tries[-1]['categorized_ms']:.0f} ms, others used {tries[-1]['other_load_cores']:.2f} cores",
                      file=sys.stderr, flush=True)
            results.append(min(tries, key=lambda r: r["other_load_cores"]))
    report = {"machine": host, "machine_kind": machine_kind(host), "shape": M.SHAPE, "batch": [M.BATCH, M.SEQ],
              "steps": args.steps, "results": results}
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(tables([("", report)]))


if __name__ == "__main__":
    main()
