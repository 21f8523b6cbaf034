"""One configuration of benchmarks/device_run.py, measured in this process: jaxtune's own jitted train step, or
PyTorch+PEFT's eager step (TRL's log-probabilities and DPO loss for DPO), on the first accelerator (or the CPU); or
one layer's attention through cuDNN's flash attention or jaxtune's blockwise kernel (`attention_run`).

Both sides train in bfloat16 as their users would: jaxtune with bfloat16 frozen weights and compute, float32
trainable masters (`TrainPlan(param_dtype="bfloat16", compute_dtype="bfloat16")`); torch with bfloat16 frozen
weights (float32 for the full fine-tune, whose weights are its masters) under `torch.autocast(bfloat16)`, PEFT's
adapters in float32. QLoRA: jaxtune's NF4 with double quantisation against bitsandbytes' (the same), where it imports
and CUDA runs it. Peak memory is the device's high-water mark: jax's `memory_stats()["peak_bytes_in_use"]` over the
whole process (its weights are created in their dtypes), torch's `max_memory_allocated()` from the model in its
training dtypes on (transformers creates float32 weights first); None on a CPU, which has no such count.
"""

from __future__ import annotations

import tempfile
import time

import _measure as M
import numpy as np

# Llama-3.2-1B and Llama-3.1-8B with fewer layers (their own widths, heads and vocabulary); "tiny" for --dry-run.
SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=4, num_heads=32,
               num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2, num_heads=32,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, tie_word_embeddings=False),
}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (method kind, objective); every adapter on all linear layers
METHODS = {"full": ("full", "sft"), "lora": ("lora", "sft"), "qlora": ("qlora", "sft"), "dpo_lora": ("lora", "dpo")}
RANK, ALPHA, DPO_BETA = 16, 32.0, 0.1


def rows_of(method: str, batch: int) -> int:
    """Rows through the model per step: a DPO pair is two (chosen, rejected)."""
    return 2 * batch if METHODS[method][1] == "dpo" else batch


def model_flops(shape: str, method: str, batch: int, seq: int) -> float:
    """FLOPs of one step: 6 N per token (forward + backward) + attention's 12 L H hd T per token (PaLM, Chowdhery
    et al. 2022, appendix B: full T x T scores, not halved for causality). N: the matmul parameters, the LM head
    included, the embedding lookup not; the same for every method (LoRA's backward skips the frozen weights'
    gradients, so its MFU understates the hardware's share). DPO adds the reference's forward: 2 N + 4 L H hd T."""
    s = SHAPES[shape]
    d, heads, kv, hd = s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"]
    layer = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * s["intermediate_size"]
    n = s["num_layers"] * layer + s["vocab_size"] * d
    attention = 12 * s["num_layers"] * heads * hd * seq
    per_token = 6 * n + attention
    if METHODS[method][1] == "dpo":
        per_token += 2 * n + attention / 3
    return per_token * rows_of(method, batch) * seq


def token_batch(shape: str, method: str, batch: int, seq: int) -> dict:
    """[rows, seq] numpy arrays of random tokens (seed 0): SFT rows (loss on every token) or DPO pairs (jaxtune's
    `pair_batch`: a quarter prompt, the rest completion; chosen rows, then rejected)."""
    from jaxtune.data.formats import PreferenceExample
    from jaxtune.objectives.dpo import pair_batch

    rng = np.random.default_rng(0)
    vocab = SHAPES[shape]["vocab_size"]
    if METHODS[method][1] == "dpo":
        prompt = seq // 4
        pairs = [PreferenceExample(*(tuple(int(t) for t in rng.integers(0, vocab, n)) for n in
                                     (prompt, seq + 1 - prompt, seq + 1 - prompt))) for _ in range(batch)]
        return pair_batch(pairs, batch, seq)
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    ones = np.ones((batch, seq), np.int32)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": ones.astype(np.float32),
            "segment_ids": ones, "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ones.shape)}


