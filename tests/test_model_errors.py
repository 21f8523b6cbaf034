"""Bad model input gives one clear line naming the file, tensor or architecture; the CLI prints no traceback."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxtune.errors import JaxtuneError
from jaxtune.spine.model import load_model

pytestmark = pytest.mark.reference


@pytest.fixture
def model_copy(hf_model_dir, tmp_path):
    directory, _ = hf_model_dir("llama")
    shutil.copytree(directory, tmp_path / "m")
    return tmp_path / "m"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxtune.cli", *map(str, args)], capture_output=True, text=True)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(JaxtuneError, match=f"{tmp_path / 'nope'}: model directory not found"):
        load_model(tmp_path / "nope")


def test_missing_config_is_named(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(JaxtuneError, match="config.json: file not found"):
        load_model(model_copy)


def test_missing_weights_list_what_is_there(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(JaxtuneError,
                       match=r"no model.safetensors or model.safetensors.index.json \(found: config.json"):
        load_model(model_copy)


def test_unsupported_architecture_lists_supported(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(JaxtuneError, match="unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, "
                                           "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                           "Gemma2ForCausalLM, Gemma3ForCausalLM"):
        load_model(model_copy)


def test_gemma_checkpoint_disagreeing_with_its_config_names_the_tensor_or_key(hf_model_dir, tmp_path):
    """A Gemma 2 without a layer's post-feed-forward norm; a Llama's tensors under a Gemma 2 config; Gemma 3's
    multimodal class without its text_config, bidirectional attention, which jaxtune does not compute."""
    directory, _ = hf_model_dir("gemma2")
    shutil.copytree(directory, tmp_path / "g")
    tensors = load_file(str(tmp_path / "g" / "model.safetensors"))
    del tensors["model.layers.1.post_feedforward_layernorm.weight"]
    save_file(tensors, str(tmp_path / "g" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JaxtuneError, match="tensor model.layers.1.post_feedforward_layernorm.weight is missing"):
        load_model(tmp_path / "g")
    llama, _ = hf_model_dir("llama")
    shutil.copytree(llama, tmp_path / "l")
    config = json.loads((tmp_path / "l" / "config.json").read_text())
    (tmp_path / "l" / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(JaxtuneError, match="tensor model.layers.0.(pre|post)_feedforward_layernorm.weight is missing"):
        load_model(tmp_path / "l")
    for change, message in [({"architectures": ["Gemma3ForConditionalGeneration"]},
                             "Gemma3ForConditionalGeneration without a text_config"),
                            ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True},
                             "use_bidirectional_attention is not supported"),
                            ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"},
                             "hidden activation 'gelu' is not supported")]:
        (tmp_path / "l" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(JaxtuneError, match=f"config.json: {message}"):
            load_model(tmp_path / "l")


def test_wrong_shape_names_tensor_and_both_shapes(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JaxtuneError, match=r"model.layers.1.self_attn.k_proj.weight has shape \(16, 64\), "
                                           r"expected \(32, 64\)"):
        load_model(model_copy)


def test_missing_and_unexpected_tensors_are_named(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = tensors.pop("model.layers.2.mlp.up_proj.weight")
    save_file(tensors, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JaxtuneError, match="tensor model.layers.2.mlp.up_proj.weight is missing"):
        load_model(model_copy)
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((112, 64), np.float32)
    save_file(tensors, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JaxtuneError, match="unexpected tensors model.layers.0.mlp.extra.weight"):
        load_model(model_copy)


def test_corrupt_safetensors_is_named(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(JaxtuneError, match="model.safetensors: not a readable safetensors file"):
        load_model(model_copy)


def test_invalid_config_json_names_line(model_copy):
    (model_copy / "config.json").write_text('{\n  "vocab_size": 96,\n  oops\n}')
    with pytest.raises(JaxtuneError, match=r"config.json: invalid JSON at line 3"):
        load_model(model_copy)


@pytest.mark.parametrize("case", ["missing", "architecture", "shape"])
def test_cli_prints_one_line_without_traceback(case, model_copy, tmp_path):
    if case == "missing":
        target, expected = tmp_path / "absent", "model directory not found"
    elif case == "architecture":
        config = json.loads((model_copy / "config.json").read_text())
        config["architectures"] = ["FalconForCausalLM"]
        (model_copy / "config.json").write_text(json.dumps(config))
        target, expected = model_copy, "unsupported architecture FalconForCausalLM"
    else:
        tensors = load_file(str(model_copy / "model.safetensors"))
        tensors["model.layers.0.input_layernorm.weight"] = np.zeros((65,), np.float32)
        save_file(tensors, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
        target, expected = model_copy, "input_layernorm.weight has shape (65,), expected (64,)"
    result = run_cli("info", "--model", target)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert expected in result.stderr


def test_mixture_tensors_disagreeing_with_the_config_are_named_as_stored(hf_model_dir, tmp_path):
    """Mixtral's hub names (block_sparse_moe, w1/w2/w3) in the messages, not the names jaxtune reads them under."""
    directory, _ = hf_model_dir("mixtral")
    shutil.copytree(directory, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = np.zeros((40, 64), np.float32)
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JaxtuneError, match=r"tensor model.layers.0.block_sparse_moe.experts.3.w2.weight is missing"):
        load_model(tmp_path / "m")
    tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"] = np.zeros((64, 48), np.float32)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JaxtuneError, match=r"model.layers.1.block_sparse_moe.experts.2.w3.weight has shape \(40, 64\), "
                                           r"expected \(48, 64\)"):
        load_model(tmp_path / "m")


def test_mixture_with_dense_layers_is_refused_by_name(hf_model_dir, tmp_path):
    directory, _ = hf_model_dir("qwen3_moe")
    shutil.copytree(directory, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [1]}))
    with pytest.raises(JaxtuneError, match=r"config.json: decoder_sparse_step=1, mlp_only_layers=\[1\]: jaxtune's "
                                           "mixtures have experts in every layer"):
        load_model(tmp_path / "m")
