"""LoRA dropout: PEFT's formula with jaxtune's masks, float64 re-statement, no dropout outside training, unbiased,
independent masks per layer / micro-batch / step, and a training run that learns and resumes exactly."""

import os
import signal

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from steps import one_device_run, sft_gradients
from test_train import DEMO_DATA, metric_lines, write_config

from jaxtune.config import ForwardOptions, MethodConfig, Remat, TrainConfig, tiny_config
from jaxtune.methods import method_config
from jaxtune.methods.lora import merge
from jaxtune.methods.lora.product import LORA_HOOK
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.adapters import Adapters, adapter_dropout_key
from jaxtune.models.linear import dense, dropout, dropout_keep_mask, kernel_of
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params
from jaxtune.models.rope import inverse_frequencies
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.train.loop import fine_tune

CFG = tiny_config(num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                  head_dim=8, initializer_range=0.2)
RATE = 0.3
jit_forward = jax.jit(forward, static_argnames=("cfg", "method", "options"))
METHODS = {
    "lora_all_rslora": method_config("lora", rank=4, alpha=8, dropout=RATE, rslora=True,
                                     target_modules=("all-linear",)),
    "dora_all": method_config("lora", rank=4, alpha=8, dropout=RATE, dora=True, target_modules=("all-linear",)),
    "qlora_qv": method_config("qlora", rank=4, alpha=8, dropout=RATE, bits=8),
}


def adapted(method: MethodConfig, seed: int = 1) -> dict:
    """The tiny model with `method`'s leaves, lora_b non-zero (B = 0 would hide the adapter path)."""
    params = apply_method(init_params(CFG, jax.random.key(0)), CFG, method, jax.random.key(seed))
    layers = dict(params["layers"])
    for i, name in enumerate(n for n in method.target_modules if n in layers):
        b = layers[name]["lora_b"]
        layers[name] = {**layers[name], "lora_b": 0.3 * jax.random.normal(jax.random.key(100 + i), b.shape)}
    return {**params, "layers": layers}


def tokens(seed=0, shape=(2, 12)):
    return jax.random.randint(jax.random.key(seed), shape, 0, CFG.vocab_size)


