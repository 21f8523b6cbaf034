"""The optimizers of `[train] optimizer` and LoRA+, each against its reference: optax's own Adafactor, AdamW and Muon,
Keller Jordan's Newton-Schulz iteration (torch), a float64 transcription of bitsandbytes' block-wise 8-bit AdamW,
PEFT's `create_loraplus_optimizer` groups under torch's AdamW; the planner's count of each state; exact resume."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_run_safety import train_killed_after_checkpoint
from test_train import metric_lines, setup, write_config  # noqa: F401 - setup: the tiny model and data fixture

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, OffloadConfig, TrainConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.methods import method_config, method_unit
from jaxtune.parallel.mesh import make_mesh
from jaxtune.planner import compile_step, estimate, format_estimate, get_device
from jaxtune.run_config import load_run_config
from jaxtune.spine.optimizers import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    QuantizedMoment,
    dequantize_blockwise,
    make_optimizer,
    quantize_blockwise,
    row_chunks,
    scale_by_adam_8bit,
)
from jaxtune.spine.run import abstract_run, init_run
from jaxtune.spine.state import weight_decay_mask
from jaxtune.train.loop import fine_tune

OPTIMIZERS = ("adamw", "adafactor", "muon", "adamw_8bit")
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


def random_tree(tree, seed: int, scale: float = 1.0):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([scale * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def run_steps(optimizer, params, grads_per_step):
    state = optimizer.init(params)
    for grads in grads_per_step:
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def assert_trees_close(ours, theirs, rtol, atol):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


PARAMS = random_tree({"embed_tokens": jnp.zeros((300, 48)), "norm": jnp.zeros((48,)),
                      "layers": {"input_layernorm": jnp.zeros((3, 48)), "q_proj": {"kernel": jnp.zeros((3, 48, 160))},
                                 "o_proj": {"kernel": jnp.zeros((3, 160, 48))}}}, 0, 0.1)
GRADS = [random_tree(PARAMS, s, 1e-4) for s in range(1, 4)]  # global norm 0.025: not clipped


# --- config ---------------------------------------------------------------------------------------------------------

def test_bad_values_are_one_line_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r'^optimizer = "sgd": choose one of adamw, adafactor, muon, adamw_8bit$'):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match=r'^muon_adjust_lr_fn = "x": choose one of match_rms_adamw, original$'):
        TrainConfig(muon_adjust_lr_fn="x")
    with pytest.raises(ConfigError, match=r"^loraplus_lr_ratio = 4: is for lora and qlora, not full$"):
        method_config("full", loraplus_lr_ratio=4)
    with pytest.raises(ConfigError, match=r"^loraplus_lr_ratio = -1: must be >= 0"):
        method_config("lora", loraplus_lr_ratio=-1)
    with pytest.raises(ConfigError, match=r'^moments_dtype = "bfloat16": is for optimizer adamw, not adamw_8bit'):
        TrainPlan(method_config("full"), optimizer="adamw_8bit", offload=OffloadConfig(moments_dtype="bfloat16"))
    with pytest.raises(JaxtuneError, match=r"^config: \[offload\] moments_dtype = 'bfloat16' is for \[train\] "
                                           r"optimizer = 'adamw', not 'muon'$"):
        load_run_config(None, ["train.optimizer=muon", "offload.moments_dtype=bfloat16"])
    config = load_run_config(None, ["train.optimizer=adamw_8bit", "method.loraplus_lr_ratio=16"])
    assert (config.train.optimizer, config.method.loraplus_lr_ratio) == ("adamw_8bit", 16.0)


def test_adamw_state_is_unchanged_so_earlier_checkpoints_resume():
    state = make_optimizer("adamw", TrainConfig(), 10, PARAMS).init(PARAMS)
    assert isinstance(state[0], optax.EmptyState) and isinstance(state[1][0], optax.ScaleByAdamState)


# --- each optimizer against its reference ---------------------------------------------------------------------------

@pytest.mark.full
def test_adafactor_equals_optax_adafactor():
    """optax.adafactor as transformers' Trainer sets it (no parameter scaling), its decay rate lr x weight_decay
    (decoupled decay times the learning rate, as AdamW's), masked off norms; three steps."""
    lr, wd = 1e-2, 0.1
    train = TrainConfig(learning_rate=lr, schedule="constant", weight_decay=wd)
    ours, _ = run_steps(make_optimizer("adafactor", train, 10, PARAMS), PARAMS, GRADS)
    reference = optax.adafactor(lr, multiply_by_parameter_scale=False, weight_decay_rate=lr * wd,
                                weight_decay_mask=weight_decay_mask(PARAMS))
    theirs, _ = run_steps(reference, PARAMS, GRADS)
    assert_trees_close(ours, theirs, 1e-6, 1e-7)
    assert not np.allclose(ours["norm"], PARAMS["norm"])


@pytest.mark.parametrize("adjust, rms", [pytest.param("match_rms_adamw", 0.2, marks=pytest.mark.full),
                                         ("original", None)])
def test_muon_of_a_stacked_kernel_equals_per_layer_optax_muon(adjust, rms):
    """Muon on [L, in, out] stacks = optax.contrib.muon on each layer's [in, out] matrix on its own (its width
    scaling too); the embedding and the norms = optax.adamw with the decay mask; three steps."""
    lr, wd = 1e-2, 0.1
    train = TrainConfig(learning_rate=lr, schedule="constant", weight_decay=wd, muon_adjust_lr_fn=adjust)
    ours, _ = run_steps(make_optimizer("muon", train, 10, PARAMS), PARAMS, GRADS)

    def per_layer(tree):
        return {f"{name}{layer}": tree["layers"][name]["kernel"][layer] for name in ("q_proj", "o_proj")
                for layer in range(3)}

    muon = optax.contrib.muon(lr, beta=0.95, weight_decay=wd, consistent_rms=rms)
    theirs, _ = run_steps(muon, per_layer(PARAMS), [per_layer(g) for g in GRADS])
    for key, matrix in theirs.items():
        name, layer = key[:6], int(key[6:])
        np.testing.assert_allclose(ours["layers"][name]["kernel"][layer], matrix, rtol=1e-5, atol=1e-7)
    rest = lambda t: {"embed_tokens": t["embed_tokens"], "norm": t["norm"],  # noqa: E731
                      "layers": {"input_layernorm": t["layers"]["input_layernorm"]}}
    adamw = optax.adamw(lr, weight_decay=wd, mask=weight_decay_mask)
    theirs, _ = run_steps(adamw, rest(PARAMS), [rest(g) for g in GRADS])
    assert_trees_close(rest(ours), theirs, 1e-6, 1e-8)


def test_muon_state_is_momentum_for_matrices_and_adam_for_the_rest():
    state = jax.eval_shape(make_optimizer("muon", TrainConfig(), 10, PARAMS).init, PARAMS)
    sizes = sorted(x.size for x in jax.tree.leaves(state) if x.size > 3)  # not counters, nor the 3 NS coefficients
    matrices, rest = 3 * 48 * 160 * 2, [48, 48, 3 * 48, 3 * 48, 300 * 48, 300 * 48]
    assert sum(sizes) == matrices + sum(rest)


# --- 8-bit AdamW: a float64 transcription of bitsandbytes -----------------------------------------------------------

def bnb_dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), in float64."""
    data, non_sign_bits, max_exponent_bits = [], 7, 7
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = np.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += (10 ** (-(max_exponent_bits - 1) + i) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0, 1.0]
    assert len(data) == 256
    return np.sort(np.asarray(data))


def bnb_quantize_blockwise(a: np.ndarray, code: np.ndarray, blocksize: int = 256):
    """bitsandbytes' pure-torch `_quantize_blockwise_pytorch` (backends/triton/kernels_optim.py) in float64: (codes,
    absmax, whether each code was a near tie, where float32 may round the other way)."""
    flat = a.astype(np.float64).ravel()
    pad = -flat.size % blocksize
    blocks = np.pad(flat, (0, pad)).reshape(-1, blocksize)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    absmax[absmax == 0] = 1.0
    diff = np.abs(blocks[..., None] / absmax[..., None] - code)
    codes = np.argmin(diff, axis=-1)
    two = np.sort(diff, axis=-1)[..., :2]
    tie = two[..., 1] - two[..., 0] < 1e-6 * np.abs(blocks / absmax)  # float32's rounding of x / absmax could flip it
    cut = lambda x: x.ravel()[:flat.size].reshape(a.shape)  # noqa: E731
    return cut(codes), absmax[:, 0], cut(tie)


def bnb_dequantize_blockwise(codes, absmax, code, blocksize: int = 256):
    values = code[codes].ravel()
    pad = -values.size % blocksize
    return (np.pad(values, (0, pad)).reshape(-1, blocksize) * absmax[:, None]).ravel()[:values.size].reshape(
        codes.shape)


def test_the_dynamic_maps_are_bitsandbytes():
    np.testing.assert_allclose(SIGNED_MAP, bnb_dynamic_map(True), rtol=1e-7)
    np.testing.assert_allclose(UNSIGNED_MAP, bnb_dynamic_map(False), rtol=1e-7)


@pytest.mark.parametrize("shape, stacked", [((3, 40, 100), True), ((5000,), False), ((2, 256, 8), True)])
@pytest.mark.parametrize("signed", [True, False])
def test_blockwise_quantiser_equals_the_bitsandbytes_transcription(shape, stacked, signed):
    """Each layer's tensor in blocks of 256 (the last one partial: 4000 and 5000 elements), its absmax and the codes
    nearest to x / absmax, over values spread across six decades as Adam's moments are."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 0, shape)).astype(np.float32)
    x = x if signed else x**2
    code = SIGNED_MAP if signed else UNSIGNED_MAP
    q = quantize_blockwise(jnp.asarray(x), code, 1 if stacked else 0)
    assert q.codes.shape == x.shape and q.codes.dtype == jnp.uint8
    layers = list(x) if stacked else [x]
    for layer, codes, absmax in zip(layers, q.codes if stacked else [q.codes], q.absmax if stacked else [q.absmax]):
        ref_codes, ref_absmax, tie = bnb_quantize_blockwise(layer, bnb_dynamic_map(signed))
        np.testing.assert_array_equal(np.asarray(absmax), ref_absmax.astype(np.float32))
        assert (np.asarray(codes)[~tie] == ref_codes[~tie]).all() and tie.mean() < 1e-3
        ours = dequantize_blockwise(QuantizedMoment(codes, absmax), code)
        np.testing.assert_allclose(ours, bnb_dequantize_blockwise(np.asarray(codes), ref_absmax,
                                                                  bnb_dynamic_map(signed)), rtol=1e-6)


