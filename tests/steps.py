"""The spine's step for tests that build their own parameter trees: a run on one device, and SFT's gradients."""

import jax

from jaxtune.config import ForwardOptions, MeshConfig, TrainConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.objectives.base import Context
from jaxtune.objectives.sft import loss_terms as sft_terms
from jaxtune.parallel.mesh import make_mesh
from jaxtune.spine.run import AbstractRun, abstract_run
from jaxtune.spine.update import accumulate


def one_device_run(cfg, method, objective: str = "sft", *, train: TrainConfig = TrainConfig(), total_steps: int = 100,
                   batch_size: int = 1, seq_len: int = 16, grad_accum: int = 1,
                   options: ForwardOptions = ForwardOptions(), param_dtype: str = "float32", section=None,
                   second_model=None) -> AbstractRun:
    """The spine's run of `method` and `objective` on `cfg` on the first device: `.step(state, frozen, second,
    batch)`, `.init_state(trainable, seed)`, `.eval_step(params, second, batch)`."""
    plan = TrainPlan(method, batch_size, seq_len, grad_accum, param_dtype=param_dtype,
                     forward=ForwardOptions(compute_dtype=options.compute_dtype, remat=options.remat.policy),
                     objective=objective, section=section, second_model=second_model)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    return abstract_run(cfg, plan, mesh, train, total_steps)


def sft_gradients(trainable, frozen, batch, cfg, method, options=ForwardOptions(), key=None):
    """(mean loss, loss tokens, gradients of the mean) over the [A, B, T] micro-batches of `batch` (spine.update)."""
    terms = sft_terms(Context(cfg, method, options))
    loss_fn = lambda t, micro, k=None: terms(t, frozen, None, micro, k)
    loss, count, grads, _ = accumulate(loss_fn, trainable, batch, key)
    return loss, count, grads
