"""Realistic data: one epoch of a long-tailed instruction set, jaxtune against TRL's `SFTTrainer`.

    .venv/bin/python benchmarks/realistic_data.py                          # the three runs, one epoch each
    .venv/bin/python benchmarks/realistic_data.py --examples 40 --max-steps 3   # a smoke test
    .venv/bin/python benchmarks/realistic_data.py --only jaxtune
    .venv/bin/python benchmarks/realistic_data.py --examples 300 --past-epoch 0.25   # + jaxtune past the epoch

Data: benchmarks/data/long_tailed_{train,eval}.jsonl (`experiments/make_long_tailed_data.py`): 2,000 training and
200 held-out prompt/completion pairs of real text (Python's docstrings, license texts) from 33 to 1,857 tokens,
median 160, mean 245. Model: the benchmark shape of `_measure.py` (hidden 512, 8 layers, 8 / 4 heads of 64) with
the byte-level tokenizer's 259-token vocabulary, a random `transformers.LlamaForCausalLM` saved in float32
safetensors beside jaxtune's `tokenizer.json` (which `AutoTokenizer` loads with the same ids; checked). Nothing is
downloaded: the model is made here and the Hugging Face libraries run offline.

Three runs, each a fresh process:
  jaxtune     `fine_tune` with its defaults: examples packed into rows of 2,048 (best-fit decreasing, each example
              attending only to itself), `batch_size` 1 row a step.
  TRL         `SFTTrainer` as its documentation sets it up (model path, prompt/completion dataset, `peft_config`):
              no packing, each batch padded to its longest example; `per_device_train_batch_size` = the mean number
              of examples in a jaxtune row, so both take about as many examples a step (the full set: 2,000
              examples in 239 rows, 8.4 a row; TRL takes 8, 250 steps to jaxtune's 239).
  TRL packed  the same with `packing=True`: TRL's best-fit decreasing packing into rows of `max_length` 2,048,
              which turns on its padding-free collator (one flattened row with `position_ids` restarting at each
              example; transformers builds the block-diagonal mask from them, so no example sees another).
Same on every side: LoRA rank 8, alpha 16, no dropout, on q_proj and v_proj; AdamW (0.9, 0.999, 1e-8, no weight
decay), lr 2e-4 constant, no warm-up, gradients clipped at 1.0; max length 2,048; float32; one epoch. TRL's own
defaults that differ are set to match: bf16 off (float32 like jaxtune), gradient checkpointing off (jaxtune's
remat "none"; recomputing would only slow TRL down), `lr_scheduler_type` "constant".

Loss on completion tokens only, on both sides: jaxtune's loss mask covers the completion and EOS; TRL's
`completion_only_loss` (on by default for prompt/completion data) sets the prompt's labels to -100. Each TRL run
checks that its labels cover exactly the tokens of jaxtune's rule (`labels_match`). Both divide the step's summed
loss by its completion-token count.

Measured: wall time from the start of the run (before `fine_tune` / before `SFTTrainer(...)`, so loading, tokenizing,
packing and jaxtune's compilation count) to the saved adapter; peak RSS of the process; the positions computed (rows
x length of every batch, padding included); the held-out loss (mean -log p over every completion token of the
held-out file, one sum and one count) of each saved adapter, by one evaluator for all (transformers + PEFT, fresh
process). The curve: the held-out loss at step 0 and about every 1/8 epoch against the training seconds so far, by
jaxtune's own evaluation (the same quantity) and by the shared evaluator inside TRL (a callback); evaluation time is
kept off the clock on both sides (for jaxtune by wrapping the task's `evaluate`, the one hook into `fine_tune`).
From the curves: the seconds each run takes to reach the held-out loss TRL's default run ends at; a run that ends
its epoch above it does not reach it, so `--past-epoch F` adds a fourth run, jaxtune going on for F of an epoch more
(the same rows again) with the held-out loss evaluated after every step, whose curve gives jaxtune's time to that
loss. Results go to benchmarks/results/realistic_data.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _measure as M  # noqa: E402

DATA = HERE / "data"
SEQ = 2048
TARGETS = ("q_proj", "v_proj")
CURVE_POINTS = 8  # held-out evaluations an epoch, besides step 0
RUNS = ("jaxtune", "trl", "trl_packed", "jaxtune_on")
LABELS = {"jaxtune": "jaxtune (packed)", "trl": "TRL SFTTrainer (default: padded)", "trl_packed": "TRL (packing=True)",
          "jaxtune_on": "jaxtune, on past the epoch"}
WORKER_OF = {"jaxtune_on": "jaxtune"}  # runs that are another run's worker with other settings
# Workers' environment: the Hugging Face libraries offline (nothing downloads), no progress bars in the logs.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Clock:
    """Seconds since it was made, less those spent inside `paused()` (held-out evaluations)."""

    def __init__(self):
        self.start, self.paused_s = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused_s

    @contextmanager
    def paused(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t0


def read_pairs(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def data_files(workdir: Path, examples: int | None) -> tuple[Path, Path]:
    """The bundled files, or (for `--examples N`) their first N training and first ceil(N / 10) held-out lines."""
    train, held_out = DATA / "long_tailed_train.jsonl", DATA / "long_tailed_eval.jsonl"
    if examples is None:
        return train, held_out
    subset = []
    for path, n in ((train, examples), (held_out, math.ceil(examples / 10))):
        out = workdir / path.name
        out.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:n]))
        subset.append(out)
    return subset[0], subset[1]


# --- the torch side: tokenizing as jaxtune does, and the shared held-out evaluator --------------------------------

def encode(tokenizer, pairs: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per pair by jaxtune's rule: prompt with special tokens (BOS) + completion + EOS, the mask 1
    on the completion and EOS."""
    out = []
    for pair in pairs:
        prompt = tokenizer(pair["prompt"])["input_ids"]
        completion = tokenizer(pair["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    return out


def held_out_loss(model, encoded: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int = 8) -> float:
    """Mean -log p of every completion token over the set (one sum, one count); batches of like length, padded."""
    import torch

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            chunk = [encoded[i] for i in order[start:start + batch_size]]
            T = max(len(ids) for ids, _ in chunk)
            ids_BxT = torch.full((len(chunk), T), pad_id, dtype=torch.long)
            valid_BxT = torch.zeros((len(chunk), T), dtype=torch.long)
            mask_BxT = torch.zeros((len(chunk), T))
            for r, (ids, mask) in enumerate(chunk):
                ids_BxT[r, :len(ids)] = torch.tensor(ids)
                valid_BxT[r, :len(ids)] = 1
                mask_BxT[r, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
            logits_BxTxV = model(input_ids=ids_BxT, attention_mask=valid_BxT, use_cache=False).logits.float()
            logp_BxT = torch.log_softmax(logits_BxTxV[:, :-1], -1).gather(-1, ids_BxT[:, 1:, None])[..., 0]
            total -= float((logp_BxT * mask_BxT[:, 1:]).sum())
            count += int(mask_BxT[:, 1:].sum())
    model.train(was_training)
    return total / count


def _torch_threads() -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)


# --- workers (each runs in its own process) ------------------------------------------------------------------------

def prepare(a) -> dict:
    """Write the model directory (seed 0); return jaxtune's packed rows, which set the examples a step, and whether
    transformers' tokenizer gives jaxtune's ids and loss masks on both files."""
    import torch
    import transformers

    from jaxtune.data.batching import count_epoch_batches
    from jaxtune.data.formats import load_sft_examples
    from jaxtune.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.byte_level()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=M.SHAPE["hidden_size"],
        intermediate_size=M.SHAPE["intermediate_size"], num_hidden_layers=M.SHAPE["num_layers"],
        num_attention_heads=M.SHAPE["num_heads"], num_key_value_heads=M.SHAPE["num_kv_heads"],
        head_dim=M.SHAPE["head_dim"], max_position_embeddings=SEQ, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(a.model, safe_serialization=True)
    tokenizer.save(a.model)
    hf = transformers.AutoTokenizer.from_pretrained(a.model)
    loaded = {path: load_sft_examples(path, tokenizer, SEQ)[0] for path in (a.train, a.eval)}
    same = all([(list(ex.ids), list(ex.loss_mask)) for ex in examples] == encode(hf, read_pairs(path))
               for path, examples in loaded.items())
    examples = loaded[a.train]
    return {"examples": len(examples), "rows": count_epoch_batches(examples, 1, SEQ),
            "tokens": sum(len(ex.ids) for ex in examples), "hf_tokenizer_matches": same,
            "vocab_size": tokenizer.vocab_size}


def run_jaxtune(a) -> dict:
    import jax

    from jaxtune.config import DataConfig, ModelSection, TrainConfig
    from jaxtune.methods import method_config
    from jaxtune.run_config import RunConfig
    from jaxtune.train import loop

    config = RunConfig(
        model=ModelSection(path=str(a.model)),
        method=method_config("lora", rank=M.RANK, alpha=M.ALPHA, target_modules=TARGETS),
        data=DataConfig(train=str(a.train), eval=str(a.eval), max_seq_len=SEQ),
        train=TrainConfig(output_dir=str(a.run_dir), batch_size=1, learning_rate=M.LEARNING_RATE,
                          schedule="constant", max_grad_norm=M.MAX_GRAD_NORM, max_steps=a.max_steps,
                          eval_every=a.every, log_every=1))
    clock, curve = Clock(), []
    setup = loop.start_run

    def timed_setup(config, log):
        task = setup(config, log)
        evaluate = task.training.evaluate

        def timed(eval_step, params):
            with clock.paused():
                record = evaluate(eval_step, params)
            curve.append({"train_s": clock.elapsed(), "eval_loss": record["eval_loss"]})
            return record

        return replace(task, training=replace(task.training, evaluate=timed))

    loop.start_run = timed_setup
    result = loop.fine_tune(config, log=lambda message: print(message, file=sys.stderr))
    wall = clock.elapsed()
    records = [json.loads(line) for line in (a.run_dir / "metrics.jsonl").read_text().splitlines()]
    for point, record in zip(curve, [r for r in records if "eval_loss" in r]):
        point.update(step=record["step"], epoch=record["step"] / a.rows)
    return {"wall_s": wall, "eval_s": clock.paused_s, "steps": result.step, "curve": curve,
            "examples_per_step": a.examples_total / a.rows, "rows": a.rows, "positions": result.step * SEQ,
            "train_loss": [r["loss"] for r in records if "loss" in r], "adapter": str(result.result_path),
            "own_final_eval_loss": result.eval_loss, "peak_rss_mib": M.peak_rss_mib(), "jax_version": jax.__version__}


def run_trl(a, packing: bool) -> dict:
    _torch_threads()
    import datasets
    import peft
    import torch
    import transformers
    import trl

    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)  # for the evaluator; TRL loads its own
    held_out = encode(tokenizer, read_pairs(a.eval))
    curve = []

    class HeldOutCurve(transformers.TrainerCallback):
        """The held-out loss at step 0, every `a.every` steps and at the end, off `clock`."""

        def __init__(self, clock: Clock):
            self.clock = clock

        def point(self, step: int, max_steps: int, model) -> None:
            with self.clock.paused():
                loss = held_out_loss(model, held_out, tokenizer.pad_token_id)
            curve.append({"train_s": self.clock.elapsed(), "eval_loss": loss, "step": step,
                          "epoch": step / max_steps})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.point(0, state.max_steps, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % a.every == 0 or state.global_step == state.max_steps:
                self.point(state.global_step, state.max_steps, model)

    args = trl.SFTConfig(
        output_dir=str(a.run_dir), num_train_epochs=1, max_steps=a.max_steps or -1,
        per_device_train_batch_size=1 if packing else a.batch, gradient_accumulation_steps=1,
        learning_rate=M.LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=M.MAX_GRAD_NORM, max_length=SEQ, packing=packing, bf16=False, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    lora = peft.LoraConfig(r=M.RANK, lora_alpha=M.ALPHA, lora_dropout=0.0, target_modules=list(TARGETS), bias="none",
                           task_type="CAUSAL_LM")
    clock = Clock()
    train = datasets.Dataset.from_list(read_pairs(a.train))
    trainer = trl.SFTTrainer(model=str(a.model), args=args, train_dataset=train, peft_config=lora,
                             callbacks=[HeldOutCurve(clock)])
    trainer.train()
    trainer.save_model(str(a.run_dir / "adapter"))
    wall = clock.elapsed()

    # Off the clock: the labels train exactly jaxtune's tokens; the positions an epoch's batches compute (one
    # shuffle of them: the padding depends on which examples share a batch).
    expected = encode(tokenizer, read_pairs(a.train))
    labels = trainer.train_dataset["labels"]
    if packing:  # rows of several examples: the counts agree
        labels_match = sum(x != -100 for row in labels for x in row) == sum(sum(m) for _, m in expected)
    else:
        labels_match = [[x != -100 for x in row] for row in labels] == [[bool(b) for b in m] for _, m in expected]
    epoch = [batch["input_ids"].numel() for batch in trainer.get_train_dataloader()]  # positions a batch
    steps = trainer.state.global_step
    return {"wall_s": wall, "eval_s": clock.paused_s, "steps": steps, "curve": curve,
            "examples_per_step": a.examples_total / len(epoch), "dataset_rows": len(trainer.train_dataset),
            "positions": sum(epoch) * steps / len(epoch),
            "train_loss": [r["loss"] for r in trainer.state.log_history if "loss" in r],
            "adapter": str(a.run_dir / "adapter"), "labels_match": labels_match,
            "completion_only_loss": trainer.completion_only_loss, "padding_free": trainer.padding_free,
            "attn_implementation": trainer.model.config._attn_implementation, "optim": str(args.optim),
            "peak_rss_mib": M.peak_rss_mib(), "torch_version": torch.__version__, "trl_version": trl.__version__,
            "transformers_version": transformers.__version__, "peft_version": peft.__version__}


def evaluate_adapters(a) -> dict:
    """The shared evaluator: base model and each adapter (transformers + PEFT) on the held-out file."""
    _torch_threads()
    import peft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)
    held_out = encode(tokenizer, read_pairs(a.eval))
    load = lambda: transformers.LlamaForCausalLM.from_pretrained(a.model, dtype="float32")
    losses = {"base": held_out_loss(load(), held_out, tokenizer.pad_token_id)}
    for name, adapter in json.loads(a.adapters).items():
        model = peft.PeftModel.from_pretrained(load(), adapter)
        losses[name] = held_out_loss(model, held_out, tokenizer.pad_token_id)
    return losses


WORKERS = {"prepare": prepare, "jaxtune": run_jaxtune, "trl": lambda a: run_trl(a, packing=False),
           "trl_packed": lambda a: run_trl(a, packing=True), "evaluate": evaluate_adapters}


# --- the runner ----------------------------------------------------------------------------------------------------

def spawn(name: str, a, **extra) -> dict:
    """Run `name`'s worker in a fresh interpreter, in an empty WORKDIR/NAME (a jaxtune run would resume from
    checkpoints left there); its result and log go to WORKDIR/NAME.json and .log."""
    worker = WORKER_OF.get(name, name)
    run_dir, result, log_path = (a.workdir / name, a.workdir / f"{name}.json", a.workdir / f"{name}.log")
    shutil.rmtree(run_dir, ignore_errors=True)
    result.unlink(missing_ok=True)
    options = {"model": a.model, "train": a.train, "eval": a.eval, "run-dir": run_dir, "result": result,
               "max-steps": a.max_steps, **extra}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker]
    for key, value in options.items():
        cmd += [f"--{key}", str(value)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **WORKER_ENV},
                              check=False).returncode
    if code:
        raise SystemExit(f"worker {worker} failed ({code}); {log_path} ends:\n{log_path.read_text()[-2000:]}")
    return {**json.loads(result.read_text()), "process_wall_s": time.perf_counter() - t0}


