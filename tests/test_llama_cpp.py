"""GGUF exports run by llama.cpp itself (`llama-cpp-python`, built from source by pip): the real SmolLM2-135M-Instruct
written as f16 and q8_0, and a LoRA adapter as llama.cpp's GGUF LoRA, against jaxtune, transformers and PEFT.

llama.cpp is loaded without its extra CPU buffer types (`use_extra_bufts = false`, the CLI's `--no-repack`): on Intel
CPUs with AMX, its AMX buffer repacks quantised weights (Q4_0/Q4_1/Q8_0, ...) and then dies with SIGSEGV in
`ggml_backend_amx_mul_mat` on the first decode (ggml-org/llama.cpp#20824, seen here with llama-cpp-python 0.3.36 on
every quantised file); the plain CPU kernels are what every other CPU runs. The build's features are written to stderr
once, so a crash in a worker names the machine's path.
"""

import sys
from unittest import mock

import jax
import jax.numpy as jnp
import llama_cpp
import numpy as np
import peft
import pytest
import torch
from test_gguf import smollm2_path, transformers_gguf

from jaxtune.cli import main
from jaxtune.config import SamplingConfig
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.generation import generate
from jaxtune.methods import method_config
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.methods.transform import apply_method
from jaxtune.models.llama import forward
from jaxtune.spine.model import load_model

pytestmark = [pytest.mark.slow, pytest.mark.reference]
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]


def llama_cpp_model(path, **options) -> llama_cpp.Llama:
    """llama.cpp's model of a GGUF file on the plain CPU buffers: `Llama` exposes no `use_extra_bufts`, so the model
    parameters it starts from are patched for this one load."""
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    with mock.patch.object(llama_cpp.llama.llama_cpp, "llama_model_default_params", without_extra_buffers):
        return llama_cpp.Llama(model_path=str(path), **{"verbose": False, **options})


@pytest.fixture(scope="module", autouse=True)
def build_features(request):
    """llama.cpp's system info (its SIMD paths, AMX, REPACK), written past pytest's capture to the process's stderr
    before any model runs: a crash there loses captured output, and xdist shows a worker's stderr."""
    info = llama_cpp.llama_print_system_info().decode().strip()
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\nllama.cpp {llama_cpp.__version__} (extra buffer types off): {info}", file=sys.stderr)
    return info


@pytest.mark.full
def test_models_load_on_the_plain_cpu_buffers(exports, capfd):
    """The loader really turns the extra buffer types off (their AMX path crashes): llama.cpp's own load log puts
    every weight of a q8_0 file in a plain CPU buffer, none in an AMX or repacked one."""
    paths, _ = exports
    capfd.readouterr()
    llama_cpp_model(paths["q8_0"], n_ctx=64, verbose=True).close()
    buffers = [line for line in capfd.readouterr().err.splitlines() if "model buffer size" in line]
    assert buffers and all("CPU" in line and "AMX" not in line and "REPACK" not in line for line in buffers), buffers


def llama_cpp_logits(path, ids: list[int], lora=None, **options) -> np.ndarray:
    """[T, V] logits of llama.cpp on `ids` (with a GGUF LoRA adapter at scale 1, if given; `options`: `Llama`'s)."""
    model = llama_cpp_model(path, n_ctx=256, logits_all=True, seed=0, **({"lora_path": str(lora)} if lora else {}),
                            **options)
    model.eval(ids)
    return np.array(model.scores[:len(ids)])


def llama_cpp_greedy(path, ids: list[int], steps: int) -> list[int]:
    model = llama_cpp_model(path, n_ctx=256, logits_all=True, seed=0)
    model.eval(ids)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(model.scores[model.n_tokens - 1])))
        model.eval(out[-1:])
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """SmolLM2 written by `jaxtune export --gguf` as f32, f16 and q8_0, and chat prompts' ids."""
    source, out = smollm2_path(), tmp_path_factory.mktemp("llama_cpp")
    paths = {}
    for kind in ("f32", "f16", "q8_0"):
        paths[kind] = out / f"smollm2-{kind}.gguf"
        assert main(["export", "--model", str(source), "--gguf", str(paths[kind]), "--type", kind]) == 0
    tokenizer = load_tokenizer(source)
    from jaxtune.data.formats import render_chat

    prompts = [tokenizer.encode(render_chat([{"role": "user", "content": q}], tokenizer, True),
                                add_special_tokens=False) for q in QUESTIONS]
    return paths, prompts


