"""`fine_tune(config)`: a whole fine-tuning run, as `jaxtune train` runs it and a notebook can call it.

One loop for every objective: what differs (data, the step, the eval, the export) is a `StartedRun` (start.py, from
`start_run`), whose arrays and step are the spine's, sharded over `[mesh]`. Epoch e's batches depend only on
(data.seed, e) (GRPO's also on the params), so the data position is the step and a resumed run replays an
uninterrupted one; metrics reach the host one step late (the only host sync); a batch sampled a step ahead
(`StartedRun.ahead`) is scored while the step before it runs. Nothing trained is lost (`train/resume.py`): one
writer a run directory; a step's metrics line is on disk before its checkpoint; the last step is checkpointed before
its evaluation; SIGTERM/SIGINT finish the step, save it and return `interrupted` (a second one stops at once).
"""

from __future__ import annotations

import json
import signal
import sys
import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError, JaxtuneWarning
from jaxtune.host_cpu import warn_if_slow_bf16
from jaxtune.host_memory import release_after_compiles, return_large_blocks
from jaxtune.methods.transform import combine
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import stored_dtype
from jaxtune.objectives import objective_named
from jaxtune.parallel.distributed import barrier, host_copy, is_main_process, main_process_says
from jaxtune.parallel.mesh import make_mesh
from jaxtune.parallel.offload import on_device
from jaxtune.paths import check_output_dir, run_directory_lock
from jaxtune.run_config import RunConfig, config_items, dump_run_config, with_local_inputs
from jaxtune.train.card import push_run_result
from jaxtune.train.checkpoint import Checkpoints
from jaxtune.train.metrics import PHASES, MetricsLog, plot_losses
from jaxtune.train.outputs import fetch_run_directory, run_directories, sync_run_directory
from jaxtune.train.resume import check_resume, export_hint, record_config
from jaxtune.train.setup_checks import warn_degenerate
from jaxtune.train.start import StartedRun, start_run_on
from jaxtune.train.task_scores import task_scorer
from jaxtune.train.tracking import ProgressLines, Trackers

HIDDEN_METRICS = ("tokens", "loss_tokens", "bad_streak")  # used for tokens/s and the stop rule, not logged as is


@dataclass(frozen=True)
class RunResult:
    """eval_metrics: the last evaluation's record (eval_loss, eval_perplexity, eval_rewards/accuracy, ...).
    interrupted: stopped by `signal` (SIGTERM/SIGINT) before the last step, its checkpoint saved."""

    run_dir: Path
    step: int
    train_loss: float
    eval_loss: float | None
    eval_perplexity: float | None
    skipped_steps: int
    result_path: Path | None
    interrupted: bool = False
    eval_metrics: dict | None = None
    signal: int = 0


