"""Published parameter counts from the real configs, with `jax.eval_shape`: nothing is allocated."""

import jax
import pytest

from jaxtune.config import ModelConfig
from jaxtune.models.hf_config import config_from_hf
from jaxtune.models.params import abstract_params, count_params, init_params, logical_axes, param_specs

# Values from each model's config.json on the Hugging Face hub, written here so the test needs no network.
REAL = {
    "Llama-3-8B": (ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                               intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                               rope_theta=500000.0), 8.03e9, 8_030_261_248),
    "Llama-3-70B": (ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=8192,
                                intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0), 70.55e9, 70_553_706_496),
    "Mistral-7B-v0.1": (ModelConfig(architecture="MistralForCausalLM", vocab_size=32000, hidden_size=4096,
                                    intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                                    head_dim=128, sliding_windows=(4096,) * 32), 7.24e9, 7_241_732_096),
    "Qwen2-7B": (ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                             intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                             qkv_bias=True, rope_theta=1000000.0), 7.62e9, 7_615_616_512),
    "Qwen3-8B": (ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
                             intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                             qk_norm=True, rope_theta=1000000.0), 8.19e9, 8_190_735_360),
    "Qwen3-0.6B": (ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
                               intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                               qk_norm=True, tie_word_embeddings=True, rope_theta=1000000.0), 0.60e9, 596_049_920),
}