@pytest.mark.full
def test_llama_cpp_greedy_on_the_f16_export_equals_jaxtune(exports):
    """llama.cpp loads the f16 export (names, metadata, tokenizer, interleaved q/k rows) and continues three chat
    prompts as jaxtune does on the same file, token for token; its tokenizer gives jaxtune's ids."""
    paths, prompts = exports
    cfg, params = load_model(paths["f16"], dtype=np.float32)
    ours = generate(params, cfg, prompts, SamplingConfig(max_new_tokens=16), eos_ids=())
    for ids, expected in zip(prompts, ours):
        assert llama_cpp_greedy(paths["f16"], ids, 16) == expected
    model = llama_cpp_model(paths["f16"], n_ctx=256, vocab_only=True)
    text = "Hello, world! def f(x): return x ** 2  # 日本語 🙂"
    assert model.tokenize(text.encode(), add_bos=False, special=True) == load_tokenizer(paths["f16"]).encode(text)


@pytest.mark.full
def test_llama_cpp_logits_of_the_f32_and_q8_0_exports(exports):
    """llama.cpp's logits of the f32 export equal jaxtune's of the same file (measured 4e-4 relative); the q8_0
    export moves them by what its 8-bit weights (measured in jaxtune, 2.7%) and llama.cpp's 8-bit activations in
    its q8_0 dot products bring (together 5.4%), with the same next token almost everywhere."""
    paths, prompts = exports
    ids = prompts[0] + prompts[1]
    relative = lambda x, ref: float(np.linalg.norm(x - ref) / np.linalg.norm(ref))
    ours = {}
    for kind in ("f32", "q8_0"):
        cfg, params = load_model(paths[kind], dtype=np.float32)
        ours[kind] = np.asarray(forward(params, jnp.asarray([ids]), cfg))[0]
    theirs = {kind: llama_cpp_logits(paths[kind], ids) for kind in ("f32", "q8_0")}
    assert relative(theirs["f32"], ours["f32"]) < 2e-3
    weights_only = relative(ours["q8_0"], ours["f32"])
    assert weights_only < 0.05
    assert relative(theirs["q8_0"], theirs["f32"]) < 2.5 * weights_only
    assert (theirs["q8_0"].argmax(-1) == theirs["f32"].argmax(-1)).mean() >= 0.85


@pytest.mark.full
def test_llama_cpp_applies_the_gguf_lora_as_peft_does(exports, tmp_path):
    """A LoRA adapter (random B, ranks 8 on attention and down_proj) exported with `--gguf-lora`: llama.cpp's
    logits with it applied to the f32 export equal transformers' with the PEFT adapter, as far from the base's."""
    paths, prompts = exports
    source = smollm2_path()
    cfg, params = load_model(source, dtype=np.float32)
    method = method_config("lora", rank=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
    adapted = apply_method(params, cfg, method, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    layers = {name: {**m, "lora_b": 0.05 * jax.random.normal(next(keys), m["lora_b"].shape)}
              if isinstance(m, dict) and "lora_b" in m else m for name, m in adapted["layers"].items()}
    adapter = save_peft_adapter(tmp_path / "adapter", {**adapted, "layers": layers}, cfg, method,
                                base_model=str(source))
    assert main(["export", "--model", str(source), "--adapter", str(adapter), "--gguf-lora",
                 str(tmp_path / "lora.gguf")]) == 0
    ids = prompts[1]
    base = transformers_gguf(source)
    with torch.no_grad():
        reference_base = base(torch.tensor([ids])).logits[0].numpy()
        reference = peft.PeftModel.from_pretrained(base, adapter)(torch.tensor([ids])).logits[0].numpy()
    ours = llama_cpp_logits(paths["f32"], ids, lora=tmp_path / "lora.gguf")
    plain = llama_cpp_logits(paths["f32"], ids)
    change, error = np.abs(reference - reference_base).max(), np.abs(ours - reference).max()
    assert change > 1.0  # measured 8.0
    assert error < 0.02 * change  # measured 0.045, where the base alone differs by 0.040
    assert np.abs(plain - reference_base).max() < 0.02 * change


def family_export_logits(family: str, tmp_path, **change) -> tuple[np.ndarray, np.ndarray]:
    """jaxtune's and llama.cpp's [T, V] logits of `family`'s tiny model (in the shape llama.cpp's loader fixes, with
    `change`) written by `jaxtune export --gguf` (f32) from the converter's file; llama.cpp's KV cache in float32, as
    the export. gpt-oss is compared with its YaRN ramp rounded, as llama.cpp rounds it (transformers' gpt-oss does
    not)."""
    import dataclasses

    from gguf_files import TOKENS, write_family_gguf
    from hf_models import make_hf_model
    from test_gguf_families import EXPRESSIBLE

    model = make_hf_model(family, tmp_path / "hf", vocab_size=len(TOKENS), **{**EXPRESSIBLE[family], **change})
    source, out = write_family_gguf(tmp_path / "source.gguf", model), tmp_path / "out.gguf"
    assert main(["export", "--model", str(source), "--gguf", str(out), "--type", "f32"]) == 0
    cfg, params = load_model(out, dtype=np.float32)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "yarn":
        cfg = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, truncate=True))
    ids = [int(i) for i in np.random.default_rng(0).integers(3, len(TOKENS), 24)]
    ours = np.asarray(forward(params, jnp.asarray([ids]), cfg))[0]
    return ours, llama_cpp_logits(out, ids, type_k=0, type_v=0)  # GGML_TYPE_F32


