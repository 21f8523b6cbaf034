"""A catalogue of bad inputs, tried as a new user would against a finished run: each ends with exit status 2 and
one line naming what is wrong, and leaves the run directory and its checkpoints exactly as they were. A bug
(any other exception) is one line naming a file that holds the traceback; running out of memory is one line
saying what to lower."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxtune.cli import main
from jaxtune.methods import method_config
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.methods.transform import apply_method
from jaxtune.presets import write_random_model
from jaxtune.spine.model import load_model

DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, its data, a finished 2-step LoRA run, an IA3 adapter and an adapter of another model."""
    root = tmp_path_factory.mktemp("bad")
    model = write_random_model(root / "model", "llama", seed=0, max_position_embeddings=64)
    data = root / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:24]))
    config = root / "run.toml"
    config.write_text("\n".join([
        "[model]", f'path = "{model}"', "[method]", 'kind = "lora"', "rank = 4", "[data]", f'train = "{data}"',
        "max_seq_len = 64", "[train]", f'output_dir = "{root / "run"}"', "max_steps = 2", "batch_size = 4",
        "checkpoint_every = 1", "keep_checkpoints = 3", "log_every = 1"]) + "\n")
    assert main(["train", str(config)]) == 0
    cfg, params = load_model(model)
    ia3 = method_config("ia3")
    save_peft_adapter(root / "ia3", apply_method(params, cfg, ia3, jax.random.key(0)), cfg, ia3)
    other = write_random_model(root / "other", "llama", hidden_size=32, head_dim=8)
    other_cfg, other_params = load_model(other)
    lora = method_config("lora", rank=4)
    save_peft_adapter(root / "other_adapter", apply_method(other_params, other_cfg, lora,
                                                           jax.random.key(0)), other_cfg, lora)
    return root


def broken_model(root: Path, name: str, damage) -> Path:
    """A copy of the tiny model with `damage(directory)` applied."""
    directory = root / f"model_{name}"
    if not directory.exists():
        shutil.copytree(root / "model", directory)
        damage(directory)
    return directory


def text_file(root: Path, name: str, content: bytes) -> Path:
    path = root / name
    path.write_bytes(content)
    return path


def data_file(root: Path, name: str, content: bytes) -> Path:
    return text_file(root, f"{name}.jsonl", content)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:200])


def wrong_shape(directory: Path) -> None:
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:16]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def corrupt_latest_checkpoint(root: Path) -> Path:
    """A copy of the finished run whose newest checkpoint's state files are garbage."""
    run = root / "run_corrupt"
    if not run.exists():
        shutil.copytree(root / "run", run)
        for f in (run / "checkpoints" / "2").rglob("*"):
            if f.is_file() and f.stat().st_size > 0 and "state" in str(f):
                f.write_bytes(b"garbage")
    return run


def set_(*items):
    return [x for item in items for x in ("--set", item)]


def data_set(root: Path, name: str, content: bytes) -> list[str]:
    """--set data.train= a file of `content`."""
    return set_(f"data.train={data_file(root, name, content)}")


