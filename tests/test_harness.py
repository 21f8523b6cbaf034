"""jaxtune as an lm-eval model, without torch: packed scoring equals each request's own forward, lm-eval's own API and
command line run two tasks with `--model jaxtune`, `jaxtune eval --tasks` writes lm-eval's results, training writes
task scores to metrics.jsonl, TensorBoard and the plot, and bad tasks or model_args end in one line.
(Agreement with lm-eval's `hf` model on real weights: tests/test_harness_parity.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import lm_eval
import matplotlib.pyplot as plt
import numpy as np
import pytest
from conftest import numpy_random_params
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_generate import randomize_lora
from test_tracking import _items, _train, _wandb_records, no_wandb_credentials  # noqa: F401

from jaxtune.cli import main
from jaxtune.config import tiny_config
from jaxtune.errors import JaxtuneError
from jaxtune.harness import JaxtuneLM, evaluate_tasks, scores, scoring
from jaxtune.harness.scoring import pack_rows, score_requests
from jaxtune.harness.tasks import bundled_tasks
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method
from jaxtune.models.attention import BRANCH_SHIFT
from jaxtune.models.llama import forward
from jaxtune.presets import write_random_model

jit_forward = jax.jit(forward, static_argnames=("cfg", "method"))

QUESTIONS = [("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
             ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
             ("Which planet is called the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
             ("What is two plus two?", ["three", "five", "six", "four"], 3)]
ANSWERS = [("What is the capital of Italy?", "Rome"), ("What is the opposite of hot?", "cold"),
           ("What day comes after Monday?", "Tuesday")]
MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
QA_YAML = """task: tiny_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 6
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("model"), "llama", seed=0)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """tiny_mc.yaml and tiny_qa.yaml, their data files named relative to the YAML's directory."""
    directory = tmp_path_factory.mktemp("tasks")
    (directory / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                                for q, c, a in QUESTIONS))
    (directory / "qa.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in ANSWERS))
    (directory / "tiny_mc.yaml").write_text(MC_YAML.format(data="mc.jsonl"))
    (directory / "tiny_qa.yaml").write_text(QA_YAML.format(data="qa.jsonl"))
    return directory


def test_packing_fills_rows_longest_first():
    rows = pack_rows([5, 9, 3, 7, 2, 16], 16)
    assert rows == [[5], [1, 3], [0, 2, 4]]
    assert all(sum([5, 9, 3, 7, 2, 16][i] for i in row) <= 16 for row in rows)


@pytest.mark.parametrize("windows", [(0, 6), (0, 0)], ids=["window", "trees"])
@pytest.mark.parametrize("method", [None, method_config("lora", rank=4, target_modules=("q_proj", "v_proj", "o_proj")),
                                    method_config("prefix", num_virtual_tokens=3)], ids=["base", "lora", "prefix"])
@pytest.mark.full
def test_packed_scores_equal_each_requests_own_forward(method, windows, monkeypatch):
    """Requests of 2..40 tokens packed several to a row (and over several batches) score as each alone: the sum of
    float64 log-softmax of its own forward's logits at the continuation, and whether each token is the argmax.
    Requests sharing a context share its computation (prefix trees) unless a sliding window is narrower than a row."""
    cfg = tiny_config(vocab_size=259, num_layers=2, sliding_windows=windows)
    params = numpy_random_params(cfg)
    if method is not None:
        params = apply_method(params, cfg, method, jax.random.key(1))
        params = randomize_lora(params) if method.kind == "lora" else params
    rng = np.random.RandomState(0)
    totals, conts = rng.choice([9, 17, 31], 14), rng.randint(1, 8, 14)  # 3 input lengths: 3 reference compiles
    requests = [(rng.randint(0, 259, t - c).tolist(), rng.randint(0, 259, c).tolist()) for t, c in zip(totals, conts)]
    for ctx in (requests[0][0], requests[5][0]):  # choices of one question: 1 to 4 tokens, one equal to another's
        requests += [(ctx, rng.randint(0, 259, 1 + k % 4).tolist()) for k in range(5)] + [(ctx, requests[-1][1])]
    fewshot = rng.randint(0, 259, 7).tolist()  # questions after one few-shot prefix: a tree's root, a branch each
    requests += [(fewshot + rng.randint(0, 259, 2).tolist(), rng.randint(0, 259, 1 + k).tolist())
                 for _ in range(3) for k in range(3)]
    logits = lambda ids: np.asarray(jit_forward(params, np.asarray([ids]), cfg, method=method)[0], np.float64)
    segments = []
    real = scoring.continuation_logprobs
    monkeypatch.setattr(scoring, "continuation_logprobs",
                        lambda *args, **kw: segments.append(np.asarray(args[3])) or real(*args, **kw))
    got = score_requests(params, cfg, requests, method=method, batch_tokens=64)
    trees = windows == (0, 0)
    assert (max(s.max() for s in segments) >= 2 ** BRANCH_SHIFT) == trees  # branches only where windows allow them
    roots = [set(row[(row > 0) & (row < 2 ** BRANCH_SHIFT)]) & set(row[row >= 2 ** BRANCH_SHIFT] >> BRANCH_SHIFT)
             for s in segments for row in s]
    assert any(roots) == trees  # the few-shot prefix computed once, as a root under several branches
    for (ctx, cont), (logp, greedy) in zip(requests, got):
        x = logits((ctx + cont)[:-1])[-len(cont):]
        log_softmax = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        assert logp == pytest.approx(log_softmax[np.arange(len(cont)), cont].sum(), abs=2e-5)
        assert greedy == bool(np.all(x.argmax(-1) == cont))
    # a request that is its own continuation's argmax must say so: take the greedy tokens as the continuation
    ctx = requests[0][0]
    cont = [int(logits(ctx)[-1].argmax())]
    assert score_requests(params, cfg, [(ctx, cont)], method=method)[0][1] is True


@pytest.mark.full
def test_lm_eval_api_scores_two_tasks_with_model_jaxtune(model_dir, tasks):
    """lm_eval.simple_evaluate(model="jaxtune", model_args="model=...") on a multiple-choice and a generation task
    (YAML files whose data lie beside them); the flat scores are what training logs."""
    both = [str(tasks / "tiny_mc.yaml"), str(tasks / "tiny_qa.yaml")]
    results = evaluate_tasks(JaxtuneLM(model=str(model_dir)), both, log_samples=True)
    assert set(results["results"]) == {"tiny_mc", "tiny_qa"}
    mc = results["samples"]["tiny_mc"]
    assert len(mc) == len(QUESTIONS) and all(len(s["resps"]) == 4 for s in mc)
    assert all(logp < 0 for s in mc for ((logp, _),) in s["resps"])
    flat = scores(results)
    assert set(flat) == {"tiny_mc/acc", "tiny_qa/exact_match"} and 0 <= flat["tiny_mc/acc"] <= 1
    assert results["pretty_env_info"].startswith(f"jax {jax.__version__}")  # not torch's collect_env (seconds)
    via_registry = lm_eval.simple_evaluate(model="jaxtune", model_args=f"model={model_dir},batch_size=2",
                                           tasks=[_absolute(tasks / "tiny_mc.yaml")], log_samples=True,
                                           torch_random_seed=None, bootstrap_iters=0)
    assert [s["resps"] for s in via_registry["samples"]["tiny_mc"]] == [s["resps"] for s in mc]


def _absolute(yaml_path: Path) -> dict:
    from jaxtune.harness.tasks import task_specs

    return task_specs([str(yaml_path)])[0][0]


def test_lm_eval_command_line_runs_two_tasks_with_model_jaxtune(model_dir, tasks, tmp_path):
    """lm-eval's own entry point (`cli_evaluate`, here with jaxtune registered: `python -m jaxtune.harness`), as an
    lm-eval user runs it: two task files, --model jaxtune, results JSON written by lm-eval; compile_cache keeps the
    compiled programs."""
    out = subprocess.run([sys.executable, "-m", "jaxtune.harness", "run", "--model", "jaxtune", "--model_args",
                          f"model={model_dir},compile_cache={tmp_path / 'xla'}", "--tasks", "tiny_mc.yaml",
                          "tiny_qa.yaml", "--batch_size", "4",
                          "--output_path", str(tmp_path / "out")], cwd=tasks, env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (written,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(written.read_text())
    assert set(results["results"]) == {"tiny_mc", "tiny_qa"} and results["config"]["model"] == "jaxtune"
    assert "|tiny_mc|" in out.stdout.replace(" ", "")
    assert len(list((tmp_path / "xla").iterdir())) >= 3  # scoring, prefill, decode


@pytest.mark.full
def test_jaxtune_eval_tasks_writes_results_and_table(model_dir, tasks, tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "eval", "--model", str(model_dir), "--tasks",
                          f"{tasks / 'tiny_mc.yaml'},{tasks / 'tiny_qa.yaml'}", "--output", str(tmp_path / "r.json"),
                          "--json"], env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = json.loads(out.stdout)
    written = json.loads((tmp_path / "r.json").read_text())
    assert printed == written["results"] and set(printed) == {"tiny_mc", "tiny_qa"}
    assert "tiny_qa" in (tmp_path / "r.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task': not a task YAML file, a bundled task"),
    (["--tasks", "hellaswg"], "did you mean hellaswag"),
    (["--tasks", "missing.yaml"], "missing.yaml: task file not found"),
    (["--tasks", "jaxtune_facts", "--model-args", "batch_tokens=lots"], "model_args: batch_tokens='lots' is not an"),
    (["--tasks", "jaxtune_facts", "--model-args", "colour=blue"], "model_args: unknown key 'colour'"),
])
@pytest.mark.full
def test_bad_tasks_and_model_args_are_one_line_errors(model_dir, capsys, args, message):
    assert main(["eval", "--model", str(model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.full
def test_lm_eval_command_line_bad_model_args_is_one_line(model_dir, tasks):
    out = subprocess.run([sys.executable, "-m", "jaxtune.harness", "run", "--model", "jaxtune", "--model_args",
                          f"model={model_dir},compute_dtype=float32,max_gen_toks=0", "--tasks", "tiny_mc.yaml"],
                         cwd=tasks, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines()[-1] == (
        "jaxtune: error: model_args: max_gen_toks=0 is not an integer >= 1"), out.stderr[-1000:]


def test_bundled_tasks_are_there():
    assert {"jaxtune_facts", "jaxtune_qa", "jaxtune_text"} <= set(bundled_tasks())


def test_model_args_errors_name_the_key(model_dir):
    with pytest.raises(JaxtuneError, match="model_args: model=DIR_OR_GGUF is required"):
        JaxtuneLM()
    with pytest.raises(JaxtuneError, match="model_args: add_bos_token='maybe' is not true or false"):
        JaxtuneLM(model=str(model_dir), add_bos_token="maybe")
    with pytest.raises(JaxtuneError, match="model_args: compile_cache='.*config.json' is a file, not a directory"):
        JaxtuneLM(model=str(model_dir), compile_cache=str(model_dir / "config.json"))


@pytest.mark.full
def test_training_records_task_scores_in_metrics_tensorboard_wandb_and_plot(tasks, tmp_path, no_wandb_credentials):
    """[eval] tasks are scored at step 0, every eval_every steps and at the end: lm-eval's metrics as
    eval_<task>/<metric> in metrics.jsonl, the same numbers in TensorBoard and the offline W&B run, a second panel in
    loss.png; the scores are those of the run's own weights (the exported adapter scores the same)."""
    records = _train(tmp_path, 'report_to = ["tensorboard", "wandb"]\n[eval]\n'
                               f'tasks = ["{tasks / "tiny_mc.yaml"}", "{tasks / "tiny_qa.yaml"}"]\n')
    scored = [r for r in records if "eval_tiny_mc/acc" in r]
    assert [r["step"] for r in scored] == [0, 2, 4]
    assert all("eval_tiny_qa/exact_match" in r and "eval_loss" in r for r in scored)

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tensorboard = events.Scalars("eval_tiny_mc/acc")
    assert [e.step for e in tensorboard] == [0, 2, 4]
    assert [e.value for e in tensorboard] == pytest.approx([r["eval_tiny_mc/acc"] for r in scored])
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = [_items(r.history.item) for r in _wandb_records(log) if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["eval_tiny_qa/exact_match"]) for h in history if "eval_tiny_qa/exact_match" in h] == [
        (r["step"], r["eval_tiny_qa/exact_match"]) for r in scored]
    assert plt.imread(tmp_path / "run" / "loss.png").shape[1] == 1200  # two panels

    lm = JaxtuneLM(model=str(tmp_path / "model"), adapter=str(tmp_path / "run" / "adapter"))
    final = scores(evaluate_tasks(lm, [str(tasks / "tiny_mc.yaml"), str(tasks / "tiny_qa.yaml")]))
    assert final == {k.removeprefix("eval_"): v for k, v in scored[-1].items() if k.startswith("eval_tiny")}


@pytest.mark.full
def test_weights_split_over_a_mesh_score_as_on_one_device(model_dir, tasks):
    """model_args fsdp=4,tensor=2 on 8 devices: the weights split as training splits them, every log-likelihood within
    1e-5 of one device's and the same greedy generations."""
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("harness_worker.py")), str(model_dir),
                          str(tasks / "tiny_mc.yaml"), str(tasks / "tiny_qa.yaml")], env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result.pop("devices") == 8
    for (ours, split), in zip(*[iter(result["tiny_mc"])]):
        assert [r[0][1] for r in ours] == [r[0][1] for r in split]
        assert max(abs(a[0][0] - b[0][0]) for a, b in zip(ours, split)) < 1e-5
    assert [one for one, _ in result["tiny_qa"]] == [split for _, split in result["tiny_qa"]]
