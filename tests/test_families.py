"""The families of 2025-26 (`models/hf_families.py`) against transformers and PEFT, each on its tiny random
config (tests/hf_models.py): LoRA gradients equal PEFT's, greedy generation equals transformers' `generate` over
20 tokens, a jaxtune-trained adapter loads in PEFT with the same logits and merges into a directory transformers
loads. (Their logits, bfloat16 and round trips are test_model_parity.py's, over every family.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import padded_batch
from hf_models import randomize
from peft import LoraConfig, PeftModel, get_peft_model
from reference import float64_reference
from test_generate import PROMPT_LENGTHS, left_padded, prompts
from test_methods_peft import assert_merged_export, assert_same_as_peft, randomize_adapter, randomize_peft

from jaxtune.config import ForwardOptions, SamplingConfig
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate
from jaxtune.methods import method_config
from jaxtune.methods.peft import adapter_state_dict, load_peft_adapter, save_peft_adapter
from jaxtune.methods.transform import apply_method
from jaxtune.models.hf_families import peft_unloadable
from jaxtune.models.llama import forward
from jaxtune.spine.model import load_model

pytestmark = [pytest.mark.parity, pytest.mark.reference]

FAMILIES = ["smollm3", "olmo2", "olmo3", "gpt_oss", "llama4", "llama4_maverick", "qwen3_5", "qwen3_5_moe",
            "qwen3_next", "deepseek_v3"]


def everyday(arch: str) -> list:
    """FAMILIES with all but `arch` in the full tier (the everyday tier reads every family's logits already)."""
    return [a if a == arch else pytest.param(a, marks=pytest.mark.full) for a in FAMILIES]
ALL_LINEAR = method_config("lora", rank=4, alpha=8, target_modules=("all-linear",))
# PEFT's all-linear takes Llama 4's router too (an nn.Linear), where jaxtune's LoRA does not go
LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LATENT_MODULES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]  # DeepSeek's attention
# Qwen3.5's linear attention, Qwen3-Next's fused
DELTANET_MODULES = {False: ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
                    True: ["in_proj_qkvz", "in_proj_ba", "out_proj"]}


@pytest.fixture(scope="module")
def family(hf_model_dir):
    def get(arch):
        directory, model = hf_model_dir(arch)
        return directory, model, *load_model(directory)
    return get


def token_loss(logits, ids, mask):
    """Mean next-token cross entropy over the real tokens (either library's arrays)."""
    lib = torch if isinstance(logits, torch.Tensor) else jnp
    logp = lib.log_softmax(logits[:, :-1], -1) if lib is torch else jax.nn.log_softmax(logits[:, :-1], -1)
    target = ids[:, 1:]
    picked = (torch.gather(logp, -1, target[..., None])[..., 0] if lib is torch
              else jnp.take_along_axis(logp, target[..., None], -1)[..., 0])
    valid = (mask[:, 1:] * mask[:, :-1])
    return -(picked * valid).sum() / valid.sum()


@pytest.mark.full  # the everyday tier has the families' logits and a PEFT adapter's
@pytest.mark.parametrize("arch", FAMILIES)
def test_lora_gradients_equal_peft(arch, family, tmp_path):
    """d(loss)/d(LoRA A, B) on every linear module, both in float64, named as PEFT names them (`adapter_state_dict`,
    which writes float32): equal to float32's rounding, 1e-6 of the largest."""
    directory, model, cfg, params = family(arch)
    targets = (LATENT_MODULES + LINEAR_MODULES[4:] if cfg.kv_lora_rank else LINEAR_MODULES) + DELTANET_MODULES[
        cfg.linear_attention_fused] * bool(cfg.linear_attention_layers)
    peft_model = randomize_peft(get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                               LoraConfig(r=4, lora_alpha=8, target_modules=targets)))
    peft_model.save_pretrained(tmp_path)
    method, with_adapter = load_peft_adapter(tmp_path, params, cfg)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    reference = float64_reference(peft_model)
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    token_loss(reference(input_ids=ids_t, attention_mask=mask_t, position_ids=torch.tensor(positions)).logits,
               ids_t, mask_t).backward()
    theirs = {name.replace(".default", ""): p.grad.numpy() for name, p in reference.named_parameters()
              if p.requires_grad}
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), with_adapter)

        def loss(p):
            logits = forward(p, jnp.asarray(ids), cfg, method=method, positions_BxT=jnp.asarray(positions),
                             attention_mask_BxT=jnp.asarray(mask), options=ForwardOptions(compute_dtype="float64"))
            return token_loss(logits, jnp.asarray(ids), jnp.asarray(mask))

        grads = jax.grad(loss)(params64)
        ours = adapter_state_dict(jax.tree.map(lambda g: np.asarray(g, np.float64), grads), cfg, method)
    # PEFT takes Qwen3-Next's and DeepSeek's gate/up/down_proj for their experts (gate_up_proj at twice the rank),
    # their shared experts and dense MLPs then unadapted
    unloadable = peft_unloadable(cfg)
    adapted = sum(len(layers) for name, layers in cfg.layer_stacks() if name not in unloadable)
    adapted += len(cfg.module_layers("experts")) * len(method.expert_modules)
    assert bool(method.expert_modules) == bool(unloadable)
    assert set(ours) == set(theirs) and len(ours) == 2 * adapted, set(ours) ^ set(theirs)
    for name, want in theirs.items():
        assert np.abs(ours[name] - want).max() <= 1e-6 * np.abs(want).max(), name
    assert min(np.abs(g).max() for g in theirs.values()) > 1e-6  # every adapted module reaches the loss


