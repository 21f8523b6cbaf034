"""Where a fine-tuning method enters the forward pass: the method's `AdapterForward` (`config/method.py`), asked of
its options once a forward (`adapter_forward`), and `Adapters`, what one layer's linear modules run of it.

`linear.dense` runs a dense hook wherever a module holds the hook's trigger leaf (LoRA's `lora_a`, IA3's `ia3_in` /
`ia3_out`, the adapter rows' `row_a`); `moe` runs the expert hook on expert stacks. The forward names no method.
Prefix keys (`prefix`) and bottleneck adapters (`attn_adapter`, `mlp_adapter`) have fixed places in `llama.py`'s
layer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxtune.config.method import AdapterForward, DenseHook, MethodConfig
from jaxtune.config.model import LINEAR_MODULE_NAMES, ModelConfig


def adapter_forward(method: MethodConfig | None, cfg: ModelConfig) -> AdapterForward:
    """The forward's view of `method` on a model of `cfg` (None: the base model)."""
    return AdapterForward() if method is None else method.forward_of(cfg)


def adapter_dropout_key(layer_key: jax.Array, name: str) -> jax.Array:
    """The dropout key of module `name` (q_proj, ..., down_proj, linear_attn.out_proj) from its layer's key."""
    return jax.random.fold_in(layer_key, LINEAR_MODULE_NAMES.index(name.rsplit(".", 1)[-1]))


class Adapters(NamedTuple):
    """What one layer's linear modules run of a method: its dense hooks, and in training its dropout (the layer's
    key and the rate; key None: no dropout). `Adapters()` runs the base model."""

    hooks: tuple[DenseHook, ...] = ()
    dropout_key: jax.Array | None = None
    dropout_rate: float = 0.0

    def of_module(self, name: str) -> Adapters:
        """The same, with module `name`'s dropout key (`adapter_dropout_key` of the layer's)."""
        return self if self.dropout_key is None else self._replace(dropout_key=adapter_dropout_key(self.dropout_key,
                                                                                                   name))

    def with_key(self, key: jax.Array) -> Adapters:
        """The same, drawing its dropout from `key` instead (a tile of a tiled MLP): unchanged without dropout."""
        return self if self.dropout_key is None else self._replace(dropout_key=key)

    def hooks_of(self, module: dict) -> tuple[DenseHook, ...]:
        """The hooks whose trigger leaf `module` holds, in the method's order."""
        return tuple(hook for hook in self.hooks if hook.trigger in module)


def layer_adapters(forward: AdapterForward, layer_key: jax.Array | None) -> Adapters:
    """One layer's `Adapters` of a method's forward view; layer_key: the layer's dropout key (None: no dropout)."""
    use = layer_key is not None and forward.dropout_rate > 0
    return Adapters(forward.dense, layer_key if use else None, forward.dropout_rate if use else 0.0)
