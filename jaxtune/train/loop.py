"""`fine_tune(config)`: the whole supervised fine-tuning run, as `jaxtune train` runs it and a notebook can call it.

The loop is deterministic given the config: the batches of epoch e depend only on (data.seed, e), so the data
position is just the step, and a run resumed from a checkpoint replays exactly what an uninterrupted run does.
Metrics are pulled to the host one step late (the only host sync), so the device is never idle waiting on a log.
The run is placed on the `[mesh]` (one device by default) with `jaxtune.parallel`: the state, frozen weights and
batches get their shardings (and, with `[offload]`, host memory) before the first step.
SIGTERM and SIGINT finish the current step, save a checkpoint and return.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxtune.data.batching import count_epoch_batches, epoch_batches
from jaxtune.data.formats import load_sft_examples, train_eval_split
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.hf_weights import load_model
from jaxtune.models.llama import ForwardOptions, Remat
from jaxtune.parallel.mesh import make_mesh
from jaxtune.parallel.offload import low_precision_moments, on_device
from jaxtune.parallel.placement import init_sharded_state, shard_eval_step, shard_train_step, train_shardings
from jaxtune.run_config import RunConfig, dump_run_config
from jaxtune.train.checkpoint import Checkpoints
from jaxtune.train.export import export_result
from jaxtune.train.evaluation import evaluate
from jaxtune.train.metrics import MetricsLog, plot_losses
from jaxtune.train.step import learning_rate_schedule, make_eval_step, make_optimizer, make_train_step


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    step: int
    train_loss: float
    eval_loss: float | None
    eval_perplexity: float | None
    skipped_steps: int
    result_path: Path | None
    interrupted: bool = False


def stack_micro_batches(batches: list[dict], grad_accum: int, index: int) -> dict:
    """Micro-batches index*A .. index*A+A-1 stacked to [A, B, T]; missing ones are empty (no loss tokens)."""
    chunk = batches[index * grad_accum:(index + 1) * grad_accum]
    chunk += [{k: np.zeros_like(v) for k, v in batches[0].items()}] * (grad_accum - len(chunk))
    return {k: np.stack([b[k] for b in chunk]) for k in chunk[0]}


@contextmanager
def _preemption_flag():
    """A dict whose "stop" entry turns True on SIGTERM/SIGINT while the block runs."""
    flag = {"stop": False}

    def handler(signum, _):
        flag["stop"] = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _progress(total: int, initial: int):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def fine_tune(config: RunConfig, log=print) -> RunResult:
    """Fine-tune `config.model.path` on `config.data.train` and write the run directory.

    run_dir = config.train.output_dir: config.toml, metrics.jsonl, loss.png, checkpoints/, and the result
    (adapter/ in PEFT format, or model/ as a Hugging Face directory for a full fine-tune).
    """
    with _preemption_flag() as flag:
        return _train(config, log, flag)


def _train(config: RunConfig, log, flag: dict) -> RunResult:
    tc, method = config.train, config.method
    run_dir = Path(tc.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_run_config(config))

    if not config.model.path:
        raise JaxtuneError("[model] path is not set")
    if not config.data.train:
        raise JaxtuneError("[data] train is not set")
    if method.dropout > 0:
        raise JaxtuneError(f"[method] dropout = {method.dropout}: adapter dropout is not implemented; set it to 0")
    mesh = make_mesh(config.mesh)
    cfg, base = load_model(config.model.path, None if config.model.dtype == "auto" else config.model.dtype)
    tokenizer = load_tokenizer(config.model.path)
    seq_len = config.data.max_seq_len
    examples, stats = load_sft_examples(config.data.train, tokenizer, seq_len)
    if config.data.eval:
        train_examples = examples
        eval_examples, _ = load_sft_examples(config.data.eval, tokenizer, seq_len)
    else:
        train_examples, eval_examples = train_eval_split(examples, config.data.eval_fraction, config.data.seed)
    log(f"data: {len(train_examples)} train / {len(eval_examples)} eval examples "
        f"({stats.dropped_prompt_too_long} dropped: prompt >= max_seq_len {seq_len}; {stats.truncated} truncated)")

    micro_per_epoch = count_epoch_batches(train_examples, tc.batch_size, seq_len, config.data.pack)
    steps_per_epoch = math.ceil(micro_per_epoch / tc.grad_accum)
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    options = ForwardOptions(compute_dtype=config.model.compute_dtype, remat=Remat(config.model.remat))

    params = apply_method(base, cfg, method, jax.random.key(tc.seed))
    trainable, frozen = partition(params, trainable_mask(params, method))
    optimizer = make_optimizer(tc, total_steps, trainable)
    if config.offload.moments_dtype != "float32":
        optimizer = low_precision_moments(optimizer, config.offload.moments_dtype)
    schedule = learning_rate_schedule(tc, total_steps)
    shardings = train_shardings(mesh, cfg, trainable, frozen, optimizer, tc.batch_size, config.offload)
    state = init_sharded_state(trainable, optimizer, tc.seed, shardings)
    frozen = jax.device_put(frozen, shardings.frozen)
    del base, params, trainable  # the unsharded copies: each device now holds only its part
    train_step = shard_train_step(make_train_step(cfg, method, options, optimizer, schedule), shardings)
    eval_step = shard_eval_step(make_eval_step(cfg, method, options), shardings)
    eval_batches = (epoch_batches(eval_examples, tc.batch_size, seq_len, config.data.seed, 0, config.data.pack)
                    if eval_examples else [])

    checkpoints = Checkpoints(run_dir / "checkpoints", tc.keep_checkpoints)
    start = tc.resume_step if tc.resume_step >= 0 else (checkpoints.steps() or [0])[-1]
    if start > 0:
        state, meta = checkpoints.restore(start, state)
        state = jax.device_put(state, shardings.state)
        checkpoints.discard_after(start)
        log(f"resumed from step {start} (epoch {meta['epoch']}, batch {meta['batch']})")
    metrics_log = MetricsLog(run_dir / "metrics.jsonl", resume_step=start)

    def run_eval(step: int, epoch: float) -> tuple[float, float] | None:
        if not eval_batches:
            return None
        loss, ppl, tokens = evaluate(eval_step, combine(state["params"], frozen), eval_batches)
        metrics_log.write({"step": step, "epoch": epoch, "eval_loss": loss, "eval_perplexity": ppl,
                           "eval_tokens": tokens})
        log(f"step {step}: eval loss {loss:.4f}, perplexity {ppl:.3f} ({tokens} tokens)")
        return loss, ppl

    def save(step: int) -> None:
        checkpoints.save(step, state, {"step": step, "epoch": step // steps_per_epoch,
                                       "batch": step % steps_per_epoch})

    if start == 0:
        run_eval(0, 0.0)
    log(f"training {total_steps} steps ({steps_per_epoch} per epoch, {tc.grad_accum} x {tc.batch_size} rows "
        f"of {seq_len} tokens)")
    progress = _progress(total_steps, start)
    pending, last_time, train_loss, interrupted = None, time.perf_counter(), float("nan"), False
    cached_epoch, batches = -1, []

    def flush(pending) -> float:
        step, metrics = pending
        values = {k: v.item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        nonlocal last_time
        elapsed, last_time = now - last_time, now
        if values["bad_streak"] >= tc.max_nonfinite_steps:
            save(step)
            raise JaxtuneError(f"step {step}: {values['bad_streak']} non-finite steps in a row (loss or gradients "
                               "NaN/inf); stopped. Lower train.learning_rate or check the data")
        if step % tc.log_every == 0 or step == total_steps:
            metrics_log.write({"step": step, "epoch": step / steps_per_epoch, "loss": values["loss"],
                               "learning_rate": values["learning_rate"], "grad_norm": values["grad_norm"],
                               "tokens_per_s": values["tokens"] / max(elapsed, 1e-9),
                               "skipped_steps": values["skipped_steps"]})
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{values['tokens'] / max(elapsed, 1e-9):.0f}")
        return values["loss"]

    for step in range(start + 1, total_steps + 1):
        epoch, index = divmod(step - 1, steps_per_epoch)
        if epoch != cached_epoch:
            batches = epoch_batches(train_examples, tc.batch_size, seq_len, config.data.seed, epoch,
                                    config.data.pack)
            cached_epoch = epoch
        state, metrics = train_step(state, frozen, stack_micro_batches(batches, tc.grad_accum, index))
        if pending is not None:
            train_loss = flush(pending)
        pending = (step, metrics)
        epoch_end = step % steps_per_epoch == 0
        if (tc.eval_every and step % tc.eval_every == 0) or epoch_end or step == total_steps:
            train_loss = flush(pending)
            pending = None
            run_eval(step, step / steps_per_epoch)
        if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == total_steps or flag["stop"]:
            save(step)
        if flag["stop"] and step < total_steps:
            interrupted = True
            break
    if pending is not None:
        train_loss = flush(pending)
    if progress is not None:
        progress.close()
    checkpoints.close()
    final_step = int(state["step"])
    records = metrics_log.records()
    plot_losses(records, run_dir / "loss.png")
    if interrupted:
        log(f"interrupted at step {final_step}: checkpoint saved; run the same command again to resume")
        return RunResult(run_dir, final_step, train_loss, None, None, int(state["skipped"]), None, True)
    params = on_device(combine(state["params"], frozen), shardings.params)  # out of host memory, if offloaded
    result_path = export_result(run_dir, config, cfg, params, method)
    evals = [r for r in records if "eval_loss" in r]
    log(f"done: {final_step} steps, {int(state['skipped'])} skipped; result in {result_path}")
    return RunResult(run_dir, final_step, train_loss, evals[-1]["eval_loss"] if evals else None,
                     evals[-1]["eval_perplexity"] if evals else None, int(state["skipped"]), result_path)
