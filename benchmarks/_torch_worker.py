"""One PyTorch (+PEFT) configuration, measured in this process, the way a transformers user trains it.

`transformers.LlamaForCausalLM` of the same shape in float32, `peft.get_peft_model` with `LoraConfig` (rank 8,
alpha 16, no dropout) for LoRA, `torch.optim.AdamW` on the trainable parameters and `clip_grad_norm_` at 1.0;
labels = input_ids with transformers' own shift. Torch gets its best eager settings: two intra-op threads
(the machine's cores), the attention implementation chosen by the caller ("sdpa" or "eager"; the runner keeps the
faster), and the fastest AdamW implementation (`fused=True` where the build has the CPU kernel, else foreach).
QLoRA needs bitsandbytes' 4-bit layers: where `import bitsandbytes` fails the result says so.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple

import _measure as M


class TorchSetup(NamedTuple):
    """One configuration's model (PEFT-wrapped for LoRA), trainable parameters, AdamW (and which implementation),
    fixed input ids [B, T] and whether it trains under bfloat16 autocast."""

    model: Any
    params: list
    optimizer: Any
    adamw: str
    input_ids: object
    bf16: bool


def build(name: str, attn: str) -> TorchSetup:
    """Configuration `name`'s model, optimizer and batch with attention implementation `attn`; QLoRA is refused
    (see `run`)."""
    import peft
    import torch
    import transformers

    kind, targets = M.METHODS[name]
    assert kind != "qlora", "QLoRA needs bitsandbytes' 4-bit training, not benchmarked on CPU"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=M.SHAPE["vocab_size"], hidden_size=M.SHAPE["hidden_size"],
        intermediate_size=M.SHAPE["intermediate_size"], num_hidden_layers=M.SHAPE["num_layers"],
        num_attention_heads=M.SHAPE["num_heads"], num_key_value_heads=M.SHAPE["num_kv_heads"],
        head_dim=M.SHAPE["head_dim"], max_position_embeddings=M.MAX_POSITIONS, tie_word_embeddings=False,
        use_cache=False)
    config._attn_implementation = attn
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    if kind == "lora":
        lora = peft.LoraConfig(r=M.RANK, lora_alpha=M.ALPHA, lora_dropout=0.0, target_modules=list(targets),
                               bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    if M.REMAT == "full":  # recompute each layer in the backward, as jaxtune's remat "full"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = torch.optim.AdamW(params, lr=M.LEARNING_RATE, weight_decay=0.0, fused=True)
        adamw = "fused"
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(params, lr=M.LEARNING_RATE, weight_decay=0.0, foreach=True)
        adamw = "foreach"
    input_ids = torch.from_numpy(M.fixed_tokens()[:, :-1].copy()).long()
    return TorchSetup(model, params, optimizer, adamw, input_ids, M.COMPUTE_DTYPE.get(name) == "bfloat16")


def train_step(setup: TorchSetup, phase=contextlib.nullcontext) -> float:
    """One step (forward with transformers' loss, backward, clipping, AdamW); the loss. `phase(name)`: a context
    the update runs in ("optimizer"; step_profile.py's profiler range)."""
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.bf16):
        loss = setup.model(input_ids=setup.input_ids, labels=setup.input_ids, use_cache=False).loss
    loss.backward()
    with phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(setup.params, M.MAX_GRAD_NORM)
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(name: str, attn: str, warmup: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    import peft
    import transformers

    kind = M.METHODS[name][0]
    if kind == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            return {"framework": "torch", "config": name, "variant": attn, "unavailable": f"bitsandbytes: {e}"}
        return {"framework": "torch", "config": name, "variant": attn,
                "unavailable": "bitsandbytes is installed but 4-bit training on CPU is not benchmarked here"}

    setup = build(name, attn)
    baseline = M.rss_mib()
    M.reset_peak_rss()
    losses = []
    timing = M.time_steps(lambda: losses.append(train_step(setup)), warmup, steps)
    return {
        "framework": "torch", "config": name, "variant": attn, "compile_s": None, **timing,
        "baseline_rss_mib": baseline, "train_peak_rss_mib": M.window_peak_rss_mib(), "peak_rss_mib": M.peak_rss_mib(),
        "loss_first": losses[0], "loss_last": losses[-1], "adamw": setup.adamw, "threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "peft_version": peft.__version__, "attn_implementation": setup.model.config._attn_implementation,
    }
