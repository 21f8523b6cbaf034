"""A run never loses itself (issue 28): whatever fails after a step, a stop, a kill, a second writer, a full disk or a
changed config, what was trained stays on disk, exportable, and the run's record stays whole."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from test_train import metric_lines, setup, write_config  # noqa: F401 - setup: the tiny model and data fixture

from jaxtune.cli import main
from jaxtune.errors import JaxtuneError, JaxtuneWarning
from jaxtune.paths import run_directory_lock
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

QUIET = dict(log=lambda _: None)


def snapshot(directory: Path) -> dict:
    """Every file under `directory`: its bytes and modification time."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def jaxtune(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtune.cli", *map(str, args)], capture_output=True, text=True,
                          **kwargs)


@pytest.mark.full
def test_a_degenerate_setup_is_said_once_at_start_and_still_trains(setup, tmp_path):
    """The README's example settings on a small dataset (what a new user ran): a profile window after the run's
    last step crashed it at the end, losing everything. Now the run finishes and leaves its adapter, and each waste
    is one warning at start: rows fewer than a step takes, mostly padding, warm-up past the end, eval and checkpoint
    cadence beyond the run, the profile window."""
    _, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=0, epochs=3, batch_size=8,
                          grad_accum=4, warmup_steps=50, eval_every=100, checkpoint_every=200,
                          profile_steps=[20, 22])
    with pytest.warns(JaxtuneWarning) as said:
        result = fine_tune(load_run_config(config, ["data.max_seq_len=512"]), **QUIET)
    assert result.step == 3 and result.result_path == tmp_path / "run" / "adapter"
    texts = [str(w.message) for w in said if issubclass(w.category, JaxtuneWarning)]
    for expected in ("fewer than one step takes (train.batch_size 8 x train.grad_accum 4)",
                     "of the tokens each step computes are padding",
                     "train.warmup_steps = 50 reaches the run's last step (3)",
                     "train.eval_every = 100 is beyond the run's 3 steps",
                     "train.checkpoint_every = 200 is beyond the run's 3 steps",
                     "train.profile_steps = [20, 22] starts after the run's last step (3): no trace is taken"):
        assert sum(expected in text for text in texts) == 1, (expected, texts)
    assert not (tmp_path / "run" / "profile").exists()


@pytest.mark.full
def test_a_sane_setup_draws_no_warning(setup, tmp_path, recwarn):
    _, model, data = setup
    fine_tune(load_run_config(write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4,
                                           warmup_steps=1)), **QUIET)
    assert not [w for w in recwarn if issubclass(w.category, JaxtuneWarning)]


def test_a_failure_after_the_last_step_keeps_the_checkpoint_and_the_run_exports_from_it(setup, tmp_path,
                                                                                         monkeypatch):
    """The plot (end-of-run work) fails: one error saying the last step's checkpoint is safe and how to export it;
    `jaxtune export --run` then writes the adapter the finished run writes, byte for byte."""
    _, model, data = setup
    config = load_run_config(write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4,
                                          checkpoint_every=0))

    def full_disk(*_):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "loss.png"))

    monkeypatch.setattr("jaxtune.train.loop.plot_losses", full_disk)
    with pytest.raises(JaxtuneError, match=r"after the last step: \[Errno 28\] No space left on device.*Nothing "
                                           r"trained is lost: the checkpoint of step 4 is safe in .*checkpoints/4; "
                                           r"`jaxtune export --run .* --step 4 --peft OUT` writes its result"):
        fine_tune(config, **QUIET)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "adapter").exists()
    assert main(["export", "--run", str(tmp_path / "run"), "--peft", str(tmp_path / "exported")]) == 0
    rerun = fine_tune(config, **QUIET)  # the same command again: nothing to train, the result written
    assert rerun.step == 4 and rerun.result_path == tmp_path / "run" / "adapter"
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "exported" / name).read_bytes() == (rerun.result_path / name).read_bytes()


@pytest.mark.full
def test_a_trace_that_fails_to_stop_is_a_warning(setup, tmp_path, monkeypatch):
    _, model, data = setup

    def broken():
        raise RuntimeError("No profile started")

    monkeypatch.setattr("jax.profiler.stop_trace", broken)
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=3, profile_steps=[1, 2])
    with pytest.warns(JaxtuneWarning, match=r"train.profile_steps: the trace did not stop \(No profile started\)"):
        result = fine_tune(load_run_config(config), **QUIET)
    assert result.result_path.is_dir()
    monkeypatch.undo()
    jax.profiler.stop_trace()  # the trace is process-wide: a later test in this worker starts its own


