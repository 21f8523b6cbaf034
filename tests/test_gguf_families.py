"""GGUF files of the 2025-26 families (SmolLM3, OLMo 2 and 3, gpt-oss with float or MXFP4 experts, Llama 4,
DeepSeek-V3, Qwen3.5 and its MoE, Qwen3-Next, Gemma 4) as llama.cpp's converter writes them (tests/gguf_files.py,
written apart from jaxtune): read with the source model's logits; written back by `save_gguf` tensor for tensor as
that converter writes them; a config llama.cpp's loader cannot express refused by name. llama.cpp itself runs the
exports in test_llama_cpp.py (full tier)."""

import re

import gguf
import ml_dtypes
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import TOKENS, write_deepseek_gguf, write_family_gguf, write_qwen35_gguf
from hf_models import make_hf_model
from reference import assert_float32_parity, logits_four_ways
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.methods.gguf_export import save_gguf
from jaxtune.models.gguf import GGUFCheckpoint
from jaxtune.models.mxfp4 import encode_mxfp4
from jaxtune.spine.model import load_model

pytestmark = [pytest.mark.reference, pytest.mark.parity]

# Each family's tiny model in the shape llama.cpp's loader fixes (NoPE, sliding and chunked layers every 4th or
# every other; Llama 4's chunk 8192, temperature floor 8192 and scale 0.1, its RoPE scaled as Scout's: llama3
# with equal bands; DeepSeek's latent norms' epsilon 1e-6, its mscale and mscale_all_dim equal), vocabulary the
# test tokenizer's.
# Qwen3.5's, its MoE's and Qwen3-Next's: 3 Gated DeltaNet layers (2 key heads, 4 value heads, one width) and a full
# one; the L2 norms' epsilon 1e-6 (llama.cpp's rms_norm_eps); the mixtures' unused intermediate_size their experts'
# width (jaxtune holds no other).
QWEN35_LAYERS = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=16,
                     rms_norm_eps=1e-6)
MROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [1, 1, 0], "mrope_interleaved": True})  # of 2 rotated pairs
EXPRESSIBLE = {
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=None, use_sliding_window=False),
    "olmo2": {},
    "olmo3": dict(num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500_000.0,
                                                      "original_max_position_embeddings": 16},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}),
    "gpt_oss": {},
    "llama4": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], attention_chunk_size=8192, floor_scale=8192,
                   attn_scale=0.1, rope_parameters={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 1.0, "rope_theta": 500_000.0,
                                                    "original_max_position_embeddings": 8192}),
    "deepseek_v3": dict(rms_norm_eps=1e-6),
    "gemma4": dict(vocab_size_per_layer_input=len(TOKENS)),  # llama.cpp's per-layer embedding: a row a token
    "gemma4_dense": dict(final_logit_softcapping=30.0),  # as released (the converter writes no key for none)
    **{family: dict(QWEN35_LAYERS, **extra) for family, extra in (
        ("qwen3_5", MROPE), ("qwen3_next", dict(intermediate_size=32)),
        ("qwen3_5_moe", dict(MROPE, intermediate_size=32)))},
}
SLIDING, FULL = "sliding_attention", "full_attention"
DEEPSEEK_LITE = dict(q_lora_rank=None, n_group=2, topk_group=2)  # DeepSeek-V2-Lite's queries; every group chosen
EVERYDAY = ("gpt_oss", "gemma4_dense")  # experts, sinks, biases, windows, YaRN; Gemma 4's widths by layer


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory):
    cache = {}

    def get(family: str, mxfp4: bool = False):
        if (family, mxfp4) not in cache:
            directory = tmp_path_factory.mktemp(family)
            model = make_hf_model(family, directory / "hf", vocab_size=len(TOKENS), **EXPRESSIBLE[family])
            stacks = {}
            if mxfp4:  # the experts on the MXFP4 grid; the reference holds transformers' dequantisation of them
                for name, p in model.named_parameters():
                    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                        stacks[name] = encode_mxfp4(p.detach().numpy().swapaxes(1, 2))  # [E, out, in/32, 16]
                        with torch.no_grad():
                            p.copy_(convert_moe_packed_tensors(*map(torch.from_numpy, stacks[name]),
                                                               dtype=torch.float32))
            cache[family, mxfp4] = model, write_family_gguf(directory / "model.gguf", model, Q.F32, stacks)
        return cache[family, mxfp4]

    return get


def every_family():
    return [pytest.param(f, marks=() if f in EVERYDAY else pytest.mark.full) for f in EXPRESSIBLE]


