"""Adapters agree with PEFT in both directions: export -> PEFT loads -> same logits; PEFT saves -> we load."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from peft import IA3Config, LoraConfig, PeftModel, PrefixTuningConfig, get_peft_model

from conftest import make_hf_model, padded_batch
from jaxtune.cli import main
from jaxtune.config import MethodConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.lora import merge
from jaxtune.methods.peft import load_peft_adapter, save_peft_adapter
from jaxtune.methods.transform import ADAPTER_KEYS, apply_method, parameter_report
from jaxtune.models.hf_weights import load_model
from jaxtune.models.llama import forward

jit_forward = jax.jit(forward, static_argnames=("cfg", "method", "options"))

METHODS = {
    "lora_qv": (MethodConfig("lora", rank=4, alpha=8),
                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")),
    "lora_all_linear": (MethodConfig("lora", rank=4, alpha=16, target_modules=("all-linear",)),
                        LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")),
    "rslora": (MethodConfig("lora", rank=4, alpha=8, rslora=True, target_modules=("q_proj", "k_proj", "up_proj")),
               LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "up_proj"],
                          task_type="CAUSAL_LM")),
    "dora": (MethodConfig("lora", rank=4, alpha=8, dora=True, target_modules=("q_proj", "v_proj", "down_proj")),
             LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                        task_type="CAUSAL_LM")),
    "ia3": (MethodConfig("ia3"), IA3Config(task_type="CAUSAL_LM")),
    "prefix": (MethodConfig("prefix", num_virtual_tokens=5),
               PrefixTuningConfig(num_virtual_tokens=5, task_type="CAUSAL_LM")),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    make_hf_model("llama", directory)
    cfg, params = load_model(directory)
    return directory, cfg, params


def randomize_adapter(params, seed=1):
    """Non-zero adapter weights (not the identity init), so the comparison exercises every adapter tensor."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def perturb(path, leaf, key):
        if any(getattr(k, "key", None) in ADAPTER_KEYS for k in path):
            return leaf + 0.3 * jax.random.normal(key, leaf.shape)
        return leaf

    return jax.tree.unflatten(treedef, [perturb(p, x, k) for (p, x), k in zip(leaves, keys)])


def logits_pair(peft_model, params, cfg, method, seed=0):
    """(PEFT logits, jaxtune logits, valid mask) on a padded batch.

    Prefix tuning: both sides place real tokens after the P virtual tokens (positions P..), as PEFT does.
    """
    ids, mask, positions = padded_batch(cfg.vocab_size, seed)
    kwargs = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    ours = {"attention_mask_BxT": jnp.asarray(mask)}
    if method.kind != "prefix":
        kwargs["position_ids"] = torch.tensor(positions)
        ours["positions_BxT"] = jnp.asarray(positions)
    with torch.no_grad():
        ref = peft_model(**kwargs).logits.numpy()
    out = np.asarray(jit_forward(params, jnp.asarray(ids), cfg, method=method, **ours))
    return ref, out, mask > 0


@pytest.mark.parametrize("name", list(METHODS))
def test_export_loads_in_peft_with_equal_logits(name, base, tmp_path):
    directory, cfg, params = base
    method, _ = METHODS[name]
    params = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path, params, cfg, method)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path)
    ref, out, valid = logits_pair(peft_model.eval(), params, cfg, method)
    base_ref = jit_forward(load_model(directory)[1], jnp.asarray(padded_batch(cfg.vocab_size)[0]), cfg)
    assert np.abs(np.asarray(base_ref) - ref)[valid].max() > 0.1, "the adapter must change the logits"
    assert np.abs(out - ref)[valid].max() <= 1e-4


@pytest.mark.parametrize("name", list(METHODS))
def test_peft_adapter_imports_with_equal_logits(name, base, tmp_path):
    directory, cfg, params = base
    method, peft_config = METHODS[name]
    torch.manual_seed(0)
    peft_model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory), peft_config)
    with torch.no_grad():
        for param_name, p in peft_model.named_parameters():
            if p.requires_grad:  # PEFT's own init leaves LoRA B at zero and IA3 at one
                p.add_(0.3 * torch.randn_like(p))
    peft_model.save_pretrained(tmp_path)
    loaded_method, loaded = load_peft_adapter(tmp_path, params, cfg)
    assert loaded_method == method
    ref, out, valid = logits_pair(peft_model.eval(), loaded, cfg, loaded_method, seed=1)
    assert np.abs(out - ref)[valid].max() <= 1e-4
    trainable, total = peft_model.get_nb_trainable_parameters()
    report = parameter_report(loaded, loaded_method)
    assert (report.trainable, report.total) == (trainable, total)


@pytest.mark.parametrize("name", ["lora_qv", "lora_all_linear", "dora"])
def test_merged_export_loads_in_transformers_with_unmerged_logits(name, base, tmp_path):
    directory, cfg, params = base
    method, _ = METHODS[name]
    params = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path / "adapter", params, cfg, method)
    assert main(["export", "--model", str(directory), "--adapter", str(tmp_path / "adapter"),
                 "--merged", str(tmp_path / "merged")]) == 0
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ref, out, valid = logits_pair(merged_model, params, cfg, method)
    assert np.abs(out - ref)[valid].max() <= 1e-4
    ids = jnp.asarray(padded_batch(cfg.vocab_size)[0])
    np.testing.assert_allclose(jit_forward(merge(params, method), ids, cfg), jit_forward(params, ids, cfg, method=method),
                               atol=1e-4)


def test_cli_peft_export_round_trips(base, tmp_path):
    directory, cfg, params = base
    method, _ = METHODS["dora"]
    params = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path / "a", params, cfg, method)
    assert main(["export", "--model", str(directory), "--adapter", str(tmp_path / "a"), "--peft", str(tmp_path / "b")]) == 0
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["use_dora"] is True and config["r"] == 4
    _, again = load_peft_adapter(tmp_path / "b", load_model(directory)[1], cfg)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_unknown_peft_kind_is_named(base, tmp_path):
    directory, cfg, params = base
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LOHA", "r": 8}))
    with pytest.raises(JaxtuneError, match="adapter type 'LOHA' is not supported \\(readable: LORA, IA3, PREFIX_TUNING, JAXTUNE_BOTTLENECK\\)"):
        load_peft_adapter(tmp_path, params, cfg)


def test_adapter_with_wrong_tensor_shape_is_named(base, tmp_path):
    directory, cfg, params = base
    method = MethodConfig("lora", rank=4)
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