@contextmanager
def _stop_signals():
    """A dict whose "signal" entry is set by the first SIGTERM/SIGINT while the block runs; a second one raises
    KeyboardInterrupt at once (a step can take minutes)."""
    stop = {"signal": 0}

    def handler(signum, _):
        if stop["signal"]:
            raise KeyboardInterrupt
        stop["signal"] = signum
        print(f"jaxtune: {signal.Signals(signum).name}: stopping after this step, once it is checkpointed "
              "(again to stop at once, without saving it)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _progress(total: int, initial: int):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def fine_tune(config: RunConfig, log=print, progress=None) -> RunResult:
    """Train `config.model.path` with `config.train.objective` on `config.data.train`; write the run directory.

    run_dir = config.train.output_dir (a URL's local copy: `train.outputs`): config.toml, metrics.jsonl, loss.png,
    checkpoints/, and the result:
    adapter/ in PEFT format, or model/ as a Hugging Face directory for a full fine-tune; reward_model/ (an HF
    sequence-classification directory) for objective "reward". log: where messages go; progress: where the
    progress lines go when stderr is not a terminal (default: log).
    """
    with _stop_signals() as stop:
        return _train(config, log, progress or log, stop)


def start_run(config: RunConfig, log) -> StartedRun:
    """Check the config's required keys, then make the mesh, read the model's config and tokenizer, and prepare the
    objective's data, the spine's run and its weights (read straight into their shardings). bfloat16 compute on a
    CPU without fast bfloat16 dots gets one warning a process (`host_cpu.warn_if_slow_bf16`); from here on, the host
    memory each compile frees and large freed blocks go back to the system (`host_memory`)."""
    if not config.model.path:
        raise JaxtuneError("[model] path is not set")
    if not config.data.train:
        raise JaxtuneError("[data] train is not set")
    mesh = make_mesh(config.mesh)
    warn_if_slow_bf16(config.model.forward.compute_dtype)
    release_after_compiles()
    return_large_blocks()
    cfg = load_config(config.model.path)
    if config.model.router_aux_loss_coef >= 0:
        cfg = cfg.replace(router_aux_loss_coef=config.model.router_aux_loss_coef,
                          output_router_logits=config.model.router_aux_loss_coef > 0)
    tokenizer = load_tokenizer(config.model.path)
    return start_run_on(config, mesh, tokenizer, stored_dtype(config.model.path), cfg, log)


def _train(config: RunConfig, log, progress_log, stop: dict) -> RunResult:
    """Every input is checked (output directory, model, data, the checkpoint to resume and the config changes it
    allows) before the run directory is written to, so a run that fails to start leaves a finished one as it was.
    A Hub id in [model] or [data] is resolved first: the run records (and resumes from) its snapshot's path."""
    config = with_local_inputs(config)
    tc = config.train
    run_dir, checkpoint_dir = run_directories(tc.output_dir)
    writer = is_main_process()  # files that exist once are written by process 0 alone
    check_output_dir(run_dir, "train.output_dir")
    objective_named(tc.objective)  # an unknown objective fails before anything is written
    fetch_run_directory(tc.output_dir, run_dir)  # a URL output's run, restarted here
    if jax.process_count() > 1:
        log(f"process {jax.process_index()} of {jax.process_count()}: {len(jax.devices())} devices "
            f"({len(jax.local_devices())} local)")
    with ExitStack() as held:
        lock = held.enter_context(run_directory_lock(run_dir)) if writer else None
        if writer:  # what the run wrote reaches a URL output however it ends
            held.callback(sync_run_directory, tc.output_dir, run_dir)
        loading = time.perf_counter()
        log(f"loading {config.model.path} and {config.data.train}, placing the weights ...")
        task = start_run(config, log)
        score_tasks = task_scorer(config, task.run.context, task.run.shardings.params, task.run.mesh)
        log(f"ready in {time.perf_counter() - loading:.0f} s")
        checkpoints = Checkpoints(checkpoint_dir, tc.keep_checkpoints)
        held.callback(checkpoints.close)
        start = tc.resume_step if tc.resume_step >= 0 else (checkpoints.steps() or [0])[-1]
        recorded = config_items(config)
        state, changes = task.state, {}
        if start > 0:
            checkpoints.check_shapes(start, state, recorded)
            changes = check_resume(checkpoints.saved_config(start), recorded, checkpoints.directory / str(start))
            state, meta = checkpoints.restore(start, state)
            state = jax.device_put(state, task.run.shardings.state)
        if writer:
            assert lock is not None  # the writer's
            run_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire()  # a new directory is held from here
            record_config(run_dir, config, start, changes)
            for write in task.cache_writes:  # every input is checked by now
                write()
        if start > 0:
            checkpoints.discard_after(start)
            log(f"resumed from step {start} (epoch {meta['epoch']}, batch {meta['batch']})"
                + "".join(f"; {k} {json.dumps(old)} -> {json.dumps(new)}" for k, (old, new) in changes.items()))
        warn_degenerate(config, task, start)
        if stop["signal"]:  # asked to stop while loading: nothing new to save
            log(f"stopped by {signal.Signals(stop['signal']).name} before training from step {start}: nothing new to "
                "save")
            return RunResult(run_dir, start, float("nan"), None, None, 0, None, True, signal=stop["signal"])
        return _steps(config, task, checkpoints, start, state, changes, run_dir, writer, log, progress_log, stop,
                      score_tasks)


def _steps(config: RunConfig, task: StartedRun, checkpoints: Checkpoints, start: int, state: dict, changes: dict,
           run_dir: Path, writer: bool, log, progress_log, stop: dict, score_tasks=None) -> RunResult:
    """The step loop from `start` to the last step, then what a finished run leaves. score_tasks(params): the
    `[eval] tasks` scores (`task_scores.task_scorer`), recorded with each evaluation."""
    tc, run = config.train, task.run
    total_steps, steps_per_epoch = task.total_steps, task.steps_per_epoch
    objective = task.run.objective
    recorded = config_items(config)
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

    def run_eval(step: int) -> None:
        result = timed("eval", task.evaluate, state)
        if score_tasks is not None:
            result = {**(result or {}), **timed("eval", score_tasks, combine(state["params"], task.frozen))}
        if not result:
            return
        record({"step": step, "epoch": step / steps_per_epoch, **result})
        log(f"step {step}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in result.items()))

    def save(step: int) -> None:
        metrics_log.sync()  # the step's line is on disk before its checkpoint exists
        timed("checkpoint", checkpoints.save, step, state, {"step": step, "epoch": step // steps_per_epoch,
                                                            "batch": step % steps_per_epoch, "config": recorded})
        if writer:
            timed("checkpoint", sync_run_directory, tc.output_dir, run_dir)

    def eval_due(step: int) -> bool:
        return bool(tc.eval_every and step % tc.eval_every == 0) or step % steps_per_epoch == 0 or step == total_steps

    if changes:
        metrics_log.write({"step": start, "config_changes": {k: list(v) for k, v in changes.items()}})
    if start == 0 or (eval_due(start) and main_process_says(not metrics_log.has_eval(start))):
        run_eval(start)  # step 0's baseline, or the evaluation a killed run checkpointed and did not record
    log(f"training {objective.name}: {total_steps} steps ({steps_per_epoch} per epoch, {tc.grad_accum} x "
        f"{tc.batch_size} {objective.unit} of {config.data.max_seq_len} tokens)")
    progress = _progress(total_steps, start)
    lines = ProgressLines(total_steps, start, progress_log, tc.progress_every_s) if progress is None and writer \
        else None
    pending, last_time, train_loss = None, time.perf_counter(), float("nan")
    profile = _Profile(tc.profile_steps, run_dir / "profile", log)
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

    step, stopping = start, False
    for step in range(start + 1, total_steps + 1):
        epoch, index = divmod(step - 1, steps_per_epoch)
        profile.before(step)
        batch = timed("data", lambda: run.place_batch(task.batch(epoch, index, state)))
        # one-step-off rollouts: the next step's batch decoded with the params this step starts from, before the
        # step donates them, and scored on the host while the device runs the step
        finish = timed("data", task.ahead, *divmod(step, steps_per_epoch), state) if step < total_steps else None
        state, metrics = timed("step", run.step, state, task.frozen, task.second, batch)
        if finish is not None:
            timed("data", finish)  # before any checkpoint of this step: a resumed run reads the batch back
        profile.after(step, total_steps, state)
        if pending is not None:
            train_loss = flush(pending)
        pending = (step, metrics)
        stopping = bool(stop["signal"])  # read once: a signal between two reads would stop without a checkpoint
        checkpoint = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == total_steps or stopping
        if checkpoint or eval_due(step):
            train_loss, pending = flush(pending), None
        if checkpoint:
            save(step)
        if step == total_steps:
            break
        if eval_due(step):
            run_eval(step)
        if stopping:
            break
    if pending is not None:
        train_loss = flush(pending)
    if progress is not None:
        progress.close()
    final_step, skipped = int(state["step"]), int(state["skipped"])
    hint = export_hint(run_dir, config, final_step)
    with _after_training(f"checkpoint of step {final_step} is safe in {checkpoints.directory / str(final_step)}; "
                         f"{hint}"):
        if step == total_steps > start:
            run_eval(step)
        profile.close()
        trackers.close()
        if writer:
            plot_losses(metrics_log.records(), run_dir / "loss.png")
        if stopping and final_step < total_steps:
            name = signal.Signals(stop["signal"]).name
            log(f"stopped by {name} at step {final_step} of {total_steps}: checkpoint saved. Run the same command to "
                f"resume; {hint}")
            return RunResult(run_dir, final_step, train_loss, None, None, skipped, None, True, signal=stop["signal"])
        params = on_device(combine(state["params"], task.frozen), run.shardings.params)  # off host memory if offloaded
        if jax.process_count() > 1:
            params = host_copy(params)  # every process takes part in gathering what is split across them
        result_path = task.export(run_dir, params) if writer else None
        barrier("export")
        if result_path is not None and tc.push_to_hub:
            push_run_result(run_dir, config, result_path, log)
    evals = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in metrics_log.records()
             if any(k.startswith("eval_") for k in r)]
    last = evals[-1] if evals else None
    where = f"result in {result_path}" if writer else f"process {jax.process_index()}: process 0 writes the result"
    log(f"done: {final_step} steps, {skipped} skipped; {where}")
    return RunResult(run_dir, final_step, train_loss, None if last is None else last.get("eval_loss"),
                     None if last is None else last.get("eval_perplexity"), skipped, result_path, eval_metrics=last)


@contextmanager
def _after_training(safe: str):
    """End-of-run work: whatever fails in it is one JaxtuneError saying that the trained state is safe."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever it is, the user must learn that the trained state is safe
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        kind = "" if isinstance(e, (JaxtuneError, OSError)) else f"{type(e).__name__}: "
        raise JaxtuneError(f"after the last step: {kind}{text}. Nothing trained is lost: the {safe}") from e


class _Profile:
    """A `jax.profiler` trace of steps [first, last] (`train.profile_steps`), clipped to the run; a window outside
    it traces nothing (`setup_checks` says so at start), and a trace that fails to stop is a warning."""

    def __init__(self, steps: tuple, directory: Path, log):
        self.first, self.last = steps if steps else (0, -1)
        self.directory, self.log, self.tracing = directory, log, False

    def before(self, step: int) -> None:
        if step == self.first:
            try:
                jax.profiler.start_trace(str(self.directory))
                self.tracing = True
            except Exception as e:  # noqa: BLE001 - a profile is never worth the run
                warnings.warn(f"train.profile_steps: the trace did not start ({e})", JaxtuneWarning, stacklevel=2)

    def after(self, step: int, total_steps: int, state) -> None:
        if self.tracing and step == min(self.last, total_steps):
            jax.block_until_ready(state)
            self.close()
            self.log(f"profile of steps {self.first}-{step}: {self.directory}")

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            try:
                jax.profiler.stop_trace()
            except Exception as e:  # noqa: BLE001 - a profile is never worth the run
                warnings.warn(f"train.profile_steps: the trace did not stop ({e})", JaxtuneWarning, stacklevel=2)