@pytest.mark.full
@pytest.mark.parametrize("family", ["smollm3", "olmo2", "olmo3", "gpt_oss", "llama4", "deepseek_v3", "qwen3_5",
                                    "qwen3_next", "qwen3_5_moe"])
def test_llama_cpp_runs_the_family_exports(family, tmp_path):
    """Each 2025-26 family written by `jaxtune export --gguf` (f32): llama.cpp's logits equal jaxtune's of the same
    file (measured 6e-7 to 8e-7 relative; Qwen3.5's, Qwen3-Next's and Qwen3.5-MoE's 2.6e-6, 2.4e-6 and 2.2e-6, their
    Gated DeltaNet layers' value heads reordered; DeepSeek-V3's 6e-4 with llama.cpp's default float16 cache)."""
    ours, theirs = family_export_logits(family, tmp_path)
    assert float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)) < 1e-5


PLAIN_GELU = jax.nn.gelu


def ggml_gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """GELU (tanh; jaxtune's only) as ggml's CPU kernels compute it (`GGML_GELU_FP16`, always on): below -10 zero,
    above 10 x, else its float16 table at x rounded to float16, so both the input and the value in float16."""
    table = PLAIN_GELU(x.astype(jnp.float16).astype(jnp.float32), approximate=True).astype(jnp.float16)
    return jnp.where(x <= -10, 0.0, jnp.where(x >= 10, x, table.astype(x.dtype))).astype(x.dtype)


@pytest.mark.full
@pytest.mark.parametrize("family, bound", [("gemma4_dense", 1e-5), ("gemma4", 1e-3)])
def test_llama_cpp_runs_the_gemma4_exports(family, bound, tmp_path):
    """Gemma 4 written by `jaxtune export --gguf` (f32): llama.cpp's logits equal jaxtune's computed with ggml's GELU
    (its float16 table), 31B's shape measured 3.1e-6 relative, the E2B/26B-A4B one (per-layer inputs, KV sharing,
    experts, values from keys, 6 layers) 2.6e-4: the table's rounding now and then turns a float32 ulp of its input
    into a float16 one, so the error jumps at a few tokens and spreads to the later ones, the more GELUs the more
    (3 dense layers 7e-6, 6 layers 2.7e-5, 6 with experts 1.4e-4). With the exact GELU, 4.3e-4 and 0.12 (there the
    table moves a routing choice). llama.cpp tokenizes as jaxtune does with the file's "gemma4" vocabulary."""
    jax.clear_caches()  # GELU is traced anew under the patch (and after it, unpatched)
    with mock.patch.object(jax.nn, "gelu", ggml_gelu):
        ours, theirs = family_export_logits(family, tmp_path)
    jax.clear_caches()
    assert float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)) < bound
    out, text = tmp_path / "out.gguf", "te tt\n\n ete é 🙂\t"
    model = llama_cpp_model(out, n_ctx=64, vocab_only=True)  # its "gemma4" vocabulary
    assert model.tokenize(text.encode(), add_bos=True, special=True) == load_tokenizer(out).encode(text)