@pytest.mark.parametrize("family", every_family())
def test_family_gguf_logits_equal_the_source_model(family, family_gguf):
    """The converter's file read by jaxtune (its names, split experts, permuted rows, metadata into the family's
    config) gives the source model's float32 logits on a padded batch."""
    model, path = family_gguf(family)
    cfg, params = load_model(path, dtype=np.float32)
    assert cfg.architecture == type(model).__name__
    out = logits_four_ways(model, params, cfg)
    assert_float32_parity(out["out32"], out["ref32"], out["ref64"], out["valid"])


def test_gpt_oss_gguf_with_mxfp4_experts(family_gguf):
    """gpt-oss's experts as GGML MXFP4 blocks (as llama.cpp's converter repacks the released ones): read an expert
    slice at a time into the values transformers' own MXFP4 dequantisation gives."""
    model, path = family_gguf("gpt_oss", mxfp4=True)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if "_exps.weight" in t.name} == {Q.MXFP4}
    cfg, params = load_model(path, dtype=np.float32)
    out = logits_four_ways(model, params, cfg)
    assert_float32_parity(out["out32"], out["ref32"], out["ref64"], out["valid"])
    with GGUFCheckpoint(path) as reader:  # MXFP4 is exact in bfloat16: read so, half float32's bytes
        experts = reader.read("model.layers.0.mlp.experts.gate_up_proj", (slice(1, 3),))
    assert experts.dtype == ml_dtypes.bfloat16 and experts.shape == (2, cfg.hidden_size, 2 * cfg.expert_size)
    np.testing.assert_array_equal(experts.astype(np.float32), model.model.layers[0].mlp.experts.gate_up_proj[1:3]
                                  .detach().numpy())