def reference_forward(params, ids, method: MethodConfig, key) -> np.ndarray:
    """Float64 numpy Llama forward with PEFT's LoRA / DoRA dropout; masks regenerated from `key` as the forward
    derives them (layer i: split(key, L)[i], module: `adapter_dropout_key`). key None: no dropout."""
    f64 = lambda a: np.asarray(a, np.float64)
    L, K, hd = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim
    G = CFG.num_heads // K
    s = method.lora_scale
    layer_keys = None if key is None else jax.random.split(key, L)

    def linear(x, module, name, i):
        layer = {k: v[i] for k, v in module.items() if k != "kernel"}
        w = f64(kernel_of({"kernel": jax.tree.map(lambda a: a[i], module["kernel"])}, jnp.float32))
        y = x @ w
        if "lora_a" not in module:
            return y
        xd = x
        if layer_keys is not None:
            keep = np.asarray(dropout_keep_mask(adapter_dropout_key(layer_keys[i], name), x.shape, method.dropout))
            xd = x * keep / (1 - method.dropout)
        a, b = f64(layer["lora_a"]), f64(layer["lora_b"])
        lora = xd @ a @ b * s
        if "magnitude" not in layer:
            return y + lora
        scale = f64(layer["magnitude"]) / np.linalg.norm(w + s * a @ b, axis=0)
        return y + (scale - 1) * (xd @ w) + scale * lora  # PEFT DoraLinearVariant.forward with dropout

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.rms_norm_eps) * f64(w)

    def rope(x):  # [B, T, N, hd], positions 0..T-1, half-split rotation
        angles = np.arange(x.shape[1])[:, None] * f64(inverse_frequencies(CFG))[None]
        cos, sin = (np.concatenate([f(angles)] * 2, -1)[None, :, None] for f in (np.cos, np.sin))
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    ly = params["layers"]
    x = f64(params["embed_tokens"])[np.asarray(ids)]
    B, T, _ = x.shape
    causal = np.tril(np.ones((T, T), bool))
    for i in range(L):
        h = norm(x, ly["input_layernorm"][i])
        q = rope(linear(h, ly["q_proj"], "q_proj", i).reshape(B, T, K * G, hd))
        k = rope(linear(h, ly["k_proj"], "k_proj", i).reshape(B, T, K, hd))
        v = linear(h, ly["v_proj"], "v_proj", i).reshape(B, T, K, hd)
        k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # query head n reads key/value head n // G
        scores = np.where(causal, np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + linear(np.einsum("bnts,bsnh->btnh", probs, v).reshape(B, T, -1), ly["o_proj"], "o_proj", i)
        h = norm(x, ly["post_attention_layernorm"][i])
        gate, up = linear(h, ly["gate_proj"], "gate_proj", i), linear(h, ly["up_proj"], "up_proj", i)
        x = x + linear(gate / (1 + np.exp(-gate)) * up, ly["down_proj"], "down_proj", i)
    return norm(x, params["norm"]) @ f64(params["lm_head"]["kernel"])


@pytest.mark.parity
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.full
def test_forward_with_dropout_equals_float64_restatement(name):
    """(a) The same masks in a float64 numpy Llama: logits agree; the re-statement also agrees with no dropout."""
    method = METHODS[name]
    params, ids, key = adapted(method), tokens(), jax.random.key(7)
    out = jit_forward(params, ids, CFG, method=method, dropout_key=key)
    np.testing.assert_allclose(out, reference_forward(params, ids, method, key), atol=2e-5, rtol=1e-5)
    plain = jit_forward(params, ids, CFG, method=method)
    np.testing.assert_allclose(plain, reference_forward(params, ids, method, None), atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(out - plain).max()) > 1e-2  # dropout changed the logits
    layer_keys = jax.random.split(key, CFG.num_layers)  # (c) every layer and module draws its own mask
    masks = [np.asarray(dropout_keep_mask(adapter_dropout_key(k, m), (2, 12, 32), RATE))
             for k in layer_keys for m in ("q_proj", "v_proj")]
    assert all(not np.array_equal(masks[i], masks[j]) for i in range(len(masks)) for j in range(i))


@pytest.mark.reference
@pytest.mark.parity
@pytest.mark.parametrize("dora", [False, True])
def test_dense_matches_peft_train_mode_with_the_same_mask(dora):
    """PEFT's own `lora.Linear` in training, its dropout module replaced by jaxtune's mask: the same output."""
    import torch
    from peft import LoraConfig, get_peft_model

    D_in, D_out, r, alpha = 24, 16, 4, 8.0
    peft_model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(D_in, D_out, bias=True)).double(),
                                LoraConfig(r=r, lora_alpha=alpha, lora_dropout=RATE, use_dora=dora,
                                           target_modules=["0"]))
    layer = peft_model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.3)
        if dora:
            layer.lora_magnitude_vector["default"].weight.mul_(1.5)
    module = {"kernel": jnp.asarray(layer.base_layer.weight.detach().numpy().T, jnp.float32),
              "bias": jnp.asarray(layer.base_layer.bias.detach().numpy(), jnp.float32),
              "lora_a": jnp.asarray(layer.lora_A["default"].weight.detach().numpy().T, jnp.float32),
              "lora_b": jnp.asarray(layer.lora_B["default"].weight.detach().numpy().T, jnp.float32)}
    if dora:
        module["magnitude"] = jnp.asarray(layer.lora_magnitude_vector["default"].weight.detach().numpy(), jnp.float32)
    x = np.random.default_rng(0).normal(size=(3, 5, D_in))
    key = jax.random.key(3)
    keep = torch.from_numpy(np.asarray(dropout_keep_mask(key, x.shape, RATE), np.float64))

    class FixedMask(torch.nn.Dropout):  # nn.Dropout with jaxtune's mask: active in train mode only
        def forward(self, t):
            return t * keep / (1 - RATE) if self.training else t

    layer.lora_dropout["default"] = FixedMask()
    peft_model.train()
    expected = peft_model(torch.from_numpy(x)).detach().numpy()
    out = lora_dense(jnp.asarray(x, jnp.float32), module, alpha / r, key, RATE)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    peft_model.eval()  # eval: PEFT skips dropout; jaxtune without a key
    np.testing.assert_allclose(lora_dense(jnp.asarray(x, jnp.float32), module, alpha / r),
                               peft_model(torch.from_numpy(x)).detach().numpy(), atol=1e-5)