@pytest.mark.full
def test_llama_cpp_runs_deepseek_without_a_query_latent(tmp_path):
    """DeepSeek-V3 with DeepSeek-V2-Lite's queries (no latent: its query latent rank written as 0, which llama.cpp's
    loader requires) and every expert group chosen (written as one group, which its assertions require): llama.cpp
    loads the export and its logits equal jaxtune's (measured 1.2e-6 relative)."""
    from test_gguf_families import DEEPSEEK_LITE

    ours, theirs = family_export_logits("deepseek_v3", tmp_path, **DEEPSEEK_LITE)
    assert float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)) < 1e-5


def family_lora_logits(family: str, tmp_path, targets: tuple[str, ...]) -> tuple:
    """jaxtune's [T, V] logits of `family`'s tiny model merged with a LoRA adapter (random B, rank 4) on `targets`,
    of the model alone, llama.cpp's of the f32 export with the adapter as its GGUF LoRA (float32 KV cache), and the
    adapted tree."""
    from gguf_files import TOKENS, write_family_gguf
    from hf_models import make_hf_model
    from test_gguf_families import EXPRESSIBLE

    from jaxtune.methods.gguf_export import save_gguf
    from jaxtune.methods.lora.gguf import save_gguf_lora
    from jaxtune.methods.lora.merge import merge

    model = make_hf_model(family, tmp_path / "hf", vocab_size=len(TOKENS), **EXPRESSIBLE[family])
    source = write_family_gguf(tmp_path / "source.gguf", model)
    cfg, params = load_model(source, dtype=np.float32)
    base = save_gguf(tmp_path / "base.gguf", cfg, params, load_tokenizer(source), kind="f32")
    method = method_config("lora", rank=4, alpha=8, target_modules=targets)
    adapted = apply_method(params, cfg, method, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), len(adapted["layers"])))
    adapted["layers"] = {name: {**m, "lora_b": 0.2 * jax.random.normal(next(keys), m["lora_b"].shape)}
                         if isinstance(m, dict) and "lora_b" in m else m for name, m in adapted["layers"].items()}
    ids = [int(i) for i in np.random.default_rng(0).integers(3, len(TOKENS), 24)]
    ours = np.asarray(forward(merge(adapted, method, cfg=cfg), jnp.asarray([ids]), cfg))[0]
    plain = np.asarray(forward(params, jnp.asarray([ids]), cfg))[0]
    theirs = llama_cpp_logits(base, ids, lora=save_gguf_lora(tmp_path / "lora.gguf", cfg, adapted, method),
                              type_k=0, type_v=0)
    return ours, plain, theirs, adapted


@pytest.mark.full
def test_llama_cpp_applies_a_deepseek_gguf_lora_where_it_adapts(tmp_path):
    """A LoRA adapter (random B) on DeepSeek-V3's output projection, dense MLP (layer 0) and shared experts (layers 1
    and 2, their stack's rows 0 and 1) as llama.cpp's GGUF LoRA: its logits with it on the f32 export equal
    jaxtune's of the merged model (measured 4e-6, where the adapter moves them by 4.0)."""
    ours, plain, theirs, adapted = family_lora_logits("deepseek_v3", tmp_path,
                                                      ("o_proj", "gate_proj", "up_proj", "down_proj"))
    assert {"shared_expert.up_proj", "gate_proj"} <= set(adapted["layers"])
    change, error = np.abs(ours - plain).max(), np.abs(theirs - ours).max()
    assert change > 1.0
    assert error < 1e-4 * change


@pytest.mark.full
def test_llama_cpp_applies_a_gemma4_gguf_lora(tmp_path):
    """A LoRA adapter (random B) on every projection of Gemma 4's 31B shape (its sliding and full layers' own stacks)
    as llama.cpp's GGUF LoRA: its logits with it on the f32 export equal jaxtune's of the merged model with ggml's
    GELU (measured 2.7e-4 where the adapter moves them by 4.0)."""
    jax.clear_caches()
    with mock.patch.object(jax.nn, "gelu", ggml_gelu):
        ours, plain, theirs, adapted = family_lora_logits("gemma4_dense", tmp_path, (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    jax.clear_caches()
    assert {"q_proj@global", "v_proj@global"} <= set(adapted["layers"])
    change, error = np.abs(ours - plain).max(), np.abs(theirs - ours).max()
    assert change > 1.0
    assert error < 2e-4 * change