@pytest.mark.full
def test_a_second_writer_is_refused_and_a_killed_one_leaves_no_lock(setup, tmp_path):
    """While a run holds its directory, another `train` on it is one line naming the holder, and changes nothing;
    the kernel drops the lock with a killed process, so the next run starts."""
    _, model, data = setup
    config = load_run_config(write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=2))
    fine_tune(config, **QUIET)
    before = snapshot(tmp_path / "run")
    with run_directory_lock(tmp_path / "run"):
        with pytest.raises(JaxtuneError, match=rf"train.output_dir '{tmp_path / 'run'}': another jaxtune run is "
                                               rf"writing to it \(process {os.getpid()}\)"):
            fine_tune(config, **QUIET)
    assert snapshot(tmp_path / "run") == before
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom jaxtune.paths import run_directory_lock\n"
                               f"with run_directory_lock({str(tmp_path / 'run')!r}):\n"
                               "    print('held', flush=True)\n    time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(JaxtuneError, match=rf"\(process {holder.pid}\)"):
        fine_tune(config, **QUIET)
    holder.kill()
    holder.wait()
    with run_directory_lock(tmp_path / "run"):
        pass


@pytest.mark.full
def test_resume_records_changes_that_keep_the_run_and_refuses_the_others(setup, tmp_path):
    """A resume may change the schedule and the run's length: logged, recorded in metrics.jsonl at the step it took
    effect, and kept as config-step-N.toml beside the config the run started with. A change of the data order is
    refused in one line naming it, and leaves the run directory as it was."""
    _, model, data = setup
    path = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4)
    first = load_run_config(path)
    fine_tune(first, **QUIET)
    run = tmp_path / "run"
    started_with = (run / "config.toml").read_text()
    lines = []
    longer = load_run_config(path, ["train.max_steps=6", "train.learning_rate=0.005"])
    assert fine_tune(longer, log=lines.append).step == 6
    assert any("resumed from step 4" in line and "train.max_steps 4 -> 6" in line
               and "train.learning_rate 0.01 -> 0.005" in line for line in lines), lines
    assert (run / "config.toml").read_text() == started_with
    assert load_run_config(run / "config-step-4.toml") == longer
    records = metric_lines(run)
    assert {"step": 4, "config_changes": {"train.max_steps": [4, 6], "train.learning_rate": [0.01, 0.005]}} in records
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]

    before = snapshot(run)
    with pytest.raises(JaxtuneError, match=r"checkpoints/6 was saved by a run with another config \(data.seed = 0 "
                                           r"there, 3 here\): resuming would not continue the same run"):
        fine_tune(load_run_config(path, ["train.max_steps=6", "train.learning_rate=0.005", "data.seed=3"]), **QUIET)
    assert snapshot(run) == before


@pytest.mark.slow
def train_killed_after_checkpoint(config, step: int) -> None:
    """`fine_tune(config)` in a subprocess that SIGKILLs itself the moment the step-`step` checkpoint is published."""
    killer = ("import os, signal\nfrom jaxtune.run_config import load_run_config\n"
              "from jaxtune.train.checkpoint import Checkpoints\nfrom jaxtune.train.loop import fine_tune\n"
              "save = Checkpoints.save\n"
              "def save_then_die(self, step, state, meta):\n    save(self, step, state, meta)\n"
              f"    if step == {step}:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
              "Checkpoints.save = save_then_die\n"
              f"fine_tune(load_run_config({str(config)!r}), log=lambda _: None)\n")
    died = subprocess.run([sys.executable, "-c", killer], capture_output=True, text=True)
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]


