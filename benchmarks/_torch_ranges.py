"""PyTorch+PEFT's step under torch.profiler, every op in step_profile.py's ranges (see its module doc): module hooks
open `record_function` ranges, and a backward op takes its forward op's (by autograd's sequence number)."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import _measure as M
from step_profile import RANGE, TorchOp, result, torch_category


def torch_ops(events) -> list[TorchOp]:
    """`TorchOp`s of torch.profiler's events: a backward op (under autograd's evaluate_function of a node) takes
    the ranges of the forward op that recorded the node's sequence number."""
    def ranges(e) -> tuple[str, ...]:
        names = []
        while e is not None:
            if e.name.startswith(RANGE):
                names.append(e.name[len(RANGE):])
            e = e.cpu_parent
        return tuple(reversed(names))

    def node_of(e):
        while e is not None and not e.name.startswith("autograd::engine::evaluate_function"):
            e = e.cpu_parent
        return e

    forward: dict[int, tuple[str, ...]] = {}
    for e in events:
        if e.sequence_nr >= 0 and node_of(e) is None:
            scopes = ranges(e)
            if len(scopes) >= len(forward.get(e.sequence_nr, ())):
                forward[e.sequence_nr] = scopes
    ops = []
    for e in events:
        node = node_of(e)
        scopes = ranges(e) if node is None else forward.get(node.sequence_nr, ()) + ranges(e)
        shapes = tuple(tuple(s) for s in (e.input_shapes or []))
        ops.append(TorchOp(name=e.name, self_s=e.self_cpu_time_total * 1e-6, scopes=scopes, backward=node is not None,
                           shapes=shapes))
    return ops


def install_ranges(model) -> None:
    """Hooks opening this script's ranges around the model's parts (see the module doc)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    open_ranges: list = []

    def enter(label: str) -> None:
        r = torch.profiler.record_function(RANGE + label)
        r.__enter__()
        open_ranges.append(r)

    def leave(*_) -> None:
        open_ranges.pop().__exit__(None, None, None)

    hooked: set[int] = set()

    def ranged(module, label: str) -> None:
        if id(module) not in hooked:
            hooked.add(id(module))
            module.register_forward_pre_hook(lambda *_: enter(label))
            module.register_forward_hook(leave)

    def in_range(fn, label: str):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(RANGE + label):
                return fn(*args, **kwargs)
        return wrapped

    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("LlamaRMSNorm", "LlamaRotaryEmbedding", "LlamaAttention", "LlamaMLP"):
            ranged(module, {"LlamaRMSNorm": "norm", "LlamaRotaryEmbedding": "rope", "LlamaAttention": "attention",
                            "LlamaMLP": "mlp"}[kind])
            if kind == "LlamaMLP":
                ranged(module.act_fn, "activation")
        elif hasattr(module, "lora_A") and hasattr(module, "base_layer"):  # PEFT's LoRA layer around its base
            ranged(module, "lora")
            ranged(module.base_layer, "attention" if ".self_attn." in path else "mlp")
        elif kind == "LlamaForCausalLM":  # lm_head opens "head", closed once the loss is computed
            module.lm_head.register_forward_pre_hook(lambda *_: enter("head"))
            module.register_forward_hook(leave)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = in_range(ALL_ATTENTION_FUNCTIONS["sdpa"], "kernel")
    modeling_llama.apply_rotary_pos_emb = in_range(modeling_llama.apply_rotary_pos_emb, "rope")


def torch_profile(name: str, steps: int, warmup: int = 2) -> dict:
    """PyTorch+PEFT's step of configuration `name` (sdpa attention) profiled over `steps` steps: ms a step by
    category, and the wall step."""
    import _torch_worker
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    setup = _torch_worker.build(name, "sdpa")
    install_ranges(setup.model)
    phase = lambda label: torch.profiler.record_function(RANGE + label)  # noqa: E731
    untraced = []
    for _ in range(warmup):
        start = time.perf_counter()
        _torch_worker.train_step(setup, phase)
        untraced.append(time.perf_counter() - start)
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            _torch_worker.train_step(setup, phase)
            times.append(time.perf_counter() - start)
    totals: dict[str, float] = defaultdict(float)
    for op in torch_ops(prof.events()):
        totals[torch_category(op, M.BATCH * M.SEQ)] += op.self_s
    return result("torch", name, steps, times, totals, untraced_ms=1e3 * untraced[-1], adamw=setup.adamw, attn="sdpa",
                  torch_version=torch.__version__)