def bnb_adamw_8bit(p, grads, lr, b1, b2, eps, wd):
    """bitsandbytes' `optimizer_update_8bit_blockwise_pytorch` (adam) in float64, one tensor, from zero states."""
    signed, unsigned = bnb_dynamic_map(True), bnb_dynamic_map(False)
    p = p.astype(np.float64)
    s1 = s2 = np.zeros_like(p)
    for step, g in enumerate(grads, 1):
        s1 = s1 * b1 + (1 - b1) * g
        s2 = s2 * b2 + (1 - b2) * g * g
        denom = np.sqrt(s2) / np.sqrt(1 - b2**step) + eps
        p = p * (1 - lr * wd) - lr / (1 - b1**step) * s1 / denom
        s1 = bnb_dequantize_blockwise(*bnb_quantize_blockwise(s1, signed)[:2], signed)
        s2 = bnb_dequantize_blockwise(*bnb_quantize_blockwise(s2, unsigned)[:2], unsigned)
    return p


@pytest.mark.full
def test_adamw_8bit_is_adamw_at_step_one_and_bitsandbytes_after():
    """Step 1 (moments from zero) = optax.adamw; five steps = bitsandbytes' 8-bit AdamW (float64 transcription), and
    within the quantisation error of float AdamW; a tensor under 4096 elements a layer keeps float32 moments."""
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    train = TrainConfig(learning_rate=lr, schedule="constant", weight_decay=wd)
    params = {"layers": {"q_proj": {"kernel": PARAMS["layers"]["q_proj"]["kernel"]}}, "norm": PARAMS["norm"]}
    grads = [random_tree(params, s, 1e-3) for s in range(1, 6)]  # norm 0.15: not clipped
    eight = make_optimizer("adamw_8bit", train, 10, params)
    state = eight.init(params)
    assert isinstance(state[1][0].mu["layers"]["q_proj"]["kernel"], QuantizedMoment)
    assert state[1][0].nu["norm"].dtype == jnp.float32
    adamw = optax.adamw(lr, b1, b2, eps, weight_decay=wd, mask=weight_decay_mask)
    assert_trees_close(run_steps(eight, params, grads[:1])[0], run_steps(adamw, params, grads[:1])[0], 1e-6, 1e-8)

    ours = run_steps(eight, params, grads)[0]["layers"]["q_proj"]["kernel"]
    float_adamw = run_steps(adamw, params, grads)[0]["layers"]["q_proj"]["kernel"]
    start = params["layers"]["q_proj"]["kernel"]
    reference = np.stack([bnb_adamw_8bit(np.asarray(start[i]), [np.asarray(g["layers"]["q_proj"]["kernel"][i])
                                                                for g in grads], lr, b1, b2, eps, wd)
                          for i in range(3)])
    off = np.abs(np.asarray(ours) - reference)  # a near tie that float32 rounds the other way moves one code
    assert (off < 1e-3 * lr).mean() > 0.999 and off.max() < 0.05 * lr
    quantisation = np.abs(np.asarray(float_adamw) - reference).max()
    assert 1e-4 * lr < quantisation < 0.5 * lr and np.abs(np.asarray(ours) - float_adamw).max() < 0.5 * lr


