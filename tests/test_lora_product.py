"""LoRA folded into its base product on CPU (`lora.lora_product`, `linear.dense`): the same values and gradients as
the float64 formula and as the unfolded branch, and the compiled step holds none of the passes folding removes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import tiny_config
from jaxtune.methods import method_config
from jaxtune.methods.lora.product import lora_branch, lora_product
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models import linear
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params

TOKENS, IN, OUT, R = 24, 40, 56, 4  # tokens (2 rows of 12), in, out, rank


def factors(dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((2, TOKENS // 2, IN), (IN, OUT), (IN, R), (R, OUT))
    x, w, a, b = (jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)
    return x, w, a, b, jnp.asarray(rng.standard_normal((2, TOKENS // 2, OUT)), jnp.float32)


def reference(x, x_lora, w, a, b, scale):
    return x @ w + scale * ((x_lora @ a) @ b)


def values_and_grads(fn, x, x_lora, w, a, b, g, dtype):
    loss = lambda *p: jnp.sum(fn(*p).astype(dtype) * g.astype(dtype))  # noqa: E731
    return fn(x, x_lora, w, a, b), jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, x_lora, w, a, b)


@pytest.mark.parametrize("traced", [False, True], ids=["static_scale", "traced_scale"])
@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_lora_product_equals_the_float64_formula(dtype, tolerance, traced):
    """Values and the gradients of x, x_lora (x after dropout), the kernel, A and B; a per-layer (traced) scale too.
    In bfloat16 the product accumulates in float32 and rounds once, so it stays within bfloat16's rounding."""
    x, w, a, b, g = factors(dtype)
    x_lora = x * 1.5  # stands for dropout's output: its own gradient
    scale = jnp.asarray(0.75) if traced else 0.75
    got, got_grads = values_and_grads(lambda *p: lora_product(*p, scale), x, x_lora, w, a, b, g, jnp.float32)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(p, np.float64)) for p in (x, x_lora, w, a, b, g)]
        want, want_grads = values_and_grads(lambda *p: reference(*p, 0.75), *wide, jnp.float64)
    assert got.dtype == dtype and got.shape == x.shape[:-1] + (OUT,)
    for name, have, exact in zip(("y", "x", "x_lora", "kernel", "a", "b"), (got, *got_grads), (want, *want_grads)):
        exact = np.asarray(exact)
        err = np.max(np.abs(np.asarray(have, np.float64) - exact)) / np.max(np.abs(exact))
        assert err <= tolerance, (name, err)


CFG = tiny_config(num_layers=2, vocab_size=128, hidden_size=64, intermediate_size=160, initializer_range=0.1)


def lora_loss_and_grads(method, unfolded: bool, monkeypatch):
    """The model's loss and the adapter's gradients, compiled with the branches folded (the CPU default) or not;
    and the compiled gradient's HLO."""
    if unfolded:
        monkeypatch.setattr(linear, "folds_branch", lambda *args, **kwargs: False)
    jax.clear_caches()
    params = init_params(CFG, jax.random.key(0))
    adapted = apply_method(params, CFG, method, jax.random.key(1))
    adapted = jax.tree.map(lambda p: p + 0.05 if p.ndim == 3 and p.shape[1] == method.rank else p, adapted)  # B != 0
    trainable, frozen = partition(adapted, trainable_mask(adapted, method))
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, CFG.vocab_size)

    def loss(trainable):
        logits = forward(combine(trainable, frozen), tokens, CFG, method=method)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

    step = jax.jit(jax.value_and_grad(loss))
    (value, grads), hlo = step(trainable), step.lower(trainable).compile().as_text()
    monkeypatch.undo()
    return value, grads, hlo


@pytest.mark.full
def test_folded_model_equals_the_unfolded_one(monkeypatch):
    """Every linear module adapted, B non-zero: the folded and unfolded models' losses and adapter gradients agree
    to float32 rounding."""
    method = method_config("lora", rank=4, alpha=8, target_modules=("all-linear",))
    folded, folded_grads, _ = lora_loss_and_grads(method, False, monkeypatch)
    plain, plain_grads, _ = lora_loss_and_grads(method, True, monkeypatch)
    np.testing.assert_allclose(float(folded), float(plain), rtol=1e-6)
    for have, want in zip(jax.tree.leaves(folded_grads), jax.tree.leaves(plain_grads)):
        assert np.max(np.abs(np.asarray(have) - np.asarray(want))) <= 1e-5 * np.max(np.abs(np.asarray(want)))


@pytest.mark.full
def test_folded_step_has_no_rank_r_product_over_the_outputs(monkeypatch):
    """Folded, the forward has no [tokens, r] x [r, out] product: of the dots contracting r = 4 into [48 tokens, n],
    only the backward's dxa A^T are left, one a module (7); unfolded, each module's forward adds its own. Neither
    multiplies A's gradient as x^T dxa ([in, r] out of x contracted along its tokens, XLA:CPU's slow form)."""
    method = method_config("lora", rank=4, alpha=8, target_modules=("all-linear",))

    def rank_products(hlo):  # dots whose first operand is [tokens, r], written over the tokens
        return re.findall(r"= f32\[48,\d+\]\{[^}]*\} dot\(f32\[48,4\]", _with_operand_shapes(hlo))

    def transposed_inputs(hlo):  # A's gradient [in, r] as one dot
        return re.findall(r"= f32\[(?:64|160),4\]\{1,0\} dot\(", hlo)

    _, _, folded = lora_loss_and_grads(method, False, monkeypatch)
    _, _, plain = lora_loss_and_grads(method, True, monkeypatch)
    assert len(rank_products(folded)) == 7 and len(rank_products(plain)) == 14
    assert not transposed_inputs(folded) and not transposed_inputs(plain)


def _with_operand_shapes(hlo: str) -> str:
    """HLO text with each dot's first operand written as its shape (`f32[48,4]`), so a dot can be matched by it."""
    shapes = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = (\w+\[[\d,]*\])", hlo)}
    return re.sub(r"dot\(%([\w.\-]+),", lambda m: f"dot({shapes.get(m.group(1), '?')},", hlo)


def test_lora_branch_gradient_of_a_is_not_refolded():
    """The unfolded branch (GPU and TPU, DoRA's form): A's gradient is taken as (dxa^T x)^T behind a barrier, so the
    compiled backward multiplies dxa^T [r, tokens] by x as stored into [r, in]; without the barrier XLA folds the
    transpose back and multiplies x^T dxa into [in, r], contracting x along its tokens (several times slower on
    XLA:CPU)."""
    x, _, a, b, g = factors(jnp.float32)
    loss = lambda x, a, b: jnp.sum(lora_branch(x, a, b) * g)  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=1)).lower(x, a, b).compile().as_text()
    assert not re.search(rf"= f32\[{IN},{R}\]\{{1,0\}} dot\(", hlo)
    assert re.search(rf"= f32\[{R},{IN}\]\{{1,0\}} (?:dot|fusion)\(", hlo)
