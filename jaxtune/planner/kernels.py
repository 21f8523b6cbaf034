"""The attention kernel a plan's step runs, as the planner counts it: the forward's own choice (`models.kernels.
choose_kernel`, asked with the plan's facts), and that kernel's declared figures (`KernelCosts`)."""

from __future__ import annotations

from jaxtune.config import ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.models.kernels import KERNELS, AttentionKernel, AttentionShape, choose_kernel
from jaxtune.models.params import param_specs


def planned_kernel(cfg: ModelConfig, plan: TrainPlan, platform: str, rows: int, prefix: int, context: int
                   ) -> AttentionKernel | None:
    """The fused kernel the step's forward takes on `platform`'s devices for `rows` packed rows a device (prefix:
    learned keys), where it runs natively there; None: the blockwise kernel (also across a context axis, whose ring
    the planner counts as the blockwise kernel's)."""
    if context > 1:
        return None
    shape = AttentionShape(rows, plan.seq_len, plan.seq_len + prefix, cfg.num_kv_heads,
                           cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, prefix, True, False, cfg.attn_logit_softcap,
                           plan.forward.compute_dtype, tuple(sorted(set(cfg.sliding_windows))),
                           "sinks" in param_specs(cfg)["layers"],  # as the forward reads them: from the parameters
                           plan.images is not None and plan.images.family.image_spans)
    fused = choose_kernel(plan.forward.attention, shape, platform, planning=True)
    return None if fused is None else KERNELS[fused.kind]