def jax_run(shape: str, method: str, batch: int, seq: int, warmup: int, steps: int, device_name: str) -> dict:
    """jaxtune's step of one configuration; with the planner's prediction of its peak on `device_name`."""
    import jax

    from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, TrainConfig
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.methods.transform import apply_method, partition, trainable_mask
    from jaxtune.models.params import init_params
    from jaxtune.models.quant import as_bit_patterns
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.planner import estimate, get_device
    from jaxtune.planner.kernels import planned_kernel
    from jaxtune.spine.run import abstract_run

    kind, objective = METHODS[method]
    cfg = ModelConfig(**SHAPES[shape], max_position_embeddings=max(seq, 2048))
    options = {} if kind == "full" else dict(rank=RANK, alpha=ALPHA, target_modules=ALL_LINEAR)
    method_cfg = method_config(kind, **options)
    plan = TrainPlan(method_cfg, batch, seq, 1, param_dtype="bfloat16", objective=objective,
                     forward=ForwardOptions(compute_dtype="bfloat16"))
    device = jax.devices()[0]
    predicted = estimate(cfg, plan, get_device(device_name))
    # the step's rows carry segment ids (packing), which cuDNN's attention cannot take: "auto" is blockwise there
    kernel = planned_kernel(cfg, plan, device.platform, rows_of(method, batch), 0, 1)

    key = jax.random.key(0)
    params = apply_method(init_params(cfg, key, jax.numpy.bfloat16), cfg, method_cfg, jax.random.fold_in(key, 1))
    trainable, frozen = partition(params, trainable_mask(params, method_cfg))
    del params
    tc = TrainConfig(learning_rate=2e-4, schedule="constant", max_grad_norm=1.0)
    run = abstract_run(cfg, plan, make_mesh(MeshConfig(), [device]), tc, warmup + steps)
    state = run.init_state(trainable, seed=0, donate=True)  # as spine/load.py: no second copy of a full model
    frozen = as_bit_patterns(frozen)
    batch_arrays = jax.device_put({k: v[None] for k, v in token_batch(shape, method, batch, seq).items()})
    created = (device.memory_stats() or {}).get("peak_bytes_in_use")  # QLoRA: the bfloat16 weights it quantised

    t0 = time.perf_counter()
    compiled = run.step.lower(state, frozen, None, batch_arrays).compile()
    compile_s = time.perf_counter() - t0
    holder, losses = {"state": state}, []
    del state

    def step():
        holder["state"], metrics = compiled(holder["state"], frozen, None, batch_arrays)
        losses.append(metrics["loss"])
        jax.block_until_ready(holder["state"])

    timing = M.time_steps(step, warmup, steps, rows_of(method, batch) * seq)
    stats = device.memory_stats() or {}
    return {"compile_s": compile_s, **timing, "peak_bytes": stats.get("peak_bytes_in_use"),
            "creation_peak_bytes": created, "planned_peak_bytes": predicted.peak_bytes,
            "planned_step_bytes": predicted.total_bytes, "planned_device": predicted.device.name,
            "attention_kernel": kernel.name if kernel else "blockwise",
            "loss_first": float(losses[0]), "loss_last": float(losses[-1])}


def attention_run(shape: str, kernel: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """One layer's causal attention, forward and backward (the gradients of q, k and v), at `shape`'s heads on
    [batch, seq] unpacked rows in bfloat16: cuDNN's flash attention as jaxtune calls it (`kernels.cudnn.
    cudnn_attention`; off a GPU the same `jax.nn.dot_product_attention` call with XLA's implementation) or jaxtune's
    blockwise kernel (`attention.blockwise_attention`, its live-block skipping included)."""
    import jax
    import jax.numpy as jnp

    from jaxtune.models import attention
    from jaxtune.models.kernels.cudnn import cudnn_attention

    s = SHAPES[shape]
    K, G, hd = s["num_kv_heads"], s["num_heads"] // s["num_kv_heads"], s["head_dim"]
    rng = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(rng.standard_normal(dims), jnp.bfloat16) for dims in
                  ((batch, seq, K, G, hd), (batch, seq, K, hd), (batch, seq, K, hd), (batch, seq, K, G, hd)))
    implementation = "cudnn" if jax.devices()[0].platform == "gpu" else "xla"

    def cudnn(q, k, v):
        return cudnn_attention(q, k, v, jnp.int32(0), (0,), scale=hd**-0.5, implementation=implementation)

    def blockwise(q, k, v):
        mask = attention.training_mask(batch, seq, 0, None, None)
        out = attention.blockwise_attention(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3),
                                            v.transpose(0, 2, 1, 3), mask, 0, attention.live_blocks(mask, seq, seq),
                                            scale=hd**-0.5)
        return out.transpose(0, 3, 1, 2, 4)

    forward = cudnn if kernel == "cudnn" else blockwise
    loss = lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32) * g)  # noqa: E731
    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    timing = M.time_steps(lambda: jax.block_until_ready(compiled(q, k, v)), warmup, steps, batch * seq)
    return {"compile_s": compile_s, **timing, "implementation": implementation if kernel == "cudnn" else "blockwise"}