# The hub's config.json files as published (written by transformers 4.42 and 4.50: no layer_types, no
# rope_parameters; Gemma 3's pattern as sliding_window_pattern, its local base as rope_local_base_freq).
HUB_CONFIGS = {
    "Gemma-2-9B": ({"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
                    "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
                    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
                    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
                    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
                    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
                    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
                    "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
                    "vocab_size": 256000}, 9.24e9, 9_241_705_984),
    "Gemma-3-1B": ({"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
                    "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
                    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912,
                    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
                    "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
                    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
                    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
                    "torch_dtype": "bfloat16", "vocab_size": 262144}, 1.00e9, 999_885_952),
}
PHI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu", bos_token_id=1, rms_norm_eps=1e-05)
HUB_CONFIGS |= {
    "Phi-3-mini-4k-instruct": (dict(PHI, vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                    max_position_embeddings=4096, original_max_position_embeddings=4096,
                                    sliding_window=2047, rope_theta=10000.0, rope_scaling=None, eos_token_id=32000,
                                    pad_token_id=32000, tie_word_embeddings=False), 3.82e9, 3_821_079_552),
    "Phi-4": (dict(PHI, vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                   num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384,
                   original_max_position_embeddings=16384, rope_theta=250000, rope_scaling=None,
                   sliding_window=None, eos_token_id=100265, pad_token_id=100349), 14.66e9, 14_659_507_200),
}
HUB_CONFIGS |= {  # mixtures of experts
    "Mixtral-8x7B-v0.1": ({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                           "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                           "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
                           "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                           "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
                           "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
                           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                           "vocab_size": 32000}, 46.70e9, 46_702_792_704),
    "Qwen3-30B-A3B": ({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
                       "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                       "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                       "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                       "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                       "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                       "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
                       "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                       "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
                       "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936},
                      30.53e9, 30_532_122_624),
    "Qwen1.5-MoE-A2.7B": ({"architectures": ["Qwen2MoeForCausalLM"], "bos_token_id": 151643,
                           "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
                           "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
                           "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
                           "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
                           "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
                           "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                           "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
                           "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                           "use_sliding_window": False, "vocab_size": 151936}, 14.32e9, 14_315_784_192),
}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
           "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096}, "rope_theta": 150000.0}
HUB_CONFIGS.update({  # issue 50's families; counts of transformers 5.24's model built on the meta device
    "gpt-oss-20b": (GPT_OSS, 20.91e9, 20_914_757_184),
    "gpt-oss-120b": ({**GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128}, 116.83e9, 116_829_156_672),
    "SmolLM3-3B": ({"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
                    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                    "num_key_value_heads": 4, "rope_theta": 5e6, "tie_word_embeddings": True}, 3.08e9, 3_075_098_624),
    "OLMo-3-7B": ({"architectures": ["Olmo3ForCausalLM"], "vocab_size": 100278, "hidden_size": 4096,
                   "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "sliding_window": 4096, "tie_word_embeddings": False}, 7.30e9, 7_298_011_136),
    "Llama-4-Scout (text)": ({"architectures": ["Llama4ForCausalLM"], "vocab_size": 202048, "hidden_size": 5120,
                              "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
                              "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                              "num_local_experts": 16, "num_experts_per_tok": 1, "attention_chunk_size": 8192},
                             107.77e9, 107_769_861_120),
})
REAL.update({name: (config_from_hf(hub, name), published, exact) for name, (hub, published, exact)
             in HUB_CONFIGS.items()})


def test_hub_gemma_configs_read_as_transformers_reads_them():
    """Tied embeddings by default, the soft caps, Gemma 2's alternating and Gemma 3's five-in-six sliding layers,
    Gemma 3's two RoPE bases."""
    gemma2, gemma3 = REAL["Gemma-2-9B"][0], REAL["Gemma-3-1B"][0]
    assert gemma2.tie_word_embeddings and gemma3.tie_word_embeddings
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.query_pre_attn_scalar) == (50.0, 30.0, 256)
    assert gemma2.sliding_windows == (4096, 0) * 21
    assert gemma3.sliding_windows == ((512,) * 5 + (0,)) * 4 + (512, 512)
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.rope_scaling, gemma3.qk_norm) == (1e6, 1e4, None, True)
    assert (gemma3.attn_logit_softcap, gemma3.final_logit_softcap, gemma3.eos_token_id) == (None, None, (1, 106))


def test_hub_mixture_configs_read_as_transformers_reads_them():
    """Experts, top k and its normalisation, Qwen2-MoE's shared expert and biases; the load-balancing loss stays off
    as output_router_logits says."""
    mixtral, qwen3, qwen2 = (REAL[n][0] for n in ("Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "Qwen1.5-MoE-A2.7B"))
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_size, mixtral.normalize_top_k) == (
        8, 2, 14336, True)
    assert (qwen3.num_experts, qwen3.experts_per_token, qwen3.expert_size, qwen3.normalize_top_k, qwen3.qk_norm) == (
        128, 8, 768, True, True)
    assert (qwen2.expert_size, qwen2.shared_expert_size, qwen2.normalize_top_k, qwen2.qkv_bias, qwen2.o_bias) == (
        1408, 5632, False, True, False)
    assert qwen2.linear_modules[4:] == ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
    assert not any(c.output_router_logits for c in (mixtral, qwen3, qwen2)) and mixtral.router_aux_loss_coef == 0.02


def test_hub_configs_of_issue_50_read_as_transformers_reads_them():
    """gpt-oss: sliding (128) and full layers alternating from the first, YaRN unrounded, biases, sinks, top 4 of 32;
    SmolLM3: every fourth layer NoPE; OLMo 3: three sliding layers in four, post norms, whole-projection q/k norms;
    Llama 4 Scout: three chunked rotating layers, then a global NoPE one; 16 experts, top 1, a shared expert."""
    gpt, smol, olmo = (REAL[n][0] for n in ("gpt-oss-20b", "SmolLM3-3B", "OLMo-3-7B"))
    assert gpt.sliding_windows == (128, 0) * 12 and (gpt.num_experts, gpt.experts_per_token) == (32, 4)
    assert (gpt.rope_scaling.kind, gpt.rope_scaling.factor, gpt.rope_scaling.truncate) == ("yarn", 32.0, False)
    assert gpt.attention_sinks and gpt.router_bias and gpt.expert_bias and gpt.qkv_bias and gpt.o_bias
    assert smol.nope_layers == tuple(range(3, 36, 4)) and smol.tie_word_embeddings
    assert olmo.sliding_windows == (4096, 4096, 4096, 0) * 8 and olmo.post_norms and olmo.qk_norm_whole
    scout = REAL["Llama-4-Scout (text)"][0]
    assert scout.sliding_windows == (-8192, -8192, -8192, 0) * 12 and scout.nope_layers == tuple(range(3, 48, 4))
    assert (scout.num_experts, scout.experts_per_token, scout.shared_expert_size) == (16, 1, 8192)


@pytest.mark.parametrize("name", list(REAL))
def test_eval_shape_gives_published_parameter_count(name):
    cfg, published, exact = REAL[name]
    shapes = jax.eval_shape(lambda key: init_params(cfg, key, "bfloat16"), jax.random.key(0))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    assert count_params(shapes) == exact
    assert round(count_params(shapes) / 1e9, 2) == round(published / 1e9, 2)
    assert count_params(abstract_params(cfg)) == count_params(param_specs(cfg)) == exact


def test_logical_axes_name_every_dimension():
    cfg = REAL["Llama-3-8B"][0]
    shapes = abstract_params(cfg)
    axes = logical_axes(cfg)
    for shape, names in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert len(shape.shape) == len(names)
    assert axes["layers"]["q_proj"]["kernel"] == ("layers", "embed", "q_heads")
    assert shapes["layers"]["k_proj"]["kernel"].shape == (32, 4096, 1024)
