"""The command line's smaller promises: `info` on a GGUF file reports what the file stores, `export --merged` turns
a GGUF file into a Hugging Face directory, written files get the umask's mode, an adapter records its base's
absolute path, every option has a help text, and a refused flag value is the one argparse kept."""

import argparse
import json
import os
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import CHAT_TEMPLATE, TOKENS, write_gguf

from jaxtune.cli import build_parser, main
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.demo import smollm2_path
from jaxtune.methods import method_config
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.methods.transform import apply_method
from jaxtune.models.llama import forward
from jaxtune.presets import write_random_model
from jaxtune.spine.model import load_model, load_model_with_adapter

# Rows of 256: whole blocks of every type written here.
SHAPE = dict(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, bos_token_id=1, eos_token_id=2)
OVERRIDES = {"llama": dict(rope_scaling=None), "qwen2": dict(tie_word_embeddings=False)}
IDS = np.asarray([[5, 17, 42, 99, 3, 250, 7, 1]])


def tiny_gguf(directory: Path, arch: str, kind: Q) -> Path:
    from hf_models import make_hf_model

    model = make_hf_model(arch, directory / "hf", **{**SHAPE, **OVERRIDES[arch]})
    return write_gguf(directory / "model.gguf", model, kind)


def transformers_gguf(path: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def stored(path: Path) -> tuple[dict[str, int], int]:
    """({llama.cpp type name: values}, bytes) of a GGUF file's tensors, as the `gguf` package reads them."""
    counts, nbytes = {}, 0
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        nbytes += int(t.n_bytes)
    return counts, nbytes


@pytest.mark.reference
def test_info_of_a_gguf_reports_its_stored_types_and_bytes(tmp_path, capsys):
    """llama.cpp's type names with their parameter counts, and the bytes as stored (not the float32 they load as)."""
    path = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    types, nbytes = stored(path)
    assert set(types) == {"Q4_1", "F32"}
    assert main(["info", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtypes"] == types and sum(types.values()) == info["parameters"]
    assert info["weights_bytes"] == nbytes < 4 * info["parameters"] / 5


@pytest.mark.slow
@pytest.mark.full
def test_info_of_smollm2_reports_q4_1_and_its_92_mib(capsys):
    """The real SmolLM2 Q4_1 file (embedding Q8_0, norms F32): its types and ~92 MiB, not float32's 513 MiB."""
    path = smollm2_path()
    types, nbytes = stored(path)
    assert set(types) == {"Q4_1", "Q8_0", "F32"}
    assert main(["info", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtypes"] == types and sum(types.values()) == info["parameters"]
    assert info["weights_bytes"] == nbytes < path.stat().st_size
    assert main(["info", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"dtypes: Q4_1 ({types['Q4_1']:,}), Q8_0 ({types['Q8_0']:,}), F32 ({types['F32']:,})" in out
    assert "weights: 92.1 MiB" in out


@pytest.mark.reference
@pytest.mark.parametrize("arch,kind", [("llama", Q.Q4_1), ("qwen2", Q.Q8_0)])
def test_export_merged_of_a_gguf_loads_in_transformers_with_its_own_logits(arch, kind, tmp_path):
    """`export --model X.gguf --merged OUT` without an adapter: transformers loads OUT with the logits of its own
    loading of the file (a Llama's q/k rows back from llama.cpp's interleaving; Qwen2's biases and untied head),
    and the tokenizer and chat template of the file."""
    import torch
    import transformers

    path = tiny_gguf(tmp_path, arch, kind)
    assert main(["export", "--model", str(path), "--merged", str(tmp_path / "out")]) == 0
    written = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = written(torch.tensor(IDS)).logits.numpy()
        reference = transformers_gguf(path)(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("the hat and the cat").input_ids == load_tokenizer(path).encode("the hat and the cat")
    assert tokenizer.chat_template == CHAT_TEMPLATE


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.full
def test_export_merged_of_smollm2_equals_transformers_loading_the_file(tmp_path):
    import torch
    import transformers

    path = smollm2_path()
    assert main(["export", "--model", str(path), "--merged", str(tmp_path / "out")]) == 0
    with torch.no_grad():
        ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()(
            torch.tensor(IDS)).logits.numpy()
        reference = transformers_gguf(path)(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_array_equal(ours, reference)


@pytest.fixture
def umask():
    """Umask 027 while the test runs (not the usual 022, so that a mode fixed at 0644 fails too)."""
    before = os.umask(0o027)
    yield 0o027
    os.umask(before)


def lora_adapter(model: Path, out: Path, base_model: str = "") -> Path:
    """A LoRA adapter (q, v; B moved off zero) of `model` written by jaxtune."""
    cfg, params = load_model(model)
    method = method_config("lora", rank=4, alpha=8)
    params = apply_method(params, cfg, method, jax.random.key(0))
    layers = params["layers"]
    for name in ("q_proj", "v_proj"):
        b = layers[name]["lora_b"]
        layers[name] = {**layers[name], "lora_b": 0.1 * jax.random.normal(jax.random.key(1), b.shape, b.dtype)}
    return save_peft_adapter(out, {**params, "layers": layers}, cfg, method, base_model=base_model)


@pytest.mark.full
def test_written_files_get_the_umasks_mode(tmp_path, umask):
    """Adapters, merged models, GGUF files and their Modelfiles are created as `open()` creates them: 0666 less the
    umask."""
    model = write_random_model(tmp_path / "model")
    adapter = lora_adapter(model, tmp_path / "adapter")
    for flag, out in (("--peft", "peft"), ("--merged", "merged"), ("--gguf", "model.gguf"),
                      ("--gguf-lora", "lora.gguf")):
        assert main(["export", "--model", str(model), "--adapter", str(adapter), flag, str(tmp_path / out)]) == 0
    files = [p for d in ("adapter", "peft", "merged") for p in (tmp_path / d).iterdir()]
    files += [tmp_path / "model.gguf", tmp_path / "model.Modelfile", tmp_path / "lora.gguf"]
    assert {"adapter_model.safetensors", "model.safetensors", "tokenizer.json"} <= {p.name for p in files}
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))


@pytest.mark.reference
def test_adapter_records_the_absolute_base_and_peft_loads_it_from_anywhere(tmp_path, monkeypatch):
    """An adapter written from a relative model path records the resolved path: PEFT's AutoPeftModelForCausalLM
    finds the base from another working directory, with jaxtune's logits."""
    import torch
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tmp_path)
    assert main(["init", "model"]) == 0
    lora_adapter(Path("model"), Path("adapter"), base_model="model")
    assert main(["export", "--model", "model", "--adapter", "adapter", "--peft", "peft"]) == 0
    for adapter in ("adapter", "peft"):
        config = json.loads((tmp_path / adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str((tmp_path / "model").resolve())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "peft"), dtype=torch.float32).eval()
    with torch.no_grad():
        reference = peft_model(torch.tensor(IDS)).logits.numpy()
    cfg, params, method = load_model_with_adapter(tmp_path / "model", tmp_path / "peft")
    logits = jax.jit(forward, static_argnames=("cfg", "method"))(params, IDS, cfg, method=method)
    np.testing.assert_allclose(np.asarray(logits), reference, atol=1e-5, rtol=1e-5)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_has_help_and_gguf_is_named_where_accepted():
    commands = subparsers(build_parser())
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in commands.items()
               for a in p._actions if not (a.help or "").strip()]
    assert missing == []
    for name in ("info", "eval", "generate", "export", "plan"):
        model = next(a for a in commands[name]._actions if "--model" in a.option_strings)
        assert ".gguf" in model.help, name


@pytest.mark.parametrize("flags,named", [
    (["--max-new-tokens", "4", "--max-new-tokens", "-1"], "--max-new-tokens -1: must be >= 1"),
    (["--max-new-tokens", "4", "--max-new-tokens=-2"], "--max-new-tokens -2: must be >= 1"),
    (["--max-new-tokens=0", "--max-new-tokens", "8", "--top-p=1.5"], "--top-p 1.5: "),
])
def test_a_refused_flag_value_is_the_last_one_given(flags, named, tmp_path, capsys):
    """argparse keeps a repeated flag's last value; the error names that one, in either syntax."""
    model = write_random_model(tmp_path / "model")
    assert main(["generate", "--model", str(model), "--prompt", "hi", *flags]) == 2
    assert f"jaxtune: error: {named}" in capsys.readouterr().err
