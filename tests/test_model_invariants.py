"""Properties the forward must have whatever the weights: scan == loop, remat == no remat, causality, packing."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import ForwardOptions, Remat, tiny_config
from jaxtune.models import llama
from jaxtune.models.llama import forward as _forward
from jaxtune.models.params import init_params

forward = jax.jit(_forward, static_argnames=("cfg", "options"))

CFG = tiny_config(num_layers=3, vocab_size=101, sliding_windows=(0, 5, 0), qkv_bias=True, initializer_range=0.2)


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(CFG, jax.random.key(0))


def tokens(seed=0, shape=(2, 16)):
    return jax.random.randint(jax.random.key(seed), shape, 0, CFG.vocab_size)


def loss(params, ids, options):
    logits = _forward(params, ids, CFG, options=options)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] ** 2)


@pytest.mark.full
def test_scan_equals_unrolled_loop(params):
    ids = tokens()
    scanned = forward(params, ids, CFG)
    looped = forward(params, ids, CFG, options=ForwardOptions(scan_layers=False))
    np.testing.assert_allclose(scanned, looped, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", [pytest.param("full", marks=pytest.mark.full), "save_matmuls"])
def test_remat_equals_no_remat_in_values_and_gradients(params, policy):
    ids = tokens(1)
    base_value, base_grads = jax.jit(jax.value_and_grad(loss), static_argnums=2)(params, ids, ForwardOptions())
    value, grads = jax.jit(jax.value_and_grad(loss), static_argnums=2)(params, ids,
                                                                       ForwardOptions(remat=Remat(policy)))
    np.testing.assert_allclose(value, base_value, rtol=1e-6)
    flat_base, flat = jax.tree.leaves(base_grads), jax.tree.leaves(grads)
    assert any(float(jnp.abs(g).max()) > 1e-4 for g in flat_base)
    for g0, g1 in zip(flat_base, flat):  # float32 sums in another order: equal up to rounding of the largest entry
        assert float(jnp.abs(g1 - g0).max()) <= 1e-5 * float(jnp.abs(g0).max())


@pytest.mark.full
def test_remat_policy_changes_what_is_saved(params):
    """The policies differ in the compiled program: full remat recomputes, so it saves fewer residuals."""
    ids = tokens(1, (4, 64))

    def temp_bytes(policy):
        fn = jax.jit(jax.grad(loss), static_argnums=2)
        compiled = fn.lower(params, ids, ForwardOptions(remat=Remat(policy))).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") < temp_bytes("none")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_matmuls_keeps_every_projection_output(params, dtype):
    """save_matmuls keeps each layer's seven projection outputs (stacked over the layer scan), in the compute
    dtype (bfloat16 as its uint16 bits); full keeps only the layer input. The projections are custom-VJP matmuls,
    whose dots a dot-saving policy alone does not see: in bfloat16 it had kept none of them."""
    ids = tokens(1)
    short = {"float32": "f32", "bfloat16": "u16"}[dtype]

    def stacked_layer_outputs(policy):
        options = ForwardOptions(compute_dtype=dtype, remat=Remat(policy))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            jax.ad_checkpoint.print_saved_residuals(lambda p: loss(p, ids, options), params)
        return sorted(int(width) for width in re.findall(rf"^{short}\[{CFG.num_layers},2,16,(\d+)\] output of scan",
                                                           printed.getvalue(), re.M))

    D, F, hd = CFG.hidden_size, CFG.intermediate_size, CFG.head_dim
    projections = [CFG.num_heads * hd, CFG.num_kv_heads * hd, CFG.num_kv_heads * hd, D, F, F, D]
    assert stacked_layer_outputs("save_matmuls") == sorted(projections)
    assert stacked_layer_outputs("full") == [D]


@pytest.mark.parametrize("policy", ["none", "save_matmuls", "full"])
@pytest.mark.full
def test_bfloat16_residuals_are_kept_as_bits(params, monkeypatch, policy):
    """In bfloat16 a layer's residuals, whatever the policy keeps, are kept as their uint16 bits, and the compiled
    gradient holds no float32 stack of them (XLA:CPU float-normalises a scanned bfloat16 stack: the forward's
    update of it widened the whole stack and back at every layer, and the backward's slice widened it whole before
    the loop); the gradients are bitwise those of the plain policy."""
    ids = tokens(1)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    options = ForwardOptions(compute_dtype="bfloat16", remat=Remat(policy))
    L = CFG.num_layers

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(lambda p: loss(p, ids, options), bf16)
    assert re.search(rf"^u16\[{L},2,16,", printed.getvalue(), re.M), printed.getvalue()
    assert not re.search(rf"^bf16\[{L},", printed.getvalue(), re.M), printed.getvalue()

    def gradient(p):
        grad = jax.jit(jax.grad(loss), static_argnums=2)
        return grad(p, ids, options), grad.lower(p, ids, options).compile().as_text()

    widened = rf"= f32\[{L},2,16[\d,]*\]\{{[\d,]*\}} convert\("  # a stack of layers' activations, widened whole
    grads, hlo = gradient(bf16)
    assert not re.search(widened, hlo)
    monkeypatch.setattr(llama, "remat_layer", lambda block, remat, dtype: remat.wrap(block))
    plain, old_hlo = gradient(bf16)
    assert re.search(widened, old_hlo)  # what XLA:CPU does with a scanned bfloat16 stack (the reason for the bits)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g0, np.float32))


def test_unknown_remat_policy_is_named():
    with pytest.raises(ValueError, match='remat = "sometimes": choose one of none, full, save_matmuls'):
        Remat("sometimes")


def test_causality(params):
    """Changing token t changes no logit before t (and does change logits at t)."""
    ids = tokens(2, (1, 16))
    base = forward(params, ids, CFG)
    for t in (0, 7, 15):
        changed = forward(params, ids.at[0, t].set((ids[0, t] + 1) % CFG.vocab_size), CFG)
        np.testing.assert_array_equal(changed[:, :t], base[:, :t])
        assert float(jnp.abs(changed[:, t:] - base[:, t:]).max()) > 1e-3


@pytest.mark.full
def test_packed_segments_equal_separate_rows(params):
    """Two sequences packed in one row, with segment ids and restarted positions, have their own logits."""
    a, b = tokens(3, (1, 9)), tokens(4, (1, 7))
    packed = jnp.concatenate([a, b], axis=1)
    segments = jnp.asarray([[1] * 9 + [2] * 7])
    positions = jnp.asarray([list(range(9)) + list(range(7))])
    out = forward(params, packed, CFG, positions_BxT=positions, segment_ids_BxT=segments)
    np.testing.assert_allclose(out[:, :9], forward(params, a, CFG), atol=1e-5)
    np.testing.assert_allclose(out[:, 9:], forward(params, b, CFG), atol=1e-5)


def test_bfloat16_matmul_accumulates_in_float32_forward_and_backward():
    """`linear.matmul` under bfloat16 compute: products of the bfloat16 inputs summed in float32 (then rounded once),
    forward and in both gradients, against float64 sums of the same bfloat16 values."""
    from jaxtune.models.linear import matmul

    rng = np.random.default_rng(0)
    x, w, g = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((2, 5, 256), (256, 96), (2, 5, 96)))
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    wide = matmul(x, w, jnp.float32)  # float32 out: no final rounding, so the float32 accumulation shows
    np.testing.assert_allclose(np.asarray(wide), x64 @ w64, rtol=1e-5, atol=1e-4)
    y, vjp = jax.vjp(matmul, x, w)
    dx, dw = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    for ours, exact in ((y, x64 @ w64), (dx, g64 @ w64.T), (dw, np.einsum("bti,bto->io", x64, g64))):
        rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
        np.testing.assert_allclose(np.asarray(ours, np.float64), rounded, rtol=2**-7, atol=1e-2)


def test_qwen3_5_packed_segments_equal_separate_rows():
    """Qwen3.5's Gated DeltaNet layers restart their convolution and state at each segment (the second mid-chunk,
    running across the 64-token chunk boundary; then a padding tail): every segment's logits are its own row's, in
    float64 to 1e-10
    (in float32 the chunks' sums round differently at another length)."""
    from jaxtune.presets import tiny_model_config

    cfg = tiny_model_config("qwen3_5", num_layers=2, vocab_size=101, initializer_range=0.2)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(1))
    lengths = (40, 40)
    rows = [np.asarray(jax.random.randint(jax.random.key(i), (1, n), 0, cfg.vocab_size)) for i, n in enumerate(lengths)]
    packed = np.concatenate(rows + [np.zeros((1, 4), np.int32)], axis=1)
    segments = np.asarray([sum(([i + 1] * n for i, n in enumerate(lengths)), []) + [0] * 4])
    positions = np.asarray([sum((list(range(n)) for n in lengths), []) + [0] * 4])
    float64 = ForwardOptions(compute_dtype="float64")
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        out = forward(params, jnp.asarray(packed), cfg, positions_BxT=jnp.asarray(positions),
                      segment_ids_BxT=jnp.asarray(segments), options=float64)
        at = 0
        for row, n in zip(rows, lengths):
            np.testing.assert_allclose(out[:, at:at + n], forward(params, jnp.asarray(row), cfg, options=float64),
                                       atol=1e-10)
            at += n


