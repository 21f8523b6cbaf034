"""jaxtune's LoRA multiply as it was before issue 34's fourth session (commit 75e629e), for `paired_step.py`: the
branch x W + s (x A) B added after the base product on every platform, and A's gradient x^T dxa as XLA laid it out
(no barrier)."""

import jax.numpy as jnp

from jaxtune.methods.lora import product as lora
from jaxtune.models import linear

_saved = lora._a_gradient, linear.folds_branch
lora._a_gradient = lambda x, dxa, accumulate=None: jnp.einsum("...r,...i->ri", dxa, x,
                                                               preferred_element_type=accumulate).T
linear.folds_branch = lambda *args, **kwargs: False


def undo():
    lora._a_gradient, linear.folds_branch = _saved
