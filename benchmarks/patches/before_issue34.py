"""jaxtune's LoRA multiply as it was before issue 34's fourth session (commit 75e629e), for `paired_step.py`: the
branch x W + s (x A) B added after the base product on every platform, and A's gradient x^T dxa as XLA laid it out."""

import jax
import jax.numpy as jnp

from jaxtune.methods import lora
from jaxtune.models import linear

_saved = lora.lora_branch, linear._fused_hook


@jax.custom_vjp
def lora_branch(x, a, b):
    return (x @ a) @ b


def _forward(x, a, b):
    xa = x @ a
    return xa @ b, (x, a, b, xa)


def _backward(residuals, g):
    x, a, b, xa = residuals
    g = g.astype(x.dtype)
    dxa = g @ b.T
    return dxa @ a.T, jnp.einsum("...r,...i->ri", dxa, x).T, jnp.einsum("...r,...o->ro", xa, g)


lora_branch.defvjp(_forward, _backward)
lora.lora_branch = lora_branch
linear._fused_hook = lambda *args, **kwargs: None


def undo():
    lora.lora_branch, linear._fused_hook = _saved
