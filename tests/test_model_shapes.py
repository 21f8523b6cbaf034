"""Published parameter counts from the real configs, with `jax.eval_shape`: nothing is allocated."""

import jax
import pytest

from jaxtune.config import ModelConfig
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