def torch_run(shape: str, method: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """PyTorch+PEFT's step of one configuration (transformers' Llama, sdpa attention, fused AdamW)."""
    import peft
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kind, objective = METHODS[method]
    if kind == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as error:
            return {"unavailable": f"bitsandbytes: {error}"}
        if device == "cpu":
            return {"unavailable": "bitsandbytes' 4-bit training needs CUDA"}
    torch.manual_seed(0)
    s = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"], tie_word_embeddings=s["tie_word_embeddings"], max_position_embeddings=max(seq, 2048),
        use_cache=False, attn_implementation="sdpa")
    model = _nf4_model(config) if kind == "qlora" else _model(config, device, kind)
    if device == "cuda":  # the peak from the model in its training dtypes on: not its float32 creation or NF4 loading
        torch.cuda.reset_peak_memory_stats()
    if kind != "full":
        lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(ALL_LINEAR),
                               bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0, fused=device == "cuda")
    arrays = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device, torch.long if v.dtype == np.int32 else None)
              for k, v in token_batch(shape, method, batch, seq).items()}
    loss_of = _dpo_loss if objective == "dpo" else _sft_loss
    losses = []

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_of(model, arrays)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step's kernels

    timing = M.time_steps(step, warmup, steps, rows_of(method, batch) * seq)
    return {"compile_s": None, **timing, "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "loss_first": losses[0], "loss_last": losses[-1]}


def _model(config, device: str, kind: str):
    """A random Llama on `device`: float32 weights for the full fine-tune (its masters), bfloat16 frozen ones."""
    import torch
    import transformers

    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.float32 if kind == "full" else torch.bfloat16)


def _nf4_model(config):
    """A random Llama, saved and loaded back through bitsandbytes' NF4 (double quantisation, bfloat16 compute), as
    a QLoRA user loads one."""
    import torch
    import transformers

    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as directory:
        with torch.device("cuda"):
            transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
        torch.cuda.empty_cache()
        return transformers.LlamaForCausalLM.from_pretrained(directory, quantization_config=quantization,
                                                             dtype=torch.bfloat16, device_map={"": 0})


def _sft_loss(model, arrays: dict):
    return model(input_ids=arrays["input_ids"], labels=arrays["input_ids"], use_cache=False).loss


def _dpo_loss(model, arrays: dict):
    """DPO's sigmoid loss (Rafailov et al. 2023) as TRL's DPOTrainer computes it: completion log-probabilities summed
    per row with TRL's `selective_log_softmax`; the reference is the base with the adapters off (no copy)."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    def logps(model):
        logits = model(input_ids=arrays["input_ids"], use_cache=False).logits
        return (selective_log_softmax(logits, arrays["labels"]) * arrays["loss_mask"]).sum(-1)

    chosen, rejected = logps(model).chunk(2)
    with torch.no_grad(), model.disable_adapter():
        reference_chosen, reference_rejected = logps(model).chunk(2)
    margin = (chosen - reference_chosen) - (rejected - reference_rejected)
    return -torch.nn.functional.logsigmoid(DPO_BETA * margin).mean()
