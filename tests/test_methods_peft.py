"""Adapters agree with PEFT in both directions: export -> PEFT loads -> same logits; PEFT saves -> we load.

Every comparison is against a float64 run of the PEFT model (`reference.py`): jaxtune in float64 equals it to 1e-9,
and jaxtune's float32 logits are as close to it as PEFT's own float32 logits (and within 1e-4 of them). Adapter
weights are perturbed away from their identity init at the scale training gives them (LoRA's A and B by
0.3 / sqrt(fan-in)), so every tensor matters and the model stays well-conditioned.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import padded_batch
from hf_models import make_hf_model
from peft import IA3Config, LoraConfig, PeftModel, PrefixTuningConfig, get_peft_model
from reference import assert_float32_parity, jaxtune_float64, logits_four_ways

from jaxtune.cli import main
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.methods import method_config
from jaxtune.methods.base import adapter_keys, method_unit
from jaxtune.methods.lora import merge
from jaxtune.methods.peft import load_peft_adapter, save_peft_adapter
from jaxtune.methods.transform import apply_method, parameter_report
from jaxtune.models.llama import forward
from jaxtune.spine.model import load_model

pytestmark = [pytest.mark.parity, pytest.mark.reference]  # also run with AVX2 forced (.ci/run)

jit_forward = jax.jit(forward, static_argnames=("cfg", "method", "options"))

METHODS = {
    "lora_qv": (method_config("lora", rank=4, alpha=8),
                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")),
    "lora_all_linear": (method_config("lora", rank=4, alpha=16, target_modules=("all-linear",)),
                        LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")),
    "rslora": (method_config("lora", rank=4, alpha=8, rslora=True, target_modules=("q_proj", "k_proj", "up_proj")),
               LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "up_proj"],
                          task_type="CAUSAL_LM")),
    "dora": (method_config("lora", rank=4, alpha=8, dora=True, target_modules=("q_proj", "v_proj", "down_proj")),
             LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                        task_type="CAUSAL_LM")),
    "ia3": (method_config("ia3"), IA3Config(task_type="CAUSAL_LM")),
    "prefix": (method_config("prefix", num_virtual_tokens=5),
               PrefixTuningConfig(num_virtual_tokens=5, task_type="CAUSAL_LM")),
}

# Adapters as they come from the wild: every field PEFT writes that selects or varies what is adapted.
WILD = {
    "full_paths": ("llama", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=[
        "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj", "model.layers.2.self_attn.v_proj",
        "model.layers.2.mlp.down_proj"])),
    "regex_rank_alpha_pattern": ("llama", LoraConfig(
        r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=r".*\.(q_proj|v_proj|gate_proj)",
        rank_pattern={"v_proj": 6, "layers.1.self_attn.q_proj": 2}, alpha_pattern={"gate_proj": 24})),
    "exclude_layers_to_transform": ("llama", LoraConfig(
        r=4, lora_alpha=8, task_type="CAUSAL_LM", exclude_modules=["o_proj"],
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=[0, 2], layers_pattern="layers")),
    "exclude_regex": ("llama", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules="all-linear",
                                          exclude_modules=r".*\.layers\.1\..*")),
    "dora_layers": ("llama", LoraConfig(r=4, lora_alpha=8, use_dora=True, task_type="CAUSAL_LM",
                                        target_modules=["q_proj", "v_proj"], layers_to_transform=[1])),
    "rslora_rank_pattern": ("llama", LoraConfig(r=4, lora_alpha=8, use_rslora=True, task_type="CAUSAL_LM",
                                                target_modules=["q_proj", "up_proj"], rank_pattern={"up_proj": 8})),
    "modules_to_save_lm_head": ("llama", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                    target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "modules_to_save_embed": ("llama", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                  target_modules=["v_proj"], modules_to_save=["embed_tokens"])),
    "tied_modules_to_save": ("llama_tied_bias_linear", LoraConfig(
        r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "lora_bias": ("llama_tied_bias_linear", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                       target_modules=["q_proj", "down_proj"], lora_bias=True)),
    "ia3_modules_to_save": ("llama", IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "down_proj"],
                                               feedforward_modules=["down_proj"], modules_to_save=["lm_head"])),
    "qwen3_all_linear": ("qwen3", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules="all-linear")),
    "qwen3_dora_qk": ("qwen3", LoraConfig(r=4, lora_alpha=8, use_dora=True, task_type="CAUSAL_LM",
                                          target_modules=["q_proj", "k_proj"])),
    "gemma2_all_linear": ("gemma2", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules="all-linear")),
    "gemma3_dora_qk": ("gemma3", LoraConfig(r=4, lora_alpha=8, use_dora=True, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "down_proj"])),
    "gemma3_ia3": ("gemma3", IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                                       feedforward_modules=["down_proj"])),
    # Phi-3's fused modules, as PEFT names and shapes them: one LoRA over [q | k | v] and one over [gate | up]
    "phi3_all_linear": ("phi3", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules="all-linear")),
    "phi3_dora_fused": ("phi3", LoraConfig(r=4, lora_alpha=8, use_dora=True, task_type="CAUSAL_LM",
                                           target_modules=["qkv_proj", "gate_up_proj"])),
    "phi3_ia3": ("phi3", IA3Config(task_type="CAUSAL_LM", target_modules=["qkv_proj", "down_proj"],
                                   feedforward_modules=["down_proj"])),
    # Mixtures: attention, and Qwen2-MoE's shared expert (mlp.shared_expert.*_proj); the experts are not modules
    "mixtral_qv": ("mixtral", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "v_proj"])),
    "qwen2_moe_shared": ("qwen2_moe", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])),
    "qwen3_moe_dora": ("qwen3_moe", LoraConfig(r=4, lora_alpha=8, use_dora=True, task_type="CAUSAL_LM",
                                               target_modules=["q_proj", "k_proj", "o_proj"])),
    # LoRA on the experts themselves (PEFT's target_parameters: one A and B an expert), with and without modules
    "qwen3_moe_experts": ("qwen3_moe", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=["v_proj"],
                                                  target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"])),
    # v4's names for the experts: PEFT under transformers 5 turns gate_proj and up_proj into gate_up_proj at twice
    # the rank and alpha (rank_pattern, alpha_pattern), down_proj into the experts' down_proj
    "qwen3_moe_mlp_names": ("qwen3_moe", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=[
        "q_proj", "gate_proj", "up_proj", "down_proj"])),
    "mixtral_experts_only": ("mixtral", LoraConfig(r=4, lora_alpha=16, task_type="CAUSAL_LM",
                                                   target_parameters=["experts.down_proj"])),
    "qwen2_moe_ia3": ("qwen2_moe", IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                                             feedforward_modules=["down_proj"])),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """arch -> (directory, cfg, params), built once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            directory = tmp_path_factory.mktemp(arch)
            make_hf_model(arch, directory)
            cache[arch] = (directory, *load_model(directory))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def base(bases):
    return bases("llama")