def lora_dense(x, module: dict, scale: float, key=None, rate: float = 0.0):
    """`dense` through LoRA's hook, the module holding its scale as the forward puts it there."""
    return dense(x, {**module, "lora_scale": jnp.asarray(scale, jnp.float32)}, Adapters((LORA_HOOK,), key, rate))


def primitives(jaxpr) -> list[str]:
    """Names of every primitive a (closed) jaxpr applies, sub-jaxprs (scan, checkpoint, ...) included, in order."""
    names = []
    for eqn in jaxpr.jaxpr.eqns if hasattr(jaxpr, "jaxpr") else jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += primitives(sub)
    return names


@pytest.mark.full
def test_no_dropout_in_eval_merge_or_with_rate_zero():
    """(b) Rate 0 with a key, or any rate without one, is the no-dropout forward bit for bit, and traces no
    random-number work at all; merging ignores dropout."""
    method = METHODS["lora_all_rslora"]
    zero = method_config("lora", rank=4, alpha=8, dropout=0.0, rslora=True, target_modules=("all-linear",))
    params, ids, key = adapted(method), tokens(), jax.random.key(7)
    plain = jit_forward(params, ids, CFG, method=zero)
    np.testing.assert_array_equal(jit_forward(params, ids, CFG, method=zero, dropout_key=key), plain)
    np.testing.assert_array_equal(jit_forward(params, ids, CFG, method=method), plain)
    ops = lambda m, k: primitives(jax.make_jaxpr(lambda p, t: forward(p, t, CFG, method=m, dropout_key=k))(params, ids))
    assert ops(zero, key) == ops(zero, None) and not any(op.startswith("random") for op in ops(zero, key))
    assert "random_bits" in ops(method, key)
    np.testing.assert_allclose(jit_forward(merge(params, method), ids, CFG), plain, atol=1e-4)


def small_batch(A: int, seed: int = 0) -> dict:
    """[A, 2, 12] micro-batches, all equal (so only the dropout masks can tell them apart)."""
    ids = np.asarray(tokens(seed, (2, 13)))
    ones = np.ones((2, 12), np.int32)
    micro = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": ones.astype(np.float32), "segment_ids": ones,
             "positions": np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))}
    return {k: np.stack([v] * A) for k, v in micro.items()}


@pytest.mark.slow
@pytest.mark.full
def test_masks_differ_across_micro_batches_and_steps():
    """(c) Two equal micro-batches with dropout: their mean loss differs from one alone, so their masks differ
    (without dropout the two are equal: tests/test_train.py's accumulation test). Two steps at learning rate 0 on
    one batch (unchanged params): different losses, so the step's masks differ."""
    method = METHODS["lora_all_rslora"]
    params = adapted(method)
    trainable, frozen = partition(params, trainable_mask(params, method))
    grads = jax.jit(sft_gradients, static_argnums=(3, 4, 5))
    key = jax.random.key(5)
    one = grads(trainable, frozen, small_batch(1), CFG, method, ForwardOptions(), key)[0]
    two = grads(trainable, frozen, small_batch(2), CFG, method, ForwardOptions(), key)[0]
    assert abs(float(one) - float(two)) > 1e-4

    tc = TrainConfig(learning_rate=0.0, schedule="constant")
    run = one_device_run(CFG, method, train=tc, total_steps=4, batch_size=2, seq_len=12)
    state = run.init_state(trainable, 0)
    state, first = run.step(state, frozen, None, small_batch(1))
    state, second = run.step(state, frozen, None, small_batch(1))
    assert abs(float(first["loss"]) - float(second["loss"])) > 1e-4


