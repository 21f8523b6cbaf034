"""What storing Adam's moments in bfloat16 (`[offload] moments_dtype = "bfloat16"`) does to the loss.

The demo's setting, longer: a tiny Llama (4 layers, hidden 128) trained from random weights on the bundled text
(full fine-tune), then LoRA (all linear layers, rank 16) on the bundled instructions from that base; each run once
with float32 moments and once with bfloat16 moments, everything else equal. Prints a JSON line per run and a table.

    python experiments/bf16_moments.py [--steps 300] [--out runs/bf16-moments]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxtune.config import DataConfig, MethodConfig, ModelSection, OffloadConfig, TrainConfig
from jaxtune.demo import ASSETS, BASE_SHAPE
from jaxtune.methods import method_config
from jaxtune.presets import write_random_model
from jaxtune.run_config import RunConfig
from jaxtune.train.loop import fine_tune


def run(name: str, model: Path, method: MethodConfig, data: str, moments: str, out: Path, steps: int) -> dict:
    result = fine_tune(RunConfig(
        model=ModelSection(path=str(model)), method=method,
        data=DataConfig(train=str(ASSETS / data), eval_fraction=0.1, max_seq_len=128),
        train=TrainConfig(output_dir=str(out / f"{name}-{moments}"), max_steps=steps, batch_size=16,
                          learning_rate=3e-3, warmup_steps=10, log_every=1, eval_every=steps // 3),
        offload=OffloadConfig(moments_dtype=moments)), log=lambda *_: None)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    return {"run": name, "moments": moments, "losses": losses, "evals": evals, "result": str(result.result_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/bf16-moments")
    args = parser.parse_args()
    out = Path(args.out)
    model = write_random_model(out / "random-init", "llama", seed=0, **BASE_SHAPE)
    rows = []
    for name, method, data in (("full", method_config("full"), "demo_corpus.jsonl"),
                               ("lora", method_config("lora", rank=16, alpha=16, target_modules=("all-linear",)),
                                "demo_instructions.jsonl")):
        pair = [run(name, model, method, data, moments, out, args.steps) for moments in ("float32", "bfloat16")]
        for r in pair:
            print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
        rows.append(pair)
        if name == "full":
            model = Path(pair[0]["result"])  # LoRA starts from the float32-trained base, as in the demo
    print("\n| run | steps | train loss, mean of last 20: fp32 | bf16 | max relative difference of the step loss "
          "| eval loss: fp32 | bf16 |")
    print("|---|---|---|---|---|---|---|")
    for fp32, bf16 in rows:
        tail = lambda r: sum(r["losses"][-20:]) / 20
        diff = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"]))
        print(f"| {fp32['run']} | {len(fp32['losses'])} | {tail(fp32):.4f} | {tail(bf16):.4f} | {diff:.2e} "
              f"| {fp32['evals'][-1]:.4f} | {bf16['evals'][-1]:.4f} |")


if __name__ == "__main__":
    main()