def randomize_adapter(params, seed=1):
    """Adapter leaves moved off their init: matrices by 0.3 / sqrt(fan-in) N(0, 1), vectors by 0.3 N(0, 1)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def perturb(path, leaf, key):
        if not any(getattr(k, "key", None) in adapter_keys() for k in path):
            return leaf
        scale = 0.3 / np.sqrt(leaf.shape[-2]) if leaf.ndim >= 3 else 0.3
        return leaf + scale * jax.random.normal(key, leaf.shape)

    return jax.tree.unflatten(treedef, [perturb(p, x, k) for (p, x), k in zip(leaves, keys)])


def randomize_peft(peft_model, seed=0):
    """The same perturbation on PEFT's trainable tensors (torch's [out, in] layout: fan-in is the last axis)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:  # PEFT's own init leaves LoRA B at zero and IA3 at one
                scale = 0.3 / np.sqrt(p.shape[-1]) if ("lora_A" in name or "lora_B" in name) and p.ndim == 2 else 0.3
                p.add_(scale * torch.randn_like(p))
    return peft_model.eval()


def assert_same_as_peft(peft_model, params, cfg, method, seed=0):
    """jaxtune's logits with `params` equal `peft_model`'s: float64 to 1e-9, float32 as close to float64 as PEFT's
    own float32 (see reference.py). Returns PEFT's float32 logits."""
    logits = logits_four_ways(peft_model, params, cfg, method, seed)
    assert np.abs(logits["out64"] - logits["ref64"])[logits["valid"]].max() <= 1e-9
    assert_float32_parity(logits["out32"], logits["ref32"], logits["ref64"], logits["valid"])
    return logits["ref32"]


def wild_adapter(name: str, bases, directory):
    """WILD[name] made by PEFT on its base, perturbed, saved to `directory` and loaded by jaxtune:
    (base directory, cfg, base params, PEFT model, method, params with the adapter)."""
    arch, peft_config = WILD[name]
    base_dir, cfg, params = bases(arch)
    peft_model = randomize_peft(get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                               peft_config))
    peft_model.save_pretrained(directory)
    return (base_dir, cfg, params, peft_model, *load_peft_adapter(directory, params, cfg))