@pytest.mark.parametrize("arch", everyday("gpt_oss"))
def test_greedy_equals_transformers_generate(arch, family):
    """20 new tokens after left-padded prompts of different lengths (past the sliding windows of 4; gpt-oss's
    sinks in the cached decode)."""
    directory, model, cfg, params = family(arch)
    # Llama 4's chunks and temperature count cache slots, in transformers as here: left padding moves them, by as
    # much as each library pads; rows of one length, jaxtune's prompt bucket (16), compare the model itself
    batch = prompts(cfg.vocab_size, lengths=(16, 16, 16) if arch.startswith("llama4") else PROMPT_LENGTHS)
    ids, mask = left_padded(batch)
    n = 20
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    assert generate(params, cfg, batch, SamplingConfig(max_new_tokens=n), eos_ids=()) == ref[
        :, ids.shape[1]:].numpy().tolist()


@pytest.mark.parametrize("arch", everyday("olmo2"))
def test_trained_adapter_loads_in_peft_and_merges(arch, family, tmp_path):
    """A LoRA adapter on every linear module, as jaxtune saves it, loads in PEFT with jaxtune's logits; its merged
    export loads in transformers with the unmerged logits. Qwen3-Next's and DeepSeek's: on every expert in place
    of the shared experts and dense MLPs (PEFT reads no LoRA there), gate_up_proj at twice the rank, as PEFT makes
    it."""
    directory, model, cfg, params = family(arch)
    method = ALL_LINEAR
    if peft_unloadable(cfg):
        refused = ", ".join(n for n in cfg.linear_modules if n in peft_unloadable(cfg)).replace(".", r"\.")
        with pytest.raises(JaxtuneError, match=f"LoRA on {refused}: PEFT takes a {cfg.architecture} adapter"):
            save_peft_adapter(tmp_path / "refused", apply_method(params, cfg, method, jax.random.key(0)), cfg, method)
        attention = LATENT_MODULES if cfg.kv_lora_rank else (*LINEAR_MODULES[:4], *DELTANET_MODULES[True])
        method = method_config("lora", rank=4, alpha=8, target_modules=tuple(attention),
                               rank_pattern={r".*\.gate_up_proj": 8}, alpha_pattern={r".*\.gate_up_proj": 16},
                               target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    with_adapter = randomize_adapter(apply_method(params, cfg, method, jax.random.key(0)))
    save_peft_adapter(tmp_path / "adapter", with_adapter, cfg, method)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                           tmp_path / "adapter").eval()
    assert_same_as_peft(peft_model, with_adapter, cfg, method)
    assert_merged_export(directory, tmp_path / "adapter", cfg, method, with_adapter,
                         peft_model.merge_and_unload().eval(), tmp_path / "merged")


@pytest.mark.full  # 16 s; the everyday tier reads Qwen3.5 itself
def test_qwen3_5_reads_the_text_model_of_its_vision_language_checkpoint(tmp_path):
    """Qwen3.5 as released (Qwen3_5ForConditionalGeneration: `text_config`, `model.language_model.*`, a vision
    tower): jaxtune reads its text model, as transformers' AutoModelForCausalLM does, with that model's logits; a
    PEFT adapter trained on the vision-language model's text modules loads onto it."""
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    randomize(transformers.Qwen3_5ForConditionalGeneration(config), 0).save_pretrained(tmp_path / "vl")
    text_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vl").eval()
    cfg, params = load_model(tmp_path / "vl")
    assert cfg.architecture == "Qwen3_5ForCausalLM" and cfg.linear_attention_layers == (0,)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    with torch.no_grad():
        want = text_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = forward(params, jnp.asarray(ids), cfg, positions_BxT=jnp.asarray(positions),
                   attention_mask_BxT=jnp.asarray(mask))
    assert np.abs(np.asarray(ours) - want)[mask > 0].max() <= 1e-4
    vl_model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "vl")
    peft_model = randomize_peft(get_peft_model(vl_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                                                       "in_proj_z"])))
    peft_model.save_pretrained(tmp_path / "adapter")
    method, with_adapter = load_peft_adapter(tmp_path / "adapter", params, cfg)
    with torch.no_grad():  # text alone through the vision-language model and its adapter
        want = peft_model.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = forward(with_adapter, jnp.asarray(ids), cfg, method=method, positions_BxT=jnp.asarray(positions),
                   attention_mask_BxT=jnp.asarray(mask))
    assert np.abs(np.asarray(ours) - want)[mask > 0].max() <= 1e-4
