"""GRPO, RLOO and on-policy (and seq_kd) distillation across devices and processes: each device decodes its own rows
of a rollout with the policy's (or the teacher's) split weights, each process scores its share of the rows, and the
run equals one device's (or one process's) on the same seed: losses, rewards, KL and gradient norms within 1e-5, with
the padded decode and with the paged rollout engine (`PAGED`). Two local `jaxtune train` processes are joined as
tests/test_distributed.py joins them; the 8-device runs are `fine_tune` in tests/parallel_worker.py."""

import json
from pathlib import Path

import numpy as np
import pytest
from eight_devices import DeviceWorker
from test_distributed import finish, free_port, records, train

from jaxtune.data.tokenizer import Tokenizer
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

TESTS = Path(__file__).resolve().parent
PROMPTS = ["Write:", "Say:", "Go:", "Now:", "Then:", "Here:", "So:", "Yes:", "No:", "Try:"]
COMPARED = ("loss", "reward", "kl", "grad_norm", "eval_reward", *(f"{e}rewards/{f}/mean" for e in ("", "eval_")
                                                                  for f in ("odd_characters", "letter_a_or_none")))

run_worker = DeviceWorker(TESTS / "parallel_worker.py")


@pytest.fixture(scope="module", autouse=True)
def _close_worker():
    yield
    run_worker.close()


# short, for the byte-level vocabulary (every character a token): "user: Go:\nassistant: ..."
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
EPISODES = 'environment = "grpo_environments.TwoTurns"\nenvironment_options = {turns = 2}'
PAGED = 'rollout_engine = "paged"\nrollout_slots = 8\nrollout_page_size = 4'  # 16 samples a step through 8 slots


def rollout_config(tmp_path: Path, objective: str, reward: str | list = "grpo_rewards.odd_characters",
                   max_steps: int = 3, extra: str = "") -> Path:
    """A LoRA run of `objective` on a random model with a chat template: 8 training prompts (2 held out), 4 a step,
    groups of 4. reward: a function's dotted path (or a list of them), or `EPISODES` (two-turn episodes, 128 tokens a
    row); extra: more lines of the objective's section."""
    model = tmp_path / "model"
    if not model.exists():
        write_random_model(model, "llama", seed=0, initializer_range=0.3, max_position_embeddings=256)
        tokenizer = Tokenizer.byte_level()
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save(model)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    config = tmp_path / f"{objective}.toml"
    config.write_text("\n".join([
        "[model]", f'path = "{model}"', "[method]", 'kind = "lora"', "[data]",
        f'train = "{tmp_path / "prompts.jsonl"}"',
        f"max_seq_len = {128 if reward == EPISODES else 24}", "eval_fraction = 0.2", "[train]",
        f'objective = "{objective}"', f"max_steps = {max_steps}",
        "batch_size = 4", "learning_rate = 2e-2", "log_every = 1", f"eval_every = {max_steps}",
        f"[{objective}]", reward if reward == EPISODES else f"reward = {json.dumps(reward)}", "group_size = 4",
        "max_new_tokens = 8", extra]) + "\n")
    return config


def two_processes(config: Path, output_dir: Path, env: dict | None = None) -> list:
    """Two `jaxtune train` processes of `config` joined as one cluster on a free local port, writing `output_dir`."""
    port = free_port()
    return [train(config, "--set", f"train.output_dir={output_dir}", "--coordinator", f"127.0.0.1:{port}",
                  "--num-processes", "2", "--process-id", str(i), env=env) for i in range(2)]