def assert_adapter_matters(ref, directory, cfg, seed=0):
    ids, mask, _ = padded_batch(cfg.vocab_size, seed)
    base_logits = np.asarray(jit_forward(load_model(directory)[1], jnp.asarray(ids), cfg))
    assert np.abs(base_logits - ref)[mask > 0].max() > 0.1, "the adapter must change the logits"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in ("lora_all_linear", "rslora") else n
                                  for n in METHODS])  # the everyday tier: one of each PEFT type, and DoRA
def test_export_loads_in_peft_with_equal_logits(name, base, tmp_path):
    directory, cfg, params = base
    method, _ = METHODS[name]
    params = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path, params, cfg, method)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path)
    ref = assert_same_as_peft(peft_model.eval(), params, cfg, method)
    assert_adapter_matters(ref, directory, cfg)


@pytest.mark.parametrize("name", list(METHODS))
def test_peft_adapter_imports_with_equal_logits(name, base, tmp_path):
    directory, cfg, params = base
    method, peft_config = METHODS[name]
    peft_model = randomize_peft(get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                               peft_config))
    peft_model.save_pretrained(tmp_path)
    loaded_method, loaded = load_peft_adapter(tmp_path, params, cfg)
    if loaded_method != method:  # PEFT writes all-linear as the names it found: the same modules of this model
        assert dataclasses.replace(loaded_method, target_modules=method.target_modules) == method
        assert method_unit(method).adapted(loaded_method, cfg.layer_stacks()) == method_unit(method).adapted(
            method, cfg.layer_stacks())
    assert_same_as_peft(peft_model, loaded, cfg, loaded_method, seed=1)
    trainable, total = peft_model.get_nb_trainable_parameters()
    report = parameter_report(loaded, loaded_method, cfg)
    assert (report.trainable, report.total) == (trainable, total)


@pytest.mark.parametrize("name", list(WILD))
@pytest.mark.full
def test_wild_peft_adapter_imports_and_exports_with_equal_logits(name, bases, tmp_path):
    """Target paths, regular expressions, exclude_modules, layers_to_transform, rank/alpha patterns,
    modules_to_save (untied and tied) and lora_bias: PEFT saves -> jaxtune loads (same logits, PEFT's parameter
    counts) -> jaxtune exports -> PEFT loads (same logits again)."""
    directory, cfg, params, peft_model, method, loaded = wild_adapter(name, bases, tmp_path / "peft")
    ref = assert_same_as_peft(peft_model, loaded, cfg, method, seed=1)
    assert_adapter_matters(ref, directory, cfg, seed=1)
    report = parameter_report(loaded, method, cfg)
    assert (report.trainable, report.total) == peft_model.get_nb_trainable_parameters()

    save_peft_adapter(tmp_path / "ours", loaded, cfg, method)
    reloaded = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                         tmp_path / "ours").eval()
    assert_same_as_peft(reloaded, loaded, cfg, method, seed=2)
    _, again = load_peft_adapter(tmp_path / "ours", params, cfg)
    jax.tree.map(np.testing.assert_array_equal, again, loaded)


@pytest.mark.full
def test_layer_patterns_train_only_the_adapted_ranks(bases):
    """A layer of smaller rank (rank_pattern) or none (layers_to_transform) holds zeros beyond its rank; their
    gradients are exactly zero, so training keeps them zero and the adapter stays what PEFT can load."""
    _, cfg, params = bases("llama")
    method = method_config("lora", rank=4, alpha=8, target_modules=("q_proj", "v_proj"), layers_to_transform=(0, 2),
                          rank_pattern={"layers.2.self_attn.q_proj": 2})
    adapted = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    a, b = (np.array(adapted["layers"]["q_proj"][k]) for k in ("lora_a", "lora_b"))
    a[1], b[1], a[2, :, 2:], b[2, 2:] = 0, 0, 0, 0  # the padding a loaded or initialised adapter holds
    adapted["layers"]["q_proj"] = {**adapted["layers"]["q_proj"], "lora_a": jnp.asarray(a), "lora_b": jnp.asarray(b)}
    ids = jnp.asarray(padded_batch(cfg.vocab_size)[0])
    grads = jax.grad(lambda p: jnp.sum(jit_forward(p, ids, cfg, method=method) ** 2))(adapted)["layers"]["q_proj"]
    ga, gb = np.asarray(grads["lora_a"]), np.asarray(grads["lora_b"])
    assert np.all(ga[1] == 0) and np.all(gb[1] == 0) and np.all(ga[2, :, 2:] == 0) and np.all(gb[2, 2:] == 0)
    assert np.abs(ga[0]).max() > 0 and np.abs(gb[2, :2]).max() > 0
    fresh = apply_method(params, cfg, method, jax.random.key(0))["layers"]["q_proj"]["lora_a"]
    assert np.all(np.asarray(fresh)[1] == 0) and np.all(np.asarray(fresh)[2, :, 2:] == 0)