def conds(jaxpr) -> list:
    """Every `cond` equation of a jaxpr, its sub-jaxprs' too."""
    from jax.extend.core import subjaxprs

    return [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "cond"] + [
        eqn for sub in subjaxprs(jaxpr) for eqn in conds(sub)]


KINDS = {"arch": "qwen3_5", "num_layers": 4}  # Gated DeltaNet layers and attention layers


def kinds_loss(cfg):
    ids = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    return lambda p, options: jnp.mean(jax.nn.log_softmax(_forward(p, ids, cfg, options=options))[..., 0] ** 2)


def test_each_kind_of_layer_is_rematerialised_alone():
    """A model of two kinds of layer (Qwen3.5's Gated DeltaNet and attention) switches on a layer's kind, and jax's
    switch returns every kind's residuals (zeros for the kinds not taken). Under remat "full" each kind is
    checkpointed inside the switch, so no switch of the gradient returns more than a layer's input or its rows:
    without it, Qwen3.5-27B's LoRA step on a v6e-8 needed 22.3 GiB a chip, with it 16.2."""
    from jaxtune.presets import tiny_model_config

    cfg = tiny_model_config(**KINDS)
    assert len(set(cfg.layer_kinds)) == 2
    p = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
    grad = jax.make_jaxpr(jax.grad(kinds_loss(cfg)), static_argnums=1)(p, ForwardOptions(remat=Remat("full")))
    largest = max(v.aval.size for eqn in conds(grad.jaxpr) for v in eqn.outvars)
    assert largest <= max(2 * 32 * cfg.hidden_size, *(a.size // a.shape[0] for a in jax.tree.leaves(p["layers"])))


@pytest.mark.full
def test_layers_of_several_kinds_remat_equals_no_remat():
    from jaxtune.presets import tiny_model_config

    cfg = tiny_model_config(**KINDS)
    p = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    grad = jax.jit(jax.value_and_grad(kinds_loss(cfg)), static_argnums=1)
    (base_value, base_grads) = grad(p, ForwardOptions())
    for policy in ("full", "save_matmuls"):
        value, grads = grad(p, ForwardOptions(remat=Remat(policy)))
        np.testing.assert_allclose(value, base_value, rtol=1e-6)
        for g0, g1 in zip(jax.tree.leaves(base_grads), jax.tree.leaves(grads)):
            assert float(jnp.abs(g1 - g0).max()) <= 1e-5 * float(jnp.abs(g0).max()) + 1e-12
