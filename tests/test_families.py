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
from jaxtune.spine.model import load_adapters, load_model

pytestmark = [pytest.mark.parity, pytest.mark.reference]

FAMILIES = ["smollm3", "olmo2", "olmo3", "gpt_oss", "llama4", "llama4_maverick", "qwen3_5", "qwen3_5_moe",
            "qwen3_next", "deepseek_v3", "gemma4"]


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
    # Llama 4's chunks and temperature count transformers' padded slots in a batch, jaxtune's positions (a prompt
    # alone's: tests/test_generate.py): rows of one length, jaxtune's prompt bucket (16), compare the model itself
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


def _deepseek_with_adapter(family, tmp_path):
    """(directory, base model, config, params, LoRA method, the adapter's directory, PEFT's model) with LoRA on every
    latent-attention module, kv_b_proj's included."""
    directory, model, cfg, params = family("deepseek_v3")
    method = method_config("lora", rank=4, alpha=8, target_modules=tuple(LATENT_MODULES))
    save_peft_adapter(tmp_path / "adapter", randomize_adapter(apply_method(params, cfg, method, jax.random.key(1))),
                      cfg, method)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                           tmp_path / "adapter").eval()
    return directory, model, cfg, params, method, tmp_path / "adapter", peft_model


def _reference_generate(model, batch, n: int = 20) -> list:
    ids, mask = left_padded(batch)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:].numpy().tolist()


def test_deepseek_decodes_in_the_latent_space_with_an_adapter(family, tmp_path):
    """DeepSeek-V3's decode step attends in the latent's space (the cache holds latents, the key expansion folded
    into the queries): with LoRA on every latent-attention module, kv_b_proj's included (folded into that
    expansion), jaxtune's 20 greedy tokens equal PEFT's `generate`, which the adapter changes."""
    directory, model, cfg, params, method, adapter, peft_model = _deepseek_with_adapter(family, tmp_path)
    assert cfg.kv_lora_rank and cfg.num_kv_heads == cfg.num_heads
    batch = prompts(cfg.vocab_size)
    adapted = _reference_generate(peft_model, batch)
    assert adapted != _reference_generate(model, batch)
    _, with_adapter = load_peft_adapter(adapter, params, cfg)
    assert generate(with_adapter, cfg, batch, SamplingConfig(max_new_tokens=20), eos_ids=(), method=method) == adapted


@pytest.mark.full  # 12 s; the everyday tier decodes with the adapter on every row
def test_deepseek_decodes_rows_of_different_adapters_in_one_batch(family, tmp_path):
    """With the adapter and the base model on alternate rows of one batch (`load_adapters`), each row's 20 greedy
    tokens equal its own model's: the latent expansion is folded in row by row."""
    directory, model, cfg, _, _, adapter, peft_model = _deepseek_with_adapter(family, tmp_path)
    batch = prompts(cfg.vocab_size)
    adapted, base = _reference_generate(peft_model, batch), _reference_generate(model, batch)
    cfg, stacked, slots = load_adapters(directory, {"a": adapter})
    rows = [slots["a"] if i % 2 else 0 for i in range(len(batch))]
    mixed = generate(stacked, cfg, batch, SamplingConfig(max_new_tokens=20), eos_ids=(), adapter_of_row=rows)
    assert mixed == [adapted[i] if i % 2 else base[i] for i in range(len(batch))]