@pytest.mark.parametrize("field, value, message", [
    ("use_qalora", True, "field use_qalora = true is not supported"),
    ("layer_replication", [[0, 2]], "field layer_replication = [[0, 2]] is not supported"),
    ("fan_in_fan_out", True, "field fan_in_fan_out = true is not supported"),
    ("bias", "all", 'field bias = "all" is not supported'),
    ("task_type", "SEQ_CLS", "task_type 'SEQ_CLS' is not supported"),
    ("target_modules", ["lm_head"], 'target_modules = "lm_head": not a linear module of a decoder layer (train it '
                                    "whole with modules_to_save)"),
    ("target_modules", "(unclosed", 'target_modules = "(unclosed": not a regular expression'),
    ("target_modules", r".*\.nothing", "selects no module"),
    ("rank_pattern", {"q_proj": 0}, "rank_pattern['q_proj'] = 0: must be a positive integer"),
    ("modules_to_save", ["score"], 'modules_to_save = "score": jaxtune trains whole lm_head and embed_tokens'),
])
def test_what_jaxtune_cannot_represent_is_refused_naming_the_field(field, value, message, base, tmp_path):
    directory, cfg, params = base
    method = method_config("lora", rank=4)
    save_peft_adapter(tmp_path, apply_method(params, cfg, method, jax.random.key(0)), cfg, method)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(JaxtuneError, match="adapter_config.json: .*" + re.escape(message)):
        load_peft_adapter(tmp_path, params, cfg)


def test_lora_on_a_module_jaxtune_lacks_is_refused_by_tensor(base, tmp_path):
    """A regular expression that also matched lm_head in PEFT leaves lm_head's LoRA tensors in the file."""
    directory, cfg, params = base
    peft_model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                LoraConfig(r=4, target_modules=r".*(q_proj|lm_head)", task_type="CAUSAL_LM"))
    peft_model.save_pretrained(tmp_path)
    with pytest.raises(JaxtuneError, match=r"tensor base_model\.model\.lm_head\.\S+ adapts lm_head, which jaxtune's "
                                           r"LoRA does not"):
        load_peft_adapter(tmp_path, params, cfg)


def assert_merged_export(directory, adapter, cfg, method, params, peft_merged, tmp_path):
    """`jaxtune export --merged` writes merge(params) (layer by layer, so equal to float32 rounding); transformers'
    logits of the file equal jaxtune's forward of it (float64, 1e-9), and are as close to the unmerged adapter in
    float64 as `peft_merged`'s, PEFT's own merge_and_unload (float32)."""
    assert main(["export", "--model", str(directory), "--adapter", str(adapter), "--merged", str(tmp_path)]) == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    merged = merge(params, method)
    assert not any("lora_a" in merged["layers"][name] for name in cfg.linear_modules)
    written = load_model(tmp_path)[1]
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(written), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    ours32 = assert_same_as_peft(ours, written, cfg, None)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    with torch.no_grad():
        theirs32 = peft_merged(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                               position_ids=torch.tensor(positions)).logits.numpy()
    ref64 = jaxtune_float64(params, ids, cfg, method=method, attention_mask_BxT=mask, positions_BxT=positions)
    assert_float32_parity(ours32, theirs32, ref64, mask > 0)


@pytest.mark.parametrize("name", ["lora_qv", *(pytest.param(n, marks=pytest.mark.full)
                                              for n in ("lora_all_linear", "dora"))])
def test_merged_export_loads_in_transformers_with_unmerged_logits(name, base, tmp_path):
    directory, cfg, params = base
    method, _ = METHODS[name]
    params = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path / "adapter", params, cfg, method)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                           tmp_path / "adapter")
    assert_merged_export(directory, tmp_path / "adapter", cfg, method, params, peft_model.merge_and_unload().eval(),
                         tmp_path / "merged")


