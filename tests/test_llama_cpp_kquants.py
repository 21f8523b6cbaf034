"""GGUF k-quant exports against llama.cpp itself (`llama-cpp-python`, the full tier's): jaxtune's quantisers against
ggml's in its library, the real SmolLM2-135M-Instruct exported as each kind against `llama_model_quantize` of the
same model's f32 export (every tensor's type and bytes), and llama.cpp loading each export, generating, and scoring
held-out text with the perplexity of its own quantiser's file."""

import ctypes
import json

import gguf
import llama_cpp
import numpy as np
import pytest
from ggml_quants import GGML_TYPES, STORED, ggml_quantize
from test_gguf import smollm2_path
from test_gguf_kquants import LLAMA_CPP_TYPES
from test_llama_cpp import llama_cpp_model

from jaxtune.cli import main
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.io.gguf_kquants import quantize_rows
from jaxtune.methods.gguf_mixture import MIXTURES

pytestmark = [pytest.mark.slow, pytest.mark.reference]
HELD_OUT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
            "great lens, and wrote the weather in a leather book: wind from the north-west, a swell rising, two "
            "fishing boats returning late. In winter the storms came in from the sea and the spray reached the "
            "lantern room, but the light never failed. Ships passing the headland counted its flashes, three every "
            "fifteen seconds, and knew where they were.")


@pytest.mark.full
def test_quantisers_write_ggmls_bytes():
    """Every block type jaxtune writes, on 4096 rows of weights at several scales (and the stored sample rows):
    jaxtune's bytes are ggml's (the k-quants its own, the 32-blocks the gguf package's); the everyday tier's copy
    of ggml's bytes is what the library writes."""
    stored = np.load(STORED)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        np.testing.assert_array_equal(ggml_quantize(stored["rows"], kind), stored[kind])
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((4096, 512)) * rng.choice([1e-3, 0.02, 1.0], (4096, 1))).astype(np.float32)
    rows[::7] = rows[::7] ** 3
    for kind in GGML_TYPES:
        qtype = gguf.GGMLQuantizationType[kind]
        ours = quantize_rows(rows, kind) if kind.endswith("_K") else gguf.quants.quantize(rows, qtype)
        np.testing.assert_array_equal(ours, ggml_quantize(rows, kind), err_msg=kind)


@pytest.fixture(scope="module")
def f32_export(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquants") / "smollm2-f32.gguf"
    assert main(["export", "--model", str(smollm2_path()), "--gguf", str(path), "--type", "f32"]) == 0
    return path


def llama_quantize(source, out, kind: str):
    """llama.cpp's own quantisation of `source` (its `llama-quantize`) as `kind`."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = MIXTURES[kind][0].value
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def exports(f32_export):
    """kind -> the files of that kind written by `jaxtune export --gguf-type` and by llama.cpp's quantiser from the
    f32 export (each made when first asked for)."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            ours = f32_export.parent / f"jaxtune-{kind}.gguf"
            assert main(["export", "--model", str(smollm2_path()), "--gguf", str(ours), "--gguf-type", kind]) == 0
            made[kind] = ours, llama_quantize(f32_export, f32_export.parent / f"llama-cpp-{kind}.gguf", kind)
        return made[kind]

    return get


@pytest.mark.full
def test_exports_equal_llama_quantize_byte_for_byte(exports):
    """For every kind, every tensor of jaxtune's export has the type and the bytes of llama.cpp's quantisation of
    the same model (SmolLM2: the k-quants on ffn_down, the fallbacks elsewhere); the file type is llama.cpp's;
    the everyday tier's copy of llama.cpp's types is what it gives."""
    stored = json.loads(LLAMA_CPP_TYPES.read_text())
    for kind in MIXTURES:
        ours, theirs = exports(kind)
        a, b = tensors(ours), tensors(theirs)
        assert set(a) == set(b)
        for name in a:
            assert a[name].tensor_type == b[name].tensor_type, (kind, name)
            np.testing.assert_array_equal(np.asarray(a[name].data).view(np.uint8),
                                          np.asarray(b[name].data).view(np.uint8), err_msg=f"{kind} {name}")
        assert [b[name].tensor_type.name for name, _ in stored["tensors"]] == stored["types"][kind]
        file_type = gguf.GGUFReader(ours).fields["general.file_type"].contents()
        assert file_type == gguf.GGUFReader(theirs).fields["general.file_type"].contents() == MIXTURES[kind][0]


def perplexity(path, ids: list[int]) -> float:
    model = llama_cpp_model(path, n_ctx=256, logits_all=True)
    model.eval(ids)
    logits = np.array(model.scores[:len(ids)], np.float64)
    log_p = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    return float(np.exp(-np.mean(log_p[np.arange(len(ids) - 1), ids[1:]])))


@pytest.mark.full
@pytest.mark.parametrize("kind", ["q4_k_m", "q5_k_m", "q6_k", "q4_0"])
def test_llama_cpp_runs_the_exports_at_its_own_perplexity(kind, exports, f32_export):
    """llama.cpp loads jaxtune's export, continues a prompt, and scores held-out text with the perplexity of its own
    quantiser's file (equal: the same bytes), near the f32 export's (measured 76.7; q4_k_m 94.1, q5_k_m 87.8,
    q6_k 76.3, q4_0 77.5: SmolLM2's rows of 576 put most of the k-kinds' matrices in their fallbacks)."""
    ours, theirs = exports(kind)
    ids = load_tokenizer(f32_export).encode(HELD_OUT)
    ppl = {name: perplexity(path, ids) for name, path in (("ours", ours), ("theirs", theirs), ("f32", f32_export))}
    print(kind, ppl)
    assert ppl["ours"] == ppl["theirs"]
    assert 0.95 * ppl["f32"] < ppl["ours"] < 1.3 * ppl["f32"]
    text = llama_cpp_model(ours, n_ctx=128)("The capital of France is", max_tokens=8, temperature=0)
    assert text["choices"][0]["text"].strip()