@pytest.mark.full
def test_adamw_8bit_clips_inside_its_update_and_chunks_leaves_outside_the_stacks():
    """The global-norm clip 8-bit AdamW applies a layer (or a row chunk) at a time = clipping first (optax), and a
    leaf outside the layer stacks (an embedding), updated in 16 chunks of whole blocks, = bitsandbytes' 8-bit AdamW
    on the whole tensor (float64 transcription)."""
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    params = {"embed_tokens": random_tree(jnp.zeros((512, 64)), 7), "norm": PARAMS["norm"],
              "layers": {"q_proj": {"kernel": PARAMS["layers"]["q_proj"]["kernel"]}}}
    assert row_chunks(512 * 64) == 16
    train = TrainConfig(learning_rate=lr, schedule="constant", weight_decay=wd, max_grad_norm=1.0)
    eight = make_optimizer("adamw_8bit", train, 10, params)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), scale_by_adam_8bit(b1, b2, eps),
                          optax.add_decayed_weights(wd, weight_decay_mask(params)), optax.scale_by_learning_rate(lr))
    steps = [random_tree(params, 11), random_tree(params, 12, 1e-3)]  # global norms ~200 (clipped to 1) and ~0.2
    assert float(optax.global_norm(steps[0])) > 100
    ours, theirs = run_steps(eight, params, steps)[0], run_steps(clipped, params, steps)[0]
    assert_trees_close(ours, theirs, 1e-6, 1e-8)
    unclipped = run_steps(make_optimizer("adamw_8bit", replace(train, max_grad_norm=1e9), 10, params), params, steps)
    assert np.abs(np.asarray(unclipped[0]["norm"]) - np.asarray(ours["norm"])).max() > 1e-4 * lr  # it clips

    grads = [random_tree(params, s, 1e-3) for s in range(1, 6)]  # not clipped
    ours = np.asarray(run_steps(eight, params, grads)[0]["embed_tokens"])
    reference = bnb_adamw_8bit(np.asarray(params["embed_tokens"]), [np.asarray(g["embed_tokens"]) for g in grads],
                               lr, b1, b2, eps, wd)
    off = np.abs(ours - reference)
    assert (off < 1e-3 * lr).mean() > 0.999 and off.max() < 0.05 * lr