@pytest.mark.parametrize("name", ["regex_rank_alpha_pattern", "dora_layers", "tied_modules_to_save", "lora_bias",
                                  "qwen3_all_linear", "gemma2_all_linear", "gemma3_dora_qk", "phi3_all_linear",
                                  "phi3_dora_fused", "qwen2_moe_shared", "qwen3_moe_dora", "qwen3_moe_experts",
                                  "mixtral_experts_only"])
@pytest.mark.full
def test_merged_export_of_a_wild_adapter_equals_peft_merge_and_unload(name, bases, tmp_path):
    directory, cfg, params, peft_model, method, loaded = wild_adapter(name, bases, tmp_path / "peft")
    assert_merged_export(directory, tmp_path / "peft", cfg, method, loaded, peft_model.merge_and_unload().eval(),
                         tmp_path / "merged")


def test_cli_peft_export_round_trips(base, tmp_path):
    directory, cfg, params = base
    method, _ = METHODS["dora"]
    params = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path / "a", params, cfg, method)
    assert main(["export", "--model", str(directory), "--adapter", str(tmp_path / "a"),
                 "--peft", str(tmp_path / "b")]) == 0
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["use_dora"] is True and config["r"] == 4
    _, again = load_peft_adapter(tmp_path / "b", load_model(directory)[1], cfg)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_unknown_peft_kind_is_named(base, tmp_path):
    directory, cfg, params = base
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LOHA", "r": 8}))
    with pytest.raises(JaxtuneError, match="adapter type 'LOHA' is not supported "
                                           "\\(readable: LORA, IA3, PREFIX_TUNING, JAXTUNE_BOTTLENECK\\)"):
        load_peft_adapter(tmp_path, params, cfg)


def test_adapter_with_wrong_tensor_shape_is_named(base, tmp_path):
    directory, cfg, params = base
    method = method_config("lora", rank=4)
    save_peft_adapter(tmp_path, apply_method(params, cfg, method, jax.random.key(0)), cfg, method)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(JaxtuneError, match="lora_A.weight has shape \\(4, 64\\), expected \\(8, 64\\)"):
        load_peft_adapter(tmp_path, params, cfg)


def test_info_reports_adapter_counts_as_peft(base, tmp_path, capsys):
    directory, cfg, params = base
    method, peft_config = METHODS["dora"]
    peft_model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory), peft_config)
    peft_model.save_pretrained(tmp_path)
    assert main(["info", "--model", str(directory), "--adapter", str(tmp_path), "--json"]) == 0
    adapter = json.loads(capsys.readouterr().out)["adapter"]
    assert (adapter["trainable"], adapter["total"]) == peft_model.get_nb_trainable_parameters()
    assert adapter["method"] == "lora (DoRA)"


def test_lora_targets_phi3_lacks_name_its_fused_modules(bases):
    """LoRA's default q_proj, v_proj select nothing on Phi-3, whose attention has one qkv_proj: the error says so."""
    directory, cfg, params = bases("phi3")
    with pytest.raises(JaxtuneError, match=r"selects no module of a 3-layer model with modules qkv_proj, o_proj, "
                                           r"gate_up_proj, down_proj.*Phi-3 fuses q, k and v into qkv_proj"):
        apply_method(params, cfg, method_config("lora"), jax.random.key(0))


def test_info_counts_lora_on_experts_as_peft(bases, tmp_path, capsys):
    """PEFT's trainable and total counts for LoRA on a Qwen3-MoE's q_proj and every expert (r E (in + out) a stack
    and layer), from v4's module names: gate_up_proj's rank twice down_proj's."""
    directory, _, _ = bases("qwen3_moe")
    _, peft_config = WILD["qwen3_moe_mlp_names"]
    peft_model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory), peft_config)
    peft_model.save_pretrained(tmp_path)
    assert main(["info", "--model", str(directory), "--adapter", str(tmp_path), "--json"]) == 0
    adapter = json.loads(capsys.readouterr().out)["adapter"]
    assert (adapter["trainable"], adapter["total"]) == peft_model.get_nb_trainable_parameters()
    assert json.loads((tmp_path / "adapter_config.json").read_text())["rank_pattern"] == {r".*\.gate_up_proj": 8}


def test_lora_on_experts_refuses_what_peft_refuses():
    with pytest.raises(ConfigError, match="dropout = 0.1: does not go with target_parameters"):
        method_config("lora", dropout=0.1, target_parameters=("mlp.experts.down_proj",))
    with pytest.raises(ConfigError,
                       match='target_parameters = "mlp.gate.weight": jaxtune adapts a mixture.s expert stacks'):
        method_config("lora", target_parameters=("mlp.gate.weight",))
