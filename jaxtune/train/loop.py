"""`fine_tune(config)`: a whole fine-tuning run, as `jaxtune train` runs it and a notebook can call it.

One loop for every objective (sft, dpo, reward, grpo, distill): what differs — data, the step, the eval, the
export — is a `Task` (tasks.py); the loop owns what they share. It is deterministic given the config: the batches
of epoch e depend only on (data.seed, e) (and for grpo on the params, restored exactly), so the data position is
just the step, and a run resumed from a checkpoint replays exactly what an uninterrupted run does. Metrics are
pulled to the host one step late (the only host sync), so the device is never idle waiting on a log. The run is
placed on the `[mesh]` (one device by default) with `jaxtune.parallel`: the state, frozen weights and batches get
their shardings (and, with `[offload]`, host memory) before the first step.
SIGTERM and SIGINT finish the current step, save a checkpoint and return.
"""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.host_cpu import warn_if_slow_bf16
from jaxtune.host_memory import release_after_compiles, return_large_blocks
from jaxtune.methods.transform import combine
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import stored_dtype
from jaxtune.objectives import objective_named
from jaxtune.parallel.distributed import barrier, host_copy, is_main_process
from jaxtune.parallel.mesh import make_mesh
from jaxtune.parallel.offload import on_device
from jaxtune.paths import check_output_dir, run_directories
from jaxtune.run_config import RunConfig, config_items, dump_run_config
from jaxtune.train.checkpoint import Checkpoints
from jaxtune.train.metrics import PHASES, MetricsLog, plot_losses
from jaxtune.train.tasks import Task, prepare_task
from jaxtune.train.tracking import ProgressLines, Trackers

HIDDEN_METRICS = ("tokens", "loss_tokens", "bad_streak")  # used for tokens/s and the stop rule, not logged as is


@dataclass(frozen=True)
class RunResult:
    """eval_metrics: the last evaluation's record (eval_loss, eval_perplexity, eval_rewards/accuracy, ...)."""

    run_dir: Path
    step: int
    train_loss: float
    eval_loss: float | None
    eval_perplexity: float | None
    skipped_steps: int
    result_path: Path | None
    interrupted: bool = False
    eval_metrics: dict | None = None


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
    """Train `config.model.path` with `config.train.objective` on `config.data.train`; write the run directory.

    run_dir = config.train.output_dir (see `run_directories` for gs://): config.toml, metrics.jsonl, loss.png,
    checkpoints/, and the result:
    adapter/ in PEFT format, or model/ as a Hugging Face directory for a full fine-tune; reward_model/ (an HF
    sequence-classification directory) for objective "reward".
    """
    with _preemption_flag() as flag:
        return _train(config, log, flag)


def setup_task(config: RunConfig, log) -> Task:
    """Check the config's required keys, then make the mesh, read the model's config and tokenizer, and prepare the
    objective's data, the spine's run and its weights (read straight into their shardings). bfloat16 compute on a
    CPU that widens it to float32 gets one warning a process (`host_cpu.warn_if_slow_bf16`); from here on, the host
    memory each compile frees and large freed blocks go back to the system (`host_memory`)."""
    if not config.model.path:
        raise JaxtuneError("[model] path is not set")
    if not config.data.train:
        raise JaxtuneError("[data] train is not set")
    mesh = make_mesh(config.mesh)
    warn_if_slow_bf16(config.model.compute_dtype)
    release_after_compiles()
    return_large_blocks()
    cfg = load_config(config.model.path)
    if config.model.router_aux_loss_coef >= 0:
        cfg = cfg.replace(router_aux_loss_coef=config.model.router_aux_loss_coef,
                          output_router_logits=config.model.router_aux_loss_coef > 0)
    tokenizer = load_tokenizer(config.model.path)
    return prepare_task(config, mesh, tokenizer, stored_dtype(config.model.path), cfg, log)