# --- LoRA+ ----------------------------------------------------------------------------------------------------------

def lora_b_group(method, trainable: dict) -> dict:
    """True at the leaves LoRA+ trains at ratio x the learning rate (`Method.learning_rates`)."""
    rates = method_unit(method).learning_rates(method.replace(loraplus_lr_ratio=4.0), trainable)
    return jax.tree.map(lambda rate: rate == 4.0, rates)


@pytest.mark.full
def test_loraplus_group_is_peft_s_b_group_on_jaxtune_s_leaves():
    method = method_config("lora", dora=True, modules_to_save=("lm_head",))
    trainable, _ = init_run(TINY, method)
    group = lora_b_group(method, trainable)
    assert {k: v for k, v in group["layers"]["q_proj"].items() if v is not None} == {
        "lora_a": False, "lora_b": True, "magnitude": True}
    assert group["lm_head"] == {"kernel": False}
    method = method_config("lora", lora_bias=True)
    trainable, _ = init_run(TINY, method)
    group = lora_b_group(method, trainable)
    assert {k: v for k, v in group["layers"]["v_proj"].items() if v is not None} == {
        "lora_a": False, "lora_b": True, "lora_bias": True}
    assert not weight_decay_mask(trainable)["layers"]["v_proj"]["lora_bias"]  # "bias" in its name, as in PEFT


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("variant", ["lora_bias", "dora"])
def test_loraplus_equals_torch_adamw_on_peft_s_loraplus_groups(variant):
    """PEFT's `create_loraplus_optimizer(model, torch.optim.AdamW, lr, loraplus_lr_ratio, loraplus_weight_decay)` on a
    LoRA model (with a LoRA bias and lm_head in modules_to_save, or DoRA): two steps of the same gradients on the same
    leaves equal jaxtune's AdamW with `loraplus_lr_ratio`."""
    import torch
    import transformers
    from hf_models import TINY as HF_TINY
    from peft import LoraConfig, get_peft_model
    from peft.optimizers import create_loraplus_optimizer

    lr, ratio, wd = 1e-2, 16.0, 0.1
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_TINY))
    extra = dict(lora_bias=True, modules_to_save=["lm_head"]) if variant == "lora_bias" else dict(use_dora=True)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra))
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(p.shape).astype(np.float32) * 0.1 for n, p in named.items()}
    grads = [{n: rng.standard_normal(p.shape).astype(np.float32) * 0.01 for n, p in named.items()} for _ in range(2)]
    optimizer = create_loraplus_optimizer(model, torch.optim.AdamW, lr=lr, loraplus_lr_ratio=ratio,
                                          loraplus_weight_decay=wd, betas=(0.9, 0.999), eps=1e-8)
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(torch.from_numpy(values[n]))
    for g in grads:
        for n, p in named.items():
            p.grad = torch.from_numpy(g[n])
        optimizer.step()

    leaf = {"lora_A.default.weight": ("lora_a", True), "lora_B.default.weight": ("lora_b", True),
            "lora_B.default.bias": ("lora_bias", False), "lora_magnitude_vector.default.weight": ("magnitude", False)}

    def jaxtune_tree(by_name):
        tree = {"layers": {}}
        for n, x in by_name.items():
            if "modules_to_save" in n:
                tree["lm_head"] = {"kernel": x.T}
                continue
            layer, module = int(n.split(".layers.")[1].split(".")[0]), n.split(".")[-4]
            for suffix, (name, transpose) in leaf.items():
                if n.endswith(suffix):
                    tree["layers"].setdefault(module, {}).setdefault(name, {})[layer] = x.T if transpose else x
        for module in tree["layers"].values():
            for name, layers in module.items():
                module[name] = jnp.stack([layers[i] for i in sorted(layers)])
        return tree

    params = jaxtune_tree(values)
    train = TrainConfig(learning_rate=lr, schedule="constant", weight_decay=wd, max_grad_norm=1e9)
    method = method_config("lora", rank=4, alpha=8, loraplus_lr_ratio=ratio,
                           **(dict(lora_bias=True) if variant == "lora_bias" else dict(dora=True)))
    rates = method_unit(method).learning_rates(method, params)
    ours, _ = run_steps(make_optimizer("adamw", train, 10, params, rates=rates), params,
                        [jaxtune_tree(g) for g in grads])
    theirs = jaxtune_tree({n: p.detach().numpy() for n, p in named.items()})
    # B's steps are ~0.16; optax's bias corrections are float32 (1 - 0.999 off by 1.3e-5), torch's float64
    assert_trees_close(ours, theirs, 1e-5, 5e-6)
    without, _ = run_steps(make_optimizer("adamw", train, 10, params), params, [jaxtune_tree(g) for g in grads])
    assert not np.allclose(without["layers"]["q_proj"]["lora_b"], theirs["layers"]["q_proj"]["lora_b"])