def write_fp8_release(source, directory, block: int, extra: dict | None = None):
    """`source`'s checkpoint as DeepSeek releases its own: every linear weight (not the router's) float8_e4m3fn in
    blocks of block x block, each with a float32 `weight_scale_inv` (the block's absmax / 448; ragged blocks at the
    edges), and `quantization_config` saying so; `extra` tensors beside them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n, t in tensors.items() if t.ndim == 2 and n.startswith("model.layers.")
                 and not n.endswith(".mlp.gate.weight")]:
        w = tensors[name]
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:w.shape[0], :w.shape[1]] = w
        scale = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)) / 448.0
        blocks = padded.reshape(rows, block, cols, block) / scale[:, None, :, None]
        tensors[name] = blocks.reshape(rows * block, cols * block)[:w.shape[0], :w.shape[1]].to(
            torch.float8_e4m3fn).contiguous()
        tensors[name.replace(".weight", ".weight_scale_inv")] = scale
    save_file({**tensors, **(extra or {})}, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def test_deepseek_reads_its_fp8_release_and_skips_its_prediction_head(family, tmp_path):
    """DeepSeek-V3 as released: block-scaled FP8 weights decode, a block at a time as read, to transformers' own
    dequantisation (the same logits; the kernels equal), ragged edge blocks (576 = 4.5 x 128 in DeepSeek-V3's
    kv_a_proj_with_mqa) to fp8 x their block's scale, a slice of a weight to the slice of the whole; the
    multi-token-prediction layer past num_hidden_layers is read past with one warning."""
    import warnings

    from jaxtune.errors import JaxtuneWarning
    from jaxtune.io.fp8_blocks import BlockFP8Reader
    from jaxtune.io.safetensors import CheckpointReader

    directory, _, cfg, _ = family("deepseek_v3")
    head = {f"model.layers.{cfg.num_layers}.eh_proj.weight": torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size)}
    write_fp8_release(directory, tmp_path / "fp8", 8, head)  # every dimension a multiple of 8, as transformers needs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg8, params8 = load_model(tmp_path / "fp8")
    assert [str(w.message) for w in caught if issubclass(w.category, JaxtuneWarning)] == [
        f"{tmp_path / 'fp8'}: layers {cfg.num_layers}+ (1 tensors) are DeepSeek's multi-token prediction; read past, "
        "not trained or exported"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    np.testing.assert_array_equal(np.asarray(params8["layers"]["kv_b_proj"]["kernel"][1]),
                                  theirs.model.layers[1].self_attn.kv_b_proj.weight.detach().numpy().T)
    ids, mask, positions = padded_batch(cfg.vocab_size)
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                      position_ids=torch.tensor(positions)).logits.numpy()
    ours = forward(params8, jnp.asarray(ids), cfg8, positions_BxT=jnp.asarray(positions),
                   attention_mask_BxT=jnp.asarray(mask))
    assert np.abs(np.asarray(ours) - want)[mask > 0].max() <= 1e-4
    stored = write_fp8_release(directory, tmp_path / "ragged", 16)  # 24-wide latents: blocks of 16 and 8
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    fp8, scale = stored[name].float().numpy(), stored[name.replace(".weight", ".weight_scale_inv")].numpy()
    want_kernel = fp8 * np.repeat(np.repeat(scale, 16, 0), 16, 1)[:fp8.shape[0], :fp8.shape[1]]
    _, ragged = load_model(tmp_path / "ragged")
    np.testing.assert_array_equal(np.asarray(ragged["layers"]["kv_a_proj_with_mqa"]["kernel"][2]), want_kernel.T)
    with BlockFP8Reader(CheckpointReader(tmp_path / "ragged"), (16, 16)) as reader:
        np.testing.assert_array_equal(reader.read(name, (slice(5, 21), slice(3, 40))), want_kernel[5:21, 3:40])


def test_deepseek_refuses_what_it_cannot_hold_in_one_line(family, tmp_path):
    """A GGUF LoRA on its latent attention's projections is not written (llama.cpp's deepseek2 graph multiplies
    them without its LoRA hook), prefix tuning (per-head keys and values where the cache holds latents) not
    trained: each a one-line JaxtuneError naming why."""
    from jaxtune.methods.lora.gguf import save_gguf_lora

    _, _, cfg, params = family("deepseek_v3")
    cfg = cfg.replace(rms_norm_eps=1e-6)  # the latent norms' epsilon, which llama.cpp's rms_norm_eps also sets
    lora = method_config("lora", rank=4, target_modules=("kv_b_proj", "o_proj"))
    with pytest.raises(JaxtuneError, match="DeepseekV3ForCausalLM: llama.cpp applies no GGUF LoRA to kv_b_proj "
                                           "\\(its deepseek2 graph multiplies them plainly\\)"):
        save_gguf_lora(tmp_path / "lora.gguf", cfg, apply_method(params, cfg, lora, jax.random.key(0)), lora)
    assert not (tmp_path / "lora.gguf").exists()
    with pytest.raises(JaxtuneError, match="prefix tuning needs per-head keys and values; DeepseekV3ForCausalLM's "
                                           "latent attention caches a latent a token"):
        apply_method(params, cfg, method_config("prefix", num_virtual_tokens=4), jax.random.key(0))


@pytest.mark.full  # 31 s; the everyday tier reads Gemma 4's logits, round trip and refusals
def test_gemma4_reads_its_multimodal_release_and_decodes_rows_of_different_adapters(family, tmp_path):
    """Gemma 4 as released (Gemma4ForConditionalGeneration: `text_config`, `model.language_model.*` beside its vision
    and audio towers, which are left; k_proj/v_proj/k_norm tensors that some checkpoints keep in KV-sharing layers,
    which transformers ignores too) reads as its text model. With LoRA on every module of both head widths (the
    wide MLPs' too) and the base model on alternate rows of one batch, each row's 20 greedy tokens equal its own
    model's `generate`: the sharing layers attend over their sources' caches, row by row."""
    import json

    from safetensors.torch import load_file, save_file

    directory, model, cfg, params = family("gemma4")
    (tmp_path / "release").mkdir()
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(directory / "model.safetensors").items()}
    sharing = cfg.kv_sharing_layers[0]
    tensors.update({"model.vision_tower.patch_embedder.weight": torch.zeros(4, 4),
                    f"model.language_model.layers.{sharing}.self_attn.k_proj.weight": torch.zeros(32, 64)})
    save_file(tensors, tmp_path / "release" / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((directory / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
        "tie_word_embeddings": True}))
    released_cfg, released = load_model(tmp_path / "release")
    assert released_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, released, params)

    method = method_config("lora", rank=4, alpha=8, target_modules=tuple(LINEAR_MODULES))
    assert {name for name, _ in cfg.layer_stacks()} == {"q_proj", "k_proj", "v_proj", "o_proj", "q_proj@global",
                                                        "k_proj@global", "o_proj@global", "gate_proj", "up_proj",
                                                        "down_proj", "gate_proj@wide", "up_proj@wide",
                                                        "down_proj@wide"}
    save_peft_adapter(tmp_path / "adapter", randomize_adapter(apply_method(params, cfg, method, jax.random.key(1))),
                      cfg, method)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                           tmp_path / "adapter").eval()
    batch = prompts(cfg.vocab_size)
    adapted, base = _reference_generate(peft_model, batch), _reference_generate(model, batch)
    assert adapted != base
    cfg, stacked, slots = load_adapters(directory, {"a": tmp_path / "adapter"})
    rows = [slots["a"] if i % 2 else 0 for i in range(len(batch))]
    mixed = generate(stacked, cfg, batch, SamplingConfig(max_new_tokens=20), eos_ids=(), adapter_of_row=rows)
    assert mixed == [adapted[i] if i % 2 else base[i] for i in range(len(batch))]


def test_gemma4_refuses_what_it_cannot_hold_in_one_line(family):
    """Its GGUF (llama.cpp's `gemma4`) is written but for KV sharing llama.cpp's fixed reuse gets wrong (the last two
    layers holding keys not sliding then full), prefix tuning (one key shape a layer in PEFT's prefix) not trained:
    each a one-line JaxtuneError naming why."""
    from jaxtune.methods.gguf_export import gguf_form

    _, _, cfg, params = family("gemma4")
    assert gguf_form(cfg).arch == "gemma4"
    with pytest.raises(JaxtuneError, match="Gemma4ForCausalLM: cannot be written as GGUF \\(num_kv_shared_layers 3 "
                                           "after layers \\[True, False, True\\] sliding"):
        gguf_form(cfg.replace(sliding_windows=(4, 0, 4, 4, 4, 0)))
    with pytest.raises(JaxtuneError, match="prefix tuning needs keys and values of one shape in every layer; "
                                           "Gemma4ForCausalLM's full layers are 32 wide, its sliding ones 16"):
        apply_method(params, cfg, method_config("prefix", num_virtual_tokens=4), jax.random.key(0))


@pytest.mark.full  # 34 s, its gradient's compile
def test_gemma4_layer_scalars_stay_buffers_in_a_full_fine_tune(family):
    """transformers keeps Gemma 4's `layer_scalar` as a buffer (saved, loaded, never trained): a full fine-tune's
    gradient does not reach it and AdamW does not decay it, while every layer's scalar still scales its output."""
    from jaxtune.spine.state import weight_decay_mask

    _, _, cfg, params = family("gemma4")
    ids = jnp.asarray(padded_batch(cfg.vocab_size)[0])
    logits = jax.jit(forward, static_argnames="cfg")
    grads = jax.jit(jax.grad(lambda p: jnp.mean(logits(p, ids, cfg) ** 2)))(params)
    assert not np.any(np.asarray(grads["layers"]["layer_scalar"]))
    assert np.abs(np.asarray(grads["layers"]["o_proj@global"]["kernel"])).max() > 0
    assert not weight_decay_mask(params)["layers"]["layer_scalar"]
    doubled = {**params, "layers": {**params["layers"], "layer_scalar": 2 * params["layers"]["layer_scalar"]}}
    assert np.abs(np.asarray(logits(doubled, ids, cfg) - logits(params, ids, cfg))).max() > 1e-2