RUN = lambda root: str(root / "run.toml")
CASES = {
    # train: the config
    "toml syntax error": (lambda r: ["train", str(text_file(r, "bad.toml", b"[train\nepochs = 1"))], "invalid TOML"),
    "unknown key": (lambda r: ["train", RUN(r), *set_("train.lr=1e-4")], "unknown key 'lr' in section [train]"),
    "wrong-typed value": (lambda r: ["train", RUN(r), *set_("train.epochs=many")], "must be an integer"),
    "negative learning rate": (lambda r: ["train", RUN(r), *set_("train.learning_rate=-0.001")], "must be >= 0"),
    "unknown dtype": (lambda r: ["train", RUN(r), *set_("model.dtype=float17")],
                      "choose one of auto, float32, bfloat16, float16"),
    "unknown remat": (lambda r: ["train", RUN(r), *set_("model.remat=ful")], "choose one of none, full, save_matmuls"),
    "compute dtype alias": (lambda r: ["train", RUN(r), *set_("model.compute_dtype=bf16")],
                            "choose one of auto, float32, bfloat16"),
    "batch of 0": (lambda r: ["train", RUN(r), *set_("train.batch_size=0")], "must be >= 1"),
    "unknown objective": (lambda r: ["train", RUN(r), *set_("train.objective=ppo")], "choose one of sft, dpo"),
    "unknown target module": (lambda r: ["train", RUN(r), *set_('method.target_modules=["qkv"]')],
                              "not a linear module of a decoder layer"),
    "mesh that does not divide": (lambda r: ["train", RUN(r), *set_("mesh.data=3")],
                                  "do not divide the 1 devices available"),
    # train: where it writes
    "output under a regular file": (lambda r: ["train", RUN(r), *set_(f"train.output_dir={r / 'data.jsonl' / 'x'}")],
                                    "is a file, not a directory"),
    "unwritable output": (lambda r: ["train", RUN(r), *set_("train.output_dir=/proc/jaxtune-run")], "is not writable"),
    # train: the data
    "missing data file": (lambda r: ["train", RUN(r), *set_(f"data.train={r / 'nope.jsonl'}")], "data file not found"),
    "malformed JSONL": (lambda r: ["train", RUN(r), *data_set(r, "malformed", b'{"prompt": 1')],
                        "malformed.jsonl:1: invalid JSON"),
    "non-UTF-8 JSONL": (lambda r: ["train", RUN(r), *data_set(r, "latin1", '{"prompt": "café"}'.encode("latin-1"))],
                        "not UTF-8 text"),
    "empty data file": (lambda r: ["train", RUN(r), *data_set(r, "empty", b"")], "no examples"),
    "missing field": (lambda r: ["train", RUN(r), *data_set(r, "nofield", b'{"prompt": "a"}')], "nofield.jsonl:1"),
    # train: the model
    "model without config.json": (lambda r: ["train", RUN(r), *set_(
        f"model.path={broken_model(r, 'noconfig', lambda d: (d / 'config.json').unlink())}")],
        "config.json: file not found"),
    "truncated safetensors": (lambda r: ["train", RUN(r), *set_(
        f"model.path={broken_model(r, 'truncated', lambda d: truncate(d / 'model.safetensors'))}")],
        "model.safetensors"),
    "tensor of the wrong shape": (lambda r: ["train", RUN(r), *set_(
        f"model.path={broken_model(r, 'shape', wrong_shape)}")], "k_proj.weight has shape (16, 64), expected (32, 64)"),
    "corrupt tokenizer.json": (lambda r: ["train", RUN(r), *set_(
        f"model.path={broken_model(r, 'tokenizer', lambda d: (d / 'tokenizer.json').write_text('{broken'))}")],
        "tokenizer.json"),
    # train: the checkpoints
    "config changed under the checkpoints": (lambda r: ["train", RUN(r), *set_("method.rank=8")],
                                             "method.rank = 4 there, 8 here"),
    # eval
    "adapter of another model": (lambda r: ["eval", "--model", str(r / "model"), "--adapter", str(r / "other_adapter"),
                                            "--data", str(r / "data.jsonl")], "has shape"),
    "unknown peft_type": (lambda r: ["eval", "--model", str(r / "model"), "--adapter", str(_loha(r)), "--data",
                                     str(r / "data.jsonl")], "PEFT adapter type 'LOHA' is not supported"),
    "eval batch of 0": (lambda r: ["eval", "--model", str(r / "model"), "--data", str(r / "data.jsonl"),
                                   "--batch-size", "0"], "--batch-size 0: must be >= 1"),
    "eval data missing": (lambda r: ["eval", "--model", str(r / "model"), "--data", str(r / "none.jsonl")],
                          "data file not found"),
    # generate
    "prompt longer than the context": (lambda r: ["generate", "--model", str(r / "model"), "--prompt", "x" * 80],
                                       "context of 64"),
    "top-p outside (0, 1]": (lambda r: ["generate", "--model", str(r / "model"), "--prompt", "hi", "--top-p", "1.5"],
                             "--top-p 1.5: must be in (0.0, 1.0]"),
    "negative temperature": (lambda r: ["generate", "--model", str(r / "model"), "--prompt", "hi", "--temperature",
                                        "-1"], "--temperature -1: must be >= 0"),
    # export
    "merge a method that has no merge": (lambda r: ["export", "--model", str(r / "model"), "--adapter", str(r / "ia3"),
                                                    "--merged", str(r / "merged")],
                                         "only lora and qlora adapters merge into the weights, not ia3"),
    "export to an unwritable directory": (lambda r: ["export", "--model", str(r / "model"), "--adapter",
                                                     str(r / "run" / "adapter"), "--peft", "/proc/jaxtune-export"],
                                          "is not writable"),
    "missing adapter directory": (lambda r: ["export", "--model", str(r / "model"), "--adapter", str(r / "none"),
                                             "--peft", str(r / "out")], "adapter directory not found"),
    # plan
    "unknown device": (lambda r: ["plan", "--params", "100", "--target", "h100x"], "h100x"),
    "plan mesh that does not divide": (lambda r: ["plan", "--params", "100", "--target", "h100-80gb-8", "--mesh",
                                                  "3x1x1"], "does not divide the 8 device(s) of h100-80gb-8"),
    "plan with an unknown method": (lambda r: ["plan", "--params", "100", "--target", "cpu", "--method", "lorax"],
                                    "--method lorax: choose one of full, lora"),
    # info
    "info on a file": (lambda r: ["info", "--model", str(r / "data.jsonl")], "expected a model directory"),
    "info on invalid config.json": (lambda r: ["info", "--model", str(broken_model(
        r, "json", lambda d: (d / "config.json").write_text('{"vocab_size": 1,')))], "invalid JSON at line 1"),
}