@pytest.mark.parametrize("eval_every", [0, 2])
@pytest.mark.full
def test_a_kill_right_after_a_checkpoint_loses_no_metrics_line(setup, tmp_path, eval_every):
    """SIGKILL the moment the step-4 checkpoint is published, before step 5 runs: step 4's line was still on the
    device (metrics come one step late) and, with eval_every 2, its evaluation not yet run. The same command again
    ends with the metrics.jsonl of a run never interrupted."""
    _, model, data = setup
    reference = write_config(tmp_path / "ref.toml", model, data, tmp_path / "ref", max_steps=6, eval_every=eval_every)
    fine_tune(load_run_config(reference), **QUIET)
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=6, eval_every=eval_every)
    train_killed_after_checkpoint(config, 4)
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()
    assert fine_tune(load_run_config(config), **QUIET).step == 6
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.full)])
def test_a_stopped_run_exits_non_zero_and_stays_exportable(setup, tmp_path, stop):
    """Ctrl-C (or a scheduler's SIGTERM) mid-run: the step is finished and checkpointed, the exit status is 130
    (143), one line says how to resume, and `jaxtune export --run` writes the adapter as of that step."""
    _, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=100000, log_every=100000,
                          eval_every=0, checkpoint_every=0)
    process = subprocess.Popen([sys.executable, "-m", "jaxtune.cli", "train", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if "compile included" in line:
            break
    time.sleep(1)
    process.send_signal(stop)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 128 + stop, err
    name = signal.Signals(stop).name
    said = [line for line in out.splitlines() if line.startswith(f"stopped by {name}")]
    step = int(said[0].split("at step ")[1].split()[0])
    assert said == [f"stopped by {name} at step {step} of 100000: checkpoint saved. Run the same command to resume; "
                    f"`jaxtune export --run {tmp_path / 'run'} --step {step} --peft OUT` writes its result"]
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()) == [step]
    assert not (tmp_path / "run" / "adapter").exists()
    exported = jaxtune("export", "--run", tmp_path / "run", "--peft", tmp_path / "adapter")
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.slow
@pytest.mark.full
def test_two_runs_on_one_directory_at_once(setup, tmp_path):
    """Two `jaxtune train` on one new output directory: the one that creates it first trains; the other exits 2
    naming the holder, and metrics.jsonl logs every step once."""
    _, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=30, checkpoint_every=0)
    first = subprocess.Popen([sys.executable, "-m", "jaxtune.cli", "train", str(config)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    for line in first.stdout:
        if line.startswith("training"):
            break
    os.kill(first.pid, signal.SIGSTOP)  # still training while the second starts, however fast its 30 steps are
    try:
        second = jaxtune("train", config)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert second.returncode == 2 and second.stderr.count("\n") == 1
    assert f"another jaxtune run is writing to it (process {first.pid})" in second.stderr
    steps = [r["step"] for r in metric_lines(tmp_path / "run") if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 30


def full_fine_tune(path: Path, model: Path, data: Path, out: Path) -> Path:
    """A config whose checkpoints take MiBs (the Adam state of every weight), one every 2 of 6 steps."""
    write_config(path, model, data, out, max_steps=6, checkpoint_every=2, keep_checkpoints=5)
    path.write_text(path.read_text().replace('kind = "lora"\nrank = 4\ntarget_modules = ["all-linear"]\n',
                                             'kind = "full"\n'))
    return path


@pytest.mark.full
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes(setup, tmp_path, monkeypatch):
    """tensorstore's error for a full disk, injected into the step-4 save after orbax has begun writing: one line
    naming the directory, the space a checkpoint takes and what is free; the step-2 checkpoint intact, the partial
    one gone; the same command then resumes from step 2 and ends as an unbroken run."""
    import orbax.checkpoint as ocp

    _, model, data = setup
    fine_tune(load_run_config(full_fine_tune(tmp_path / "ref.toml", model, data, tmp_path / "ref")), **QUIET)
    config = load_run_config(full_fine_tune(tmp_path / "c.toml", model, data, tmp_path / "run"))
    save = ocp.CheckpointManager.save

    def save_on_a_full_disk(self, step, *args, **kwargs):
        if step == 4:
            (Path(str(self.directory)) / "4.orbax-checkpoint-tmp-1234").mkdir()
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.mu" in OCDBT database: [OS error: No '
                             'space left on device]')
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_on_a_full_disk)
    with pytest.raises(JaxtuneError) as failed:
        fine_tune(config, **QUIET)
    assert str(failed.value).startswith(f"{tmp_path / 'run' / 'checkpoints'}: cannot write the checkpoint of step 4: "
                                        "no space left on device (a checkpoint takes about ")
    assert "free); the last complete checkpoint, step 2, is intact: make room and run the" in str(failed.value)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    monkeypatch.undo()
    assert fine_tune(config, **QUIET).step == 6
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")


FULL_DISK_SCRIPT = """set -e
mount -t tmpfs -o size={size} tmpfs {mount}
{python} -m jaxtune.cli train {config} > {mount}/../first.out 2> {mount}/../first.err || echo $? > {mount}/../first.rc
mount -o remount,size=256m {mount}
{python} -m jaxtune.cli train {config} > {mount}/../second.out 2> {mount}/../second.err
cp -r {mount}/run {mount}/../run
"""


@pytest.mark.slow
@pytest.mark.full
def test_a_full_disk_for_real(setup, tmp_path):
    """The same on a real full disk: the run directory on a tmpfs with room for one checkpoint and a half, in a
    private mount namespace (`unshare -m`, as root: CI's machines are), then the tmpfs made larger and the same
    command run again."""
    _, model, data = setup
    fine_tune(load_run_config(full_fine_tune(tmp_path / "ref.toml", model, data, tmp_path / "ref")), **QUIET)
    checkpoint = sum(p.stat().st_size for p in (tmp_path / "ref" / "checkpoints" / "2").rglob("*") if p.is_file())
    rest = sum(p.stat().st_size for p in (tmp_path / "ref").rglob("*")
               if p.is_file() and "checkpoints" not in p.parts and "model" not in p.parts)
    mount = tmp_path / "disk"
    mount.mkdir()
    config = full_fine_tune(tmp_path / "c.toml", model, data, mount / "run")
    size = rest + checkpoint * 3 // 2 + (1 << 18)
    script = FULL_DISK_SCRIPT.format(size=size, mount=mount, python=sys.executable, config=config)
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "first.rc").read_text().strip() == "2"
    err = (tmp_path / "first.err").read_text().splitlines()
    errors = [line for line in err if line.startswith("jaxtune: error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    failed = int(errors[0].split("cannot write the checkpoint of step ")[1].split(":")[0])
    assert failed in (4, 6)
    assert errors[0].startswith(f"jaxtune: error: {mount / 'run' / 'checkpoints'}: cannot write the checkpoint of "
                                f"step {failed}: no space left on device (a checkpoint takes about ")
    assert (f"free); the last complete checkpoint, step {failed - 2}, is intact: make room and run the same command"
            in errors[0])
    assert f"resumed from step {failed - 2}" in (tmp_path / "second.out").read_text()
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")
    shutil.rmtree(tmp_path / "run")


def test_export_run_names_what_is_missing_and_takes_a_checkpoint_directory(setup, tmp_path):
    """`export --run` on a directory that is no run, on a run with no checkpoint yet, with --step of a checkpoint
    that is gone: one line each. A checkpoint directory (RUN/checkpoints/N) stands for the run and that step."""
    _, model, data = setup
    assert jaxtune("export", "--run", tmp_path, "--peft", tmp_path / "a").stderr.strip() == \
        f"jaxtune: error: {tmp_path}: not a run directory (no config.toml)"
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4, checkpoint_every=2,
                          keep_checkpoints=5)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(config.read_text())
    assert "no checkpoint to export (the run saved none yet)" in main_error(["export", "--run", tmp_path / "run",
                                                                            "--peft", tmp_path / "a"])
    fine_tune(load_run_config(config), **QUIET)
    assert main_error(["export", "--run", tmp_path / "run", "--step", "3", "--peft", tmp_path / "a"]).endswith(
        "no checkpoint for step 3 (have: [2, 4])")
    assert main(["export", "--run", str(tmp_path / "run" / "checkpoints" / "2"), "--peft", str(tmp_path / "two")]) == 0
    assert main(["export", "--run", str(tmp_path / "run"), "--step", "2", "--peft", str(tmp_path / "step2")]) == 0
    assert (tmp_path / "two" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "step2" / "adapter_model.safetensors").read_bytes() != \
        (tmp_path / "run" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert "--step goes with --run" in main_error(["export", "--model", model, "--step", "2", "--peft", tmp_path / "b"])


def main_error(argv) -> str:
    """The one line `jaxtune ...` (in this process) writes on stderr, for a command that must fail with exit 2."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([str(a) for a in argv]) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_writing_on_a_full_disk_is_one_line_naming_the_file(setup, tmp_path, monkeypatch):
    """An export checks the room it needs before writing a byte; a disk that fills midway (ENOSPC from the write)
    is the same kind of line, the partial file removed."""
    from jaxtune.paths import writing

    _, model, _ = setup
    monkeypatch.setattr("jaxtune.paths.free_bytes", lambda path: 1000)
    line = main_error(["export", "--model", model, "--merged", tmp_path / "merged"])
    assert line.startswith(f"jaxtune: error: {tmp_path / 'merged'}/model.safetensors: not enough space to write it "
                           "(needs ") and line.endswith(", 1000 B free)")
    assert not (tmp_path / "merged" / "model.safetensors").exists()
    monkeypatch.setattr("jaxtune.paths.free_bytes", lambda path: None)
    target = tmp_path / "partial.bin"
    with pytest.raises(JaxtuneError, match=rf"^{target}: cannot write it: no space left on device \(needs 2.0 KiB\)$"):
        with writing(target, 2048), open(target, "wb") as f:
            f.write(b"x" * 1024)
            raise OSError(28, "No space left on device")
    assert not target.exists()
