"""The training pipeline: accumulation, non-finite steps, exact resume, run directory, eval parity, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import one_device_run, sft_gradients

from jaxtune.cli import main
from jaxtune.config import ForwardOptions
from jaxtune.data.batching import epoch_batches
from jaxtune.data.formats import load_sft_examples
from jaxtune.data.tokenizer import Tokenizer, load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method, partition, trainable_mask
from jaxtune.objectives.base import stack_micro_batches
from jaxtune.presets import ARCH_NAMES, write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.spine.model import load_model
from jaxtune.train.loop import fine_tune
from jaxtune.train.metrics import WALL_CLOCK_FIELDS

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = write_random_model(root / "model", "llama", seed=0, initializer_range=0.1)
    data = root / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:48]))
    return root, model, data


def write_config(path: Path, model: Path, data: Path, out: Path, **train) -> Path:
    train = {"output_dir": str(out), "max_steps": 6, "batch_size": 4, "learning_rate": 1e-2, "log_every": 1,
             "eval_every": 2, "checkpoint_every": 2, "keep_checkpoints": 5, **train}
    lines = ["[model]", f'path = "{model}"', "[method]", 'kind = "lora"', "rank = 4",
             'target_modules = ["all-linear"]', "[data]", f'train = "{data}"', "max_seq_len = 96",
             "eval_fraction = 0.25", "[train]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in train.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def metric_lines(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS} for r in records]


def test_accumulated_micro_batches_equal_one_large_batch(setup):
    _, model, data = setup
    cfg, base = load_model(model)
    method = method_config("lora", rank=4, target_modules=("all-linear",))
    params = apply_method(base, cfg, method, jax.random.key(0))
    params["layers"]["q_proj"]["lora_b"] += 0.05  # B != 0 so every adapter leaf gets a gradient
    trainable, frozen = partition(params, trainable_mask(params, method))
    examples, _ = load_sft_examples(data, load_tokenizer(model), 96)
    batches = epoch_batches(examples, 4, 96, seed=0, epoch=0)
    grads = jax.jit(sft_gradients, static_argnums=(3, 4, 5))
    k = 3
    small = stack_micro_batches(batches, k, 0)  # [3, 4, T]
    large = {key: v.reshape(1, -1, v.shape[-1]) for key, v in small.items()}  # [1, 12, T]
    loss_a, count_a, grads_a = grads(trainable, frozen, small, cfg, method, ForwardOptions())
    loss_b, count_b, grads_b = grads(trainable, frozen, large, cfg, method, ForwardOptions())
    assert count_a == count_b > 0
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        assert float(jnp.abs(a - b).max()) <= 1e-6 * max(float(jnp.abs(b).max()), 1e-3)


def test_prompt_tokens_never_contribute_to_the_loss(setup):
    """Changing the labels (the next tokens) at prompt positions changes neither loss nor gradients."""
    _, model, data = setup
    cfg, base = load_model(model)
    method = method_config("lora", rank=4)
    params = apply_method(base, cfg, method, jax.random.key(0))
    trainable, frozen = partition(params, trainable_mask(params, method))
    examples, _ = load_sft_examples(data, load_tokenizer(model), 96)
    batch = stack_micro_batches(epoch_batches(examples, 4, 96, seed=0, epoch=0), 1, 0)
    scrambled = dict(batch, labels=np.where(batch["loss_mask"] > 0, batch["labels"], (batch["labels"] + 7) % 259))
    assert (scrambled["labels"] != batch["labels"]).sum() > 100
    out = [sft_gradients(trainable, frozen, b, cfg, method) for b in (batch, scrambled)]
    assert out[0][0] == out[1][0]
    jax.tree.map(np.testing.assert_array_equal, out[0][2], out[1][2])


def test_non_finite_step_is_skipped_and_counted(setup):
    _, model, data = setup
    cfg, base = load_model(model)
    method = method_config("lora", rank=4)
    params = apply_method(base, cfg, method, jax.random.key(0))
    trainable, frozen = partition(params, trainable_mask(params, method))
    run = one_device_run(cfg, method, total_steps=10, batch_size=4, seq_len=96)
    examples, _ = load_sft_examples(data, load_tokenizer(model), 96)
    batch = stack_micro_batches(epoch_batches(examples, 4, 96, seed=0, epoch=0), 1, 0)
    poisoned = dict(batch, loss_mask=np.where(batch["loss_mask"] > 0, np.nan, 0).astype(np.float32))
    state = run.init_state(trainable, 0)
    before = jax.tree.map(np.asarray, (state["params"], state["opt_state"]))
    state, metrics = run.step(state, frozen, None, poisoned)
    assert not np.isfinite(float(metrics["loss"]))
    assert int(state["skipped"]) == int(state["bad_streak"]) == 1 and int(state["step"]) == 1
    after = jax.tree.map(np.asarray, (state["params"], state["opt_state"]))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    state, metrics = run.step(state, frozen, None, batch)
    assert np.isfinite(float(metrics["loss"])) and int(state["skipped"]) == 1 and int(state["bad_streak"]) == 0
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(state["params"])))


@pytest.mark.slow
@pytest.mark.full
def test_run_stops_after_n_non_finite_steps_in_a_row(setup, tmp_path):
    root, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", learning_rate=1e30, max_grad_norm=1e30,
                          max_nonfinite_steps=2, max_steps=20, checkpoint_every=0)
    with pytest.raises(JaxtuneError, match="non-finite steps in a row"):
        fine_tune(load_run_config(config), log=lambda _: None)


@pytest.mark.slow
@pytest.mark.full
def test_run_directory_and_sigterm_resume_equal_an_uninterrupted_run(setup, tmp_path):
    root, model, data = setup
    full = write_config(tmp_path / "full.toml", model, data, tmp_path / "full")
    result = fine_tune(load_run_config(full), log=lambda _: None)
    run = tmp_path / "full"
    assert result.step == 6 and result.result_path == run / "adapter"
    assert {p.name for p in run.iterdir()} >= {"config.toml", "metrics.jsonl", "loss.png", "checkpoints", "adapter"}
    assert load_run_config(run / "config.toml") == load_run_config(full)
    records = metric_lines(run)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "learning_rate", "grad_norm", "skipped_steps", "epoch"} <= set(records[1])
    evals = [r for r in records if "eval_loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_perplexity"] == pytest.approx(np.exp(evals[-1]["eval_loss"]))

    # Preemption: SIGTERM during step 3 -> checkpoint at 3 and a clean return; the same call resumes.
    interrupted = write_config(tmp_path / "int.toml", model, data, tmp_path / "int")

    def log(line):
        if line.startswith("training"):
            os.kill(os.getpid(), signal.SIGTERM)

    first = fine_tune(load_run_config(interrupted), log=log)
    assert first.interrupted and first.step == 1
    second = fine_tune(load_run_config(interrupted), log=lambda _: None)
    assert second.step == 6 and not second.interrupted
    assert metric_lines(tmp_path / "int") == records


@pytest.mark.slow
def test_killed_process_resumes_with_the_same_metrics(setup, tmp_path):
    """SIGKILL (no chance to save) after the step-4 checkpoint; the same command again ends as an unbroken run."""
    root, model, data = setup
    reference = write_config(tmp_path / "ref.toml", model, data, tmp_path / "ref", max_steps=10)
    fine_tune(load_run_config(reference), log=lambda _: None)
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=10)
    command = [sys.executable, "-m", "jaxtune.cli", "train", str(config)]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.time() + 600  # a busy 2-core machine with a cold compilation cache
        while (not (tmp_path / "run" / "checkpoints" / "4").is_dir() and process.poll() is None
               and time.time() < deadline):
            time.sleep(0.05)
        process.kill()
        process.wait()
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir(), (tmp_path / "stderr.txt").read_text()[-3000:]
    assert subprocess.run(command, capture_output=True).returncode == 0
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.full
def test_corrupt_checkpoint_is_named_and_the_previous_one_can_be_used(setup, tmp_path):
    root, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4)
    fine_tune(load_run_config(config), log=lambda _: None)
    latest = tmp_path / "run" / "checkpoints" / "4"
    for path in latest.rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "state" in str(path):
            path.write_bytes(b"garbage")
    with pytest.raises(JaxtuneError, match=r"checkpoint for step 4 is unreadable .*--set train.resume_step=2"):
        fine_tune(load_run_config(config), log=lambda _: None)
    result = fine_tune(load_run_config(config, ["train.resume_step=2"]), log=lambda _: None)
    assert result.step == 4


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma2", marks=pytest.mark.full)])
def test_eval_equals_transformers_loss(arch, tmp_path):
    """`jaxtune eval --json` = transformers' mean cross-entropy over completion tokens (+ EOS) of the file (Gemma 2:
    of its soft-capped logits)."""
    import torch
    import transformers
    from hf_models import make_hf_model

    hf = make_hf_model(arch, tmp_path / "m", vocab_size=259, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       max_position_embeddings=512)
    Tokenizer.byte_level().save(tmp_path / "m")
    rows = [{"prompt": "Q: add 2 and 3\nA:", "completion": " 5"}, {"prompt": "Hello", "completion": " world, again"},
            {"instruction": "Say hi.", "input": "", "output": "hi"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    from jaxtune.data.formats import alpaca_prompt

    total, count = 0.0, 0
    for r in rows:
        prompt, completion = ((r["prompt"], r["completion"]) if "prompt" in r
                              else (alpaca_prompt(r["instruction"]), r["output"]))
        p_ids = tokenizer(prompt).input_ids
        ids = p_ids + tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        total += float(nll[len(p_ids) - 1:].sum())
        count += len(ids) - len(p_ids)
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "eval", "--model", str(tmp_path / "m"),
                          "--data", str(tmp_path / "d.jsonl"), "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["tokens"] == count and result["examples"] == 3 and result["dropped"] == 0
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)
    assert result["perplexity"] == pytest.approx(np.exp(total / count), rel=1e-5)


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "a" "completion"}\n', r"data.jsonl:2: invalid JSON"),
    ('{"prompt": "a"}\n', r"data.jsonl:1: .*completion"),
    ("", r"data.jsonl: no examples"),
])
def test_bad_data_gives_one_line_naming_file_and_line(setup, tmp_path, content, message):
    _, model, _ = setup
    (tmp_path / "data.jsonl").write_text(content)
    config = write_config(tmp_path / "c.toml", model, tmp_path / "data.jsonl", tmp_path / "run")
    result = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", str(config)], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    import re

    assert re.search(message, result.stderr)


def test_unknown_config_key_names_key_and_section(setup, tmp_path, capsys):
    _, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", learning_rat=1e-3)
    assert main(["train", str(config)]) == 2
    assert "unknown key 'learning_rat' in section [train]" in capsys.readouterr().err
    config = write_config(tmp_path / "ok.toml", model, data, tmp_path / "run")
    assert main(["train", str(config), "--set", "optim.lr=1"]) == 2
    assert "unknown section [optim]" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.full
def test_mixed_precision_keeps_float32_master_weights_and_trains(setup, tmp_path):
    """bf16 frozen base and bf16 compute; trainable leaves and Adam moments stay float32, and the loss falls."""
    _, model, data = setup
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=8, learning_rate=2e-2)
    config = load_run_config(config, ["model.dtype=bfloat16", "model.compute_dtype=bfloat16", "model.remat=full"])
    cfg, base = load_model(model, "bfloat16")
    params = apply_method(base, cfg, config.method, jax.random.key(0))
    trainable, frozen = partition(params, trainable_mask(params, config.method))
    state = one_device_run(cfg, config.method, train=config.train, param_dtype="bfloat16").init_state(trainable, 0)
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype("bfloat16")}
    result = fine_tune(config, log=lambda _: None)
    evals = [r for r in metric_lines(tmp_path / "run") if "eval_loss" in r]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.1
    from safetensors.numpy import load_file

    stored = load_file(str(result.result_path / "adapter_model.safetensors"))
    assert {v.dtype for v in stored.values()} == {np.dtype("float32")}


@pytest.mark.full
def test_qlora_adapter_is_evaluated_on_the_base_it_was_trained_on(setup, tmp_path, capsys):
    """The adapter records its NF4 base; `eval` uses it (saying so) and reproduces the run's held-out loss, and
    `--base float` takes the float weights (saying so), which gives another loss."""
    root, model, data = setup
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[48:64]))
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4, eval_every=4)
    config = load_run_config(config, ["method.kind=qlora", f"data.eval={held_out}"])
    result = fine_tune(config, log=lambda _: None)
    recorded = json.loads((result.result_path / "adapter_config.json").read_text())["jaxtune_quantized_base"]
    assert recorded == {"bits": 4, "double_quant": True, "format": "nf4"}
    losses = {}
    for base in ("as-trained", "float"):
        capsys.readouterr()
        assert main(["eval", "--model", str(model), "--adapter", str(result.result_path), "--data", str(held_out),
                     "--max-seq-len", "96", "--base", base, "--json"]) == 0
        out = capsys.readouterr()
        losses[base] = json.loads(out.out)["loss"]
        assert ("on its base quantised as in training (NF4, double quantisation)" if base == "as-trained" else
                "applied to the float weights") in out.err
    assert losses["as-trained"] == pytest.approx(result.eval_loss, rel=1e-5)
    assert abs(losses["float"] - losses["as-trained"]) > 1e-4


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "smollm3",
                                  "olmo3", "gpt_oss", "llama4", "gemma4"])
@pytest.mark.full
def test_qlora_trains_and_its_merged_export_loads_in_transformers(arch, tmp_path):
    """QLoRA (NF4) on every linear layer of a Qwen3 (query/key norms, head_dim 32 beside hidden / heads = 16), a
    Gemma 2 (soft caps, sandwich norms, GeGLU), a Gemma 3 (local and global RoPE), a Phi-3 (fused projections,
    quantised fused) or a mixture of experts (experts quantised; adapters on attention, Qwen2-MoE's shared expert
    and, for the Qwen mixtures, every expert): the held-out loss falls, and
    the merged export is a model of the same class that transformers loads with the logits jaxtune computes for
    the adapter on the float base."""
    import torch
    import transformers

    from jaxtune.models.llama import forward
    from jaxtune.spine.model import load_model_with_adapter

    model = write_random_model(tmp_path / "model", arch, seed=0, head_dim=32, initializer_range=0.1)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:48]))
    config = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=6, eval_every=6)
    experts = ['method.target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]'] * ("moe" in arch)
    result = fine_tune(load_run_config(config, ["method.kind=qlora", *experts]), log=lambda _: None)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if "eval_loss" in e]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert main(["export", "--model", str(model), "--adapter", str(result.result_path),
                 "--merged", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged).__name__ == ARCH_NAMES[arch]
    cfg, params, method = load_model_with_adapter(str(model), str(result.result_path), base="float")
    ids = jnp.asarray([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        reference = merged(torch.tensor(np.asarray(ids))).logits.numpy()
    logits = jax.jit(forward, static_argnames=("cfg", "method"))(params, ids, cfg, method=method)
    np.testing.assert_allclose(np.asarray(logits), reference, atol=1e-4, rtol=1e-4)


def test_a_full_fine_tune_updates_its_weights_and_moments_in_place():
    """A wide, short full fine-tune step, where the weights dominate: XLA's temporaries are the gradients and little
    more (at most 1.5x the trainable bytes). Before the update ran under `lax.cond` and clipping became one scalar
    factor, XLA copied the donated moments and wrote a clipped copy of every gradient: 2.8x (800 MiB here)."""
    from jaxtune.config import MeshConfig, ModelConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.planner import compile_step

    cfg = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=8,
                      num_kv_heads=8, head_dim=128)
    step = compile_step(cfg, TrainPlan(method_config("full"), 1, 64, 1, param_dtype="float32",
                                       forward=ForwardOptions(compute_dtype="float32", remat="none"),
                                       mesh=MeshConfig(1, 1, 1)))
    trainable = step.argument_bytes / 3  # weights, mu, nu
    assert step.temp_bytes <= 1.5 * trainable, (step.temp_bytes / 2**20, trainable / 2**20)
