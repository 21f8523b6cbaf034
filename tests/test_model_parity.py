"""jaxtune's forward is transformers' forward on a padded batch, for every architecture: equal in float64, and as
accurate as transformers in float32 (see reference.py)."""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import padded_batch
from hf_models import ARCHS
from reference import assert_float32_parity, float64_reference, jaxtune_float64

from jaxtune.config import ForwardOptions
from jaxtune.models.hf_weights import save_model
from jaxtune.models.llama import forward
from jaxtune.spine.model import load_model

pytestmark = [pytest.mark.parity, pytest.mark.reference]  # also run with AVX2 forced (.ci/run)

jit_forward = jax.jit(forward, static_argnames=("cfg", "options"))


def hf_logits(model, ids, mask, positions, float64=False):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(positions)).logits
    return (logits if float64 else logits.float()).numpy()


def jax_logits(params, cfg, ids, mask, positions, **options):
    return np.asarray(jit_forward(params, jnp.asarray(ids), cfg, positions_BxT=jnp.asarray(positions),
                                  attention_mask_BxT=jnp.asarray(mask), options=ForwardOptions(**options)))


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.full) if a in ("qwen3_next_dense", "gemma4_dense")
                                  else a for a in ARCHS])  # a variant: its own kinds' logits, in the full tier
def test_logits_equal_transformers_against_a_float64_reference(arch, hf_model_dir):
    """jaxtune in float64 equals transformers in float64 (1e-9: the same function); jaxtune's float32 logits are as
    close to that reference as transformers' own float32 logits (within reference.FACTOR) and within 1e-4 of them."""
    directory, model = hf_model_dir(arch)
    cfg, params = load_model(directory)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref32 = hf_logits(model, ids, mask, positions)
    ref64 = hf_logits(float64_reference(model), ids, mask, positions, float64=True)
    assert ref64.std() > 0.5, "logits too small for the comparison to mean anything"
    valid = mask > 0
    out64 = jaxtune_float64(params, ids, cfg, positions_BxT=positions, attention_mask_BxT=mask)
    assert np.abs(out64 - ref64)[valid].max() <= 1e-9
    assert_float32_parity(jax_logits(params, cfg, ids, mask, positions), ref32, ref64, valid)


def test_sliding_window_is_exercised(hf_model_dir):
    """Mistral's window (5) is shorter than the sequence (12): a full-attention model would differ."""
    directory, model = hf_model_dir("mistral")
    cfg, params = load_model(directory)
    assert set(cfg.sliding_windows) == {5}
    ids, mask, positions = padded_batch(cfg.vocab_size)
    full = jax_logits(params, cfg.replace(sliding_windows=(0,) * cfg.num_layers), ids, mask, positions)
    assert np.abs(full - hf_logits(model, ids, mask, positions))[mask > 0].max() > 1e-2


def test_qwen2_sliding_layers_follow_max_window_layers(hf_model_dir):
    directory, _ = hf_model_dir("qwen2_sliding")
    cfg, _ = load_model(directory)
    assert cfg.sliding_windows == (0, 4, 4)


def test_qwen3_reads_its_head_dim_query_key_norms_and_sliding_layers(hf_model_dir):
    """Qwen3's distinctive parts are read, and matter: without the query and key norms the logits move."""
    directory, model = hf_model_dir("qwen3")
    cfg, params = load_model(directory)
    assert ((cfg.qk_norm, cfg.head_dim, cfg.hidden_size // cfg.num_heads, cfg.sliding_windows)
            == (True, 32, 16, (0, 0, 4)))
    assert params["layers"]["q_norm"].shape == params["layers"]["k_norm"].shape == (3, 32)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ones = {**params, "layers": {**params["layers"], "q_norm": jnp.ones((3, 32)), "k_norm": jnp.ones((3, 32))}}
    unnormalised = jax_logits(ones, cfg, ids, mask, positions)
    assert np.abs(unnormalised - hf_logits(model, ids, mask, positions))[mask > 0].max() > 1e-2


@pytest.mark.full
def test_gemma2_reads_its_soft_caps_scale_norms_and_sliding_layers(hf_model_dir):
    """Gemma 2's distinctive parts are read, and each matters: the logits move without it."""
    directory, model = hf_model_dir("gemma2")
    cfg, params = load_model(directory)
    assert (cfg.hidden_act, cfg.norm_unit_offset, cfg.scale_embeddings, cfg.sandwich_norms, cfg.tie_word_embeddings,
            cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.query_pre_attn_scalar, cfg.sliding_windows) == (
        "gelu_tanh", True, True, True, True, 3.0, 2.0, 24.0, (4, 0, 4))
    assert params["layers"]["pre_feedforward_layernorm"].shape == params["layers"]["post_feedforward_layernorm"].shape
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, ids, mask, positions)
    assert np.abs(jax_logits(params, cfg, ids, mask, positions) - ref)[mask > 0].max() <= 1e-4
    assert np.abs(ref).max() <= 2.0
    for change in (dict(attn_logit_softcap=None), dict(final_logit_softcap=None), dict(query_pre_attn_scalar=None),
                   dict(scale_embeddings=False), dict(sliding_windows=(0, 0, 0)), dict(hidden_act="silu")):
        moved = jax_logits(params, cfg.replace(**change), ids, mask, positions)
        assert np.abs(moved - ref)[mask > 0].max() > 1e-2, change