@pytest.mark.parametrize("family", every_family())
def test_family_gguf_export_is_what_llama_cpp_converter_writes(family, family_gguf, tmp_path):
    """`save_gguf` (f32) of the model read from the converter's file: the same architecture, tensors (names,
    shapes, values; Gated DeltaNet's `ssm_a` to its exp/log round trip's ulp) and the metadata llama.cpp's loader
    reads (with Gemma 4's tokenizer keys)."""
    _, source = family_gguf(family)
    cfg, params = load_model(source, dtype=np.float32)
    out = save_gguf(tmp_path / "out.gguf", cfg, params, load_tokenizer(source), kind="f32")
    theirs, ours = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(out))
    arch = ours.fields["general.architecture"].contents()
    assert arch == theirs.fields["general.architecture"].contents()
    want = {t.name: np.asarray(t.data) for t in theirs.tensors}
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":
        assert "rope_freqs.weight" in {t.name for t in ours.tensors}  # llama.cpp's form of Llama 3/4 scaling
        want["rope_freqs.weight"] = next(np.asarray(t.data) for t in ours.tensors if t.name == "rope_freqs.weight")
        np.testing.assert_array_equal(np.unique(want["rope_freqs.weight"]), [1.0, 16.0])
    got = {t.name: np.asarray(t.data) for t in ours.tensors}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if name.endswith(".ssm_a"):  # -exp(A_log), read back through log: within a float32 ulp
            np.testing.assert_allclose(got[name], value, rtol=2e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    for key, field in theirs.fields.items():  # Gemma 4's vocabulary too, as its converter writes it ("gemma4")
        if key.startswith(f"{arch}.") or (arch == "gemma4" and key.startswith("tokenizer.")):
            assert ours.fields[key].contents() == pytest.approx(field.contents()), key
            assert ours.fields[key].types == field.types, key  # llama.cpp's loader checks each key's type


@pytest.mark.parametrize("family, change, named", [
    ("smollm3", dict(no_rope_layers=[1, 0, 1, 1]), "NoPE layers (1,)"),
    ("olmo3", dict(layer_types=["sliding_attention", "full_attention"] * 2), "sliding layers"),
    ("gpt_oss", dict(swiglu_limit=5.0), "swiglu alpha 1.702 and limit 5.0"),
    ("llama4", dict(attention_chunk_size=4, floor_scale=4), "attention chunks [-4, 0]"),
    ("qwen3_5", dict(linear_key_head_dim=8), "Gated DeltaNet key heads 8 wide, value heads 16"),
    ("qwen3_5", dict(rms_norm_eps=1e-5), "an RMSNorm epsilon 1e-05 (llama.cpp's Gated DeltaNet L2 norms"),
    ("qwen3_next", dict(norm_topk_prob=False), "top-k weights not renormalised"),
    ("qwen3_next", dict(mlp_only_layers=[0]), "dense MLP layers [0]"),
    ("gemma4", dict(layer_types=[SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL]),
     "num_kv_shared_layers 3 after layers [True, False, True] sliding (llama.cpp's shared layers read layers 1 and 2"),
    ("gemma4", dict(vocab_size_per_layer_input=96), "vocab_size_per_layer_input 96 (llama.cpp's: the vocabulary, 264)"),
    ("gemma4_dense", dict(rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, "factor": 2},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "a proportional RoPE factor 2 (llama.cpp's: 1)"),
    pytest.param("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 32}),
                 "a YaRN attention factor 0.9643 (llama.cpp's: 1)", marks=pytest.mark.full),
])
def test_what_llama_cpp_fixes_is_refused_by_name(family, change, named, tmp_path):
    model = make_hf_model(family, tmp_path / "hf", vocab_size=len(TOKENS), **{**EXPRESSIBLE[family], **change})
    cfg, params = load_model(tmp_path / "hf", dtype=np.float32)
    with pytest.raises(JaxtuneError, match=f"{type(model).__name__}: cannot be written as GGUF.*{re.escape(named)}"):
        save_gguf(tmp_path / "out.gguf", cfg, params, None, kind="f32")  # type: ignore[arg-type]
    assert not (tmp_path / "out.gguf").exists()


def test_gemma4_without_a_soft_cap_is_written_with_0(tmp_path):
    """Gemma 4 with no final soft cap (31B's shape, none named): the converter writes no key, which llama.cpp reads as
    its default 30, and so does jaxtune reading that file; `save_gguf` writes 0 (none), read back as none."""
    from gguf_files import write_gemma4_gguf

    from jaxtune.models.hf_config import load_config

    model = make_hf_model("gemma4_dense", tmp_path / "hf", vocab_size=len(TOKENS))
    assert model.config.final_logit_softcapping is None
    converted = write_gemma4_gguf(tmp_path / "converted.gguf", model)
    assert "gemma4.final_logit_softcapping" not in gguf.GGUFReader(str(converted)).fields
    assert load_config(converted).final_logit_softcap == 30.0
    cfg, params = load_model(tmp_path / "hf", dtype=np.float32)
    out = save_gguf(tmp_path / "out.gguf", cfg, params, load_tokenizer(tmp_path / "hf"), kind="f32")
    assert gguf.GGUFReader(str(out)).fields["gemma4.final_logit_softcapping"].contents() == 0.0
    assert load_config(out).final_logit_softcap is None


@pytest.mark.full
def test_deepseek_gguf_from_before_the_kv_b_split_without_a_query_latent(tmp_path):
    """DeepSeek-V2-Lite's queries (`attn_q`, no latent) and every expert group chosen, in a file from before
    llama.cpp split `attn_kv_b` (the heads' key and value lengths, no `*_mla` keys): read with the source model's
    logits; written back split, with a query latent rank of 0 and one group (llama.cpp asserts fewer groups chosen
    than there are), and read back with them again."""
    model = make_hf_model("deepseek_v3", tmp_path / "hf", vocab_size=len(TOKENS),
                          **{**EXPRESSIBLE["deepseek_v3"], **DEEPSEEK_LITE})
    source = write_deepseek_gguf(tmp_path / "legacy.gguf", model, split_kv_b=False)
    assert "blk.0.attn_kv_b.weight" in {t.name for t in gguf.GGUFReader(str(source)).tensors}
    cfg, params = load_model(source, dtype=np.float32)
    out = save_gguf(tmp_path / "out.gguf", cfg, params, load_tokenizer(source), kind="f32")
    written = gguf.GGUFReader(str(out))
    assert {"blk.0.attn_q.weight", "blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= {t.name for t in
                                                                                          written.tensors}
    assert not any(".attn_kv_b." in t.name or ".attn_q_a" in t.name for t in written.tensors)
    assert [written.fields[f"deepseek2.{key}"].contents() for key in (
        "attention.q_lora_rank", "expert_group_count", "expert_group_used_count")] == [0, 1, 1]
    for path in (source, out):
        cfg, params = load_model(path, dtype=np.float32)
        logits = logits_four_ways(model, params, cfg)
        assert_float32_parity(logits["out32"], logits["ref32"], logits["ref64"], logits["valid"])


def test_gguf_lora_on_gated_deltanet_is_refused_by_name(tmp_path):
    """A GGUF LoRA on Gated DeltaNet's projections (which llama.cpp holds reordered or split) is refused in one line,
    nothing written; the merged export carries it."""
    import jax

    from jaxtune.methods import method_config
    from jaxtune.methods.lora.gguf import save_gguf_lora
    from jaxtune.methods.transform import apply_method

    make_hf_model("qwen3_5", tmp_path / "hf", vocab_size=len(TOKENS), **EXPRESSIBLE["qwen3_5"])
    cfg, params = load_model(tmp_path / "hf", dtype=np.float32)
    lora = method_config("lora", rank=4, target_modules=("linear_attn.in_proj_qkv", "o_proj"))
    with pytest.raises(JaxtuneError, match="Qwen3_5ForCausalLM: a GGUF LoRA on linear_attn.in_proj_qkv "
                                           "is not written here"):
        save_gguf_lora(tmp_path / "lora.gguf", cfg, apply_method(params, cfg, lora, jax.random.key(0)), lora)
    assert not (tmp_path / "lora.gguf").exists()


@pytest.mark.full
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_qwen35_gguf_as_older_converters_wrote_it_with_a_multi_token_head(family, tmp_path):
    """A file with no `recurrent_layers` (layer kinds from the full-attention interval), Qwen3-Next's projections
    whole as `ssm_in`, the shared expert's gate 1-D, and a multi-token-prediction block past the trunk (which
    jaxtune does not hold, so does not read): the source model's logits; written back, the converter's current form
    with no MTP block (its --no-mtp)."""
    model = make_hf_model(family, tmp_path / "hf", vocab_size=len(TOKENS), **EXPRESSIBLE[family])
    source = write_qwen35_gguf(tmp_path / "older.gguf", model, older=True)
    names = {t.name for t in gguf.GGUFReader(str(source)).tensors}
    assert "blk.4.nextn.eh_proj.weight" in names and ("blk.0.ssm_in.weight" in names) == (family == "qwen3_next")
    cfg, params = load_model(source, dtype=np.float32)
    assert cfg.num_layers == 4 and cfg.linear_attention_layers == (0, 1, 2)
    out = logits_four_ways(model, params, cfg)
    assert_float32_parity(out["out32"], out["ref32"], out["ref64"], out["valid"])
    written = save_gguf(tmp_path / "out.gguf", cfg, params, load_tokenizer(source), kind="f32")
    current = write_family_gguf(tmp_path / "current.gguf", model)
    assert sorted(t.name for t in gguf.GGUFReader(str(written)).tensors) == sorted(
        t.name for t in gguf.GGUFReader(str(current)).tensors)


@pytest.mark.full
def test_deepseek_gguf_refuses_each_difference_llama_cpp_fixes(family_gguf, tmp_path):
    """What llama.cpp's deepseek2 loader and graph fix, each refused by name: the latent norms' epsilon (theirs
    rms_norm_eps, transformers' 1e-6), RoPE on halves, YaRN's betas (not read), other rope scalings, no shared
    expert; reading, a softmax router's file (DeepSeek-V2's), named with the file."""
    import dataclasses
    import shutil

    from jaxtune.methods.gguf_export import gguf_form

    _, path = family_gguf("deepseek_v3")
    cfg, _ = load_model(path, dtype=np.float32)
    gguf_form(cfg)
    yarn = cfg.rope_scaling
    assert yarn is not None
    for change, named in ((dict(rms_norm_eps=1e-5), "an RMSNorm epsilon 1e-05 (llama.cpp's latent norms take it"),
                          (dict(rope_interleaved=False), "RoPE on halves"),
                          (dict(rope_scaling=dataclasses.replace(yarn, beta_fast=1.0)), "YaRN betas 1 and 1"),
                          (dict(rope_scaling=dataclasses.replace(yarn, kind="linear")), "rope scaling 'linear'"),
                          (dict(shared_expert_size=0), "no shared expert")):
        with pytest.raises(JaxtuneError, match=f"DeepseekV3ForCausalLM: cannot be written as GGUF.*{re.escape(named)}"):
            gguf_form(cfg.replace(**change))
    softmax = shutil.copy(path, tmp_path / "softmax.gguf")
    field = gguf.GGUFReader(str(softmax), "r+").fields["deepseek2.expert_gating_func"]
    field.parts[field.data[0]][0] = 1
    del field
    with pytest.raises(JaxtuneError, match=f"{re.escape(str(softmax))}: metadata deepseek2.expert_gating_func 1 is "):
        load_model(softmax, dtype=np.float32)