def assert_same_run(split: list[dict], one: list[dict]) -> None:
    """Within 1e-5 of one device's, or 1e-7 (float32 noise) of a loss that is ~0: the first step's, whose ratio is 1
    and whose advantages sum to 0 over each group."""
    assert len(split) == len(one) and sum("reward" in r for r in one) >= 3
    assert any(r.get("loss", 0) != 0 for r in one)  # the rewards differ within groups: a real gradient
    for a, b in zip(split, one):
        for key in COMPARED:
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]) + 1e-7, (key, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("objective, mesh, extra", [
    pytest.param("grpo", ("mesh.fsdp=4", "mesh.tensor=2"), "", id="grpo-fsdp4-tensor2"),
    pytest.param("rloo", ("mesh.fsdp=8",), "", id="rloo-fsdp8"),
    pytest.param("grpo", ("mesh.fsdp=8",), PAGED, id="grpo-paged-fsdp8")])
@pytest.mark.full
def test_eight_devices_run_grpo_and_rloo_as_one(tmp_path, objective, mesh, extra):
    """The padded decode, and the paged engine (`PAGED`: its slots split over the devices, the policy's weights as the
    run splits them)."""
    config = rollout_config(tmp_path, objective, extra=extra)
    one = fine_tune(load_run_config(config, [f"train.output_dir={tmp_path / 'one'}"]), log=lambda *_: None)
    single = [json.loads(line) for line in (one.run_dir / "metrics.jsonl").read_text().splitlines()]
    split = run_worker("loop", str(config), f"train.output_dir={tmp_path / 'eight'}", *mesh)
    assert_same_run(split["records"], single)


@pytest.mark.slow
@pytest.mark.full
def test_two_processes_run_grpo_as_one_each_scoring_half_the_rows(tmp_path):
    """Two reward functions, one returning None for some rows: each process scores its half with both, the table
    gathered (NaN too); the per-function metrics equal one process's."""
    config = rollout_config(tmp_path, "grpo", ["grpo_rewards.odd_characters", "grpo_rewards.letter_a_or_none"],
                            extra="reward_weights = [1.0, 0.5]")
    env = {"PYTHONPATH": str(TESTS), "GRPO_REWARD_CALLS": str(tmp_path / "calls")}
    single = train(config, "--set", f"train.output_dir={tmp_path / 'single'}", env=env)
    finish(single)
    whole = np.loadtxt(tmp_path / "calls", dtype=int, ndmin=2)[:, 1]
    (tmp_path / "calls").unlink()
    pair = two_processes(config, tmp_path / "pair", env)
    outputs = [finish(p) for p in pair]
    assert "process 0 of 2" in outputs[0] and "process 1 of 2" in outputs[1]
    assert_same_run(records(tmp_path / "pair"), records(tmp_path / "single"))
    calls = np.loadtxt(tmp_path / "calls", dtype=int, ndmin=2)
    assert sorted(whole.tolist()).count(16) == 3  # 3 steps of 4 prompts x 4, and the held-out evaluations
    for process in (0, 1):  # each call's rows halved between the processes
        assert sorted(calls[calls[:, 0] == process, 1].tolist()) == sorted(whole // 2), calls


@pytest.mark.slow
@pytest.mark.full
def test_two_processes_run_grpo_with_the_paged_engine_as_one(tmp_path):
    """`rollout_engine = "paged"` across two processes: one engine program over both's devices (each its slots, the
    policy split over both), its tokens gathered to both, so both build the batch one process builds; with a stop
    string, the chunks' tokens read back on both and the same samples ended on both (punctuation: about half of the
    random model's samples hold one)."""
    stops = json.dumps(list("!#$%&()*+,-./:;<=>?@[]^_{|}~"))
    config = rollout_config(tmp_path, "grpo", extra=f"{PAGED}\nstop_strings = {stops}")
    env = {"PYTHONPATH": str(TESTS)}
    finish(train(config, "--set", f"train.output_dir={tmp_path / 'single'}", env=env))
    pair = two_processes(config, tmp_path / "pair", env)
    for process in pair:
        finish(process)
    assert_same_run(records(tmp_path / "pair"), records(tmp_path / "single"))


@pytest.mark.slow
@pytest.mark.full
def test_two_processes_run_two_turn_episodes_as_one(tmp_path):
    """GRPO on `[grpo] environment` episodes: each process steps half of them, every turn one decode of both's."""
    config = rollout_config(tmp_path, "grpo", reward=EPISODES)
    env = {"PYTHONPATH": str(TESTS)}
    finish(train(config, "--set", f"train.output_dir={tmp_path / 'single'}", env=env))
    pair = two_processes(config, tmp_path / "pair", env)
    for process in pair:
        finish(process)
    assert_same_run(records(tmp_path / "pair"), records(tmp_path / "single"))


@pytest.mark.slow
@pytest.mark.full
def test_a_reward_that_fails_on_one_process_stops_both_in_one_line(tmp_path):
    config = rollout_config(tmp_path, "grpo", reward="grpo_rewards.fails_on_process_one")
    pair = two_processes(config, tmp_path / "pair", {"PYTHONPATH": str(TESTS)})
    outputs = []
    for process in pair:
        out, _ = process.communicate(timeout=600)
        assert process.returncode != 0, out[-2000:]
        outputs.append(out)
    assert "the grader on this host is down" in outputs[1], outputs[1][-2000:]
    assert "process 1 failed scoring its share of the rows" in outputs[0], outputs[0][-2000:]


def gkd_config(tmp_path: Path, section: str) -> Path:
    """A LoRA distillation run of a random student from a random teacher on 8 SFT prompts (2 held out), 8 a step;
    section: the [distill] lines beside teacher, alpha = 1, beta = 0.5 and max_new_tokens = 8."""
    student, teacher = tmp_path / "model", tmp_path / "teacher"
    write_random_model(student, "llama", seed=0, initializer_range=0.3, max_position_embeddings=64)
    write_random_model(teacher, "llama", seed=7, initializer_range=0.3, max_position_embeddings=64)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": " fine."}) + "\n"
                                                for p in PROMPTS))
    config = tmp_path / "gkd.toml"
    config.write_text("\n".join([
        "[model]", f'path = "{student}"', "[method]", 'kind = "lora"', "[data]", f'train = "{tmp_path / "sft.jsonl"}"',
        "max_seq_len = 24", "pack = false", "eval_fraction = 0.2", "[train]", 'objective = "distill"', "max_steps = 3",
        "batch_size = 8", "learning_rate = 2e-2", "log_every = 1", "eval_every = 3", "[distill]",
        f'teacher = "{teacher}"', "alpha = 1.0", "beta = 0.5", "max_new_tokens = 8", section]) + "\n")
    return config