def time_to_loss(curve: list[dict], target: float) -> float | None:
    """The training seconds at which the held-out curve first reaches `target` (linear between points)."""
    for before, after in itertools.pairwise(curve):
        if after["eval_loss"] <= target:
            if before["eval_loss"] <= target:
                return before["train_s"]
            share = (before["eval_loss"] - target) / (before["eval_loss"] - after["eval_loss"])
            return before["train_s"] + share * (after["train_s"] - before["train_s"])
    return None


def table(rows: dict, target: float | None) -> str:
    header = ("| run | examples/step | steps | positions computed | wall s | held-out loss | s to TRL's loss "
              "| speed-up to that loss | wall speed-up | peak RSS MiB |")
    lines = [header, "|---|" + "---:|" * 9]
    reference = rows.get("trl", {})
    ratio = lambda ours, theirs: f"{theirs / ours:.2f}x" if ours and theirs else "—"
    for name, r in rows.items():
        reach = r.get("time_to_target_s")
        lines.append(f"| {LABELS[name]} | {r['examples_per_step']:.1f} | {r['steps']} | {r['positions']:,.0f} "
                     f"| {r['wall_s']:.0f} | {r['held_out_loss']:.4f} | {'—' if reach is None else f'{reach:.0f}'} "
                     f"| {ratio(reach, reference.get('time_to_target_s'))} "
                     f"| {ratio(r['wall_s'], reference.get('wall_s'))} | {r['peak_rss_mib']:.0f} |")
    if target is not None:
        lines.append(f"\nTRL's default run ends at held-out loss {target:.4f}; a speed-up is its seconds (to that "
                     "loss, or in all) over the run's.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, help="the first N training examples (and N/10 held-out)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each run after this many steps (0: one epoch)")
    parser.add_argument("--only", choices=RUNS, action="append")
    parser.add_argument("--workdir", type=Path, default=Path("runs/realistic_data"))
    parser.add_argument("--out", type=Path, help="default benchmarks/results/realistic_data.json (full runs) or "
                                                 "WORKDIR/realistic_data.json (--examples / --max-steps)")
    parser.add_argument("--worker", choices=WORKERS)
    for name in ("model", "train", "eval", "run-dir", "result"):
        parser.add_argument(f"--{name}", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--past-epoch", dest="past_epoch", type=float, default=0.0,
                        help="also run jaxtune this share of an epoch past one (its data again), evaluated every "
                             "step, for the seconds it takes to reach the held-out loss TRL's default run ends at")
    parser.add_argument("--examples-total", dest="examples_total", type=int, default=0)
    parser.add_argument("--rows", type=int, default=0)
    parser.add_argument("--adapters", default="{}")
    a = parser.parse_args()
    if a.worker:
        a.result.write_text(json.dumps(WORKERS[a.worker](a), indent=2) + "\n")
        return

    a.workdir = a.workdir.resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    a.model = a.workdir / "model"
    a.train, a.eval = data_files(a.workdir, a.examples)
    plan = spawn("prepare", a)
    if not plan["hf_tokenizer_matches"]:
        raise SystemExit("transformers' tokenizer does not give jaxtune's ids and loss mask")
    n, rows = plan["examples"], plan["rows"]
    batch = max(1, round(n / rows))  # TRL's examples a step: those of a jaxtune row, on average
    steps = {"jaxtune": rows, "trl": math.ceil(n / batch), "trl_packed": rows,
             "jaxtune_on": math.ceil(rows * (1 + a.past_epoch))}
    print(f"{n} examples, {plan['tokens']:,} tokens, {rows} packed rows of {SEQ}: jaxtune 1 row a step, "
          f"TRL {batch} examples a step (TRL packed: 1 row)", flush=True)
    results = {}
    for name in a.only or [r for r in RUNS if r != "jaxtune_on" or a.past_epoch]:
        total = min(steps[name], a.max_steps or steps[name])
        every = max(1, math.ceil(min(rows, total) / CURVE_POINTS))
        results[name] = spawn(name, a, batch=batch, every=every if name != "jaxtune_on" else 1,
                              **{"examples-total": n, "rows": rows, "max-steps": total})
        print(f"{name}: {results[name]['wall_s']:.1f} s, {results[name]['steps']} steps", flush=True)
    losses = spawn("evaluate", a, adapters=json.dumps({k: r["adapter"] for k, r in results.items()}))
    target = losses.get("trl")
    for name, r in results.items():
        r["held_out_loss"] = losses[name]
        r["time_to_target_s"] = None if target is None else time_to_loss(r["curve"], target)
    print(table(results, target))
    out = a.out or (a.workdir / "realistic_data.json" if a.examples or a.max_steps
                    else HERE / "results" / "realistic_data.json")
    out.write_text(json.dumps({"machine": os.uname().machine, "cpus": os.cpu_count(), "plan": plan,
                               "trl_batch": batch, "base_held_out_loss": losses["base"], "target_loss": target,
                               "settings": {"seq": SEQ, "rank": M.RANK, "alpha": M.ALPHA, "targets": TARGETS,
                                            "lr": M.LEARNING_RATE, "schedule": "constant",
                                            "max_grad_norm": M.MAX_GRAD_NORM, "dtype": "float32"},
                               "runs": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