@pytest.mark.full
def test_gemma3_reads_its_local_and_global_rope_and_query_key_norms(hf_model_dir):
    """Gemma 3: sliding layers rotate with base 1e4, full ones with base 1e6 scaled by 4; q and k normalised."""
    directory, model = hf_model_dir("gemma3")
    cfg, params = load_model(directory)
    assert (cfg.qk_norm, cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor, cfg.local_rope_theta,
            cfg.sliding_windows, cfg.attn_logit_softcap, cfg.final_logit_softcap) == (
        True, 1e6, "linear", 4.0, 1e4, (4, 0, 4), None, None)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, ids, mask, positions)
    for change in (dict(local_rope_theta=None), dict(rope_scaling=None), dict(local_rope_theta=1e6)):
        moved = jax_logits(params, cfg.replace(**change), ids, mask, positions)
        assert np.abs(moved - ref)[mask > 0].max() > 1e-2, change


@pytest.mark.full
def test_phi3_reads_its_fused_projections_partial_rotary_and_longrope(hf_model_dir, tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj are kept fused (as PEFT targets them); RoPE turns 12 of 16 dimensions;
    longrope's short factors below 64 positions and, for a model whose original context is 8, its long factors and
    attention factor on the same 12-token batch (transformers picks by the call's largest position too)."""
    directory, model = hf_model_dir("phi3")
    cfg, params = load_model(directory)
    assert (cfg.fused_projections, cfg.rotary_dim, cfg.rope_scaling.kind, cfg.sliding_windows) == (
        True, 12, "longrope", (6, 6, 6))
    assert params["layers"]["qkv_proj"]["kernel"].shape == (3, 64, 64 + 2 * 32)
    assert params["layers"]["gate_up_proj"]["kernel"].shape == (3, 64, 2 * 112)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, ids, mask, positions)
    for change in (dict(partial_rotary_factor=1.0, rope_scaling=None), dict(rope_scaling=None),
                   dict(sliding_windows=(0, 0, 0))):
        moved = jax_logits(params, cfg.replace(**change), ids, mask, positions)
        assert np.abs(moved - ref)[mask > 0].max() > 1e-2, change
    from hf_models import make_hf_model

    short = make_hf_model("phi3", tmp_path, original_max_position_embeddings=8)
    cfg8, params8 = load_model(tmp_path)
    assert cfg8.rope_scaling.original_max_position_embeddings == 8 and cfg8.rope_scaling.attention_factor > 1.5
    ref8 = hf_logits(short, ids, mask, positions)
    assert np.abs(jax_logits(params8, cfg8, ids, mask, positions) - ref8)[mask > 0].max() <= 1e-4
    short_only = dataclasses.replace(cfg8.rope_scaling, long_factor=cfg8.rope_scaling.short_factor)
    long_off = cfg8.replace(rope_scaling=short_only)
    assert np.abs(jax_logits(params8, long_off, ids, mask, positions) - ref8)[mask > 0].max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", *(pytest.param(a, marks=pytest.mark.full) for a in (
    "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "olmo2", "olmo3", "llama4", "gemma4_dense"))])
def test_bfloat16_compute_within_documented_tolerance(arch, hf_model_dir):
    """bf16 weights and compute, against float32 transformers: relative L2 error of the logits <= 2e-2, and no
    worse than 1.25x the error of transformers' own bf16 forward.

    bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative rounding per operation); through 3 layers the error measured
    here is 1.1-1.4% for both libraries. A wrong mask, rotation or norm gives errors of order 1.
    Mixtures are left out: bf16 rounding flips near-tied top-k routes, and a flipped token's logits move by O(1)
    (transformers' own bf16 Mixtral is 8.8% off its float32 forward here, ours 8.8%, with other flips per library).
    """
    directory, model = hf_model_dir(arch)
    cfg, params = load_model(directory, dtype="bfloat16")
    assert params["embed_tokens"].dtype == jnp.bfloat16
    ids, mask, positions = padded_batch(cfg.vocab_size)
    valid = mask > 0
    ref = hf_logits(model, ids, mask, positions)[valid]
    hf_bf16 = hf_logits(copy.deepcopy(model).to(torch.bfloat16), ids, mask, positions)[valid]
    out = jax_logits(params, cfg, ids, mask, positions, compute_dtype="bfloat16")[valid]
    error = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert error <= 2e-2
    assert error <= 1.25 * np.linalg.norm(hf_bf16 - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("arch", ["llama", "llama_tied_bias_linear", "mistral", "qwen2_sliding", "qwen3", "gemma2",
                                  "gemma3", "phi3", "mixtral", "qwen2_moe", "smollm3", "olmo2", "olmo3",
                                  "gpt_oss", "llama4", "qwen3_5",
                                  pytest.param("qwen3_5_moe", marks=pytest.mark.full), "qwen3_next",
                                  "llama4_maverick", "deepseek_v3", "gemma4",
                                  pytest.param("qwen3_next_dense", marks=pytest.mark.full),
                                  pytest.param("gemma4_dense", marks=pytest.mark.full)])
@pytest.mark.parametrize("max_shard_bytes", [2**31, 20_000])
def test_round_trip_through_transformers(arch, max_shard_bytes, hf_model_dir, tmp_path):
    """load -> save -> transformers loads the saved directory (single file or shards) -> same logits."""
    directory, model = hf_model_dir(arch)
    cfg, params = load_model(directory)
    save_model(tmp_path, cfg, params, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_bytes < 2**31)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids, mask, positions = padded_batch(cfg.vocab_size, seed=1)
    ref = hf_logits(model, ids, mask, positions)
    assert np.abs(hf_logits(reloaded, ids, mask, positions) - ref)[mask > 0].max() <= 1e-5
    cfg2, params2 = load_model(tmp_path)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixture_reads_the_hub_and_transformers_5_expert_layouts_alike(arch, hf_model_dir, tmp_path):
    """A mixture saved as transformers 5 holds it in memory (mlp.experts.gate_up_proj [E, 2F, D], down_proj
    [E, D, F], Mixtral's router under mlp.gate) loads to the same arrays as the hub's layout (one matrix an expert;
    Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2), and jaxtune writes the hub's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory, model = hf_model_dir(arch)
    state = {name: value.contiguous() for name, value in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and state[
        "model.layers.0.mlp.experts.gate_up_proj"].ndim == 3
    (tmp_path / "v5").mkdir()
    (tmp_path / "v5" / "config.json").write_text((directory / "config.json").read_text())
    save_file(state, str(tmp_path / "v5" / "model.safetensors"), metadata={"format": "pt"})
    cfg, params = load_model(directory)
    cfg5, params5 = load_model(tmp_path / "v5")
    assert cfg5 == cfg and cfg.num_experts > 1 and cfg.experts_per_token == 2
    jax.tree.map(np.testing.assert_array_equal, params, params5)
    save_model(tmp_path / "out", cfg, params5)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        written = set(f.keys())
    with safe_open(str(directory / "model.safetensors"), "np") as f:
        assert written == set(f.keys())  # the hub's names, Mixtral's w1/w2/w3 included


def test_smollm3_reads_its_nope_and_sliding_layers(hf_model_dir):
    """Layer 1 neither rotates nor sees past 4 tokens; rotating it would change the logits."""
    directory, model = hf_model_dir("smollm3")
    cfg, params = load_model(directory)
    assert (cfg.nope_layers, cfg.sliding_windows, cfg.rope_table_of_layer) == ((1,), (0, 4, 0), (0, 1, 0))
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, ids, mask, positions)
    assert np.abs(jax_logits(params, cfg.replace(nope_layers=()), ids, mask, positions) - ref)[mask > 0].max() > 1e-2


def test_olmo3_reads_post_norms_whole_projection_qk_norms_and_yarn(hf_model_dir):
    """Full layers YaRN-scaled (factor 4 past 16 positions, cos and sin scaled by 0.1 ln 4 + 1), sliding ones at
    their own unscaled base; dropping the scaling changes the logits."""
    directory, model = hf_model_dir("olmo3")
    cfg, params = load_model(directory)
    assert (cfg.post_norms, cfg.qk_norm_whole, cfg.sliding_windows) == (True, True, (4, 0, 4))
    assert (cfg.rope_scaling.kind, cfg.rope_theta, cfg.local_rope_theta) == ("yarn", 500_000.0, 10_000.0)
    assert cfg.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert params["layers"]["q_norm"].shape == (3, cfg.q_size) and "input_layernorm" not in params["layers"]
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, ids, mask, positions)
    assert np.abs(jax_logits(params, cfg.replace(rope_scaling=None), ids, mask, positions) - ref)[mask > 0].max() > 1e-2


@pytest.mark.full
def test_llama4_reads_its_chunks_nope_layers_temperature_and_router(hf_model_dir):
    """Layers 0 and 1 chunked (4) and rotating by interleaved pairs, layer 2 NoPE with temperature; removing the
    chunks, the interleaving or the temperature changes the logits."""
    directory, model = hf_model_dir("llama4")
    cfg, params = load_model(directory)
    assert (cfg.sliding_windows, cfg.nope_layers, cfg.temperature_floor) == ((-4, -4, 0), (2,), 4)
    assert (cfg.router_activation, cfg.expert_input_scaled, cfg.shared_expert_gated) == ("sigmoid", True, False)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(model, ids, mask, positions)
    for changed in (cfg.replace(sliding_windows=(0, 0, 0)), cfg.replace(rope_interleaved=False),
                    cfg.replace(temperature_floor=0)):
        assert np.abs(jax_logits(params, changed, ids, mask, positions) - ref)[mask > 0].max() > 1e-2