@pytest.mark.reference
@pytest.mark.full
def test_dropout_is_unbiased_with_torch_scaling():
    """(d) Kept elements are x / (1 - p) as torch's `nn.Dropout` gives them, and over many keys the mean LoRA and
    DoRA output approaches the no-dropout output (within 5 standard errors, elementwise)."""
    import torch

    x = jnp.ones((4000,))
    torch_kept = torch.nn.functional.dropout(torch.ones(4000), RATE, training=True).unique()
    ours = dropout(x, jax.random.key(0), RATE)
    np.testing.assert_allclose(np.unique(np.asarray(ours)), np.sort(torch_kept.numpy()), rtol=1e-7)
    assert abs(float(jnp.mean(ours == 0)) - RATE) < 0.03

    k = jax.random.split(jax.random.key(1), 5)
    module = {"kernel": jax.random.normal(k[0], (16, 8)) / 4, "lora_a": jax.random.normal(k[1], (16, 4)),
              "lora_b": jax.random.normal(k[2], (4, 8)) / 2, "magnitude": 1 + jax.random.uniform(k[3], (8,))}
    x = jax.random.normal(k[4], (3, 16))
    n = 20000
    keys = jax.random.split(jax.random.key(2), n)
    for m in (module, {k: v for k, v in module.items() if k != "magnitude"}):
        samples = jax.vmap(lambda key: lora_dense(x, m, 2.0, key, RATE))(keys)
        error = jnp.abs(samples.mean(0) - lora_dense(x, m, 2.0))
        assert float(jnp.max(error / (samples.std(0) / np.sqrt(n)))) < 5.0


@pytest.mark.slow
@pytest.mark.full
def test_training_with_dropout_learns_and_resumes_exactly(tmp_path):
    """(e) `jaxtune train` with LoRA dropout 0.1: the held-out loss falls, and a run interrupted after step 1 and
    resumed writes the same metrics as one never interrupted (the masks come from the checkpointed rng)."""
    model = write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.1)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:32]))
    overrides = ["method.dropout=0.1", "train.max_steps=4"]
    full = load_run_config(write_config(tmp_path / "full.toml", model, data, tmp_path / "full"), overrides)
    fine_tune(full, log=lambda _: None)
    records = metric_lines(tmp_path / "full")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.05

    def stop_at_start(line):
        if line.startswith("training"):
            os.kill(os.getpid(), signal.SIGTERM)

    interrupted = load_run_config(write_config(tmp_path / "int.toml", model, data, tmp_path / "int"), overrides)
    assert fine_tune(interrupted, log=stop_at_start).interrupted
    fine_tune(interrupted, log=lambda _: None)
    assert metric_lines(tmp_path / "int") == records
    no_dropout = load_run_config(write_config(tmp_path / "nd.toml", model, data, tmp_path / "nd"),
                                 ["train.max_steps=1", "train.eval_every=0"])
    fine_tune(no_dropout, log=lambda _: None)
    # Dropout was on: B = 0 at step 1 hides it from the loss, not from B's gradient.
    first_grad_norm = lambda rs: next(r["grad_norm"] for r in rs if r.get("step") == 1 and "grad_norm" in r)
    assert abs(first_grad_norm(metric_lines(tmp_path / "nd")) / first_grad_norm(records) - 1) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora_all_rslora", "qlora_qv"])
@pytest.mark.full
def test_remat_recomputes_the_same_masks(name):
    """Under `full` remat the backward recomputes the block, dropout included: gradients equal no remat's."""
    method = METHODS[name]
    params = adapted(method)
    trainable, frozen = partition(params, trainable_mask(params, method))

    def grads(remat):
        def loss(t):
            logits = forward(combine(t, frozen), tokens(), CFG, method=method, dropout_key=jax.random.key(9),
                             options=ForwardOptions(remat=Remat(remat)))
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1))
        return jax.jit(jax.grad(loss))(trainable)

    for a, b in zip(jax.tree.leaves(grads("none")), jax.tree.leaves(grads("full"))):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