@pytest.mark.reference
@pytest.mark.parity
def test_newton_schulz_equals_keller_jordan_s_zeropower_via_newtonschulz5():
    """Muon's orthogonalisation of a stacked [L, in, out] momentum (its first update: momentum = the gradient's
    direction) = `zeropower_via_newtonschulz5` from github.com/KellerJordan/Muon (muon.py), transcribed in torch and run
    in float32 (the original casts to bfloat16) on each layer's matrix, wide and tall."""
    import torch

    def zeropower_via_newtonschulz5(G, steps: int):
        assert G.ndim >= 2
        a, b, c = (3.4445, -4.7750, 2.0315)
        X = G.float()  # the original: G.bfloat16()
        if G.size(-2) > G.size(-1):
            X = X.mT
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        if G.size(-2) > G.size(-1):
            X = X.mT
        return X

    from optax.contrib import MuonDimensionNumbers, scale_by_muon

    for shape in [(3, 48, 160), (3, 160, 48)]:
        g = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        muon = scale_by_muon(weight_dimension_numbers=MuonDimensionNumbers(-2, -1))
        ours, _ = muon.update(jnp.asarray(g), muon.init(jnp.asarray(g)))
        theirs = zeropower_via_newtonschulz5(torch.from_numpy(g), 5).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=2e-5)
        assert 0.5 < np.linalg.svd(theirs[0], compute_uv=False).min()  # orthogonalised, not scaled