def assert_same_distillation(split: list[dict], one: list[dict]) -> None:
    assert len(split) == len(one)
    for a, b in zip(split, one):
        for key in ("loss", "kl", "grad_norm", "eval_kl", "loss_tokens", "on_policy"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]) + 1e-7, (key, a, b)


@pytest.mark.slow
@pytest.mark.full
def test_eight_devices_run_on_policy_distillation_as_one(tmp_path):
    """GKD with lmbda = 1 (`[distill]`): the student's samples are decoded under fsdp=8 as GRPO's rollouts are, so
    the batches, losses, divergences and gradient norms equal one device's."""
    config = gkd_config(tmp_path, "lmbda = 1.0")
    one = fine_tune(load_run_config(config, [f"train.output_dir={tmp_path / 'one'}"]), log=lambda *_: None)
    single = [json.loads(line) for line in (one.run_dir / "metrics.jsonl").read_text().splitlines()]
    split = run_worker("loop", str(config), f"train.output_dir={tmp_path / 'eight'}", "mesh.fsdp=8")["records"]
    assert sum("on_policy" in r for r in single) == 3
    assert_same_distillation(split, single)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("section, kinds", [("lmbda = 1.0", [1, 1, 1]), ("lmbda = 0.5\nseq_kd = true", [0, 0, 1])])
def test_two_processes_run_on_policy_and_sequence_level_distillation_as_one(tmp_path, section, kinds):
    """GKD across two `jaxtune train` processes: each decodes its half of the rows (the student's samples and, with
    seq_kd, the teacher's from its loaded weights: the seed draws teacher, teacher, student); losses, divergences
    and gradient norms equal one process's."""
    config = gkd_config(tmp_path, section)
    finish(train(config, "--set", f"train.output_dir={tmp_path / 'single'}"))
    pair = two_processes(config, tmp_path / "pair")
    outputs = [finish(p) for p in pair]
    assert "process 0 of 2" in outputs[0] and "process 1 of 2" in outputs[1]
    single = records(tmp_path / "single")
    assert [r["on_policy"] for r in single if "on_policy" in r] == kinds
    assert_same_distillation(records(tmp_path / "pair"), single)
    if "seq_kd" in section:  # the teacher's first step is not the dataset's batch the same run without it takes
        finish(train(config, "--set", f"train.output_dir={tmp_path / 'dataset'}", "--set", "distill.seq_kd=false"))
        first = [next(r for r in records(tmp_path / run) if "kl" in r) for run in ("single", "dataset")]
        assert first[0]["on_policy"] == first[1]["on_policy"] == 0 and first[0]["kl"] != first[1]["kl"], first