def _loha(root: Path) -> Path:
    directory = root / "loha"
    directory.mkdir(exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LOHA", "r": 8}))
    return directory


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_catalogue_has_25_distinct_inputs_across_every_command(world):
    argvs = [tuple(build(world)) for build, _ in CASES.values()]
    assert len(set(argvs)) == len(CASES) >= 25
    assert {argv[0] for argv in argvs} == {"train", "eval", "generate", "export", "plan", "info"}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(case, world, capsys):
    build, message = CASES[case]
    argv = build(world)
    before = snapshot(world / "run")
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("jaxtune:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("jaxtune: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err
    assert snapshot(world / "run") == before


def test_corrupt_latest_checkpoint_names_the_step_and_touches_nothing(world, capsys):
    run = corrupt_latest_checkpoint(world)
    before = snapshot(run)
    code = main(["train", RUN(world), *set_(f"train.output_dir={run}")])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint for step 2 is unreadable" in err and "train.resume_step=1" in err, err
    assert snapshot(run) == before


def test_a_failed_rerun_keeps_the_finished_runs_config(world):
    """The finished run's config.toml survives a re-run that fails on its data (written only once inputs check)."""
    before = (world / "run" / "config.toml").read_text()
    assert main(["train", RUN(world), *set_(f"data.train={world / 'missing.jsonl'}", "train.epochs=3")]) == 2
    assert (world / "run" / "config.toml").read_text() == before


def test_a_bug_is_one_line_and_a_traceback_file(world, capsys, monkeypatch):
    def broken(_):
        raise TypeError("an internal mistake")

    monkeypatch.setattr("jaxtune.models.summary.model_summary", broken)
    code = main(["info", "--model", str(world / "model")])
    err = capsys.readouterr().err
    assert code == 3 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "internal error (a bug in jaxtune, not in your input): TypeError: an internal mistake" in err
    trace = Path(err.strip().rsplit("traceback written to ", 1)[1])
    assert "Traceback" in trace.read_text() and "an internal mistake" in trace.read_text()


def test_out_of_memory_says_what_to_lower_and_what_the_planner_picks(world, capsys, monkeypatch):
    from jaxtune.spine.run import AbstractRun

    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 39438928240 bytes.")

    monkeypatch.setattr(AbstractRun, "place_batch", exhausted)
    code = main(["train", RUN(world), *set_(f"train.output_dir={world / 'oom'}", "train.batch_size=8")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "out of memory (Out of memory allocating 39438928240 bytes.)" in err
    assert "lower train.batch_size (now 8) or data.max_seq_len (now 64)" in err
    assert "the planner's fastest plan that fits" in err


def test_the_command_line_itself_prints_no_traceback(world):
    """The same through the installed entry point, in a fresh process: stderr is the one line."""
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", RUN(world), "--set", "model.dtype=float17"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == ("jaxtune: error: --set model.dtype=float17: choose one of auto, float32, bfloat16, "
                                  "float16")
