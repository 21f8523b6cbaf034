"""GGUF k-quants and the Ollama Modelfile, the everyday tier's share: jaxtune's quantisers against ggml's own bytes
(stored from llama.cpp's library by tests/ggml_quants.py; the full tier's test_llama_cpp_kquants.py checks the copy
against the library and whole SmolLM2 exports against `llama-quantize`), the mixture against the types llama.cpp
gave SmolLM2's tensors, and the Modelfile's Go templates rendered beside the chat templates they stand for."""

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggml_quants import STORED, sample_rows

from jaxtune.cli import build_parser
from jaxtune.data.formats import render_chat
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.io.gguf_kquants import quantize_rows
from jaxtune.methods.gguf_export import KINDS
from jaxtune.methods.gguf_mixture import MIXTURES, tensor_types
from jaxtune.methods.ollama import FAMILIES, modelfile

DATA = Path(__file__).parent / "data"
LLAMA_CPP_TYPES = DATA / "llama_cpp_smollm2_types.json"  # llama-quantize's type of each SmolLM2 tensor, by kind


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_bytes_equal_ggml(kind):
    """quantize_rows writes ggml's bytes (quantize_row_*_K_ref) for every sample row: weights at three scales, an
    all-zero row, a constant one, ties, a zero sub-block beside a spike, near-underflow values; and they decode
    (gguf's dequantiser) to within the type's error of each row of sizeable values."""
    stored = np.load(STORED)
    rows = sample_rows()
    np.testing.assert_array_equal(stored["rows"], rows)
    ours = quantize_rows(rows, kind)
    np.testing.assert_array_equal(ours, stored[kind])
    back = gguf.quants.dequantize(ours, gguf.GGMLQuantizationType[kind])
    sized = np.abs(rows).max(axis=1) > 1e-3  # not the zeros, nor the values whose float16 scales underflow to 0
    error = np.linalg.norm(back - rows, axis=1)[sized] / np.linalg.norm(rows, axis=1)[sized]
    assert sized.sum() == 6 and error.max() < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[kind], error


def test_mixture_gives_llama_cpps_types_to_smollm2():
    """tensor_types on SmolLM2-135M's tensors (30 layers, rows of 576 that no 256-block divides, tied embeddings)
    gives the type llama-quantize gave each, for every kind: the `_M` kinds' value projections and ffn_down of the
    chosen layers one step up, the fallbacks (Q5_0, Q5_1, Q8_0), the tied table as an output head."""
    stored = json.loads(LLAMA_CPP_TYPES.read_text())
    tensors = [(name, tuple(shape)) for name, shape in stored["tensors"]]
    assert set(stored["types"]) == set(MIXTURES)
    for kind, expected in stored["types"].items():
        ours = tensor_types(tensors, kind, layers=30, experts=0)
        assert [ours[name].name if ours[name] else "F32" for name, _ in tensors] == expected, kind


def test_cli_offers_every_kind():
    """`export --gguf-type` (alias of --type) takes exactly the kinds save_gguf writes."""
    export = build_parser()._subparsers._group_actions[0].choices["export"]  # type: ignore[union-attr]
    action = next(a for a in export._actions if "--gguf-type" in a.option_strings)
    assert action.dest == "type" and tuple(action.choices) == KINDS


def go_render(template: str, messages: list[dict]) -> str:
    """Ollama's Go template, for the constructs FAMILIES use: `{{- range .Messages }}...{{ end }}`, `.Role`,
    `.Content`, `{{ if eq .Role "x" }}a{{ else }}b{{ end }}`, and `{{-` trimming the whitespace before it."""
    template = re.sub(r"\s*\{\{-", "{{", template)
    head, body, tail = re.fullmatch(r"(.*?)\{\{ range \.Messages \}\}(.*)\{\{ end \}\}(.*)", template, re.S).groups()
    conditional = re.compile(r'\{\{ if eq \.Role "(\w+)" \}\}(.*?)\{\{ else \}\}(.*?)\{\{ end \}\}')
    turns = []
    for m in messages:
        turn = conditional.sub(lambda c: c[2] if m["role"] == c[1] else c[3], body)
        turns.append(turn.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]))
    return head + "".join(turns) + tail


@pytest.mark.parametrize("family, template", [("chatml", "qwen2_5"), ("llama3", "llama3"), ("gemma", "gemma2")])
def test_modelfile_template_renders_as_the_chat_template(family, template):
    """The Modelfile of a model with Qwen2.5's, Llama 3.1's or Gemma 2's chat template names its family, and its
    TEMPLATE (with its SYSTEM as Ollama adds it to a conversation without one) renders a conversation as the chat
    template does (less the BOS llama.cpp adds); its stops end the turn and the sequence."""
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = (DATA / "chat_templates" / f"{template}.jinja").read_text()
    text = modelfile("m.gguf", tokenizer, {"eos_token_id": [2], "do_sample": True, "temperature": 0.6, "top_k": 20})
    assert text.startswith("FROM ./m.gguf\n") and f"# TEMPLATE: {family} " in text
    go = re.search(r'TEMPLATE """(.*?)"""', text, re.S)[1]
    system = re.search(r'SYSTEM (?:"""(.*?)"""|"(.*?)")\n', text, re.S)
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Name a colour."}]
    default = [{"role": "system", "content": system[1] or system[2]}] if system else []
    expected = render_chat(conversation, tokenizer, add_generation_prompt=True)
    bos = tokenizer.backend.id_to_token(tokenizer.bos_id)
    assert go_render(go, default + conversation) == expected.removeprefix(bos)
    stops = re.findall(r'PARAMETER stop "(.*?)"', text)
    assert stops == [FAMILIES[family][2], tokenizer.backend.id_to_token(2)]
    assert "PARAMETER temperature 0.6" in text and "PARAMETER top_k 20" in text


def test_modelfile_of_an_unknown_template_says_so():
    """A chat template of no known family: the generic template, said in a comment; greedy generation_config as
    temperature 0."""
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = (DATA / "chat_templates" / "mistral.jinja").read_text()
    text = modelfile("m.gguf", tokenizer, {"do_sample": False, "temperature": 0.7})
    assert "# TEMPLATE: generic" in text and "tokenizer.chat_template" in text
    assert "PARAMETER temperature 0\n" in text and "0.7" not in text
    assert go_render(re.search(r'TEMPLATE """(.*?)"""', text, re.S)[1],
                     [{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "
