"""`jaxtune init` and `jaxtune info` from the command line, checked against transformers."""

import json
import subprocess
import sys

import pytest
import transformers

from jaxtune.cli import main
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.presets import ARCH_NAMES

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_init_writes_a_model_transformers_loads(tmp_path, arch):
    assert main(["init", str(tmp_path / "m"), "--arch", arch]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(model).__name__ == ARCH_NAMES[arch]
    assert model.config.vocab_size == 259
    # transformers picks its tokenizer class from model_type (Qwen2Tokenizer adds an unused <|endoftext|>);
    # the ids must agree whatever class it picks.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    ours = load_tokenizer(tmp_path / "m")
    for text in ["Instruction: add 2 and 3.", " über  spaces\n"]:
        assert tokenizer(text).input_ids == ours.encode(text)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_info_json_counts_equal_transformers(arch, hf_model_dir):
    directory, model = hf_model_dir(arch)
    result = subprocess.run([sys.executable, "-m", "jaxtune.cli", "info", "--model", str(directory), "--json"],
                            capture_output=True, text=True, check=True)
    info = json.loads(result.stdout)
    assert info["architecture"] == type(model).__name__
    assert info["parameters"] == sum(p.numel() for p in model.parameters())  # tied: counted once
    groups = info["parameters_by_group"]
    assert groups["attention"] == sum(p.numel() for n, p in model.named_parameters() if "self_attn" in n)
    assert groups["mlp"] == sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    assert info["dtypes"] == {"F32": info["parameters"]}
    assert info["weights_bytes"] == 4 * info["parameters"]


def test_info_table(hf_model_dir, capsys):
    directory, _ = hf_model_dir("mistral")
    assert main(["info", "--model", str(directory)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MistralForCausalLM: 3 layers, hidden 64, 4 heads / 2 kv heads, vocab 96")
    assert "attention" in out and "weights:" in out