# --- the planner counts each state exactly -------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_planner_counts_each_optimizer_s_state_exactly(optimizer):
    """estimate's optimizer bytes = the abstract run's state = the state `init_state` allocates (full fine-tune, where
    the state is largest, and LoRA with LoRA+), and the report names the state."""
    for method in (method_config("full"), method_config("lora", loraplus_lr_ratio=16)):
        plan = TrainPlan(method, 2, 32, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MeshConfig(1, 1, 1),
                         optimizer=optimizer)
        est = estimate(TINY, plan, get_device("cpu"))
        run = abstract_run(TINY, plan, make_mesh(MeshConfig(), jax.devices()[:1]))
        abstract = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.state["opt_state"]))
        real = run.init_state(init_run(TINY, method)[0], 0)["opt_state"]
        assert est.optimizer_bytes == abstract == sum(x.nbytes for x in jax.tree.leaves(real))
    label = {"adamw": "Adam mu and nu", "adafactor": "Adafactor", "muon": "Muon momentum", "adamw_8bit": "8 bits"}
    assert label[optimizer] in format_estimate(est)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.full
def test_the_compiled_step_takes_the_planned_state_as_arguments(optimizer):
    plan = TrainPlan(method_config("full"), 2, 32, 1, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MeshConfig(1, 1, 1),
                     optimizer=optimizer)
    est = estimate(TINY, plan, get_device("cpu"))
    args = est.frozen_bytes + est.trainable_bytes + est.optimizer_bytes + est.batch_bytes
    assert abs(args - compile_step(TINY, plan).argument_bytes) < 64  # step counters and the RNG key


# --- checkpoints and exact resume ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS[1:])
@pytest.mark.full
def test_a_kill_after_a_checkpoint_resumes_exactly(setup, tmp_path, optimizer):
    """A full fine-tune (every kind of state: 8-bit codes, Muon's and Adam's moments, factored ones), SIGKILLed right
    after the step-4 checkpoint; the same command again ends with the metrics.jsonl of a run never interrupted (the
    optimizer state saved and restored bit for bit)."""
    _, model, data = setup

    def full_config(name: str):
        path = write_config(tmp_path / f"{name}.toml", model, data, tmp_path / name, max_steps=6, eval_every=0,
                            optimizer=optimizer, learning_rate=1e-3)
        path.write_text(path.read_text().replace('kind = "lora"\nrank = 4\ntarget_modules = ["all-linear"]',
                                                 'kind = "full"'))
        return path

    fine_tune(load_run_config(full_config("ref")), log=lambda _: None)
    config = full_config("run")
    assert load_run_config(config).method.kind == "full"
    train_killed_after_checkpoint(config, 4)
    assert fine_tune(load_run_config(config), log=lambda _: None).step == 6
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")