def _train(config: RunConfig, log, flag: dict) -> RunResult:
    """Every input is checked (output directory, model, data, the checkpoint to resume) before the run directory
    is written to, so a run that fails to start leaves a finished one as it was."""
    tc = config.train
    run_dir, checkpoint_dir = run_directories(tc.output_dir)
    writer = is_main_process()  # files that exist once are written by process 0 alone
    check_output_dir(run_dir, "train.output_dir")
    objective = objective_named(tc.objective)
    if jax.process_count() > 1:
        if objective.single_process:
            raise JaxtuneError(f"objective {objective.name} runs in one process (its batches are sampled on the "
                               f"host); this run has {jax.process_count()} processes")
        log(f"process {jax.process_index()} of {jax.process_count()}: {len(jax.devices())} devices "
            f"({len(jax.local_devices())} local)")
    loading = time.perf_counter()
    log(f"loading {config.model.path} and {config.data.train}, placing the weights ...")
    task = setup_task(config, log)
    log(f"ready in {time.perf_counter() - loading:.0f} s")
    run = task.run
    state, total_steps, steps_per_epoch = task.state, task.total_steps, task.steps_per_epoch

    checkpoints = Checkpoints(checkpoint_dir, tc.keep_checkpoints)
    start = tc.resume_step if tc.resume_step >= 0 else (checkpoints.steps() or [0])[-1]
    recorded = config_items(config)
    if start > 0:
        checkpoints.check_shapes(start, state, recorded)
        state, meta = checkpoints.restore(start, state)
        state = jax.device_put(state, run.shardings.state)
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_run_config(config))
        for write in task.cache_writes:  # every input is checked by now
            write()
    if start > 0:
        checkpoints.discard_after(start)
        log(f"resumed from step {start} (epoch {meta['epoch']}, batch {meta['batch']})")
    metrics_log = MetricsLog(run_dir / "metrics.jsonl" if writer else None, resume_step=start)
    trackers = Trackers(tc.report_to if writer else (), run_dir, dump_run_config(config))
    phases = dict.fromkeys(PHASES, 0.0)  # seconds since the last metrics record

    def record(values: dict) -> None:
        values = {**values, **{f"time_{k}_s": round(v, 4) for k, v in phases.items()}}
        phases.update(dict.fromkeys(phases, 0.0))
        metrics_log.write(values)
        trackers.write(values)

    def timed(phase: str, fn, *args):
        began = time.perf_counter()
        out = fn(*args)
        phases[phase] += time.perf_counter() - began
        return out

    def run_eval(step: int, epoch: float) -> None:
        result = timed("eval", task.evaluate, state)
        if result is None:
            return
        record({"step": step, "epoch": epoch, **result})
        log(f"step {step}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in result.items()))

    def save(step: int) -> None:
        timed("checkpoint", checkpoints.save, step, state, {"step": step, "epoch": step // steps_per_epoch,
                                                            "batch": step % steps_per_epoch, "config": recorded})

    if start == 0:
        run_eval(0, 0.0)
    log(f"training {objective.name}: {total_steps} steps ({steps_per_epoch} per epoch, {tc.grad_accum} x "
        f"{tc.batch_size} {objective.unit} of {config.data.max_seq_len} tokens)")
    progress = _progress(total_steps, start)
    lines = ProgressLines(total_steps, start, log, tc.progress_every_s) if progress is None and writer else None
    pending, last_time, train_loss, interrupted = None, time.perf_counter(), float("nan"), False
    log("compiling the step (the first step's time includes it) ...")

    def flush(pending) -> float:
        step, metrics = pending
        values = {k: v.item() for k, v in timed("step", jax.device_get, metrics).items()}
        now = time.perf_counter()
        nonlocal last_time
        elapsed, last_time = now - last_time, now
        if values["bad_streak"] >= tc.max_nonfinite_steps:
            save(step)
            raise JaxtuneError(f"step {step}: {values['bad_streak']} non-finite steps in a row (loss or gradients "
                               "NaN/inf); stopped. Lower train.learning_rate or check the data")
        tokens_per_s = values["tokens"] / max(elapsed, 1e-9)
        if step % tc.log_every == 0 or step == total_steps:
            logged = {k: v for k, v in values.items() if k not in HIDDEN_METRICS}
            record({"step": step, "epoch": step / steps_per_epoch, **logged, "tokens_per_s": tokens_per_s})
        if step == start + 1:
            log(f"step {step} (compile included) took {elapsed:.1f} s")
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tokens_per_s:.0f}")
        if lines is not None:
            lines.update(step, values["loss"], tokens_per_s)
        return values["loss"]

    for step in range(start + 1, total_steps + 1):
        epoch, index = divmod(step - 1, steps_per_epoch)
        if tc.profile_steps and step == tc.profile_steps[0]:
            jax.profiler.start_trace(str(run_dir / "profile"))
        batch = timed("data", lambda: run.place_batch(task.batch(epoch, index, state)))
        state, metrics = timed("step", run.step, state, task.frozen, task.second, batch)
        if tc.profile_steps and step == min(tc.profile_steps[1], total_steps):
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            log(f"profile of steps {tc.profile_steps[0]}-{step}: {run_dir / 'profile'}")
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
    trackers.close()
    checkpoints.close()
    final_step, skipped = int(state["step"]), int(state["skipped"])
    records = metrics_log.records()
    if writer:
        plot_losses(records, run_dir / "loss.png")
    if interrupted:
        log(f"interrupted at step {final_step}: checkpoint saved; run the same command again to resume")
        return RunResult(run_dir, final_step, train_loss, None, None, skipped, None, True)
    params = on_device(combine(state["params"], task.frozen), run.shardings.params)  # out of host memory, if offloaded
    if jax.process_count() > 1:
        params = host_copy(params)  # every process takes part in gathering what is split across them
    result_path = task.export(run_dir, params) if writer else None
    barrier("export")
    evals = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in records
             if any(k.startswith("eval_") for k in r)]
    last = evals[-1] if evals else None
    log(f"done: {final_step} steps, {skipped} skipped; result in {result_path}")
    return RunResult(run_dir, final_step, train_loss, last and last.get("eval_loss"),
                     last and last.get("eval_perplexity"), skipped, result_path, eval_metrics=last)
