"""The train state, the optimiser, and the one jitted step.

The state is a plain dict pytree, so orbax saves and restores it as it is:

    {"step": int32, "params": trainable tree (None where frozen), "opt_state": optax state,
     "rng": uint32[2], "skipped": int32 (non-finite steps so far), "bad_streak": int32 (in a row)}

Frozen weights are a separate argument: never donated, never differentiated, never checkpointed.

`train_step(state, frozen, batch)` takes `grad_accum` micro-batches stacked on a leading axis ([A, B, T] arrays);
see `accumulated_gradients`. Accumulation and the update (a step whose loss or gradients are not finite leaves
params and optimiser state untouched and is counted) are `train/update.py`'s, shared with every objective.
LoRA dropout draws from `fold_in(state["rng"], step)`, folded again per micro-batch and split per layer; with
dropout 0 the step does no random-number work beyond advancing `rng`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtune.config import ForwardOptions, MethodConfig, ModelConfig, TrainConfig
from jaxtune.methods.transform import combine
from jaxtune.models.llama import forward
from jaxtune.train.update import accumulate, apply_update, dropout_key


def learning_rate_schedule(train: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine / linear decay to min_lr_ratio * lr at `total_steps`, or constant."""
    lr, warmup = train.learning_rate, min(train.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    if train.schedule == "cosine":
        decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=train.min_lr_ratio)
    elif train.schedule == "linear":
        decay = optax.linear_schedule(lr, lr * train.min_lr_ratio, decay_steps)
    else:
        decay = optax.constant_schedule(lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def weight_decay_mask(trainable: dict) -> dict:
    """False for norm scales and biases (as transformers' Trainer does), True for every other trainable leaf."""

    def decays(path, _) -> bool:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return not (names[-1] == "bias" or names[-1] == "norm" or any(n.endswith("layernorm") for n in names))

    return jax.tree_util.tree_map_with_path(decays, trainable)


def make_optimizer(train: TrainConfig, total_steps: int, trainable: dict) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the schedule and no decay on norms and biases."""
    return optax.chain(
        optax.clip_by_global_norm(train.max_grad_norm),
        optax.adamw(learning_rate_schedule(train, total_steps), b1=train.adam_b1, b2=train.adam_b2,
                    eps=train.adam_eps, weight_decay=train.weight_decay, mask=weight_decay_mask(trainable)),
    )


def init_state(trainable: dict, optimizer: optax.GradientTransformation, seed: int) -> dict:
    """Step 0: float32 master copies of the trainable leaves and a fresh optimiser state."""
    params = jax.tree.map(lambda x: x.astype(jnp.float32), trainable)
    zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state is donated leaf by leaf
    return {"step": zero(), "params": params, "opt_state": optimizer.init(params),
            "rng": jax.random.PRNGKey(seed), "skipped": zero(), "bad_streak": zero()}


def _nll_sum_fwd(logits_BxTxV: jax.Array, labels_BxT: jax.Array, weights_BxT: jax.Array):
    logits = logits_BxTxV.astype(jnp.float32)
    lse_BxT = jax.nn.logsumexp(logits, axis=-1)
    label_logit_BxT = jnp.take_along_axis(logits, labels_BxT[..., None], axis=-1)[..., 0]
    return jnp.sum((lse_BxT - label_logit_BxT) * weights_BxT), (logits_BxTxV, lse_BxT, labels_BxT, weights_BxT)


def _nll_sum_bwd(residuals, g):
    logits_BxTxV, lse_BxT, labels_BxT, weights_BxT = residuals
    vocab_V = jax.lax.broadcasted_iota(labels_BxT.dtype, logits_BxTxV.shape, logits_BxTxV.ndim - 1)
    softmax = jnp.exp(logits_BxTxV.astype(jnp.float32) - lse_BxT[..., None])
    dlogits_BxTxV = (softmax - (vocab_V == labels_BxT[..., None])) * (weights_BxT * g)[..., None]
    return dlogits_BxTxV.astype(logits_BxTxV.dtype), None, None


@jax.custom_vjp
def nll_sum(logits_BxTxV: jax.Array, labels_BxT: jax.Array, weights_BxT: jax.Array) -> jax.Array:
    """sum(weights * -log softmax(logits)[label]): `objectives.masked_nll_sum`'s value, with a hand-written gradient.

    The gradient is one fused pass, (softmax - onehot(label)) * weight, from the logits and the saved logsumexp;
    autodiff would also keep exp(logits - max) ([B, T, V] float32) for the backward and scatter the one-hot.
    """
    return _nll_sum_fwd(logits_BxTxV, labels_BxT, weights_BxT)[0]


nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)


def batch_loss(params: dict, batch: dict, cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions,
               dropout_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum of completion-token losses, number of completion tokens) of one [B, T] batch.

    dropout_key: training with LoRA dropout (see `llama.decoder`); None: no dropout.
    """
    logits = forward(params, batch["input_ids"], cfg, positions_BxT=batch["positions"],
                     segment_ids_BxT=batch["segment_ids"], method=method, options=options, dropout_key=dropout_key)
    mask = batch["loss_mask"].astype(jnp.float32)
    return nll_sum(logits, batch["labels"], mask), jnp.sum(mask)


def accumulated_gradients(trainable: dict, frozen: dict, batch: dict, cfg: ModelConfig, method: MethodConfig | None,
                          options: ForwardOptions, dropout_key: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array, dict]:
    """(mean loss, loss tokens, gradients of the mean) over A micro-batches stacked as [A, B, T] arrays.

    `update.accumulate`: loss sums and gradients of sums, divided once by the token count, so the result equals
    one batch of A*B rows. dropout_key: micro-batch a drops with `fold_in(dropout_key, a)`; None: no dropout.
    """

    def loss_sum(params, micro, key=None):
        loss, count = batch_loss(combine(params, frozen), micro, cfg, method, options, key)
        return loss, (count, {})

    loss, count, grads, _ = accumulate(loss_sum, trainable, batch, dropout_key)
    return loss, count, grads


def make_train_step(cfg: ModelConfig, method: MethodConfig, options: ForwardOptions,
                    optimizer: optax.GradientTransformation, schedule: optax.Schedule):
    """The jitted `train_step(state, frozen, batch) -> (state, metrics)`, state donated."""

    def train_step(state: dict, frozen: dict, batch: dict) -> tuple[dict, dict]:
        loss, count, grads = accumulated_gradients(state["params"], frozen, batch, cfg, method, options,
                                                   dropout_key(state, method))
        state, metrics = apply_update(state, grads, loss, optimizer, schedule)
        return state, {**metrics, "tokens": jnp.sum(batch["segment_ids"] > 0), "loss_tokens": count}

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(cfg: ModelConfig, method: MethodConfig | None, options: ForwardOptions):
    """The jitted `eval_step(params, batch) -> (loss sum, token count)` for one [B, T] batch."""
    return jax.jit(lambda params, batch: batch_loss(params, batch, cfg, method, options))
